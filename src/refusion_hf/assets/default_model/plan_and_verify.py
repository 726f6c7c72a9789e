# Generated from refusion_hf.generation.plan_and_verify by refusion_hf.modeling.remote_code (save_pretrained writes it; `make embedded-bundle` refreshes the embedded model's copy): edit the source, not this file.
"""The PLAN and VERIFY stages, and planning ahead (docs/design.md §3).

    PLAN     one forward of the block's undecoded slots (all mask tokens, causal); drafts + slot scores; choose the
             slots whose first draft passes the slot threshold (else the single best slot).
    VERIFY   one forward of the chosen drafts, concatenated in position order; accept the longest confident prefix;
             commit whole slots (or up to an EOS), else hand every chosen slot to infill (infill.py).

Planning ahead (`DecodingSettings.plan_ahead`): a VERIFY or INFILL_VERIFY query also carries the next PLAN's mask
tokens, seeing every token of the current query. When the current stage then commits exactly those tokens and
the pool is the one assumed, the next plan's inputs are the same as in a PLAN forward of its own (same cache
entries in the same order, same masks at the same positions), so its logits are used and that forward is saved;
otherwise they are discarded. Results do not change (up to float rounding of a differently shaped matmul); only
forward passes are saved. The masks ride along only when that outcome is likely: every draft still to be
verified was drafted with a probability above the token threshold (extra query tokens are not free on a CPU), and
no draft to be verified is an EOS whose acceptance would drop the plan's slots (`plan_cannot_hold`).

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .draft_policy import DraftPolicy
from .sequence_state import ChosenSlots, Kept, Query, SequenceState, Stage, consecutive, slot_offsets
from .stage_interface import (
    ExaminedPart,
    Lookahead,
    StageQuery,
    StageUnit,
    accepted_run,
    after_context,
    causal,
    constrained_scores,
    stack_rows,
)

ALL_PENDING = (0, 2**62)  # `Query.pending_view` of a token that sees every pending entry of its row


def _with_context(state: SequenceState, tokens: torch.LongTensor, positions: torch.LongTensor) -> Query:
    """A causal query of `tokens`, after the tokens still to be cached (the prompt, on the first forward)."""
    query = Query(tokens, positions, causal(tokens.shape[0], state.device))
    return query if state.context is None else after_context(state, query)


# ------------------------------------------------------------------------------------------------- PLAN
class PlanDrafts(NamedTuple):
    """A plan's device results for one row."""

    drafts: torch.LongTensor  # [P, k]
    draft_probs: torch.Tensor  # [P, k] probability of each draft when drawn


class PlanDecision(NamedTuple):
    """A plan's values for one row, on the host: per slot of the pool, whether it passes the slot threshold,
    whether its later drafts all pass the token threshold, whether it drafts an EOS; then the best slot."""

    passes: list[int]
    confident: list[int]
    ends: list[int]
    best: int

    @classmethod
    def read(cls, values: list[int], k: int) -> PlanDecision:
        """`values`: per slot of the pool, whether it passes the slot threshold; per draft (slot after slot),
        whether it passes the token threshold, then whether it is an EOS; then the best slot."""
        num_pool = (len(values) - 1) // (2 * k + 1)
        above, eos = values[num_pool : num_pool * (k + 1)], values[num_pool * (k + 1) : -1]
        confident = [all(above[i * k + 1 : (i + 1) * k]) for i in range(num_pool)]
        ends = [any(eos[i * k : (i + 1) * k]) for i in range(num_pool)]
        return cls(values[:num_pool], confident, ends, values[-1])


class PlanStage(StageUnit):
    stage = Stage.PLAN

    def batched(self, policy) -> bool:
        # Sampled plans draw one at a time: the random generator is consumed in row order, as alone.
        return not policy.samples

    def query(self, state: SequenceState) -> StageQuery:
        # All undecoded slots of the block as mask tokens, causal (as one ordinary sequence).
        k = state.settings.slot_size
        tokens = torch.full((len(state.pool) * k,), state.settings.mask_token_id, device=state.device)
        return StageQuery(_with_context(state, tokens, state.slot_positions(state.pool)))

    def examine(self, parts: list[ExaminedPart], logits: torch.Tensor):
        return examine_plans([part.state for part in parts], logits, [part.pool for part in parts])

    def decide(self, state: SequenceState, fed: StageQuery | None, payload: PlanDrafts, values: list[int]) -> Kept:
        k = state.settings.slot_size
        decision = PlanDecision.read(values, k)
        num_context = state.num_context()
        state.context = None
        state.step += 1
        picked = [i for i, passes in enumerate(decision.passes) if passes] or [decision.best]  # position order
        state.plan_drafts = payload.drafts
        # consecutive picks (the usual case) are a slice: the chosen slots' tensors are then views of the plan's
        rows = slice(picked[0], picked[-1] + 1) if consecutive(picked) else picked
        state.chosen = ChosenSlots(
            slots=[state.pool[i] for i in picked],
            tokens=payload.drafts[rows],
            draft_probs=payload.draft_probs[rows],
            confident=[bool(decision.confident[i]) for i in picked],
            ends=[bool(decision.ends[i]) for i in picked],
        )
        state.trace_chosen.append([slot * k for slot in state.chosen.slots])
        state.stage = Stage.VERIFY
        return Kept(num_context)


def examine_plans(states: list[SequenceState], logits: torch.Tensor, pools: list[list[int]]):
    """Plans of R sequences (pools of P slots each; logits [R, P*k, V], a mask predicts itself) -> the values
    [R, P + 2Pk + 1] (`PlanDecision`) and each row's `PlanDrafts`."""
    settings, policy = states[0].settings, states[0].policy
    k, rows = settings.slot_size, len(states)
    scores = constrained_scores(policy, logits, lambda: [o for pool in pools for o in slot_offsets(pool, k)])
    drafts = policy.draw(scores).view(rows, -1, k)  # [R, P, k]
    draft_probs = policy.token_probs(scores, drafts.flatten()).view(rows, -1, k)
    first = draft_probs[..., 0]  # [R, P] probability of each slot's first draft
    flags = [first > settings.slot_threshold, draft_probs > settings.token_threshold, states[0].is_eos(drafts)]
    read = torch.cat([flags[0], flags[1].flatten(1), flags[2].flatten(1)], dim=-1)  # [R, P + 2 P k]
    read = torch.cat([read.long(), first.argmax(-1, keepdim=True)], dim=-1)
    # per-row views (not `unbind`'s: the chosen slots' views of them are written in place by infill)
    return read, [PlanDrafts(drafts[row], draft_probs[row]) for row in range(rows)]


# ----------------------------------------------------------------------------------------------- VERIFY
class VerifyDecision(NamedTuple):
    """A verification's values for one row, on the host."""

    prefix: int  # the longest accepted prefix of the concatenated drafts
    first_eos: int  # the first EOS in that prefix (n*k: none)
    own_prefixes: list[int]  # per chosen slot, its own accepted prefix

    @classmethod
    def read(cls, values: list[int], n: int, k: int) -> VerifyDecision:
        """`values`: per draft after the first (n*k - 1), whether its probability given the drafts before it passes
        the token threshold; then, only when a chosen slot drafted an EOS, per draft whether it is one. A slot's
        first draft is always accepted (its planning score chose the slot); the concatenation's prefix runs through
        every slot accepted whole, into the first that is not."""
        accepted = [1, *values[: n * k - 1]]
        own = [accepted_run(accepted[i * k : (i + 1) * k], 1, k) for i in range(n)]
        prefix = 0
        for length in own:
            prefix += length
            if length < k:
                break
        eos = values[n * k - 1 :]
        first_eos = next((j for j in range(prefix) if eos[j]), n * k) if eos else n * k
        return cls(prefix, first_eos, own)


class VerifyStage(StageUnit):
    stage = Stage.VERIFY

    def batched(self, policy) -> bool:
        return True

    def query(self, state: SequenceState) -> StageQuery:
        # The chosen drafts concatenated in position order, causal: each sees the chosen slots before it.
        chosen = state.chosen
        query = _with_context(state, chosen.tokens.flatten(), state.slot_positions(chosen.slots))
        return with_lookahead(state, StageQuery(query))

    def examine(self, parts: list[ExaminedPart], logits: torch.Tensor):
        return examine_verifications([part.state for part in parts], logits)

    def decide(self, state: SequenceState, fed: StageQuery, flat: torch.LongTensor, values: list[int]) -> Kept:
        k, chosen = state.settings.slot_size, state.chosen
        n = len(chosen.slots)
        decision = VerifyDecision.read(values, n, k)
        if decision.first_eos < n * k:
            # Commit the chosen slots up to the first EOS (truncated right after it); nothing after it survives.
            end = decision.first_eos + 1
            eos_row = decision.first_eos // k
            state.commit(chosen.slots[: eos_row + 1], flat[:end], eos_at=decision.first_eos)
            state.drop_after(chosen.slots[eos_row])
            return state.finish_iteration(Kept(end))
        whole = decision.prefix // k
        if whole > 0:
            # Whole slots verified together: keep their KV from this forward (they saw each other in order).
            state.commit(chosen.slots[:whole], flat[: whole * k])
            return state.finish_iteration(Kept(whole * k))
        # Not even the first slot: complete every chosen slot on its own, from its own verified prefix (its KV is
        # recomputed with the slot alone: here the slots saw each other).
        chosen.verified = decision.own_prefixes
        chosen.cached, chosen.pending = [0] * n, [0] * n
        in_infill = set(chosen.slots)
        state.pool = [slot for slot in state.pool if slot not in in_infill]
        state.stage = Stage.INFILL_DRAFT
        return Kept(0)  # nothing of this query is kept


def examine_verifications(states: list[SequenceState], logits: torch.Tensor):
    """Verifications of R sequences (n chosen slots each, drafts concatenated in position order; logits
    [R, n*k, V], row j scoring token j + 1) -> the values [R, n*k - 1] or [R, 2n*k - 1] (`VerifyDecision`) and each
    row's drafts [n*k]."""
    settings, policy = states[0].settings, states[0].policy
    k, rows = settings.slot_size, len(states)
    flat = stack_rows([state.chosen.tokens.flatten() for state in states])  # [R, n*k]
    n = flat.shape[1] // k

    def offsets() -> list[int]:
        predicted = []
        for state in states:
            own = slot_offsets(state.chosen.slots, k)
            predicted += own[1:] + [own[-1] + 1]
        return predicted

    scores = constrained_scores(policy, logits, offsets).view(rows, n * k, -1)
    # Token j >= 1 given the drafts before it (the first token of each slot is always accepted: not read)
    probs = DraftPolicy.token_probs(scores[:, :-1], flat[:, 1:])  # [R, n*k - 1]
    read = probs > settings.token_threshold
    if any(any(state.chosen.ends) for state in states):  # where an EOS was drafted (read when planned)
        read = torch.cat([read, states[0].is_eos(flat)], dim=-1)
    return read.long(), list(flat.unbind())


# ------------------------------------------------------------------------------------------ planning ahead
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
    """Append the next plan's masks to a verification query (when planning ahead, the step will likely commit
    everything, and the plan could hold): they see every query token and, causally, each other; the query's own
    tokens do not see them. Verification queries carry no context, so query and scored indices coincide.
    Likely to commit everything: every draft this verification must accept was drafted with probability above the
    token threshold (the always-accepted token of each slot aside), as read on the host when drafted."""
    if not state.settings.plan_ahead or not all(state.chosen.confident):
        return fed
    slots = state.pool_after_commit()
    if not slots or plan_cannot_hold(state, slots):
        return fed
    query = fed.query
    if query.num_context:  # never so: a revision's re-fed context goes with the draft forward before verification
        return fed
    q = query.tokens.shape[0]
    masks = torch.full((len(slots) * state.settings.slot_size,), state.settings.mask_token_id, device=state.device)
    m = masks.shape[0]
    if query.visible is causal(q, state.device):  # a causal query (VERIFY's): with the masks, causal again
        visible = causal(q + m, state.device)
    else:
        visible = torch.zeros(q + m, q + m, dtype=torch.bool, device=state.device)
        visible[:q, :q] = query.visible
        visible[q:, :q] = True
        visible[q:, q:] = causal(m, state.device)
    view = query.pending_view
    if view is not None:  # the masks see every pending entry (all of them are committed if the plan holds)
        view = torch.cat([view, torch.tensor([ALL_PENDING], device=state.device).expand(m, 2)])
    ahead = Query(
        torch.cat([query.tokens, masks]),
        torch.cat([query.positions, state.slot_positions(slots)]),
        visible,
        pending_view=view,
    )
    return StageQuery(ahead, fed.layout, Lookahead(slots, after=q))


def plan_holds(state: SequenceState, fed: StageQuery, kept: Kept) -> bool:
    """Whether the plan that rode along `fed` is the next plan: the stage committed the whole query before the
    masks and the pool is the one the plan assumed (then the state is at PLAN)."""
    lookahead = fed.lookahead
    return (
        lookahead is not None
        and kept.committed == lookahead.after
        and state.pool == lookahead.slots
        and state.stage is Stage.PLAN
    )
