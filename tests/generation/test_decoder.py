"""The decoder's building blocks and its cache invariant."""

from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refusion_hf.generation import batch_scheduler
from refusion_hf.generation.batch_scheduler import decode_batch
from refusion_hf.generation.draft_policy import DraftPolicy
from refusion_hf.generation.infill import InfillDraftDecision, InfillVerifyDecision
from refusion_hf.generation.plan_and_verify import PlanDecision, VerifyDecision
from refusion_hf.generation.ragged_kv_cache import forward_queries
from refusion_hf.generation.sequence_state import DecodingSettings, Stage
from tests.oracle import EOS, MASK, load_cases


def leading_run(flags) -> int:
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))


def test_token_probs_are_the_softmax_probabilities_of_the_tokens():
    probs = torch.tensor([[0.25, 0.75], [0.5, 0.5], [0.125, 0.875]], dtype=torch.float64)
    # Scores are log-probabilities shifted by an arbitrary constant per row (softmax ignores it).
    scores = probs.log() + torch.tensor([[3.0], [-7.0], [0.5]], dtype=torch.float64)
    tokens = torch.tensor([1, 0, 1])
    assert DraftPolicy.token_probs(scores, tokens).tolist() == pytest.approx([0.75, 0.5, 0.875], abs=1e-12)


# The decisions are read on the host from flags the device computed elementwise; each is checked against the
# definition it implements, over every shape a step can have.
@st.composite
def slot_flags(draw, extra: int = 0):
    n, k = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    flags = draw(st.lists(st.booleans(), min_size=n * k + extra, max_size=n * k + extra))
    return n, k, flags


@given(slot_flags(extra=-1), st.one_of(st.none(), st.data()))
def test_verify_decision_is_the_accepted_prefix_of_the_concatenation(shape, eos_data):
    n, k, above = shape
    eos = None if eos_data is None else eos_data.draw(st.lists(st.booleans(), min_size=n * k, max_size=n * k))
    # A slot's first draft is always accepted; every other draft when its probability passes the threshold.
    accepted = [True, *above]
    for i in range(n):
        accepted[i * k] = True
    prefix = leading_run(accepted)
    first_eos = next((j for j in range(prefix) if eos[j]), n * k) if eos else n * k
    decision = VerifyDecision.read([int(flag) for flag in above + (eos or [])], n, k)
    assert decision.own_prefixes == [leading_run(accepted[i * k : (i + 1) * k]) for i in range(n)]
    assert (decision.prefix, decision.first_eos) == (prefix, first_eos)


@given(slot_flags(extra=0), st.data())
def test_plan_decision_reads_each_slots_flags(shape, data):
    num_pool, k, above = shape
    eos = data.draw(st.lists(st.booleans(), min_size=num_pool * k, max_size=num_pool * k))
    passes = data.draw(st.lists(st.booleans(), min_size=num_pool, max_size=num_pool))
    best = data.draw(st.integers(0, num_pool - 1))
    decision = PlanDecision.read([int(flag) for flag in passes + above + eos] + [best], k)
    assert decision.passes == passes and decision.best == best
    assert decision.confident == [all(above[i * k + 1 : (i + 1) * k]) for i in range(num_pool)]
    assert decision.ends == [any(eos[i * k : (i + 1) * k]) for i in range(num_pool)]


@st.composite
def infill_round(draw):
    """Chosen slots in infill: per slot its verified prefix (k: complete) and what the cache holds of it."""
    n, k = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    verified = draw(st.lists(st.integers(0, k), min_size=n, max_size=n))
    cached = [draw(st.integers(0, length)) if length < k else k for length in verified]
    state = SimpleNamespace(settings=SimpleNamespace(slot_size=k), chosen=SimpleNamespace(slots=list(range(n)),
                            verified=verified))  # fmt: skip
    return n, k, verified, cached, state


@given(infill_round(), st.data())
def test_infill_verify_decision_extends_each_verified_prefix(round_, data):
    n, k, verified, cached, state = round_
    # Each slot feeds its tokens from `cached` on; each fed token but the last scores the token after it.
    targets = [(i, j) for i in range(n) if cached[i] < k for j in range(cached[i] + 1, k)]
    above = data.draw(st.lists(st.booleans(), min_size=len(targets), max_size=len(targets)))
    eos = data.draw(st.lists(st.booleans(), min_size=n * k, max_size=n * k))
    decision = InfillVerifyDecision.read([int(f) for f in above + eos], SimpleNamespace(targets=targets), state)
    passing = set(target for target, flag in zip(targets, above) if flag)
    for i in range(n):  # verified tokens stay verified, the first unverified one is always accepted
        accepted = [j <= verified[i] or (i, j) in passing for j in range(k)]
        length = leading_run(accepted)
        assert decision.verified[i] == length
        assert decision.eos_in_slot[i] == next((j for j in range(length) if eos[i * k + j]), k)


@given(infill_round(), st.data())
def test_infill_draft_decision_judges_only_the_redrafted_tails(round_, data):
    n, k, verified, _, state = round_
    targets = [(i, j) for i in range(n) for j in range(verified[i], k)]  # the unverified tails, re-drafted
    above = data.draw(st.lists(st.booleans(), min_size=len(targets), max_size=len(targets)))
    eos = data.draw(st.lists(st.booleans(), min_size=len(targets), max_size=len(targets)))
    decision = InfillDraftDecision.read([int(f) for f in above + eos], SimpleNamespace(targets=targets), state)
    for i in range(n):
        tail = [index for index, (slot, _) in enumerate(targets) if slot == i]
        assert decision.confident[i] == all(above[t] or targets[t][1] == verified[i] for t in tail)
        assert decision.ends[i] == any(eos[t] for t in tail)


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
