"""The REVISE stage: sub-slot remasking of the current block's written slots (`remask_threshold`; off by default).

The paper's stated limitation (appendix E) is that a written slot is final. With `remask_threshold` set, a block is
not closed when its last slot is written: it is re-scored, and low-probability tokens go back to be decoded again.

    REVISE   one forward re-scores every revisable written slot of the block (`SequenceState.revisable_slots`), each
             as the model was trained to score a clean slot: the slot last, seeing every other written token of the
             row but none of its own (`Query.hidden`). Per slot s the query feeds the run
             [MASK at p0, t0 at p0, t1 at p1, ..., t(k-2) at p(k-2)]: the mask predicts t0 (the plan's score, now with
             the whole block in view), t(j) predicts t(j+1) (autoregressive, within the slot); runs do not see each
             other. Where a token's probability is below `remask_threshold` and the re-score prefers another token
             there (its second opinion: the argmax, or a draw when sampling), the first such token of the slot is
             replaced by that second opinion and the rest of the slot is remasked, to be decoded again; no such token
             anywhere (or only where a position from it to the slot's end was remasked `MAX_REVISIONS` times
             already): the block closes, its tokens are final.

A revision keeps invalidation local to the block: every cache entry of the block leaves the cache (`Kept.
invalidate_from`: each of those tokens may have attended to a revised one), the block's tokens outside the revised
slots are re-fed, in position order, as context of the next forward, and each revised slot is completed by infill
(infill.py) from its kept prefix and second opinion, as a slot that failed verification is (a slot whose last token
was replaced is complete: it is re-fed with the context, and the next forward is the block's next REVISE). The
slot holding the answer's EOS and those after it are never revised (only slots wholly before the first EOS are), so
the end stays as decided. Each REVISE forward either closes the block or remasks at least one position whose count
then grows; no position is remasked more than `MAX_REVISIONS` times, so decoding ends: per block at most
`MAX_REVISIONS * block_size` remasked positions, each revision costing a REVISE forward and the infill rounds that
re-decode its slots.

Tokens become final when their block closes, so streamers and stopping criteria lag by up to a block (a streamed
token is never taken back). Plans of the next block never ride along a verification that completes a block;
with `plan_ahead` they ride along the block's re-score, and hold when it closes the block (plan_ahead.py).

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .draft_policy import DraftPolicy
from .sequence_state import MAX_REVISIONS, Query, SequenceState, Stage
from .stage_interface import ExaminedPart, StageQuery, StageUnit, after_context, causal, first_true
from .transitions import CloseBlock, Kept, Remask, Transition


@dataclass(frozen=True)
class RevisionLayout:
    """The slots a REVISE query re-scores (position order) and their canvas positions and tokens, [n, k] each."""

    slots: list[int]
    canvas_index: torch.LongTensor
    tokens: torch.LongTensor


class RevisionDecision(NamedTuple):
    """Per re-scored slot: its first token to revise (k: none) and the second opinion there."""

    first: list[int]
    replacement: list[int]

    @classmethod
    def read(cls, values: list[int]) -> RevisionDecision:
        n = len(values) // 2
        return cls(values[:n], values[n:])


class ReviseStage(StageUnit):
    stage = Stage.REVISE

    def query(self, state: SequenceState) -> StageQuery:
        k, mask = state.settings.slot_size, state.settings.mask_token_id
        slots = state.revisable_slots()
        n = len(slots)
        canvas_index = torch.tensor([[slot * k + j for j in range(k)] for slot in slots], device=state.device)
        tokens = state.canvas[canvas_index]  # [n, k]
        positions = state.prompt_length + canvas_index  # [n, k]
        run_tokens = torch.cat([torch.full((n, 1), mask, device=state.device), tokens[:, :-1]], dim=1)
        run_positions = torch.cat([positions[:, :1], positions[:, :-1]], dim=1)
        run = torch.arange(n, device=state.device).repeat_interleave(k)  # [q] run of each query token
        is_mask = torch.arange(n * k, device=state.device) % k == 0
        # Block-diagonal causal; the mask predicts t0 for its run but no token of the run attends to it.
        visible = (run[:, None] == run[None, :]) & causal(n * k, state.device)
        visible &= ~is_mask[None, :] | torch.eye(n * k, dtype=torch.bool, device=state.device)
        first = positions[:, :1].repeat_interleave(k, dim=0)  # [q, 1] first position of each token's slot
        hidden = torch.cat([first, first + k], dim=1)  # [q, 2]: its own slot, never in view
        query = Query(run_tokens.flatten(), run_positions.flatten(), visible, hidden=hidden)
        if state.context is not None:  # a revision just rewrote a slot's last token: the block is re-fed first
            context = state.context_positions[None, :]  # [1, c]
            query = after_context(state, query, ~((context >= hidden[:, :1]) & (context < hidden[:, 1:])))
        return StageQuery(query, RevisionLayout(slots, canvas_index, tokens))

    def examine(self, parts: list[ExaminedPart], logits: torch.Tensor):
        state, layout = parts[0].state, parts[0].fed.layout
        n, k = layout.tokens.shape
        # Query token i of a run predicts the slot's token i (the mask: t0; t(j): t(j+1)), at its canvas position.
        scores = state.scores(logits[0, : n * k], lambda: state.prompt_length + layout.canvas_index.flatten())
        probs = DraftPolicy.token_probs(scores, layout.tokens.flatten()).view(n, k)
        second = state.policy.draw(scores).view(n, k)  # the re-score's own choice at every position
        revised = torch.tensor([state.revisions[i] for i in layout.canvas_index.flatten().tolist()])
        # A cut at j remasks j .. k - 1: allowed only while each of them was remasked fewer than MAX_REVISIONS times.
        remasked = revised.view(n, k).to(probs.device).flip(-1).cummax(-1).values.flip(-1)  # [n, k] max over j..
        revisable = remasked < MAX_REVISIONS
        flagged = (probs < state.settings.remask_threshold) & (second != layout.tokens) & revisable
        first = first_true(flagged)  # [n]; k: nothing to revise in the slot
        replacement = second.gather(1, first.clamp(max=k - 1)[:, None])[:, 0]  # [n]
        return torch.cat([first, replacement])[None], [probs]  # payload: the re-score's probabilities [n, k]

    def decide(self, state: SequenceState, fed: StageQuery, probs: torch.Tensor, values: list[int]) -> Transition:
        k, layout = state.settings.slot_size, fed.layout
        decision = RevisionDecision.read(values)
        cuts = [(slot, f, r) for slot, f, r in zip(layout.slots, decision.first, decision.replacement) if f < k]
        if not cuts:
            return CloseBlock(Kept(fed.query.num_context))
        # Every entry of the block leaves the cache; the block's other tokens are re-fed (`SequenceState.apply`).
        kept = Kept(0, invalidate_from=state.prompt_length + state.block_positions()[0])
        return Remask(kept, cuts, probs, layout.slots)
