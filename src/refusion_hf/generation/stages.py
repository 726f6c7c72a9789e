"""The registry of decoding stages, and one row's way through one forward (docs/design.md §3).

Per forward, for every row: `begin_step` asks the unit serving the row's stage for its query; after the forward,
`examine_steps` has every row's logits examined on the device (rows of one stage and width in one batched op; the
unit says which runs of its logits which unit examines: `StageUnit.parts`) and reads every row's decision values
to the host in ONE transfer; `finish_step` lets the unit advance the row (`StageUnit.advance`: its `decide`'s
transition, applied by `SequenceState.apply`). Nothing here knows a particular stage.

Which unit serves a stage is registered: `register_stage(stage, make, knob=...)` puts `make(unit below)` over the
stage's unit for the sequences whose settings have `knob` set (every sequence when `knob` is None). The built-in
stages register below; planning ahead is `PlanAhead` registered over the two verification stages and REVISE
under the `plan_ahead` knob. A new decoding mode is a unit in its own module, one `register_stage` call and its knob.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .infill import InfillDraftStage, InfillVerifyStage
from .plan_ahead import PlanAhead
from .plan_and_verify import PlanStage, VerifyStage
from .revision import ReviseStage
from .sequence_state import DecodingSettings, Kept, SequenceState, Stage
from .stage_interface import ExaminedPart, RowExamination, StageQuery, StageUnit
from .transitions import FORWARDED


@dataclass(frozen=True)
class Registration:
    """One registered unit: `make(unit below)` serves `stage` where the settings' `knob` is set (None: always)."""

    stage: Stage
    make: Callable[[StageUnit | None], StageUnit]
    knob: str | None = None


REGISTRY: list[Registration] = []  # in registration order: a later registration wraps (or replaces) an earlier one
_UNITS: dict[DecodingSettings, dict[Stage, StageUnit]] = {}  # resolved per settings (cleared by `register_stage`)
_LAST: list = [None, None]  # the settings resolved last, and their units
MAX_RESOLVED = 64  # settings resolved at once (a server may see many): beyond, the table starts again


def register_stage(stage: Stage, make: Callable[[StageUnit | None], StageUnit], knob: str | None = None):
    """Serve `stage` with `make(unit)`, `unit` being what served it before this registration (None for the first),
    for every sequence whose `DecodingSettings` field `knob` is set (truthy; None: every sequence; a knob the
    settings lack is refused when a sequence decodes). A replacement ignores its argument; a wrapper (`PlanAhead`)
    delegates to it. Returns the registration (for `unregister_stage`)."""
    registration = Registration(stage, make, knob)
    REGISTRY.append(registration)
    _UNITS.clear()
    _LAST[:] = None, None
    return registration


def unregister_stage(registration: Registration) -> None:
    """Undo `register_stage`."""
    REGISTRY.remove(registration)
    _UNITS.clear()
    _LAST[:] = None, None


def units(settings: DecodingSettings) -> dict[Stage, StageUnit]:
    """The unit serving each stage under `settings` (resolved once per settings)."""
    last_settings, last = _LAST
    if settings is last_settings:  # every row of a call shares one settings object: no hashing per step
        return last
    resolved = _UNITS.get(settings)
    if resolved is None:
        resolved = {}
        for registration in REGISTRY:
            knob = registration.knob
            if knob is not None and not hasattr(settings, knob):
                raise ValueError(
                    f"a stage is registered under the knob `{knob}`, which the decoding settings lack: declare it "
                    "as a decoding knob (a `DecodingSettings` field) or unregister the stage."
                )
            if knob is None or getattr(settings, knob):
                resolved[registration.stage] = registration.make(resolved.get(registration.stage))
        if len(_UNITS) >= MAX_RESOLVED:
            _UNITS.clear()
        _UNITS[settings] = resolved
    _LAST[:] = settings, resolved
    return resolved


_plan = PlanStage()
register_stage(Stage.PLAN, lambda _: _plan)
register_stage(Stage.VERIFY, lambda _: VerifyStage())
register_stage(Stage.INFILL_DRAFT, lambda _: InfillDraftStage())
register_stage(Stage.INFILL_VERIFY, lambda _: InfillVerifyStage())
register_stage(Stage.REVISE, lambda _: ReviseStage())
register_stage(Stage.VERIFY, lambda verify: PlanAhead(verify, _plan), knob="plan_ahead")
register_stage(Stage.INFILL_VERIFY, lambda verify: PlanAhead(verify, _plan), knob="plan_ahead")
register_stage(Stage.REVISE, lambda revise: PlanAhead(revise, _plan), knob="plan_ahead")


@dataclass
class RowStep:
    """One row's part in one forward: its state, the unit serving its stage and the query that unit built."""

    state: SequenceState
    unit: StageUnit
    fed: StageQuery


def begin_step(state: SequenceState) -> RowStep:
    unit = units(state.settings)[state.stage]
    return RowStep(state, unit, unit.query(state))


def _gather_logits(logits: torch.Tensor, parts: list[ExaminedPart]) -> torch.Tensor:
    """The parts' logits rows, [R, width, V]."""
    width = parts[0].width
    if len(parts) == 1:
        part = parts[0]
        return logits[part.row : part.row + 1, part.start : part.start + width]
    rows = torch.tensor([part.row for part in parts], device=logits.device)
    if all(part.start == parts[0].start for part in parts):
        return logits[rows, parts[0].start : parts[0].start + width]
    columns = torch.tensor([range(part.start, part.start + width) for part in parts], device=logits.device)
    return logits[rows[:, None], columns]


def examine_steps(steps: list[RowStep], logits: torch.Tensor) -> list[RowExamination]:
    """The device half of every row's step on one forward's logits [B, S, V] (row b's first `num_scored`), the
    parts of one stage and width examined together, and every row's decision values read to the host in ONE
    transfer."""
    examinations = [RowExamination() for _ in steps]
    groups: dict[tuple, list[ExaminedPart]] = {}
    for row, step in enumerate(steps):
        step.state.apply(FORWARDED)
        for part in step.unit.parts(step.state, step.fed, row, logits, examinations[row]):
            groups.setdefault(part.group_key(), []).append(part)
    reads = []  # one [R, m] tensor per group
    for parts in groups.values():
        read, payloads = parts[0].unit.examine(parts, _gather_logits(logits, parts))
        reads.append(read)
        for part, payload in zip(parts, payloads):
            if part.extra:
                examinations[part.row].extra_payload = payload
            else:
                examinations[part.row].payload = payload
    flat = torch.cat([read.flatten() for read in reads]) if len(reads) > 1 else reads[0].flatten()
    flat = flat.tolist()  # the one device-to-host read
    offset = 0
    for read, parts in zip(reads, groups.values()):
        width = read.shape[1]
        for part in parts:
            values = flat[offset : offset + width]
            if part.extra:
                examinations[part.row].extra_values = values
            else:
                examinations[part.row].values = values
            offset += width
    return examinations


def finish_step(step: RowStep, examination: RowExamination) -> Kept:
    """Host half: the unit advances the row from its values (`StageUnit.advance`). Returns what of the query keeps
    its KV in the cache."""
    return step.unit.advance(step.state, step.fed, examination)
