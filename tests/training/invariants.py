"""An independent checker of `RefusionDataCollator` batches: it rebuilds every row's meaning from the output
alone (docs/design.md §2) and asserts each invariant, so tests never compare the collator with itself."""

from __future__ import annotations

import torch

IGNORE = -100


def _slots(answer_length: int, k: int) -> list[list[int]]:
    return [list(range(start, min(start + k, answer_length))) for start in range(0, answer_length, k)]


def _row_structure(order: list[int], masked: list[bool], answer_length: int, k: int) -> list[int] | None:
    """The slot sequence of the answer part (answer coordinates) if it is consistent with slot size k, else None."""
    slots = _slots(answer_length, k)
    cursor, sequence = 0, []
    while cursor < len(order):
        slot_index = order[cursor] // k
        slot = slots[slot_index]
        if order[cursor : cursor + len(slot)] != slot:  # a slot must appear whole, contiguous, in its own order
            return None
        if len({masked[cursor + j] for j in range(len(slot))}) != 1:  # a slot is all masked or all clean
            return None
        sequence.append(slot_index)
        cursor += len(slot)
    return sequence


def check_row(
    features: dict, batch: dict, row: int, mask_token_id: int, pad_token_id: int, slot_sizes, eps, num_examples: int
) -> dict:
    """Assert every invariant for one row; returns what was inferred (slot size candidates, p_mask, ...)."""
    ids = [int(t) for t in features["input_ids"]]
    prompt_length = int(features["prompt_length"])
    n, answer_length = len(ids), len(ids) - prompt_length
    input_ids = batch["input_ids"][row].tolist()
    positions = batch["position_ids"][row].tolist()
    labels = batch["labels"][row].tolist()
    weights = batch["mdm_weights"][row].tolist()
    attention = batch["attention_mask"][row].tolist()
    width = len(input_ids)

    # attention mask and padding
    assert attention == [1] * n + [0] * (width - n)
    assert input_ids[n:] == [pad_token_id] * (width - n)
    assert positions[n:] == list(range(n, width)), "padding positions continue after the last real one"
    assert labels[n:] == [IGNORE] * (width - n) and weights[n:] == [0.0] * (width - n), "padding is unlabelled"

    # prompt untouched and unsupervised
    assert input_ids[:prompt_length] == ids[:prompt_length]
    assert positions[:prompt_length] == list(range(prompt_length))
    assert labels[:prompt_length] == [IGNORE] * prompt_length
    assert weights[:prompt_length] == [0.0] * prompt_length

    # answer: every original position exactly once
    answer_positions = positions[prompt_length:n]
    assert sorted(answer_positions) == list(range(prompt_length, n))
    order = [p - prompt_length for p in answer_positions]
    masked = [input_ids[prompt_length + i] == mask_token_id for i in range(answer_length)]
    for i, p in enumerate(answer_positions):
        buffer_index = prompt_length + i
        if masked[i]:
            assert weights[buffer_index] > 0, "a masked position carries its MDM weight"
            assert labels[buffer_index] == ids[p], "a masked position is labelled with its own original token"
        else:
            assert input_ids[buffer_index] == ids[p], "a clean token keeps its original token"
            assert weights[buffer_index] == 0.0

    # masked rows share one weight 1 / (p_mask * answer_length * num_examples), p_mask in [eps, 1]
    masked_weights = {weights[prompt_length + i] for i in range(answer_length) if masked[i]}
    p_mask = None
    if masked_weights:
        assert len(masked_weights) == 1
        p_mask = 1.0 / (masked_weights.pop() * answer_length * num_examples)
        assert eps - 1e-6 <= p_mask <= 1.0 + 1e-6

    # some allowed slot size explains the layout
    candidates = []
    for k in sorted(set(slot_sizes)):
        sequence = _row_structure(order, masked, answer_length, k)
        if sequence is None:
            continue
        slots = _slots(answer_length, k)
        slot_masked = [masked[order.index(slots[s][0])] for s in sequence]
        clean = [s for s, m in zip(sequence, slot_masked) if not m]
        masked_slots = [s for s, m in zip(sequence, slot_masked) if m]
        if sequence != clean + masked_slots or masked_slots != sorted(masked_slots):
            continue  # clean slots first, then the masked ones in original order
        # labels of clean tokens: next token of the same slot, none for a slot's last token
        ok = True
        for i, a in enumerate(order):
            if masked[i]:
                continue
            slot = slots[a // k]
            expected = ids[prompt_length + a + 1] if a != slot[-1] else IGNORE
            ok &= labels[prompt_length + i] == expected
        if ok:
            candidates.append(k)
    assert candidates, f"no slot size in {slot_sizes} explains row {row}"
    clean_order = [a for i, a in enumerate(order) if not masked[i]]
    return {"slot_sizes": candidates, "p_mask": p_mask, "num_masked": sum(masked), "clean_order": clean_order}


def check_batch(features: list[dict], batch: dict, collator) -> list[dict]:
    assert set(batch) == {"input_ids", "attention_mask", "position_ids", "labels", "mdm_weights"}
    widths = {tuple(t.shape) for t in batch.values()}
    assert widths == {(len(features), max(len(f["input_ids"]) for f in features))} or collator.pad_to_multiple_of
    assert batch["mdm_weights"].dtype == torch.float32
    for name in ("input_ids", "attention_mask", "position_ids", "labels"):
        assert batch[name].dtype == torch.long, name
    return [
        check_row(
            feature,
            batch,
            row,
            collator.mask_token_id,
            collator.pad_token_id,
            collator.slot_sizes,
            collator.eps,
            num_examples=len(features),
        )
        for row, feature in enumerate(features)
    ]
