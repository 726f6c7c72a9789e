"""The decoder's building blocks and its cache invariant."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refusion_hf.generation.refusion_decoder import (
    DecodingSettings,
    Stage,
    decode_batch,
    forward_queries,
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


def test_cache_holds_exactly_the_committed_and_pending_tokens(model64):
    """Before every forward, the cache's committed entries are one per prompt token and per committed token, its
    pending entries are the verified prefixes of the slots in infill (tagged slot * k + index), and nothing else is
    attended to (no copies, no mask or draft entries left behind); an infill round feeds only what its slots do not
    hold yet."""
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
    sequences_seen = []
    checked = {"forwards": 0, "infill": 0, "partial": 0}

    def on_step(sequences):
        sequences_seen[:] = sequences

    def forward(model, kv, queries, pad_token_id):
        assert len(queries) == 1, "one row: slots are packed, never copied per slot"
        checked["forwards"] += 1
        if sequences_seen:
            sequence = sequences_seen[0]
            assert int(kv.valid.sum()) == 8 + sum(sequence.written)
            tags = [] if kv.tags is None else sorted(kv.tags[kv.tags >= 0].tolist())
            if sequence.stage in (Stage.INFILL_DRAFT, Stage.INFILL_VERIFY):
                chosen = sequence.chosen
                assert tags == [i * 4 + j for i, count in enumerate(chosen.pending) for j in range(count)]
                fed = sum(4 - cached for cached in chosen.cached)
                assert fed <= queries[0].tokens.shape[0]  # the next plan's masks may ride along
                checked["infill"] += 1
                checked["partial"] += fed < 4 * len(chosen.slots)
            else:
                assert tags == []
        return forward_queries(model, kv, queries, pad_token_id)

    result = decode_batch(model64, [prompt], settings, pad_token_id=0, on_step=on_step, forward=forward)
    assert result.num_forward_passes == checked["forwards"] > 5
    assert checked["partial"] > 0, "the case must go through infill rounds that feed less than whole slots"
