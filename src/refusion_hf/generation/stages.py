"""The registry of decoding stages, and one row's way through one forward (docs/design.md §3).

Per forward, for every row: `begin_step` asks the unit serving the row's stage for its query; after the forward,
`examine_steps` has every row's logits examined on the device (rows of one stage and width in one batched op; the
unit says which runs of its logits which unit examines: `StageUnit.parts`) and reads every row's decision values
to the host in ONE transfer; `finish_step` lets the unit advance the row (`StageUnit.advance`: its `decide`'s
transition, applied by `SequenceState.apply`). Nothing here knows a particular stage.

Which unit serves a stage is declared in a `StageRegistry`, a frozen list of `Registration`s: each puts
`make(unit below, *units of the stages it uses)` over the stage's unit for the sequences whose settings have its
`knob` set (every sequence when `knob` is None). The package's registry, `STAGES`, is built once, below; planning
ahead is `PlanAhead` registered over the two verification stages and REVISE under the `plan_ahead` knob, using
whatever unit serves PLAN. Nothing changes a registry: `STAGES.with_unit(stage, make, knob=...)` is a new one,
which `decode_batch(..., stages=registry)` decodes with. A new decoding mode is a unit in its own module, one
`Registration` in `STAGES` and its knob.

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
    """One registered unit: `make(unit below, *units of `uses`)` serves `stage` where the settings' `knob` is set
    (None: always). The unit below is what served `stage` before this registration (None for the first): a
    replacement ignores it, a wrapper delegates to it. `uses`: stages whose units (as the registry resolves them
    for the same settings) `make` also receives, for a unit that runs another stage's work (`PlanAhead`: PLAN)."""

    stage: Stage
    make: Callable[..., StageUnit]
    knob: str | None = None
    uses: tuple[Stage, ...] = ()


@dataclass(frozen=True)
class StageRegistry:
    """Which unit serves each stage, as registrations in order (a later one wraps or replaces an earlier one of its
    stage). Frozen: `with_unit` returns a new registry; `decode_batch` resolves the one it is given (`units`)
    once per call."""

    registrations: tuple[Registration, ...] = ()

    def with_unit(
        self, stage: Stage, make: Callable[..., StageUnit], knob: str | None = None, uses: tuple[Stage, ...] = ()
    ) -> StageRegistry:
        """This registry with `make` registered last over `stage` (see `Registration`), for the sequences whose
        `DecodingSettings` field `knob` is set (truthy; None: every sequence; a knob the settings lack is refused
        when a sequence decodes)."""
        return StageRegistry((*self.registrations, Registration(stage, make, knob, tuple(uses))))

    def units(self, settings: DecodingSettings) -> dict[Stage, StageUnit]:
        """The unit serving each stage under `settings`: each stage's registrations applied in order, the stages a
        registration uses resolved first."""
        for registration in self.registrations:
            knob = registration.knob
            if knob is not None and not hasattr(settings, knob):
                raise ValueError(
                    f"a stage is registered under the knob `{knob}`, which the decoding settings lack: declare it "
                    "as a decoding knob (a `DecodingSettings` field) or leave the registration out of the registry."
                )
        resolved: dict[Stage, StageUnit] = {}
        resolving: list[Stage] = []

        def resolve(stage: Stage) -> StageUnit | None:
            if stage in resolved:
                return resolved[stage]
            if stage in resolving:
                raise ValueError(f"stage registrations use each other in a cycle: {[*resolving, stage]}")
            resolving.append(stage)
            unit = None
            for registration in self.registrations:
                if registration.stage is stage and (registration.knob is None or getattr(settings, registration.knob)):
                    unit = registration.make(unit, *(resolve(used) for used in registration.uses))
            resolving.pop()
            resolved[stage] = unit
            return unit

        for registration in self.registrations:
            resolve(registration.stage)
        return {stage: unit for stage, unit in resolved.items() if unit is not None}


# The package's registry (decode_batch's default), built once: the built-in stages, then planning ahead over the
# stages it rides along.
STAGES = StageRegistry((
    Registration(Stage.PLAN, lambda _: PlanStage()),
    Registration(Stage.VERIFY, lambda _: VerifyStage()),
    Registration(Stage.INFILL_DRAFT, lambda _: InfillDraftStage()),
    Registration(Stage.INFILL_VERIFY, lambda _: InfillVerifyStage()),
    Registration(Stage.REVISE, lambda _: ReviseStage()),
    Registration(Stage.VERIFY, PlanAhead, knob="plan_ahead", uses=(Stage.PLAN,)),
    Registration(Stage.INFILL_VERIFY, PlanAhead, knob="plan_ahead", uses=(Stage.PLAN,)),
    Registration(Stage.REVISE, PlanAhead, knob="plan_ahead", uses=(Stage.PLAN,)),
))  # fmt: skip


@dataclass
class RowStep:
    """One row's part in one forward: its state, the unit serving its stage and the query that unit built."""

    state: SequenceState
    unit: StageUnit
    fed: StageQuery


def begin_step(state: SequenceState, units: dict[Stage, StageUnit]) -> RowStep:
    """The row's step: the unit serving its stage (`units`: `StageRegistry.units` of its settings) and its query."""
    unit = units[state.stage]
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
