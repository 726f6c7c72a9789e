"""What a new decoding mode costs (docs/design.md §3, "Adding a stage"): its unit (here, in this file), one
`register_stage` call and its knob. Nothing under src/ changes.

The toy mode, `trust_drafts`, commits the chosen drafts without verifying them (up to a drafted EOS): a unit that
wraps VERIFY (it feeds VERIFY's query) and decides with a transition every stage uses (`Commit`). Its knob is a
field of the settings the decoder reads (a `DecodingSettings` subclass here; a declared knob in
`refusion_generation_config.KNOBS` for a shipped mode). Driven by scripted logits, as tests/generation/
test_stages.py drives the built-in stages.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from refusion_hf.generation.sequence_state import DecodingSettings, SequenceState, Stage
from refusion_hf.generation.stage_interface import ExaminedPart, StageQuery, StageUnit, stack_rows
from refusion_hf.generation.stages import register_stage, unregister_stage
from refusion_hf.generation.transitions import Commit, Kept
from tests.generation.scripted_logits import EOS, Belief
from tests.generation.test_stages import WRONG, answer, run, settings


# ------------------------------------------------------------------------------------------ the whole new mode
@dataclasses.dataclass(frozen=True)
class TrustSettings(DecodingSettings):
    trust_drafts: bool = False  # the knob


class TrustDrafts(StageUnit):
    """VERIFY's forward, but every chosen draft is committed (up to the first drafted EOS)."""

    def __init__(self, verify: StageUnit):
        self.verify, self.stage = verify, verify.stage

    def batched(self, policy) -> bool:
        return True

    def query(self, state: SequenceState) -> StageQuery:
        return self.verify.query(state)

    def examine(self, parts: list[ExaminedPart], logits: torch.Tensor):
        drafts = stack_rows([part.state.chosen.tokens.flatten() for part in parts])  # [R, n*k]
        return parts[0].state.is_eos(drafts).long(), list(drafts.unbind())

    def decide(self, state: SequenceState, fed: StageQuery, drafts: torch.LongTensor, values: list[int]) -> Commit:
        k, slots = state.settings.slot_size, state.chosen.slots
        eos = next((i for i, is_eos in enumerate(values) if is_eos), None)
        end = len(values) if eos is None else eos + 1
        return Commit(Kept(end), slots[: -(-end // k)], drafts[:end], eos)


@pytest.fixture
def trust_drafts():
    registration = register_stage(Stage.VERIFY, TrustDrafts, knob="trust_drafts")
    yield
    unregister_stage(registration)


# ------------------------------------------------------------------------------------------------------ tests
PLAN, VERIFY, DONE = Stage.PLAN, Stage.VERIFY, Stage.DONE


def trusting(trust: bool = True, **overrides) -> TrustSettings:
    return TrustSettings(**dataclasses.asdict(settings(**overrides)), trust_drafts=trust)


def test_a_registered_mode_serves_its_stage_where_its_knob_is_set(model64, trust_drafts):
    """The plan guesses WRONG at offset 1 (which the model, reading offset 0, does not expect). With the knob, the
    one plan's drafts are committed as drafted in one VERIFY forward; without it, verification rejects the guess
    and infill completes the slot: the registration changes nothing where its knob is not set."""
    belief = Belief(answer(), guess={1: WRONG})
    trusted = run(model64, [belief], trusting())
    assert trusted.stages == [[PLAN, VERIFY, DONE]]
    assert trusted.tokens() == [20, WRONG, *answer()[2:]]
    assert trusted.result.forward_passes_per_row == [2]
    verified = run(model64, [belief], trusting(False))
    assert verified.tokens() == answer()
    assert Stage.INFILL_DRAFT in verified.stages[0]


def test_a_trusted_eos_ends_the_answer(model64, trust_drafts):
    """The drafts, a WRONG guess and an EOS among them, are committed as drafted up to the EOS: the answer ends
    there, after one plan and one trusted forward."""
    decoded = run(model64, [Belief(answer(20, 21, 22, EOS), guess={1: WRONG})], trusting())
    assert decoded.result.answer_lengths == [4]
    assert decoded.tokens()[:4] == [20, WRONG, 22, EOS]
    assert decoded.result.forward_passes_per_row == [2]


def test_a_stage_registered_under_a_knob_the_settings_lack_is_refused(model64):
    registration = register_stage(Stage.VERIFY, TrustDrafts, knob="trust_drafts")
    try:
        with pytest.raises(ValueError, match="knob `trust_drafts`"):
            run(model64, [Belief(answer())], settings())
    finally:
        unregister_stage(registration)
    assert run(model64, [Belief(answer())], settings()).tokens() == answer()
