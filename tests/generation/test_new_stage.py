"""What a new decoding mode costs (docs/design.md §3, "Adding a stage"): its unit in a module of its own, one
registration in the stage registry and its knob.

The toy mode, `trust_drafts`, commits the chosen drafts without verifying them (up to a drafted EOS): a unit that
wraps VERIFY (it feeds VERIFY's query) and decides with a transition every stage uses (`Commit`).

Shipped as a mode is shipped (`test_a_mode_shipped_as_its_module_registration_and_one_declared_knob_works_everywhere`):
a copy of the package gets the unit as `generation/trust_drafts.py`, its `Registration` in `stages.STAGES` and
one `DecodingKnob` in `KNOBS`, nothing else; a fresh process importing the copy gets the knob as a `generate()`
argument, a config field with its type check, a command flag and a decoder setting, and the mode decodes.

In process (the other tests), the knob is a field of a `DecodingSettings` subclass and the registry a new one
(`STAGES.with_unit(...)`: the package's is never changed), so the unit is driven by scripted logits as
tests/generation/test_stages.py drives the built-in stages. A unit re-registered over PLAN serves every plan,
those riding along a verification's forward (`plan_ahead`) included.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import refusion_hf
from refusion_hf.generation.sequence_state import DecodingSettings, SequenceState, Stage
from refusion_hf.generation.stage_interface import ExaminedPart, StageQuery, StageUnit, stack_rows
from refusion_hf.generation.stages import STAGES
from refusion_hf.generation.transitions import Commit, Kept
from tests.generation.scripted_logits import EOS, Belief
from tests.generation.test_stages import WRONG, answer, run, settings
from tests.tiny_models import tiny_refusion_model


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
    """The package's registry with the mode registered over VERIFY (a new registry: `STAGES` stays as it is)."""
    registry = STAGES.with_unit(Stage.VERIFY, TrustDrafts, knob="trust_drafts")
    assert registry is not STAGES and len(registry.registrations) == len(STAGES.registrations) + 1
    return registry


# ------------------------------------------------------------------------------------------------------ tests
PLAN, VERIFY, DONE = Stage.PLAN, Stage.VERIFY, Stage.DONE


def trusting(trust: bool = True, **overrides) -> TrustSettings:
    return TrustSettings(**dataclasses.asdict(settings(**overrides)), trust_drafts=trust)


def test_a_registered_mode_serves_its_stage_where_its_knob_is_set(model64, trust_drafts):
    """The plan guesses WRONG at offset 1 (which the model, reading offset 0, does not expect). With the knob, the
    one plan's drafts are committed as drafted in one VERIFY forward; without it, verification rejects the guess
    and infill completes the slot: the registration changes nothing where its knob is not set."""
    belief = Belief(answer(), guess={1: WRONG})
    trusted = run(model64, [belief], trusting(), registry=trust_drafts)
    assert trusted.stages == [[PLAN, VERIFY, DONE]]
    assert trusted.tokens() == [20, WRONG, *answer()[2:]]
    assert trusted.result.forward_passes_per_row == [2]
    verified = run(model64, [belief], trusting(False), registry=trust_drafts)
    assert verified.tokens() == answer()
    assert Stage.INFILL_DRAFT in verified.stages[0]


def test_a_trusted_eos_ends_the_answer(model64, trust_drafts):
    """The drafts, a WRONG guess and an EOS among them, are committed as drafted up to the EOS: the answer ends
    there, after one plan and one trusted forward."""
    decoded = run(model64, [Belief(answer(20, 21, 22, EOS), guess={1: WRONG})], trusting(), registry=trust_drafts)
    assert decoded.result.answer_lengths == [4]
    assert decoded.tokens()[:4] == [20, WRONG, 22, EOS]
    assert decoded.result.forward_passes_per_row == [2]


def test_a_stage_registered_under_a_knob_the_settings_lack_is_refused(model64, trust_drafts):
    with pytest.raises(ValueError, match="knob `trust_drafts`"):
        run(model64, [Belief(answer())], settings(), registry=trust_drafts)
    assert run(model64, [Belief(answer())], settings()).tokens() == answer()


# ------------------------------------------------------------------------------------ a re-registered PLAN unit
class CountingPlan(StageUnit):
    """The PLAN unit below it, counting the plans it decides (`decided`, shared by every unit `make` builds)."""

    def __init__(self, plan: StageUnit, decided: list):
        self.plan, self.stage, self.decided = plan, plan.stage, decided

    def batched(self, policy) -> bool:
        return self.plan.batched(policy)

    def query(self, state: SequenceState) -> StageQuery:
        return self.plan.query(state)

    def examine(self, parts: list[ExaminedPart], logits: torch.Tensor):
        return self.plan.examine(parts, logits)

    def decide(self, state: SequenceState, fed, payload, values: list[int]):
        self.decided.append(state.forward_passes)
        return self.plan.decide(state, fed, payload, values)


def test_a_re_registered_plan_unit_plans_ahead_too(model64):
    """Planning ahead runs the next plan inside a verification's forward: that plan is the registry's PLAN unit's,
    as every other plan. Two blocks of two slots, the model sure of everything: the second block's plan rides
    along the first block's verification and holds (3 forwards, not 4), and the re-registered unit decided both
    plans, the tokens unchanged."""
    decoding = settings(max_new_tokens=8, slot_size=2, block_size=4, plan_ahead=True)
    decided = []
    registry = STAGES.with_unit(Stage.PLAN, lambda plan: CountingPlan(plan, decided))
    counted = run(model64, [Belief(answer())], decoding, registry=registry)
    alone = run(model64, [Belief(answer())], decoding)
    assert counted.tokens() == alone.tokens() == answer()
    assert counted.result.forward_passes_per_row == alone.result.forward_passes_per_row == [3]
    assert len(counted.result.chosen_slots[0]) == 2  # two plans: one forward of its own, one riding along
    assert decided == [1, 2]  # each decided by the registered unit, after the forward that ran it


# --------------------------------------------------------------------------- shipped: module, registration, knob
UNIT_MODULE = f'''"""The `trust_drafts` decoding mode: chosen drafts are committed without verification."""

from __future__ import annotations

import torch

from .sequence_state import SequenceState
from .stage_interface import ExaminedPart, StageQuery, StageUnit, stack_rows
from .transitions import Commit, Kept


{inspect.getsource(TrustDrafts)}'''

IMPORTS_END = "from .transitions import FORWARDED\n"
IMPORT = "from .trust_drafts import TrustDrafts\n"
STAGES_END = "))  # fmt: skip\n"
REGISTRATION = '    Registration(Stage.VERIFY, TrustDrafts, knob="trust_drafts"),\n'

KNOB = """    DecodingKnob(
        name="trust_drafts", type=bool, default=False,
        help="Commit the chosen drafts without verifying them (up to a drafted EOS).",
    ),
)  # fmt: skip
"""

KNOBS_END = ")  # fmt: skip\n"

GENERATE = dict(max_new_tokens=8, slot_size=4, block_size=8, mask_token_id=3, eos_token_id=1, pad_token_id=0)

# Run in the fresh process, importing the copy: every place a knob reaches, then both ways of decoding.
PROBE = f"""
import argparse, json, sys, torch
import refusion_hf
from refusion_hf.command_inputs import add_decoding_arguments
from refusion_hf.generation.refusion_generation_config import RefusionGenerationConfig
from refusion_hf.generation.sequence_state import DecodingSettings
from tests.tiny_models import tiny_refusion_model

parser = argparse.ArgumentParser()
add_decoding_arguments(parser)
model = tiny_refusion_model()
prompt = torch.tensor([[5, 6, 7, 8]])
decoded = {{}}
for trust in (False, True):
    out = model.generate(prompt, trust_drafts=trust, return_dict_in_generate=True, **{GENERATE!r})
    decoded[str(trust)] = [out.sequences[0].tolist(), out.num_forward_passes]
try:
    model.generate(prompt, trust_drafts="yes", **{GENERATE!r})
    refused = None
except ValueError as error:
    refused = str(error)
print(json.dumps(dict(
    package=refusion_hf.__file__,
    flag=parser.parse_args(["--trust-drafts"]).trust_drafts,
    setting=DecodingSettings.__dataclass_fields__["trust_drafts"].default,
    documented="trust_drafts (`bool`, defaults to `False`)" in RefusionGenerationConfig.__doc__,
    decoded=decoded,
    refused=refused,
)))
"""


def test_a_mode_shipped_as_its_module_registration_and_one_declared_knob_works_everywhere(tmp_path):
    """A copy of the package with three edits (the unit's module, its `Registration` in `STAGES` with its import,
    its `DecodingKnob`): in a fresh
    process the knob is a `generate()` argument, a type-checked config field, a documented field, a command flag
    and a decoder setting with the declared default; with it set the mode decodes (fewer forwards: drafts are not
    verified), without it the tokens and forwards are this package's own."""
    package = Path(refusion_hf.__file__).parent
    copy = tmp_path / "src" / "refusion_hf"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    generation = copy / "generation"
    (generation / "trust_drafts.py").write_text(UNIT_MODULE)
    stages = generation / "stages.py"
    text = stages.read_text()
    assert text.count(STAGES_END) == 1 and text.count(IMPORTS_END) == 1, "STAGES moved: update STAGES_END"
    stages.write_text(text.replace(IMPORTS_END, IMPORTS_END + IMPORT).replace(STAGES_END, REGISTRATION + STAGES_END))
    config = generation / "refusion_generation_config.py"
    text = config.read_text()
    assert text.count(KNOBS_END) == 1, "the end of KNOBS moved: update KNOBS_END"
    config.write_text(text.replace(KNOBS_END, KNOB))

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "src"), str(root)])}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROBE)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])

    assert Path(probe["package"]).parent == copy  # the copy, not the installed package
    assert probe["flag"] is True and probe["setting"] is False and probe["documented"]
    assert probe["refused"] is not None and "`trust_drafts` must be" in probe["refused"]

    prompt = torch.tensor([[5, 6, 7, 8]])
    own = tiny_refusion_model().generate(prompt, return_dict_in_generate=True, **GENERATE)
    assert probe["decoded"]["False"] == [own.sequences[0].tolist(), own.num_forward_passes]
    trusted_tokens, trusted_forwards = probe["decoded"]["True"]
    assert trusted_forwards < own.num_forward_passes
    assert trusted_tokens[:4] == [5, 6, 7, 8] and len(trusted_tokens) > 4
