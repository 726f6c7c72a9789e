"""The infill stages: completing chosen slots that verification did not accept whole (docs/design.md §3).

    INFILL_DRAFT    each unfinished chosen slot re-drafts its unverified tail (masks, own logits).
    INFILL_VERIFY   each unfinished chosen slot verifies its drafts autoregressively; when every slot is complete,
                    the slots are committed together with the KV each computed alone (full KV reuse).

A slot's verified tokens are fed once: their KV stays in the cache as *pending* entries that only that slot's later
query tokens see, and each round feeds only the slot's unverified rest (masks when drafting, drafts when
verifying). When every chosen slot is complete, the pending entries become committed ones; slots discarded after
an EOS take their pending entries with them. The chosen slots are packed in one row under a block-diagonal mask
(no prefix copy per slot); each row's layout is its own, so rows are examined one at a time.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .draft_policy import DraftPolicy
from .sequence_state import Query, SequenceState, Stage
from .stage_interface import ExaminedPart, StageQuery, StageUnit, accepted_run, after_context, causal
from .transitions import Commit, InfillChecked, Kept, Redraft


@dataclass(frozen=True)
class InfillFeed:
    """Which tokens of the chosen slots an infill query feeds, in query order (slot after slot; each slot from its
    first token not yet fed, to its end), and which of them the stage scores: the stage's `StageQuery.layout`."""

    segments: list[tuple[int, int, int]]  # (query offset, length, chosen slot) per fed slot
    targets: list[tuple[int, int]]  # host: per scored query token, (chosen slot, index in the slot) of the token
    # its logits predict (drafting: the mask itself; verifying: the token after it)
    scored: torch.LongTensor  # [s] the scored query tokens (drafting: the masks; verifying: every token followed
    # by another of its slot)
    target_index: torch.LongTensor  # [s] their targets in the chosen slots' flattened tokens (slot * k + index)

    def target_positions(self, state: SequenceState) -> torch.LongTensor:
        """[s] the original position of each target (for positional constraints only: built when asked)."""
        k, slots = state.settings.slot_size, state.chosen.slots
        starts = [state.prompt_length + slots[slot] * k + offset for slot, offset in self.targets]
        return torch.tensor(starts, dtype=torch.long, device=state.device)


@functools.lru_cache(maxsize=256)
def block_causal(lengths: tuple[int, ...], device: torch.device) -> torch.BoolTensor:
    """[q, q] causal within each run of `lengths` consecutive query tokens, nothing across runs (q = their sum).
    Shared (cached per layout): read it, never write into it."""
    q = sum(lengths)
    counts = torch.tensor(lengths, dtype=torch.long, device=device)
    run = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
    return (run[:, None] == run[None, :]) & causal(q, device)


def infill_query(state: SequenceState, drafting: bool) -> StageQuery:
    """Each chosen slot feeds what the cache does not hold of it, from its first token not fed yet to its end:
    drafting masks its unverified tail, verifying feeds the drafts. A slot sees its own pending entries and,
    causally, its own query tokens; nothing of the other chosen slots."""
    k, chosen = state.settings.slot_size, state.chosen
    segments, fed, positions, views, scored, targets = [], [], [], [], [], []
    for i, start in enumerate(chosen.cached):
        if start == k:
            continue
        first = len(fed)
        segments.append((first, k - start, i))
        fed += range(i * k + start, (i + 1) * k)  # index in the chosen slots' flattened tokens
        origin = state.prompt_length + chosen.slots[i] * k
        positions += range(origin + start, origin + k)
        views += [i * k, (i + 1) * k] * (k - start)  # the slot's own pending tags, [lo, hi)
        if drafting:  # the unverified tail: masks, each predicting itself
            verified = chosen.verified[i]
            scored += range(first + verified - start, first + k - start)
            targets += [(i, j) for j in range(verified, k)]
        else:  # every fed token but the slot's last, predicting the token after it
            scored += range(first, len(fed) - 1)
            targets += [(i, j) for j in range(start + 1, k)]
    q, s = len(fed), len(scored)
    # one host-to-device copy for the query's layout: what it feeds, their positions, their pending views [q, 2],
    # the scored tokens and their targets
    flat_targets = [slot * k + offset for slot, offset in targets]
    layout = torch.tensor(fed + positions + views + scored + flat_targets, dtype=torch.long, device=state.device)
    view = layout[2 * q : 4 * q].view(q, 2)
    scored_index, target_index = layout[4 * q : 4 * q + s], layout[4 * q + s :]
    tokens = chosen.tokens.view(-1)[layout[:q]]
    if drafting:
        tokens = tokens.index_fill(0, scored_index, state.settings.mask_token_id)
    visible = block_causal(tuple(length for _, length, _ in segments), state.device)
    feed = InfillFeed(segments, targets, scored_index, target_index)
    query = Query(tokens, layout[q : 2 * q], visible, pending_view=view)
    return StageQuery(query if state.context is None else after_context(state, query), feed)


# ------------------------------------------------------------------------------------------- INFILL_DRAFT
class InfillDraftDecision(NamedTuple):
    """Per chosen slot (read only when planning ahead): every draft after its always-accepted token was drafted
    above the threshold; a draft still to be verified (the always-accepted one included) is an EOS."""

    confident: list[bool]
    ends: list[bool]

    @classmethod
    def read(cls, values: list[int], feed: InfillFeed, state: SequenceState) -> InfillDraftDecision:
        """`values`: per re-drafted token (`feed.targets`, the slots' unverified tails), whether it was drafted
        above the token threshold, then whether it is an EOS."""
        n, verified = len(state.chosen.slots), state.chosen.verified
        confident, ends = [True] * n, [False] * n
        m = len(feed.targets)
        for (slot, offset), above, eos in zip(feed.targets, values[:m], values[m:]):
            if offset > verified[slot] and not above:  # the first unverified token is accepted regardless
                confident[slot] = False
            if eos:
                ends[slot] = True
        return cls(confident, ends)


class InfillDraftStage(StageUnit):
    stage = Stage.INFILL_DRAFT

    def query(self, state: SequenceState) -> StageQuery:
        return infill_query(state, drafting=True)

    def examine(self, parts: list[ExaminedPart], logits: torch.Tensor):
        state, feed = parts[0].state, parts[0].fed.layout
        scores = state.scores(logits[0, feed.scored], lambda: feed.target_positions(state))  # [m, V]
        proposals = state.policy.draw(scores)  # [m]: the masks, each predicting itself
        if not state.settings.plan_ahead:  # only planning ahead reads the draft probabilities
            return torch.zeros(1, 0, dtype=torch.long, device=state.device), [(proposals, None)]
        probs = state.policy.token_probs(scores, proposals)
        read = torch.cat([probs > state.settings.token_threshold, state.is_eos(proposals)])
        return read.long()[None], [(proposals, probs)]

    def decide(self, state: SequenceState, fed: StageQuery, payload, values: list[int]) -> Redraft:
        k, chosen, feed = state.settings.slot_size, state.chosen, fed.layout
        proposals, probs = payload
        confident, ends = InfillDraftDecision.read(values, feed, state) if probs is not None else (None, None)
        # The context (after a revision) is committed; the verified tokens this query fed (before each slot's
        # masks) stay in the cache, pending for their slot.
        context = fed.query.num_context
        runs = []
        for offset, _, i in feed.segments:
            fed_tokens = chosen.verified[i] - chosen.cached[i]
            if fed_tokens:
                runs.append((context + offset, fed_tokens, i * k + chosen.cached[i]))
        return Redraft(Kept(context, tuple(runs)), feed.target_index, proposals, probs, confident, ends)


# ------------------------------------------------------------------------------------------ INFILL_VERIFY
class InfillVerifyDecision(NamedTuple):
    """Per chosen slot: its verified prefix, and where an EOS lies in it (k: none)."""

    verified: list[int]
    eos_in_slot: list[int]

    @classmethod
    def read(cls, values: list[int], feed: InfillFeed, state: SequenceState) -> InfillVerifyDecision:
        """`values`: per scored token (`feed.targets`: the token after each fed one), whether its probability given
        the slot's tokens before it is above the token threshold; then, per chosen slot and index, whether its
        token is an EOS. Verified tokens stay verified, the first unverified one is always accepted (>= 1 token
        per round), and a slot's verified prefix runs on while its tokens are accepted."""
        k, n = state.settings.slot_size, len(state.chosen.slots)
        above = [[False] * k for _ in range(n)]
        m = len(feed.targets)
        for (slot, offset), flag in zip(feed.targets, values[:m]):
            above[slot][offset] = bool(flag)
        eos = values[m:]
        verified, eos_in_slot = [], []
        for i, already in enumerate(state.chosen.verified):
            length = accepted_run(above[i], already + 1, k)
            verified.append(length)
            eos_in_slot.append(next((j for j in range(length) if eos[i * k + j]), k))
        return cls(verified, eos_in_slot)


class InfillVerifyStage(StageUnit):
    stage = Stage.INFILL_VERIFY

    def query(self, state: SequenceState) -> StageQuery:
        return infill_query(state, drafting=False)

    def examine(self, parts: list[ExaminedPart], logits: torch.Tensor):
        state, feed = parts[0].state, parts[0].fed.layout
        tokens = state.chosen.tokens.view(-1)  # [n*k]
        # [s] each scored token's logits score the token after it, given the slot's tokens up to it
        scores = state.scores(logits[0, feed.scored], lambda: feed.target_positions(state))
        probs = DraftPolicy.token_probs(scores, tokens[feed.target_index])
        read = torch.cat([probs > state.settings.token_threshold, state.is_eos(tokens)])
        return read.long()[None], [None]

    def decide(self, state: SequenceState, fed: StageQuery, payload, values: list[int]) -> InfillChecked:
        k, chosen = state.settings.slot_size, state.chosen
        n = len(chosen.slots)
        verified, eos_in_slot = InfillVerifyDecision.read(values, fed.layout, state)
        ending = next((i for i in range(n) if eos_in_slot[i] < k), None)
        # What this query fed and verified stays in the cache for its slot (an ending slot's only up to its EOS;
        # nothing of the slots after it).
        runs, grown, pending = [], [], list(chosen.pending)
        for offset, _, i in fed.layout.segments:
            if ending is not None and i > ending:
                break
            end = verified[i] if i != ending else min(verified[i], eos_in_slot[i] + 1)
            if end > chosen.cached[i]:
                runs.append((offset, end - chosen.cached[i], i * k + chosen.cached[i]))
                grown.append((i, end))
                pending[i] += end - chosen.cached[i]
        keep_below, discarded, own, complete = None, 0, 0, min(verified) == k
        if ending is not None:
            # This slot ends the answer: later chosen slots and later undecoded slots are discarded, and so are
            # the pending entries after the EOS (the slot's own, verified before the EOS was seen, included).
            keep_below = ending * k + eos_in_slot[ending] + 1
            own = min(pending[ending], eos_in_slot[ending] + 1)
            discarded = sum(pending[ending + 1 :]) + pending[ending] - own
            complete = min(verified[:ending], default=k) == k  # the ending slot is complete
        if not complete:
            return InfillChecked(Kept(0, tuple(runs), keep_below, discarded=discarded), grown, verified, ending, own)
        # Every slot complete: append them in position order with the KV each computed on its own (this query's
        # kept tokens, a prefix of it, and the pending entries). Only the last one can hold an EOS (an earlier one
        # would have ended the answer), found in this round's read.
        slots = chosen.slots if ending is None else chosen.slots[: ending + 1]
        flat = chosen.tokens.flatten() if ending is None else chosen.tokens[: ending + 1].flatten()
        eos_at = None if ending is None else ending * k + eos_in_slot[ending]
        end = flat.shape[0] if eos_at is None else eos_at + 1
        committed = sum(length for _, length, _ in runs)
        kept = Kept(committed, (), keep_below, promote=True, discarded=discarded)
        return InfillChecked(kept, grown, verified, ending, own, Commit(kept, slots, flat[:end], eos_at))
