"""The PLAN and VERIFY stages (docs/design.md §3).

    PLAN     one forward of the block's undecoded slots (all mask tokens, causal); drafts + slot scores; choose the
             slots whose first draft passes the slot threshold (else the single best slot).
    VERIFY   one forward of the chosen drafts, concatenated in position order; accept the longest confident prefix;
             commit whole slots (or up to an EOS), else hand every chosen slot to infill (infill.py).

Each `decide` reads and returns a transition (transitions.py) that `SequenceState.apply` executes. Planning
ahead, which wraps VERIFY and INFILL_VERIFY, is plan_ahead.py.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .draft_policy import DraftPolicy
from .sequence_state import Query, SequenceState, Stage, consecutive, slot_offsets
from .stage_interface import (
    ExaminedPart,
    StageQuery,
    StageUnit,
    accepted_run,
    after_context,
    causal,
    constrained_scores,
    stack_rows,
)
from .transitions import Choose, Commit, EnterInfill, Kept, Transition


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
        pools = [
            part.state.pool if part.slots is None else part.slots for part in parts
        ]  # a plan riding along: its own
        return examine_plans([part.state for part in parts], logits, pools)

    def decide(self, state: SequenceState, fed: StageQuery | None, payload: PlanDrafts, values: list[int]) -> Choose:
        decision = PlanDecision.read(values, state.settings.slot_size)
        picked = [i for i, passes in enumerate(decision.passes) if passes] or [decision.best]  # position order
        # consecutive picks (the usual case) are a slice: the chosen slots' tensors are then views of the plan's
        rows = slice(picked[0], picked[-1] + 1) if consecutive(picked) else picked
        return Choose(
            Kept(state.num_context()),
            slots=[state.pool[i] for i in picked],
            tokens=payload.drafts[rows],
            draft_probs=payload.draft_probs[rows],
            confident=[bool(decision.confident[i]) for i in picked],
            ends=[bool(decision.ends[i]) for i in picked],
            plan_drafts=payload.drafts,
        )


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
        return StageQuery(_with_context(state, chosen.tokens.flatten(), state.slot_positions(chosen.slots)))

    def examine(self, parts: list[ExaminedPart], logits: torch.Tensor):
        return examine_verifications([part.state for part in parts], logits)

    def decide(self, state: SequenceState, fed: StageQuery, flat: torch.LongTensor, values: list[int]) -> Transition:
        k, chosen = state.settings.slot_size, state.chosen
        n = len(chosen.slots)
        decision = VerifyDecision.read(values, n, k)
        if decision.first_eos < n * k:
            # Commit the chosen slots up to the first EOS (truncated right after it); nothing after it survives.
            end = decision.first_eos + 1
            return Commit(Kept(end), chosen.slots[: decision.first_eos // k + 1], flat[:end], decision.first_eos)
        whole = decision.prefix // k
        if whole > 0:
            # Whole slots verified together: keep their KV from this forward (they saw each other in order).
            return Commit(Kept(whole * k), chosen.slots[:whole], flat[: whole * k])
        # Not even the first slot: complete every chosen slot on its own, from its own verified prefix (its KV is
        # recomputed with the slot alone: here the slots saw each other). Nothing of this query is kept.
        return EnterInfill(Kept(0), decision.own_prefixes)


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
