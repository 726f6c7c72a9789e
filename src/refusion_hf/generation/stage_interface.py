"""The interface every decoding stage implements, and what travels between its halves (docs/design.md §3).

A stage is a `StageUnit` with three methods, called once per forward for every row in that stage:

    query(state)                 -> StageQuery   what the row feeds: tokens, positions, visibility, and the stage's
                                                 own `layout` of them (read back by `decide`: no hidden fields)
    examine(parts, logits)       -> (values, payloads)
                                                 the device half: logits [R, W, V] of R rows (rows of one stage and
                                                 width together when `batched`) -> decision values [R, m] (long,
                                                 read to the host with every other row's in ONE transfer) and one
                                                 payload per row (device tensors `decide` needs, e.g. the drafts)
    decide(state, fed, payload, values) -> Transition
                                                 the host half: the row's values decoded into the stage's typed
                                                 decision and the transition it makes (transitions.py), which
                                                 `SequenceState.apply` executes; it carries what of the query keeps
                                                 its KV (`Kept`)

`query`, `examine` and `decide` only read the state. Two more methods have defaults that a unit wrapping another
overrides (plan_ahead.py): `parts` (which runs of its logits which unit examines) and `advance` (the transitions
applied after the forward: by default its `decide`'s). Nothing here knows a particular stage: what one unit passes
between its own halves (plan_ahead.py's lookahead) is its own subclass or payload.

`stages.py` declares which unit serves each stage (`StageRegistry`) and drives one row through one forward with
them. The
stages themselves are in `plan_and_verify.py`, `infill.py`, `revision.py` and `plan_ahead.py`; what they share is
here (tensor helpers, and re-feeding a revised block's tokens before a query: `after_context`).

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .draft_policy import DraftPolicy
from .sequence_state import Query, SequenceState, Stage
from .transitions import Kept, Transition


@dataclass(frozen=True)
class StageQuery:
    """A row's query for one forward, as its stage built it (a wrapping unit may extend it: a subclass)."""

    query: Query
    layout: Any = None  # the stage's own description of what it fed (infill: `InfillFeed`), for its `decide`


@dataclass(frozen=True)
class ExaminedPart:
    """A run of one row's logits that one stage examines: `width` logits rows from `start` (the stage's own
    logits, or a plan riding along after them)."""

    state: SequenceState
    fed: StageQuery
    unit: StageUnit
    row: int  # in the forward's batch
    start: int
    width: int
    slots: list[int] | None = None  # the slots these logits are of, when not the row's pool (None)
    extra: bool = False  # a second part of the row's logits, examined for a wrapping unit (`RowExamination`)

    def group_key(self) -> tuple:
        """Parts with equal keys are examined in one batched op."""
        stage = self.unit.stage
        return (stage, self.width) if self.unit.batched(self.state.policy) else (stage, self.width, self.row)


@dataclass
class RowExamination:
    """What examining one row's logits left for `StageUnit.advance`: the payload and values of its stage's part,
    those of an `extra` part a wrapping unit has examined, and anything else a wrapping unit's `parts` kept for its
    `advance` (`deferred`: plan_ahead.py keeps a sampled plan's logits, drawn only if the plan holds)."""

    payload: object = None
    values: list[int] | None = None
    extra_payload: object = None
    extra_values: list[int] | None = None
    deferred: object = None


class StageUnit:
    """One stage of the decoding loop (see the module docstring)."""

    stage: Stage

    def batched(self, policy: DraftPolicy) -> bool:
        """Whether rows of this stage and one width are examined in one batched op."""
        return False

    def query(self, state: SequenceState) -> StageQuery:
        raise NotImplementedError

    def examine(self, parts: list[ExaminedPart], logits: torch.Tensor) -> tuple[torch.LongTensor, list]:
        raise NotImplementedError

    def decide(self, state: SequenceState, fed: StageQuery, payload, values: list[int]) -> Transition:
        raise NotImplementedError

    def parts(
        self, state: SequenceState, fed: StageQuery, row: int, logits: torch.Tensor, into: RowExamination
    ) -> list[ExaminedPart]:
        """What of row `row` of a forward's logits ([B, S, V], the first `fed.query.num_scored` of them this row's)
        is examined, by which unit: by default all of them, by this one."""
        return [ExaminedPart(state, fed, self, row, 0, fed.query.num_scored)]

    def advance(self, state: SequenceState, fed: StageQuery, examination: RowExamination) -> Kept:
        """The host half after the forward: `decide`, and `SequenceState.apply` of its transition."""
        return state.apply(self.decide(state, fed, examination.payload, examination.values))


# ------------------------------------------------------------------------------------ shared tensor helpers
@functools.lru_cache(maxsize=64)
def causal(length: int, device: torch.device) -> torch.BoolTensor:
    """[length, length] lower-triangular True. Shared (cached per shape): read it, never write into it."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def stack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`torch.stack(tensors)`; one row is a view of it (no copy)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


def accepted_run(accepted, start: int, end: int) -> int:
    """Host flags: from `start` (everything before it accepted), how far the run of accepted entries reaches, at most
    `end`: the length of an accepted prefix."""
    length = min(start, end)
    while length < end and accepted[length]:
        length += 1
    return length


def first_true(mask: torch.BoolTensor) -> torch.LongTensor:
    """Index of the first True along the last dimension; its size where there is none."""
    return torch.where(mask.any(-1), mask.long().argmax(-1), mask.shape[-1])


def after_context(state: SequenceState, query: Query, sees_context: torch.BoolTensor | None = None) -> Query:
    """`query` (its tokens all scored) after the tokens still to be cached (the prompt, or a revised block's kept
    tokens, re-fed in position order after a revision dropped the block's entries): those are the new query's
    context, causal among themselves; scored token i sees context token j where `sees_context[i, j]` ([s, c]; None:
    every one). No visibility is built over the context (`Query`)."""
    tokens = torch.cat([state.context, query.tokens])
    positions = torch.cat([state.context_positions, query.positions])
    return Query(tokens, positions, query.visible, state.num_context(), query.pending_view, query.hidden, sees_context)


def constrained_scores(policy: DraftPolicy, logits: torch.Tensor, offsets) -> torch.Tensor:
    """logits [R, W, V] -> constrained scores [R * W, V]; `offsets()` gives the answer offset each logits row
    predicts (a host list; only called when a positional constraint needs it: off the hot path otherwise)."""
    offsets = torch.tensor(offsets(), device=logits.device) if policy.positional else None
    return policy.scores(logits.flatten(0, 1), offsets)
