"""What a stage's `decide` returns: a typed transition of one sequence's state, executed by `SequenceState.apply`
(docs/design.md §3, "Who writes the state").

A stage reads the state and its forward's values and returns one of the transitions below; `SequenceState.apply`
is the one place that changes the state, and it returns the transition's `Kept` (what of the query keeps its KV in
the cache). Transitions carry host lists and device tensors (views of the stage's payload), never a per-row loop
for `apply` to replay: they are the stage's decision, ready to be written.

    Choose        a plan chose slots (their drafts, as drafted): verify them next
    Commit        write slots' tokens (possibly cut after an EOS): the planning iteration is over
    EnterInfill   verification accepted no whole slot: complete every chosen slot on its own
    Redraft       infill re-drafted the chosen slots' unverified tails (the drafts written into the chosen slots)
    InfillChecked infill verified the chosen slots: their verified prefixes grow; complete, they are committed
    Remask        a revision took tokens back (and completes their slots by infill, or re-scores the block)
    CloseBlock    the block is final: go on with the next block, or finish
    StopAt        a stopping criterion fired: the answer ends there
    Forwarded     the sequence took part in one more forward

A new stage decides with these; a transition of a new kind is a dataclass here and its handler in
`SequenceState.apply`.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Kept:
    """What a sequence keeps of its last forward's query in the cache (a stage's `decide`).

    `committed` leading query tokens become committed entries (every stage commits a prefix of its query: the
    prompt, the verified slots in position order, the completed infill slots in position order). `pending` runs
    `(query offset, length, first tag)` are kept as pending entries tagged `first tag`, `first tag + 1`, ...
    (infill prefixes; tag = chosen slot * k + index in the slot). Then the row's pending entries tagged
    `keep_below` or more are discarded (None: none is; `discarded` counts them) and, with `promote`, the rest
    become committed (the infill is complete). Finally, with `invalidate_from`, every entry of the row holding
    that original position or a later one leaves the cache (a revision took those tokens back)."""

    committed: int
    pending: tuple[tuple[int, int, int], ...] = ()
    keep_below: int | None = None
    promote: bool = False
    discarded: int = 0
    invalidate_from: int | None = None

    @property
    def extent(self) -> int:
        """Query tokens up to the last kept one."""
        return max([self.committed] + [offset + length for offset, length, _ in self.pending])


class Transition:
    """Base of the transitions. Those a stage's `decide` returns carry `kept`: what of the query keeps its KV."""


@dataclass(frozen=True)
class Choose(Transition):
    """A plan chose `slots` (position order) of its pool: the context it fed is cached, a new step begins, and the
    chosen slots' drafts ([n, k], views of the plan's `plan_drafts` [P, k]) are verified next."""

    kept: Kept
    slots: list[int]
    tokens: torch.LongTensor
    draft_probs: torch.Tensor
    confident: list[bool]
    ends: list[bool]
    plan_drafts: torch.LongTensor


@dataclass(frozen=True)
class Commit(Transition):
    """Write `tokens` (the slots' tokens concatenated, cut after an EOS when `eos_at`, its index in `tokens`, is
    set: every undecoded slot after it is dropped and no later block is decoded); the iteration is over."""

    kept: Kept
    slots: list[int]
    tokens: torch.LongTensor
    eos_at: int | None = None


@dataclass(frozen=True)
class EnterInfill(Transition):
    """Verification accepted no whole slot: each chosen slot leaves the pool and is completed on its own, from its
    own accepted prefix (`verified`, per chosen slot)."""

    kept: Kept
    verified: list[int]


@dataclass(frozen=True)
class Redraft(Transition):
    """Infill re-drafted the chosen slots' unverified tails: `proposals` [m] go to the chosen slots' flattened
    tokens at `target_index` [m] (with their probabilities `probs`, and the slots' `confident` / `ends` re-read,
    when planning ahead needs them: None otherwise); the verified tokens fed are pending for their slots; verify
    next. The context fed (after a revision) is cached."""

    kept: Kept
    target_index: torch.LongTensor
    proposals: torch.LongTensor
    probs: torch.Tensor | None = None
    confident: list[bool] | None = None
    ends: list[bool] | None = None


@dataclass(frozen=True)
class InfillChecked(Transition):
    """Infill verified the chosen slots: `grown` (chosen slot, new cached length) runs stay pending, `verified` is
    each slot's verified prefix. `ending`: the chosen slot whose verified prefix holds an EOS (its pending entries
    cut to `ending_pending`; the slots after it and the undecoded slots after it dropped). `commit`: every slot is
    complete, and this is their commit (None: infill goes on)."""

    kept: Kept
    grown: list[tuple[int, int]]
    verified: list[int]
    ending: int | None = None
    ending_pending: int = 0
    commit: Commit | None = None


@dataclass(frozen=True)
class Remask(Transition):
    """A revision: per cut `(slot, first, replacement)`, the slot's tokens from `first` are taken back and the
    replacement written at `first`; slots with tokens left to decode are completed by infill (their re-scored
    probabilities: rows of `probs` [n, k] by `rescored_slots`); the block's other tokens are re-fed as context."""

    kept: Kept
    cuts: list[tuple[int, int, int]]
    probs: torch.Tensor
    rescored_slots: list[int]


@dataclass(frozen=True)
class CloseBlock(Transition):
    """The block is decoded and revised: its tokens are final (the context fed is cached)."""

    kept: Kept


@dataclass(frozen=True)
class StopAt(Transition):
    """A stopping criterion fired after `length` final answer tokens."""

    length: int


@dataclass(frozen=True)
class Forwarded(Transition):
    """The sequence took part in one more forward."""


FORWARDED = Forwarded()
