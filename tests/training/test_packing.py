"""Packing: a packed batch trains exactly like the padded batch of the same examples (loss and gradients), for the
stock causal LM (`PackedCausalLMCollator`) and for ReFusion (`RefusionDataCollator(packing_length=...)`)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3ForCausalLM

from refusion_hf import RefusionDataCollator
from refusion_hf.training.packing import PackedCausalLMCollator, block_causal_mask, plan_packed_rows

from ..tiny_models import tiny_qwen3_model, tiny_refusion_model

PAD = 0
MASK = 3


def random_features(seed: int, count: int, max_length: int = 30, vocab: int = 64) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    features = []
    for _ in range(count):
        length = int(torch.randint(3, max_length + 1, (1,), generator=generator))
        prompt_length = int(torch.randint(1, length, (1,), generator=generator))
        input_ids = torch.randint(4, vocab, (length,), generator=generator).tolist()
        labels = [-100] * prompt_length + input_ids[prompt_length:]
        features.append({"input_ids": input_ids, "labels": labels, "prompt_length": prompt_length})
    return features


def stock_model(attn_implementation: str) -> Qwen3ForCausalLM:
    model = tiny_qwen3_model(num_hidden_layers=2, pad_token_id=PAD, attn_implementation=attn_implementation)
    return model.double().train()


def loss_and_gradients(model, batch) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40), row_length=st.integers(1, 64))
@settings(max_examples=200, deadline=None)
def test_plan_puts_every_example_in_one_row_within_capacity(lengths, row_length):
    rows = plan_packed_rows(lengths, row_length)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    capacity = max(row_length, *lengths)
    assert all(sum(lengths[i] for i in row) <= capacity for row in rows)
    # first-fit: no two rows could be merged into one
    totals = sorted(sum(lengths[i] for i in row) for row in rows)
    assert len(totals) < 2 or totals[0] + totals[1] > capacity


def test_block_causal_mask():
    mask = block_causal_mask(torch.tensor([[0, 0, 1, 1, 1, 2]]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 6, 6) and torch.equal(mask[0, 0], expected)


def test_packed_causal_lm_batch_layout():
    features = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8, 9], "labels": [8, 9]},
        {"input_ids": [10, 11, 12, 13]},
    ]
    batch = PackedCausalLMCollator(pad_token_id=PAD, packing_length=6)(features)
    # first-fit decreasing: [10..13] then [5, 6, 7] does not fit, [8, 9] joins the first row
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 8, 9], [5, 6, 7, PAD, PAD, PAD]]
    assert batch["labels"].tolist() == [[-100, 11, 12, 13, -100, 9], [-100, 6, 7, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert "attention_mask" not in batch and batch["use_cache"] is False


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_causal_lm_batch_trains_like_the_padded_batch(attn_implementation):
    model = stock_model(attn_implementation)
    features = random_features(seed=1, count=12)
    padded_batch = {
        "input_ids": torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(f["input_ids"]) for f in features], batch_first=True, padding_value=PAD
        ),
        "labels": torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(f["labels"]) for f in features], batch_first=True, padding_value=-100
        ),
    }
    lengths = torch.tensor([len(f["input_ids"]) for f in features])
    padded_batch["attention_mask"] = (torch.arange(padded_batch["input_ids"].shape[1])[None] < lengths[:, None]).long()
    packed_batch = PackedCausalLMCollator(pad_token_id=PAD, packing_length=40)(
        [{k: f[k] for k in ("input_ids", "labels")} for f in features]
    )
    assert packed_batch["input_ids"].shape[0] < len(features)
    # a float64 model, but transformers computes the causal-LM loss in float32
    padded_loss, padded_grads = loss_and_gradients(model, padded_batch)
    packed_loss, packed_grads = loss_and_gradients(model, packed_batch)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-6)
    for a, b in zip(padded_grads, packed_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def refusion_model(attn_implementation: str):
    return tiny_refusion_model(num_hidden_layers=2, attn_implementation=attn_implementation).double().train()


def refusion_features(seed: int, count: int) -> list[dict]:
    return [{"input_ids": f["input_ids"], "prompt_length": f["prompt_length"]} for f in random_features(seed, count)]


def packed_segments(batch: dict):
    """(row, start, end) of every run of positions that attend to each other, read from the 4D mask alone."""
    rows, _, width, _ = batch["attention_mask"].shape
    for r in range(rows):
        mask = batch["attention_mask"][r, 0]
        starts = [0] + [j for j in range(1, width) if not mask[j, j - 1]]
        yield from ((r, s, e) for s, e in zip(starts, [*starts[1:], width]))


@given(
    seed=st.integers(0, 10_000),
    count=st.integers(1, 16),
    packing_length=st.integers(1, 64),
    pad_to_multiple_of=st.sampled_from([None, 8]),
)
@settings(max_examples=40, deadline=None)
def test_packed_refusion_batch_holds_the_padded_rows(seed, count, packing_length, pad_to_multiple_of):
    features = refusion_features(seed=seed, count=count)
    options = dict(mask_token_id=MASK, pad_token_id=PAD, seed=seed, pad_to_multiple_of=pad_to_multiple_of)
    padded = RefusionDataCollator(**options)(features)
    packed = RefusionDataCollator(**options, packing_length=packing_length)(features)
    rows, width = packed["input_ids"].shape
    assert packed["attention_mask"].shape == (rows, 1, width, width) and packed["attention_mask"].dtype == torch.bool
    assert pad_to_multiple_of is None or width % pad_to_multiple_of == 0
    names = ("input_ids", "position_ids", "labels", "mdm_weights")
    expected = sorted(
        tuple(tuple(padded[name][i, : len(f["input_ids"])].tolist()) for name in names) for i, f in enumerate(features)
    )
    found, capacity = [], max(packing_length, *(len(f["input_ids"]) for f in features))
    for r, start, end in packed_segments(packed):
        mask = packed["attention_mask"][r, 0]
        # causal within the segment, nothing across its borders
        assert torch.equal(mask[start:end, start:end], torch.ones(end - start, end - start, dtype=torch.bool).tril())
        assert not mask[start:end, :start].any() and not mask[end:, start:end].any()
        content = tuple(tuple(packed[name][r, start:end].tolist()) for name in names)
        if set(content[0]) == {PAD}:  # the row's padding: unlabelled, at the end
            assert set(content[2]) == {-100} and set(content[3]) == {0.0}
        else:
            assert end <= capacity
            found.append(content)
    # every example exactly once, whole, with the draws it gets unpacked (so the loss is the same)
    assert sorted(found) == expected
    assert rows == len(plan_packed_rows([len(f["input_ids"]) for f in features], packing_length))


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_refusion_batch_trains_like_the_padded_batch(attn_implementation):
    model = refusion_model(attn_implementation)
    features = refusion_features(seed=3, count=12)
    padded = RefusionDataCollator(mask_token_id=MASK, pad_token_id=PAD, seed=11)(features)
    packed = RefusionDataCollator(mask_token_id=MASK, pad_token_id=PAD, seed=11, packing_length=40)(features)
    assert packed["input_ids"].shape[0] < len(features)
    assert (padded["mdm_weights"] > 0).any() and ((padded["mdm_weights"] == 0) & (padded["labels"] != -100)).any()
    # the ReFusion loss is computed in float32 whatever the model's dtype
    padded_out, packed_out = model(**padded), model(**packed)
    for part in ("ar_loss", "mdm_loss"):
        assert getattr(packed_out, part).item() == pytest.approx(getattr(padded_out, part).item(), rel=1e-6)
    padded_loss, padded_grads = loss_and_gradients(model, padded)
    packed_loss, packed_grads = loss_and_gradients(model, packed)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-6)
    for a, b in zip(padded_grads, packed_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_packing_length_errors_name_the_argument():
    with pytest.raises(ValueError, match="packing_length must be a positive number of tokens"):
        RefusionDataCollator(mask_token_id=MASK, packing_length=0)
    with pytest.raises(ValueError, match="packing_length must be a positive number of tokens"):
        PackedCausalLMCollator(pad_token_id=PAD, packing_length=-3)
    with pytest.raises(ValueError, match="pad_token_id"):
        PackedCausalLMCollator(packing_length=8)
    with pytest.raises(ValueError, match="feature 1: `input_ids` must be non-empty and `labels` as long as it"):
        PackedCausalLMCollator(pad_token_id=PAD, packing_length=8)(
            [{"input_ids": [4, 5]}, {"input_ids": [4, 5], "labels": [4]}]
        )
