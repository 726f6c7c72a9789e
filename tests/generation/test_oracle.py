"""Token-for-token faithfulness to the authors' decoder (golden vectors, float64, greedy).

The comparison is tests/oracle.py's: on hole-free cases the tokens up to
the first EOS equal the reference's, padding follows, and we never use more forward passes; on the case where
the reference's EOS-in-infill defect left a hole, our output has none. Planning ahead (the default) only saves
forward passes: without it, the forward passes equal the reference's.
"""

import pytest
import torch

from refusion_hf.generation import batch_scheduler, plan_ahead
from tests.oracle import MASK, expected, generate_kwargs, load_cases, mismatch

CASES = load_cases()
HOLE_CASES = [case["id"] for case in CASES if not expected(case).hole_free]


def decode(model, case, **overrides):
    ids = torch.tensor([case["prompt_ids"]])
    out = model.generate(ids, return_dict_in_generate=True, **generate_kwargs(case), **overrides)
    return out.sequences[0, ids.shape[1] :].tolist(), out


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_matches_authors_decoder(model64, case):
    generated, out = decode(model64, case)
    problem = mismatch(case, generated, out.num_forward_passes)
    assert problem is None, problem


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_without_planning_ahead_forward_passes_equal_the_authors(model64, case):
    generated, out = decode(model64, case, plan_ahead=False)
    assert mismatch(case, generated, out.num_forward_passes) is None
    if expected(case).hole_free:
        assert out.num_forward_passes == case["forward_calls"]


def test_planning_ahead_changes_nothing_but_forward_passes(model64):
    saved = []
    for case in CASES:
        _, ahead = decode(model64, case)
        _, alone = decode(model64, case, plan_ahead=False)
        assert torch.equal(ahead.sequences, alone.sequences), case["id"]
        assert torch.equal(ahead.commit_step, alone.commit_step), case["id"]
        assert ahead.chosen_slots == alone.chosen_slots, case["id"]
        assert ahead.num_forward_passes <= alone.num_forward_passes, case["id"]
        saved.append(alone.num_forward_passes - ahead.num_forward_passes)
    assert sum(saved) > 1000 and sum(s > 0 for s in saved) > 100, "the plans that rode along were used"


def test_plans_that_cannot_hold_are_left_out_of_the_forward(model64, monkeypatch):
    """A plan stays out of a verification forward only where it would be discarded whatever is accepted (a drafted
    EOS ends the answer first): letting every such plan ride along saves no forward pass, only feeds more tokens."""
    fed = []
    forward = batch_scheduler.forward_queries

    def recording(model, kv, queries, pad_token_id):
        fed.extend(queries)
        return forward(model, kv, queries, pad_token_id)

    monkeypatch.setattr(batch_scheduler, "forward_queries", recording)

    def run(case):
        fed.clear()
        _, out = decode(model64, case)
        return out, sum(q.num_scored for q in fed)

    results = [run(case) for case in CASES]
    monkeypatch.setattr(plan_ahead, "plan_cannot_hold", lambda state, slots: False)
    saved = []
    for case, (out, tokens) in zip(CASES, results):
        forced, forced_tokens = run(case)
        assert torch.equal(out.sequences, forced.sequences), case["id"]
        assert out.num_forward_passes == forced.num_forward_passes, case["id"]
        saved.append(forced_tokens - tokens)
    assert min(saved) >= 0 and sum(s > 0 for s in saved) > 20, saved


def test_the_public_set_exercises_every_branch():
    """Guard against the fixture shrinking: the branches the decoder has must all be covered."""
    branches = [case["branches"] for case in CASES]
    assert len(CASES) == 300
    for key in ("gv_eos", "loop_eos"):
        assert sum(b[key] for b in branches) > 10, key
    assert sum(b["loop_multi_slot_entries"] > 0 for b in branches) > 50
    assert sum(b["gv_full_slot_iters"] > 0 for b in branches) > 50
    assert sum(b["fallback_top1_iters"] > 0 for b in branches) > 50
    assert HOLE_CASES == ["rf0302"]


@pytest.mark.parametrize("case_id", HOLE_CASES)
def test_defect_case_is_decoded_without_hole(model64, case_id):
    case = next(c for c in CASES if c["id"] == case_id)
    reference_positions = set(case["output_positions"])
    reference_cut = expected(case).cut
    assert any(p not in reference_positions for p in range(reference_cut)), "the reference really has a hole"
    generated, out = decode(model64, case)
    assert MASK not in generated
    steps = out.commit_step[0].tolist()
    end = generated.index(1) + 1 if 1 in generated else len(generated)
    assert all(step >= 0 for step in steps[:end]), "every position up to the EOS was committed by some step"
    assert all(token == 0 for token in generated[end:])
