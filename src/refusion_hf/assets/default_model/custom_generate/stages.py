# Generated from refusion_hf.generation.stages by refusion_hf.modeling.remote_code (save_pretrained writes it; `make embedded-bundle` refreshes the embedded model's copy): edit the source, not this file.
"""The registry of decoding stages, and one row's way through one forward (docs/design.md §3).

Per forward, for every row: `begin_step` asks the row's stage (`STAGES[state.stage]`) for its query; after the
forward, `examine_steps` has every row's logits examined on the device by its stage (rows of one stage and width in
one batched op) and reads every row's decision values to the host in ONE transfer; `finish_step` lets the stage
decide, then applies the plan that rode along a verification when it holds. A new stage is a `StageUnit`
(stage_interface.py) in a module of its own, a `Stage` member and an entry here.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .infill import InfillDraftStage, InfillVerifyStage
from .plan_and_verify import PlanStage, VerifyStage, examine_plans, plan_holds
from .revision import ReviseStage
from .sequence_state import Kept, SequenceState, Stage
from .stage_interface import ExaminedPart, StageQuery, StageUnit

STAGES: dict[Stage, StageUnit] = {
    Stage.PLAN: PlanStage(),
    Stage.VERIFY: VerifyStage(),
    Stage.INFILL_DRAFT: InfillDraftStage(),
    Stage.INFILL_VERIFY: InfillVerifyStage(),
    Stage.REVISE: ReviseStage(),
}


@dataclass
class RowStep:
    """One row's part in one forward: its state, its stage and the query that stage built."""

    state: SequenceState
    unit: StageUnit
    fed: StageQuery


@dataclass
class RowExamination:
    """What examining one row's logits left for `finish_step`: the stage's payload and values, and those of the
    plan that rode along (its logits instead, when drafts are sampled: drawn only if the plan holds)."""

    payload: object = None
    values: list[int] | None = None
    ahead_payload: object = None
    ahead_values: list[int] | None = None
    ahead_logits: torch.Tensor | None = None


def begin_step(state: SequenceState) -> RowStep:
    unit = STAGES[state.stage]
    return RowStep(state, unit, unit.query(state))


def _parts(step: RowStep, row: int, logits: torch.Tensor, num_scored: int, into: RowExamination):
    """What of row `row` of this forward's logits ([B, S, V], `num_scored` of them this row's) is to be examined:
    the stage's own logits and, with a plan riding along, that plan's."""
    state, lookahead = step.state, step.fed.lookahead
    own = num_scored if lookahead is None else lookahead.after
    pool = state.pool if step.unit.stage is Stage.PLAN else None
    parts = [ExaminedPart(state, step.fed, step.unit, row, 0, own, pool)]
    if lookahead is not None:
        # The plan that rode along is examined now when that costs nothing but compute (greedy); sampled drafts
        # would consume the random generator even when the plan is then discarded, so a sampled plan is drawn in
        # `finish_step`, only once it is known to hold (one more host read, for that row).
        if state.policy.samples:
            into.ahead_logits = logits[row, own:num_scored]
        else:
            plan = STAGES[Stage.PLAN]
            parts.append(ExaminedPart(state, step.fed, plan, row, own, num_scored - own, lookahead.slots, True))
    return parts


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


def examine_steps(steps: list[RowStep], logits: torch.Tensor, num_scored: list[int]) -> list[RowExamination]:
    """The device half of every row's step on one forward's logits [B, S, V] (row b's first `num_scored[b]`), the
    parts of one stage and width examined together, and every row's decision values read to the host in ONE
    transfer."""
    examinations = [RowExamination() for _ in steps]
    groups: dict[tuple, list[ExaminedPart]] = {}
    for row, (step, width) in enumerate(zip(steps, num_scored)):
        step.state.forward_passes += 1
        for part in _parts(step, row, logits, width, examinations[row]):
            groups.setdefault(part.group_key(), []).append(part)
    reads = []  # one [R, m] tensor per group
    for parts in groups.values():
        read, payloads = parts[0].unit.examine(parts, _gather_logits(logits, parts))
        reads.append(read)
        for part, payload in zip(parts, payloads):
            if part.ahead:
                examinations[part.row].ahead_payload = payload
            else:
                examinations[part.row].payload = payload
    flat = torch.cat([read.flatten() for read in reads]) if len(reads) > 1 else reads[0].flatten()
    flat = flat.tolist()  # the one device-to-host read
    offset = 0
    for read, parts in zip(reads, groups.values()):
        width = read.shape[1]
        for part in parts:
            values = flat[offset : offset + width]
            if part.ahead:
                examinations[part.row].ahead_values = values
            else:
                examinations[part.row].values = values
            offset += width
    return examinations


def finish_step(step: RowStep, examination: RowExamination) -> Kept:
    """Host half: the stage decides from its values; the plan that rode along is then applied if it holds. Returns
    what of the query keeps its KV in the cache."""
    state = step.state
    kept = step.unit.decide(state, step.fed, examination.payload, examination.values)
    if plan_holds(state, step.fed, kept):
        if examination.ahead_logits is not None:  # sampled: drawn now that it holds
            read, payloads = examine_plans([state], examination.ahead_logits[None], [state.pool])
            payload, values = payloads[0], read[0].tolist()
        else:
            payload, values = examination.ahead_payload, examination.ahead_values
        STAGES[Stage.PLAN].decide(state, None, payload, values)  # no context here: it keeps nothing
    return kept
