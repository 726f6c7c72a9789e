"""Planning ahead (`DecodingSettings.plan_ahead`): a unit that wraps a verification stage (VERIFY or INFILL_VERIFY)
or, with `remask_threshold` set, the REVISE stage, and runs the next plan inside its forward (docs/design.md §3).

The wrapped stage's query also carries the next PLAN's mask tokens. After a verification they see every token of
the query, and the plan holds when the verification commits exactly those tokens; after a revision's re-score
(which closes the block when it finds nothing to revise) they see none of the re-score's runs, which are never
cached, and the plan is the next block's: it holds when the block closes. When it holds and the pool is the one
assumed, the next plan's inputs are the same as in a PLAN forward of its own (same cache entries in the same order,
same masks at the same positions), so its logits are used and that forward is saved; otherwise they are
discarded. Results do not change (up to float rounding of a differently shaped matmul); only forward passes are
saved. After a verification the masks ride along only when that outcome is likely: every draft still to be
verified was drafted with a probability above the token threshold (extra query tokens are not free on a CPU), and
no draft to be verified is an EOS whose acceptance would drop the plan's slots (`plan_cannot_hold`). After a
re-score they ride along whenever there is a next block and no re-fed context (a revision's re-score usually closes
the block).

`PlanAhead` is registered (stages.py) over VERIFY, INFILL_VERIFY and REVISE, under the `plan_ahead` knob: with it
off those units run alone. The plan is the registry's: whatever unit serves PLAN (`Registration.uses`) examines and
decides the plan riding along, as it does a plan's own forward. PlanAhead decides nothing itself: the wrapped
unit's transition is applied, then, when the plan holds, the plan unit's. What it adds to a query (`AheadQuery`,
`Lookahead`) is declared here.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence_state import Query, SequenceState, Stage
from .stage_interface import ExaminedPart, RowExamination, StageQuery, StageUnit, causal
from .transitions import Kept

ALL_PENDING = (0, 2**62)  # `Query.pending_view` of a token that sees every pending entry of its row


@dataclass(frozen=True)
class Lookahead:
    """The next plan's masks appended to a wrapped stage's query, and what that plan assumes."""

    slots: list[int]  # the pool the next plan would have
    after: int  # query tokens before the masks (the wrapped stage's own)
    commits: int  # of those, how many the stage must commit (in query order, nothing taken back) for the plan to
    # hold: all of a verification's; none of a revision's (its re-score runs are never cached)


@dataclass(frozen=True)
class AheadQuery(StageQuery):
    """A wrapped stage's query with the next plan's masks riding along (the wrapped unit reads it as its own)."""

    lookahead: Lookahead | None = None


class PlanAhead(StageUnit):
    """`wrapped` (a verification or the revision unit), with the next plan riding along its forwards, examined and
    decided by `plan`: the unit serving PLAN (stages.py passes the registry's)."""

    def __init__(self, wrapped: StageUnit, plan: StageUnit):
        self.wrapped, self.plan, self.stage = wrapped, plan, wrapped.stage

    def batched(self, policy) -> bool:
        return self.wrapped.batched(policy)

    def query(self, state: SequenceState) -> StageQuery:
        return with_lookahead(state, self.wrapped.query(state))

    def examine(self, parts: list[ExaminedPart], logits: torch.Tensor):
        raise AssertionError("PlanAhead examines nothing itself: its parts are the wrapped unit's and the plan's")

    def parts(
        self, state: SequenceState, fed: StageQuery, row: int, logits: torch.Tensor, into: RowExamination
    ) -> list[ExaminedPart]:
        if type(fed) is not AheadQuery:
            return self.wrapped.parts(state, fed, row, logits, into)
        lookahead = fed.lookahead
        own, num_scored = lookahead.after, fed.query.num_scored
        parts = [ExaminedPart(state, fed, self.wrapped, row, 0, own)]
        # The plan that rode along is examined now when that costs nothing but compute (greedy); sampled drafts
        # would consume the random generator even when the plan is then discarded, so a sampled plan is drawn in
        # `advance`, only once it is known to hold (one more host read, for that row).
        if state.policy.samples:
            into.deferred = logits[row, own:num_scored]
        else:
            parts.append(ExaminedPart(state, fed, self.plan, row, own, num_scored - own, lookahead.slots, True))
        return parts

    def advance(self, state: SequenceState, fed: StageQuery, examination: RowExamination) -> Kept:
        kept = self.wrapped.advance(state, fed, examination)
        if plan_holds(state, fed, kept):
            if examination.deferred is not None:  # sampled: drawn now that it holds
                logits = examination.deferred
                part = ExaminedPart(state, fed, self.plan, 0, 0, logits.shape[0], state.pool, True)
                read, payloads = self.plan.examine([part], logits[None])
                payload, values = payloads[0], read[0].tolist()
            else:
                payload, values = examination.extra_payload, examination.extra_values
            state.apply(self.plan.decide(state, None, payload, values))  # no context here: it keeps nothing
        return kept


def plan_cannot_hold(state: SequenceState, slots: list[int]) -> bool:
    """Whether a plan of `slots` riding along this verification would be discarded whatever is accepted: a draft to
    be verified is an EOS, and the plan is the next block's or has a slot after that EOS's slot. (The plan holds
    only if the whole query is committed, EOS included; an accepted EOS drops every undecoded slot after it and
    ends decoding with the current block.)"""
    ending = [slot for slot, ends in zip(state.chosen.slots, state.chosen.ends) if ends]
    if not ending:
        return False
    return not state.undecoded_after_commit() or max(slots) > ending[0]


def with_lookahead(state: SequenceState, fed: StageQuery) -> StageQuery:
    """Append the next plan's masks to the wrapped stage's query when that plan could hold, causal among
    themselves; the query's own tokens do not see them. After a verification (likely to commit everything: every
    draft it must accept was drafted with probability above the token threshold, the always-accepted token of
    each slot aside, as read on the host when drafted) they see every query token; after a re-score (the next
    block's plan, if the block closes) none. Queries with re-fed context carry no plan: a verification never has
    one, and a re-score has one only when a revision rewrote a slot's last token (rare: the plan would have to see
    the re-fed block as context)."""
    query = fed.query
    if query.num_context:
        return fed
    revising = state.stage is Stage.REVISE
    if revising:
        slots = [] if state.pool else state.next_block_slots()
    elif not all(state.chosen.confident):
        return fed
    else:
        slots = state.pool_after_commit()
        if slots and plan_cannot_hold(state, slots):
            return fed
    if not slots:
        return fed
    q = query.tokens.shape[0]
    masks = torch.full((len(slots) * state.settings.slot_size,), state.settings.mask_token_id, device=state.device)
    m = masks.shape[0]
    if not revising and query.visible is causal(q, state.device):  # a causal query (VERIFY's): causal again
        visible = causal(q + m, state.device)
    else:
        visible = torch.zeros(q + m, q + m, dtype=torch.bool, device=state.device)
        visible[:q, :q] = query.visible
        visible[q:, :q] = not revising
        visible[q:, q:] = causal(m, state.device)
    view = query.pending_view
    if view is not None:  # the masks see every pending entry (all of them are committed if the plan holds)
        view = torch.cat([view, torch.tensor([ALL_PENDING], device=state.device).expand(m, 2)])
    hidden = query.hidden
    if hidden is not None:  # the masks hide nothing (the empty range)
        hidden = torch.cat([hidden, hidden.new_zeros(m, 2)])
    ahead = Query(
        torch.cat([query.tokens, masks]),
        torch.cat([query.positions, state.slot_positions(slots)]),
        visible,
        pending_view=view,
        hidden=hidden,
    )
    return AheadQuery(ahead, fed.layout, Lookahead(slots, after=q, commits=0 if revising else q))


def plan_holds(state: SequenceState, fed: StageQuery, kept: Kept) -> bool:
    """Whether the plan that rode along `fed` is the next plan: the stage committed what the plan assumed and took
    nothing back, and the pool is the one the plan assumed (then the state is at PLAN)."""
    if type(fed) is not AheadQuery:
        return False
    lookahead = fed.lookahead
    return (
        kept.committed == lookahead.commits
        and kept.invalidate_from is None
        and state.pool == lookahead.slots
        and state.stage is Stage.PLAN
    )
