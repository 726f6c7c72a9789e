"""The decoder's building blocks and its cache invariant."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refusion_hf.generation.refusion_decoder import (
    DecodingSettings,
    block_diagonal_causal,
    decode_batch,
    next_token_probs,
    prefix_length,
)


@given(st.lists(st.booleans(), min_size=0, max_size=12))
def test_prefix_length_is_the_leading_run(flags):
    expected = next((i for i, flag in enumerate(flags) if not flag), len(flags))
    assert int(prefix_length(torch.tensor(flags, dtype=torch.bool))) == expected


def test_next_token_probs_shifts_by_one():
    probs = torch.tensor([[0.25, 0.75], [0.5, 0.5], [0.125, 0.875]], dtype=torch.float64)
    tokens = torch.tensor([0, 1, 0])
    # entry j = P(tokens[j] | position j-1) under the softmax of position j-1's scores; entry 0 is undefined (0).
    # Scores are log-probabilities shifted by an arbitrary constant per row (softmax ignores it).
    scores = probs.log() + torch.tensor([[3.0], [-7.0], [0.5]], dtype=torch.float64)
    assert next_token_probs(scores, tokens).tolist() == pytest.approx([0.0, 0.75, 0.5], abs=1e-12)


def test_block_diagonal_causal():
    mask = block_diagonal_causal(2, 2, "cpu").int().tolist()
    assert mask == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_cache_holds_exactly_the_committed_tokens(model64):
    """Before every forward, the cache has one entry per prompt token and per committed token (no copies, no
    mask or draft entries left behind)."""
    prompt = torch.tensor([32, 24, 53, 31, 52, 63, 5, 38])
    settings = DecodingSettings(
        max_new_tokens=32,
        slot_size=4,
        block_size=16,
        slot_threshold=0.6,
        token_threshold=0.6,
        mask_token_id=3,
        eos_token_ids=(1,),
    )
    committed_after_step = [0]
    cache_lengths = []

    def before_forward(module, args, kwargs):
        cache = kwargs["cache"]
        cache_lengths.append(cache.get_seq_length() if cache.layers[0].is_initialized else 0)
        assert kwargs["input_ids"].shape[0] == 1, "one row: slots are packed, never copied per slot"

    def on_step(sequences):
        committed_after_step.append(sum(sequences[0].written))

    hook = model64.register_forward_pre_hook(before_forward, with_kwargs=True)
    try:
        result = decode_batch(model64, [prompt], settings, pad_token_id=0, on_step=on_step)
    finally:
        hook.remove()
    assert result.num_forward_passes == len(cache_lengths) > 5
    assert cache_lengths[0] == 0
    assert cache_lengths[1:] == [8 + c for c in committed_after_step[1:-1]]
