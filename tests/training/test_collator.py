"""`RefusionDataCollator`: every invariant of docs/design.md §2 on random batches, reproducibility, independence,
errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from refusion_hf import RefusionDataCollator
from tests.training.invariants import check_batch, check_row

MASK, PAD, EOS = 3, 0, 1


def feature(prompt_length: int, answer_length: int, offset: int = 0) -> dict:
    ids = [4 + (offset + i) % 60 for i in range(prompt_length + answer_length - 1)] + [EOS]
    return {"input_ids": ids, "prompt_length": prompt_length}


@st.composite
def batches(draw):
    rows = draw(st.integers(1, 4))
    features = []
    for _ in range(rows):
        prompt_length = draw(st.integers(0, 8))
        answer = draw(st.lists(st.integers(4, 63), min_size=0, max_size=70))
        features.append(
            {
                "input_ids": draw(st.lists(st.integers(4, 63), min_size=prompt_length, max_size=prompt_length))
                + answer
                + [EOS],
                "prompt_length": prompt_length,
            }
        )
    slot_sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    seed = draw(st.integers(0, 2**31))
    eps = draw(st.sampled_from([1e-3, 0.1, 1.0]))
    return features, slot_sizes, seed, eps


@settings(max_examples=80, deadline=None)
@given(batches())
def test_invariants_hold_on_random_batches(case):
    features, slot_sizes, seed, eps = case
    collator = RefusionDataCollator(mask_token_id=MASK, pad_token_id=PAD, slot_sizes=slot_sizes, eps=eps, seed=seed)
    batch = collator(features)
    check_batch(features, batch, collator)
    again = RefusionDataCollator(mask_token_id=MASK, pad_token_id=PAD, slot_sizes=slot_sizes, eps=eps, seed=seed)
    for name, tensor in again(features).items():
        assert torch.equal(tensor, batch[name]), f"same seed, same batch: {name} differs"


def test_tokenizer_defaults_and_fixture(fixture_path):
    tokenizer = AutoTokenizer.from_pretrained(fixture_path)
    collator = RefusionDataCollator(tokenizer, seed=0)
    assert (collator.mask_token_id, collator.pad_token_id) == (3, 0)
    features = [feature(5, 30), feature(0, 7, offset=3), feature(12, 1)]
    check_batch(features, collator(features), collator)


def test_draws_are_reproducible_and_vary_with_seed_and_epoch():
    features = [feature(4, 64, offset=i) for i in range(8)]

    def collate(seed, epoch=0):
        collator = RefusionDataCollator(mask_token_id=MASK, seed=seed)
        collator.set_epoch(epoch)
        return collator(features)

    first = collate(0)
    assert all(torch.equal(first[k], collate(0)[k]) for k in first)
    assert not torch.equal(first["input_ids"], collate(1)["input_ids"])
    assert not torch.equal(first["input_ids"], collate(0, epoch=1)["input_ids"])
    # the draw depends on the batch, not on how many batches the collator has seen (resumed runs redraw the same)
    collator = RefusionDataCollator(mask_token_id=MASK, seed=0)
    collator([feature(3, 9)])
    assert torch.equal(collator(features)["input_ids"], first["input_ids"])


def test_unseeded_collator_follows_torch_global_generator():
    features = [feature(4, 40, offset=i) for i in range(4)]
    collator = RefusionDataCollator(mask_token_id=MASK)
    torch.manual_seed(123)
    first = collator(features)
    torch.manual_seed(123)
    assert torch.equal(collator(features)["input_ids"], first["input_ids"])
    assert not torch.equal(collator(features)["input_ids"], first["input_ids"])


def test_examples_draw_independently_and_cover_the_distribution():
    copies = [feature(2, 64)] * 400
    collator = RefusionDataCollator(mask_token_id=MASK, slot_sizes=(4, 8, 16, 32), seed=7)
    rows = check_batch(copies, collator(copies), collator)
    p_masks = [row["p_mask"] for row in rows if row["p_mask"] is not None]
    assert len(set(p_masks)) > 300, "every example draws its own t"
    # E[p_mask] is ~1/2, so about half of the answer tokens are masked
    assert abs(sum(row["num_masked"] for row in rows) / (400 * 64) - 0.5) < 0.06
    # clean slots are permuted: with k = 4 and >= 3 clean slots, at most 1 in 6 permutations is the identity
    shuffled = [
        row["clean_order"] != sorted(row["clean_order"])
        for row in rows
        if row["slot_sizes"] == [4] and len(row["clean_order"]) >= 12
    ]
    assert len(shuffled) > 30 and sum(shuffled) > 0.75 * len(shuffled)
    # rows whose layout pins the slot size down show every size
    pinned = {row["slot_sizes"][0] for row in rows if len(row["slot_sizes"]) == 1}
    assert pinned == {4, 8, 16, 32}


def test_extreme_slot_sizes():
    features = [feature(3, 20, offset=i) for i in range(50)]
    whole = RefusionDataCollator(mask_token_id=MASK, slot_sizes=(20,), seed=0)(features)
    for row in range(50):  # one slot: the answer is either clean in order or entirely masked
        answer = whole["input_ids"][row, 3:23]
        assert (answer == MASK).all() or torch.equal(whole["position_ids"][row, 3:23], torch.arange(3, 23))
    singles = RefusionDataCollator(mask_token_id=MASK, slot_sizes=(1,), seed=0)(features)
    clean = (singles["mdm_weights"] == 0) & (singles["attention_mask"] == 1)
    assert (singles["labels"][clean] == -100).all(), "a one-token slot has no next token to predict"


def test_pad_to_multiple_of_and_tensor_features():
    collator = RefusionDataCollator(mask_token_id=MASK, pad_token_id=PAD, pad_to_multiple_of=8, seed=0)
    features = [
        {"input_ids": torch.tensor(feature(2, 9)["input_ids"]), "prompt_length": torch.tensor(2)},
        {"input_ids": np.array(feature(1, 3)["input_ids"]), "prompt_length": np.int64(1)},
    ]
    batch = collator(features)
    assert batch["input_ids"].shape == (2, 16)
    plain = [
        {
            "input_ids": f["input_ids"].tolist(),
            "prompt_length": int(f["prompt_length"]),
        }
        for f in features
    ]
    check_batch(plain, batch, collator)
    as_numpy = collator(features, return_tensors="np")
    assert all(np.array_equal(as_numpy[name], batch[name].numpy()) for name in batch)


def test_plain_autoregressive_examples_mix_in_at_their_rate():
    features = [feature(1 + i % 7, 3 + i % 29, offset=i) for i in range(400)]
    mixed = RefusionDataCollator(mask_token_id=MASK, pad_token_id=PAD, slot_sizes=(4, 8), ar_fraction=0.25, seed=5)
    batch = mixed(features)
    plain = []
    for row, f in enumerate(features):
        ids, p = f["input_ids"], f["prompt_length"]
        length = len(ids)
        # Only a plain example labels its last prompt token (ReFusion examples never label the prompt).
        if batch["labels"][row, p - 1] == -100:
            continue
        plain.append(row)
        assert batch["input_ids"][row, :length].tolist() == ids
        assert batch["position_ids"][row, :length].tolist() == list(range(length))
        assert batch["labels"][row, : p - 1].tolist() == [-100] * (p - 1)
        assert batch["labels"][row, p - 1 : length - 1].tolist() == ids[p:]
        assert batch["labels"][row, length - 1 :].eq(-100).all()
        assert not batch["mdm_weights"][row].any()
    assert 0.18 * len(features) < len(plain) < 0.32 * len(features)
    # Every other row is a ReFusion row obeying every invariant, its MDM weights normalised by the whole batch.
    for row in (row for row in range(len(features)) if row not in plain):
        check_row(features[row], batch, row, MASK, PAD, (4, 8), mixed.eps, num_examples=len(features))
    unmixed = RefusionDataCollator(mask_token_id=MASK, pad_token_id=PAD, slot_sizes=(4, 8), ar_fraction=0.0, seed=5)
    check_batch(features, unmixed(features), unmixed)
    every = RefusionDataCollator(mask_token_id=MASK, pad_token_id=PAD, ar_fraction=1.0, seed=5)(features[:8])
    assert all(every["labels"][row, f["prompt_length"] - 1] != -100 for row, f in enumerate(features[:8]))
    assert not every["mdm_weights"].any()


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="mask_token_id: no mask token id was given"):
        RefusionDataCollator()
    with pytest.raises(ValueError, match="slot_sizes must be a non-empty sequence of positive integers"):
        RefusionDataCollator(mask_token_id=MASK, slot_sizes=(4, 0))
    with pytest.raises(ValueError, match="slot_sizes"):
        RefusionDataCollator(mask_token_id=MASK, slot_sizes=())
    with pytest.raises(ValueError, match="return_tensors must be 'pt' or 'np'"):
        RefusionDataCollator(mask_token_id=MASK, return_tensors="tf")
    with pytest.raises(ValueError, match=r"ar_fraction must lie in \[0, 1\]"):
        RefusionDataCollator(mask_token_id=MASK, ar_fraction=1.5)
    with pytest.raises(ValueError, match=r"eps must lie in \(0, 1\]"):
        RefusionDataCollator(mask_token_id=MASK, eps=0.0)
    collator = RefusionDataCollator(mask_token_id=MASK)
    with pytest.raises(ValueError, match="feature 1: .*needs `input_ids` and `prompt_length`.*remove_unused_columns"):
        collator([feature(1, 2), {"input_ids": [5, 6]}])
    with pytest.raises(ValueError, match="feature 0: prompt_length is 3 but input_ids has 3 tokens"):
        collator([{"input_ids": [5, 6, 1], "prompt_length": 3}])
    with pytest.raises(ValueError, match="feature 0: input_ids must be a sequence of token ids"):
        collator([{"input_ids": "t5 t6", "prompt_length": 0}])
    with pytest.raises(ValueError, match="feature 0: input_ids must hold integer token ids"):
        collator([{"input_ids": [[5, 6], [7, 1]], "prompt_length": 0}])
    with pytest.raises(ValueError, match="empty batch"):
        collator([])
