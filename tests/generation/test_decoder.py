"""The decoder's building blocks and its cache invariant."""

from unittest.mock import patch

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refusion_hf.generation import batch_scheduler
from refusion_hf.generation.batch_scheduler import decode_batch
from refusion_hf.generation.ragged_kv_cache import forward_queries
from refusion_hf.generation.sequence_state import DecodingSettings, Stage
from refusion_hf.generation.stage_interface import next_token_probs, prefix_length
from tests.oracle import EOS, MASK, load_cases


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
    hold yet. Checked over oracle cases until both an infill round that feeds less than whole slots and an EOS that
    discards pending entries have been seen."""
    sequences_seen = []
    seen = {"forwards": 0, "partial": 0, "discarded": 0}

    def on_step(sequences):
        sequences_seen[:] = sequences

    def forward(model, kv, queries, pad_token_id):
        assert len(queries) == 1, "one row: slots are packed, never copied per slot"
        seen["forwards"] += 1
        if sequences_seen:
            sequence = sequences_seen[0]
            k = sequence.settings.slot_size
            assert int(kv.valid.sum()) == sequence.prompt_length + sum(sequence.written)
            tags = [] if kv.tags is None else sorted(kv.tags[kv.tags >= 0].tolist())
            if sequence.stage in (Stage.INFILL_DRAFT, Stage.INFILL_VERIFY):
                chosen = sequence.chosen
                assert tags == [i * k + j for i, count in enumerate(chosen.pending) for j in range(count)]
                fed = sum(k - cached for cached in chosen.cached)
                assert fed <= queries[0].tokens.shape[0]  # the next plan's masks may ride along
                seen["partial"] += fed < k * len(chosen.slots)
            else:
                assert tags == []
        return forward_queries(model, kv, queries, pad_token_id)

    real_finish = batch_scheduler.finish_step

    def finish_step(step, examination):
        kept = real_finish(step, examination)
        seen["discarded"] += kept.discarded > 0
        return kept

    checked = 0
    with patch.object(batch_scheduler, "finish_step", finish_step):
        for case in load_cases():
            settings = DecodingSettings(
                max_new_tokens=case["gen_length"],
                slot_size=case["slot_size"],
                block_size=case["block_length"],
                slot_threshold=case["slot_threshold"],
                token_threshold=case["token_threshold"],
                mask_token_id=MASK,
                eos_token_ids=(EOS,),
            )
            sequences_seen.clear()
            prompt = torch.tensor(case["prompt_ids"])
            decode_batch(model64, [prompt], settings, pad_token_id=0, on_step=on_step, forward=forward)
            checked += 1
            if seen["partial"] and seen["discarded"] and checked >= 20:
                break
    assert seen["partial"] > 0, "no infill round fed less than whole slots"
    assert seen["discarded"] > 0, "no EOS discarded pending entries"
