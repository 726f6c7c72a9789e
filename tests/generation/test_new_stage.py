"""What a new decoding mode costs (docs/design.md §3, "Adding a stage"): its unit in a module of its own, one
`register_stage` call and its knob.

The toy mode, `trust_drafts`, commits the chosen drafts without verifying them (up to a drafted EOS): a unit that
wraps VERIFY (it feeds VERIFY's query) and decides with a transition every stage uses (`Commit`).

Shipped as a mode is shipped (`test_a_mode_shipped_as_its_module_registration_and_one_declared_knob_works_everywhere`):
a copy of the package gets the unit as `generation/trust_drafts.py`, its registration at the end of `stages.py` and
one `DecodingKnob` in `KNOBS`, nothing else; a fresh process importing the copy gets the knob as a `generate()`
argument, a config field with its type check, a command flag and a decoder setting, and the mode decodes.

In process (the other tests), the knob is a field of a `DecodingSettings` subclass, so the unit is driven by
scripted logits as tests/generation/test_stages.py drives the built-in stages.
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
from refusion_hf.generation.stages import register_stage, unregister_stage
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


# --------------------------------------------------------------------------- shipped: module, registration, knob
UNIT_MODULE = f'''"""The `trust_drafts` decoding mode: chosen drafts are committed without verification."""

from __future__ import annotations

import torch

from .sequence_state import SequenceState
from .stage_interface import ExaminedPart, StageQuery, StageUnit, stack_rows
from .transitions import Commit, Kept


{inspect.getsource(TrustDrafts)}'''

REGISTRATION = """
from .trust_drafts import TrustDrafts  # noqa: E402

register_stage(Stage.VERIFY, TrustDrafts, knob="trust_drafts")
"""

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
    """A copy of the package with three edits (the unit's module, its registration, its `DecodingKnob`): in a fresh
    process the knob is a `generate()` argument, a type-checked config field, a documented field, a command flag
    and a decoder setting with the declared default; with it set the mode decodes (fewer forwards: drafts are not
    verified), without it the tokens and forwards are this package's own."""
    package = Path(refusion_hf.__file__).parent
    copy = tmp_path / "src" / "refusion_hf"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    generation = copy / "generation"
    (generation / "trust_drafts.py").write_text(UNIT_MODULE)
    stages = generation / "stages.py"
    stages.write_text(stages.read_text() + REGISTRATION)
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
