"""Packing: a packed batch trains exactly like the padded batch of the same examples (loss and gradients), for the
stock causal LM (`PackedCausalLMCollator`) and for ReFusion (`RefusionDataCollator(packing_length=...)`)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3Config, Qwen3ForCausalLM

from refusion_hf import RefusionDataCollator
from refusion_hf.training.packing import PackedCausalLMCollator, block_causal_mask, plan_packed_rows

from ..tiny_models import tiny_refusion_model

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
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        pad_token_id=PAD,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).double().train()


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


def test_packed_refusion_batch_holds_the_padded_rows():
    features = refusion_features(seed=2, count=10)
    padded = RefusionDataCollator(mask_token_id=MASK, pad_token_id=PAD, seed=7)(features)
    packed = RefusionDataCollator(mask_token_id=MASK, pad_token_id=PAD, seed=7, packing_length=48)(features)
    rows, width = packed["input_ids"].shape
    assert rows < len(features) and packed["attention_mask"].shape == (rows, 1, width, width)
    assert packed["attention_mask"].dtype == torch.bool
    lengths = [len(f["input_ids"]) for f in features]
    found = 0
    for index, length in enumerate(lengths):
        # every example appears once, whole, with its own draws, attending causally to itself only
        expected = {name: padded[name][index, :length] for name in ("input_ids", "position_ids", "labels")}
        for r in range(rows):
            for start in range(width - length + 1):
                window = {name: packed[name][r, start : start + length] for name in expected}
                if all(torch.equal(window[name], expected[name]) for name in expected):
                    mask = packed["attention_mask"][r, 0]
                    block = mask[start : start + length, start : start + length]
                    assert torch.equal(block, torch.ones(length, length, dtype=torch.bool).tril())
                    assert not mask[start : start + length, :start].any()
                    assert not mask[start + length :, start : start + length].any()
                    torch.testing.assert_close(
                        packed["mdm_weights"][r, start : start + length], padded["mdm_weights"][index, :length]
                    )
                    found += 1
    assert found == len(features)
    assert packed["labels"].ne(-100).sum() == padded["labels"].ne(-100).sum()


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
        PackedCausalLMCollator()
    with pytest.raises(ValueError, match="feature 1: `input_ids` must be non-empty and `labels` as long as it"):
        PackedCausalLMCollator(pad_token_id=PAD)([{"input_ids": [4, 5]}, {"input_ids": [4, 5], "labels": [4]}])
