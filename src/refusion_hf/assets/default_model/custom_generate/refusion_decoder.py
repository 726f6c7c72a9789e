# Generated from refusion_hf.generation.refusion_decoder by refusion_hf.modeling.remote_code (save_pretrained writes it; `make embedded-bundle` refreshes the embedded model's copy): edit the source, not this file.
"""ReFusion plan-and-infill decoding (docs/design.md §3), for left-padded batches.

Each sequence is a `SequenceDecoder`: an explicit state machine over the stages

    PLAN            one forward of the block's undecoded slots (all mask tokens); drafts + slot scores;
                    choose the slots to decode.
    VERIFY          one forward of the chosen drafts, concatenated in position order; accept the longest
                    confident prefix; commit whole slots (or up to an EOS), else go to infill.
    INFILL_DRAFT    each unfinished chosen slot re-drafts its unverified tail (masks, own logits).
    INFILL_VERIFY   each unfinished chosen slot verifies its drafts autoregressively; when every slot is
                    complete, the slots are committed together with the KV each computed alone (full KV reuse).

During infill a slot's verified tokens are fed once: their KV stays in the cache as *pending* entries that only
that slot's later query tokens see, and each round feeds only the slot's unverified rest (masks when drafting,
drafts when verifying). When every chosen slot is complete, the pending entries become committed ones; slots
discarded after an EOS take their pending entries with them.

Planning ahead (`DecodingSettings.plan_ahead`): a VERIFY or INFILL_VERIFY query also carries the next PLAN's
mask tokens, seeing every token of the current query. When the current stage then commits exactly those tokens
and the pool is the one assumed, the next plan's inputs are the same as in a PLAN forward of its own (same cache
entries in the same order, same masks at the same positions), so its logits are used and that forward is saved;
otherwise they are discarded. Results do not change (up to float rounding of a differently shaped matmul); only
forward passes are saved. The masks ride along only when that outcome is likely: every draft still to be
verified was drafted with a probability above the token threshold (extra query tokens are not free on a CPU), and
no draft to be verified is an EOS whose acceptance would drop the plan's slots (`_plan_cannot_hold`).

`decode_batch` drives all sequences in lock step: every loop iteration asks each unfinished sequence for its
next `Query` (tokens, original positions, which query tokens see which), runs ONE model forward for all of
them on top of one shared KV cache, and examines the logits on the device (`examine_rows`: drafts,
confidences, accepted prefixes, as small tensors of decision values; the plans of one width, and the verifications
of one width, of all rows in one batched op each, infill row by row), every row's values are read to the host in
ONE transfer, and each sequence decides (`decide`). A sequence answers with the query
tokens it commits (and, during infill, the tokens it keeps pending); their KV entries are kept, everything else
the forward appended is dropped. So the cache holds exactly the committed tokens (prompt first, then commit
order) plus the pending infill prefixes, rows are ragged (a validity mask says which entries each row may attend
to), and chosen slots that must not see each other are packed in one row under a block-diagonal mask instead of
copying the prefix cache per slot.

Sequences that finish leave the batch (their cache rows are dropped), so they cost nothing afterwards; with
continuous batching (`max_rows`) waiting prompts take their places at once.

How logits become drafts and confidences (greedy or sampled, under transformers' logits processors) is the
`DraftPolicy` (draft_policy.py). Stopping criteria see the final left-to-right prefix through `PrefixStopping`,
called the way stock `generate` calls them: once per answer position, for the whole batch.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache, StoppingCriteriaList

from .draft_policy import DraftPolicy

JOIN_FRACTION = 4  # continuous batching: waiting prompts join once 1/JOIN_FRACTION of the rows are free
ALL_PENDING = (0, 2**62)  # `Query.pending_view` of a token that sees every pending entry of its row


class Stage(enum.Enum):
    PLAN = "plan"
    VERIFY = "verify"
    INFILL_DRAFT = "infill_draft"
    INFILL_VERIFY = "infill_verify"
    DONE = "done"


@dataclass(frozen=True)
class DecodingSettings:
    max_new_tokens: int  # L: tokens returned per sequence
    slot_size: int  # k
    block_size: int  # b: tokens per serial block, a multiple of k
    slot_threshold: float
    token_threshold: float
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    plan_ahead: bool = True  # run the next plan inside verification forwards (see the module docstring)

    @property
    def canvas_length(self) -> int:  # L rounded up to a multiple of k
        return -(-self.max_new_tokens // self.slot_size) * self.slot_size

    @property
    def num_blocks(self) -> int:
        return -(-self.canvas_length // self.block_size)


@dataclass
class Query:
    """What one sequence feeds to one forward.

    The first `num_context` tokens need no logits (the prompt, on the first forward); logits are returned for the
    remaining ones. `visible[i, j]` says whether query token i may attend to query token j; every query token
    also sees all of the sequence's committed cache entries, and the pending infill entries whose tags lie in
    `[pending_view[i, 0], pending_view[i, 1])` (a pending entry's tag is chosen slot * k + index in the slot, so
    a slot's range is its own entries; None: no token sees any).
    """

    tokens: torch.LongTensor  # [q]
    positions: torch.LongTensor  # [q] original positions
    visible: torch.BoolTensor  # [q, q]
    num_context: int = 0
    pending_view: torch.LongTensor | None = None  # [q, 2]

    @property
    def num_scored(self) -> int:
        return self.tokens.shape[0] - self.num_context


@dataclass(frozen=True)
class Kept:
    """What a sequence keeps of its last forward's query in the cache (`SequenceDecoder.decide`).

    `committed` leading query tokens become committed entries (every stage commits a prefix of its query: the
    prompt, the verified slots in position order, the completed infill slots in position order). `pending` runs
    `(query offset, length, first tag)` are kept as pending entries tagged `first tag`, `first tag + 1`, ...
    (infill prefixes; tag = chosen slot * k + index in the slot). Then the row's pending entries tagged
    `keep_below` or more are discarded (None: none is; `discarded` counts them) and, with `promote`, the rest
    become committed (the infill is complete)."""

    committed: int
    pending: tuple[tuple[int, int, int], ...] = ()
    keep_below: int | None = None
    promote: bool = False
    discarded: int = 0

    @property
    def extent(self) -> int:
        """Query tokens up to the last kept one."""
        return max([self.committed] + [offset + length for offset, length, _ in self.pending])


@functools.lru_cache(maxsize=64)
def causal(length: int, device: torch.device) -> torch.BoolTensor:
    """[length, length] lower-triangular True. Shared (cached per shape): read it, never write into it."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def slot_offsets(slots: list[int], k: int) -> list[int]:
    """Answer offsets (position minus prompt length) of the slots' tokens, slot after slot (host list)."""
    return [slot * k + j for slot in slots for j in range(k)]


def next_token_probs(scores: torch.Tensor, tokens: torch.LongTensor) -> torch.Tensor:
    """scores: [..., n, V] (log-)scores at each position; returns [..., n] where entry j (j >= 1) is the
    probability of tokens[..., j] given the position before it (softmax of that position's scores). Entry 0 is
    undefined (set to 0)."""
    gathered = DraftPolicy.token_probs(scores[..., :-1, :], tokens[..., 1:])
    first = torch.zeros(tokens[..., :1].shape, dtype=gathered.dtype, device=gathered.device)
    return torch.cat([first, gathered], dim=-1)


def prefix_length(accepted: torch.BoolTensor) -> torch.LongTensor:
    """Length of the leading run of True along the last dimension."""
    return accepted.long().cumprod(-1).sum(-1)


def first_true(mask: torch.BoolTensor) -> torch.LongTensor:
    """Index of the first True along the last dimension; its size where there is none."""
    return torch.where(mask.any(-1), mask.long().argmax(-1), mask.shape[-1])


@dataclass
class ChosenSlots:
    """The slots picked by one plan, in position order, and their state through verification and infill."""

    slots: list[int]  # slot indices (slot s covers canvas [s*k, (s+1)*k))
    tokens: torch.LongTensor  # [n, k] current drafts
    scores: torch.Tensor  # [n] probability of each slot's first draft at planning time
    draft_probs: torch.Tensor  # [n, k] probability each current draft token had when it was drafted
    confident: list[bool]  # per slot: every draft still to be verified was drafted above the token threshold
    ends: list[bool]  # per slot: a draft still to be verified is an EOS (accepting it ends the answer)
    verified: list[int] = field(default_factory=list)  # per slot, length of its accepted prefix
    # Infill: per slot, how many of its leading tokens need not be fed again (their KV, computed with the slot
    # alone, is pending in the cache; after an EOS that ends the slot, k: nothing more to feed).
    cached: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # per slot, its pending cache entries

    def keep_first(self, n: int) -> None:
        """Drop every chosen slot after the first `n`."""
        self.slots, self.tokens, self.draft_probs = self.slots[:n], self.tokens[:n], self.draft_probs[:n]
        self.verified, self.confident, self.ends = self.verified[:n], self.confident[:n], self.ends[:n]
        self.cached, self.pending = self.cached[:n], self.pending[:n]


@dataclass(frozen=True)
class InfillFeed:
    """Which tokens of the chosen slots an infill query feeds, in query order (slot after slot; each slot from its
    first token not yet fed, to its end). Host lists and their device copies."""

    segments: list[tuple[int, int, int]]  # (query offset, length, chosen slot) per fed slot
    slot_index: torch.LongTensor  # [q] chosen slot of each query token
    offset_index: torch.LongTensor  # [q] its index inside the slot
    positions: torch.LongTensor  # [q] original positions
    scored: torch.LongTensor  # [s] query tokens whose logits the stage reads (drafting: the masks; verifying:
    # every token followed by another of its slot)


@dataclass(frozen=True)
class Lookahead:
    """The next plan's masks appended to a verification query, and what that plan assumes."""

    slots: list[int]  # the pool the next plan would have
    after: int  # query tokens before the masks: all of them must be committed, in query order


@dataclass
class Examined:
    """What examining left for `decide`: the plan that rode along (its logits when drafts are sampled: drawn only
    if it holds), how many values are the stage's own, the stage's device results, and those of the plan."""

    lookahead: Lookahead | None
    ahead_logits: torch.Tensor | None
    size: int = 0
    payload: object = None
    ahead_payload: object = None


@dataclass
class ExaminedPart:
    """A run of one row's logits that one stage examines: `width` logits rows from `start` (the stage's own
    logits, or a plan riding along after them)."""

    decoder: SequenceDecoder
    row: int  # in the forward's batch
    stage: Stage
    start: int
    width: int
    pool: list[int] | None  # plans: the slots planned (None otherwise)
    ahead: bool = False  # a plan riding along a verification

    def group_key(self) -> tuple:
        """Parts with equal keys are examined in one batched op: plans and verifications of one width. Sampled
        plans draw one at a time (the random generator is consumed in row order, as alone); infill layouts are
        each row's own."""
        batched = self.stage is Stage.VERIFY or (self.stage is Stage.PLAN and not self.decoder.policy.samples)
        return (self.stage, self.width) if batched else (self.stage, self.width, self.row)


class SequenceDecoder:
    """ReFusion decoding state of one sequence; see the module docstring for the stages."""

    def __init__(self, prompt: torch.LongTensor, settings: DecodingSettings, policy: DraftPolicy):
        device = prompt.device
        self.settings = settings
        self.policy = policy
        self.device = device
        self.prompt_length = prompt.shape[0]
        k, length = settings.slot_size, settings.canvas_length
        # The canvas grows as blocks are entered (`_reserve`), so memory follows the decoded answer, never
        # `max_new_tokens`: positions not allocated yet are masks, uncommitted.
        self.canvas = torch.empty(0, dtype=torch.long, device=device)
        self.written = bytearray()  # 1 where the canvas holds a committed token (host-side: no device sync)
        self._prefix = 0  # committed positions 0 .. _prefix - 1 (only grows)
        self.commit_step = torch.empty(0, dtype=torch.long, device=device)
        self.eos_ids = torch.tensor(settings.eos_token_ids, dtype=torch.long, device=device)
        self.first_eos: int | None = None  # canvas index of the first committed EOS
        self.stop_length: int | None = None  # set by a stopping criterion: the answer ends after this many tokens
        self.ends_after_block = False  # an EOS was accepted: no block after the current one is decoded
        self.slots_per_block = settings.block_size // k
        self.num_slots = length // k
        self.block = 0
        self.pool: list[int] = self._block_slots(0)  # undecoded slots of the current block, in order
        self._reserve(self.pool)
        self.context = prompt  # tokens to cache with the next forward (the prompt, once)
        self.stage = Stage.PLAN
        self.step = -1  # planning iteration
        self.forward_passes = 0
        self.trace_chosen: list[list[int]] = []
        self.plan_drafts: torch.LongTensor | None = None  # [len(pool), k], for draft streaming
        self.chosen: ChosenSlots | None = None
        self.lookahead: Lookahead | None = None  # set by `query` when the next plan rides along
        self._feed: InfillFeed | None = None  # set by `query` in the infill stages
        self._examined: Examined | None = None  # between `examine_parts` and `decide`

    # ----------------------------------------------------------------------------------------- helpers
    def _block_slots(self, block: int) -> list[int]:
        start = block * self.slots_per_block
        return list(range(start, min(start + self.slots_per_block, self.num_slots)))

    def _reserve(self, slots: list[int]) -> None:
        """Grow the canvas, its commit steps and written flags to hold `slots` (a block's, when it is entered):
        doubling, at most to the canvas length, so a long answer costs amortised O(1) copies per position."""
        have, need = len(self.written), (max(slots) + 1) * self.settings.slot_size
        if need <= have:
            return
        extra = min(self.settings.canvas_length, max(need, 2 * have)) - have
        self.canvas = torch.cat([self.canvas, self.canvas.new_full((extra,), self.settings.mask_token_id)])
        self.commit_step = torch.cat([self.commit_step, self.commit_step.new_full((extra,), -1)])
        self.written += bytes(extra)

    def _slot_positions(self, slots: list[int]) -> torch.LongTensor:
        """[n*k] original positions of the slots' tokens."""
        offsets = slot_offsets(slots, self.settings.slot_size)
        return torch.tensor([self.prompt_length + offset for offset in offsets], device=self.device)

    def _is_eos(self, tokens: torch.Tensor) -> torch.BoolTensor:
        return torch.isin(tokens, self.eos_ids)

    def _scores(self, logits: torch.Tensor, predicted_positions) -> torch.Tensor:
        """Constrained scores of logits rows; `predicted_positions()` gives the original position [n] each row
        predicts (only called when a positional constraint needs it: off the hot path otherwise)."""
        offsets = predicted_positions() - self.prompt_length if self.policy.positional else None
        return self.policy.scores(logits, offsets)

    @property
    def answer_length(self) -> int:
        """Positions of the final answer: up to and including the first EOS, at most max_new_tokens, and no
        further than a stopping criterion's cut."""
        length = self.settings.max_new_tokens
        if self.first_eos is not None:
            length = min(length, self.first_eos + 1)
        return length if self.stop_length is None else min(length, self.stop_length)

    def stop_at(self, length: int) -> None:
        """A stopping criterion fired after `length` final answer tokens: the answer ends there (tokens decoded
        out of order beyond it are discarded, undecoded slots after it are never decoded)."""
        self.stop_length = length if self.stop_length is None else min(self.stop_length, length)
        if self.finished_prefix == self.answer_length:
            self.chosen, self.plan_drafts, self.lookahead = None, None, None
            self.stage = Stage.DONE

    @property
    def finished_prefix(self) -> int:
        """Length of the left-to-right prefix of the answer that is final (committed, nothing missing)."""
        while self._prefix < len(self.written) and self.written[self._prefix]:
            self._prefix += 1
        return min(self._prefix, self.answer_length)

    def draft_view(self) -> torch.LongTensor:
        """The canvas allocated so far (at least through the current block) with the current drafts filled in (masks
        where there is none), for draft streaming."""
        view = self.canvas.clone()
        k = self.settings.slot_size
        if self.stage is Stage.VERIFY and self.plan_drafts is not None:
            for slot, tokens in zip(self.pool, self.plan_drafts):
                view[slot * k : (slot + 1) * k] = tokens
        if self.chosen is not None:
            for slot, tokens in zip(self.chosen.slots, self.chosen.tokens):
                view[slot * k : (slot + 1) * k] = tokens
        return view[: self.settings.max_new_tokens]

    # ------------------------------------------------------------------------------------------ queries
    def query(self) -> Query:
        k = self.settings.slot_size
        if self.stage is Stage.PLAN:
            # All undecoded slots of the block as mask tokens, causal (as one ordinary sequence).
            tokens = torch.full((len(self.pool) * k,), self.settings.mask_token_id, device=self.device)
            positions = self._slot_positions(self.pool)
        elif self.stage is Stage.VERIFY:
            # The chosen drafts concatenated in position order, causal: each sees the chosen slots before it.
            tokens = self.chosen.tokens.flatten()
            positions = self._slot_positions(self.chosen.slots)
        else:
            query = self._infill_query()
            return self._with_lookahead(query) if self.stage is Stage.INFILL_VERIFY else query
        context = self.context
        if context is not None:
            tokens = torch.cat([context, tokens])
            positions = torch.cat([torch.arange(context.shape[0], device=self.device), positions])
        query = Query(tokens, positions, causal(tokens.shape[0], self.device), num_context=self._num_context())
        return self._with_lookahead(query) if self.stage is Stage.VERIFY else query

    def _infill_query(self) -> Query:
        """Each chosen slot feeds what the cache does not hold of it, from its first token not fed yet to its end:
        drafting masks its unverified tail, verifying feeds the drafts. A slot sees its own pending entries and,
        causally, its own query tokens; nothing of the other chosen slots."""
        k, chosen = self.settings.slot_size, self.chosen
        drafting = self.stage is Stage.INFILL_DRAFT
        segments, slots, offsets, starts, scored = [], [], [], [], []
        for i, start in enumerate(chosen.cached):
            if start == k:
                continue
            first = len(slots)
            segments.append((first, k - start, i))
            slots += [i] * (k - start)
            offsets += range(start, k)
            starts += [self.prompt_length + chosen.slots[i] * k] * (k - start)
            verified = chosen.verified[i]
            scored += range(first + verified - start, first + k - start) if drafting else range(first, len(slots) - 1)
        q = len(slots)
        # one host-to-device copy for the query's layout: [3, q] and the scored tokens
        layout = torch.tensor(slots + offsets + starts + scored, dtype=torch.long, device=self.device)
        slot_index, offset_index = layout[:q], layout[q : 2 * q]
        positions = layout[2 * q : 3 * q] + offset_index
        scored_index = layout[3 * q :]
        tokens = chosen.tokens[slot_index, offset_index]
        if drafting:
            tokens = tokens.index_fill(0, scored_index, self.settings.mask_token_id)
        visible = (slot_index[:, None] == slot_index[None, :]) & causal(q, self.device)  # block-diagonal causal
        view = torch.stack([slot_index * k, (slot_index + 1) * k], dim=1)  # [q, 2]: the slot's own tags
        self._feed = InfillFeed(segments, slot_index, offset_index, positions, scored_index)
        return Query(tokens, positions, visible, pending_view=view)

    def _next_block_slots(self) -> list[int]:
        """The slots of the block after the current one; none when decoding ends with the current block."""
        if self.ends_after_block or self.block + 1 >= self.settings.num_blocks:
            return []
        return self._block_slots(self.block + 1)

    def _undecoded_after_commit(self) -> list[int]:
        """The current block's slots still undecoded if this iteration commits every chosen slot."""
        chosen = set(self.chosen.slots)
        return [slot for slot in self.pool if slot not in chosen]

    def _pool_after_commit(self) -> list[int]:
        """The pool of the next plan if this iteration commits every chosen slot."""
        return self._undecoded_after_commit() or self._next_block_slots()

    def _likely_to_commit_all(self) -> bool:
        """Whether every draft this verification must accept was drafted with probability above the token
        threshold (the always-accepted token of each slot aside); read on the host when the drafts were made."""
        return all(self.chosen.confident)

    def _plan_cannot_hold(self, slots: list[int]) -> bool:
        """Whether a plan of `slots` riding along this verification would be discarded whatever is accepted: a
        draft to be verified is an EOS, and the plan is the next block's or has a slot after that EOS's slot. (The
        plan holds only if the whole query is committed, EOS included; an accepted EOS drops every undecoded slot
        after it and ends decoding with the current block.)"""
        ending = [slot for slot, ends in zip(self.chosen.slots, self.chosen.ends) if ends]
        if not ending:
            return False
        return not self._undecoded_after_commit() or max(slots) > ending[0]

    def _with_lookahead(self, query: Query) -> Query:
        """Append the next plan's masks to a verification query (when planning ahead, the step will likely commit
        everything, and the plan could hold): they see every query token and, causally, each other; the query's
        own tokens do not see them. Verification queries carry no context, so query and scored indices coincide."""
        if not self.settings.plan_ahead or not self._likely_to_commit_all():
            return query
        slots = self._pool_after_commit()
        if not slots or self._plan_cannot_hold(slots):
            return query
        q = query.tokens.shape[0]
        masks = torch.full((len(slots) * self.settings.slot_size,), self.settings.mask_token_id, device=self.device)
        m = masks.shape[0]
        visible = torch.zeros(q + m, q + m, dtype=torch.bool, device=self.device)
        visible[:q, :q] = query.visible
        visible[q:, :q] = True
        visible[q:, q:] = causal(m, self.device)
        self.lookahead = Lookahead(slots, after=q)
        view = query.pending_view
        if view is not None:  # the masks see every pending entry (all of them are committed if the plan holds)
            view = torch.cat([view, torch.tensor([ALL_PENDING], device=self.device).expand(m, 2)])
        return Query(
            torch.cat([query.tokens, masks]),
            torch.cat([query.positions, self._slot_positions(slots)]),
            visible,
            num_context=query.num_context,
            pending_view=view,
        )

    def _num_context(self) -> int:
        return 0 if self.context is None else self.context.shape[0]

    # ----------------------------------------------------------------------------------------- advance
    # Each stage is two halves: the examine half does the device work on the forward's logits and returns what the
    # decision needs as long tensors (nothing is read yet); `_decide_*` takes those values, read on the host, and
    # updates the state. `examine_rows` examines the rows of one stage and shape together and reads every row's
    # values in ONE device-to-host transfer per forward.
    def examine_parts(self, row: int, logits: torch.Tensor, num_scored: int) -> list[ExaminedPart]:
        """What of row `row` of this forward's logits ([B, S, V], `num_scored` of them this sequence's) is to be
        examined: the stage's own logits and, with a plan riding along, that plan's."""
        self.forward_passes += 1
        lookahead, self.lookahead = self.lookahead, None
        own = num_scored if lookahead is None else lookahead.after
        parts = [ExaminedPart(self, row, self.stage, 0, own, self.pool if self.stage is Stage.PLAN else None)]
        ahead_logits = None
        if lookahead is not None:
            # The plan that rode along is examined now when that costs nothing but compute (greedy); sampled drafts
            # would consume the random generator even when the plan is then discarded, so a sampled plan is drawn
            # in `decide`, only once it is known to hold (one more host read, for that row).
            if self.policy.samples:
                ahead_logits = logits[row, own:num_scored]
            else:
                parts.append(ExaminedPart(self, row, Stage.PLAN, own, num_scored - own, lookahead.slots, ahead=True))
        self._examined = Examined(lookahead, ahead_logits)
        return parts

    def decide(self, values: list[int]) -> Kept:
        """Host half: apply the values examined for this sequence (read on the host; the stage's own, then those
        of a plan that rode along); return what of the query keeps its KV in the cache."""
        examined, self._examined = self._examined, None
        kept = getattr(self, f"_decide_{self.stage.value}")(examined.payload, values[: examined.size])
        # Verification stages commit a prefix of their query. The plan that rode along holds when that prefix is
        # the whole query and the pool is the one it assumed.
        lookahead = examined.lookahead
        holds = lookahead is not None and kept.committed == lookahead.after and self.pool == lookahead.slots
        if holds and self.stage is Stage.PLAN:
            if examined.ahead_logits is not None:  # sampled: drawn now that it holds
                read, payloads = examine_plans([self], examined.ahead_logits[None], [self.pool])
                payload, ahead_values = payloads[0], read[0].tolist()
            else:
                payload, ahead_values = examined.ahead_payload, values[examined.size :]
            self._decide_plan(payload, ahead_values)  # no context here: it keeps nothing
        return kept

    def _decide_plan(self, payload, values: list[int]) -> Kept:
        drafts, draft_probs, first = payload
        k = self.settings.slot_size
        num_context = self._num_context()
        self.context = None
        self.step += 1
        num_pool = len(self.pool)
        picked = [i for i in range(num_pool) if values[i]] or [values[-1]]  # ascending = position order
        self.plan_drafts = drafts
        self.chosen = ChosenSlots(
            slots=[self.pool[i] for i in picked],
            tokens=drafts[picked],
            scores=first[picked],
            draft_probs=draft_probs[picked],
            confident=[bool(values[num_pool + i]) for i in picked],
            ends=[bool(values[2 * num_pool + i]) for i in picked],
        )
        self.trace_chosen.append([slot * k for slot in self.chosen.slots])
        self.stage = Stage.VERIFY
        return Kept(num_context)

    def _decide_verify(self, flat: torch.LongTensor, values: list[int]) -> Kept:
        k, chosen = self.settings.slot_size, self.chosen
        n = len(chosen.slots)
        global_prefix, first_eos, *own_prefixes = values
        if first_eos < n * k:
            # Commit the chosen slots up to the first EOS (truncated right after it); nothing after it survives.
            end = first_eos + 1
            eos_row = first_eos // k
            self._commit(chosen.slots[: eos_row + 1], flat[:end], eos_at=first_eos)
            self._drop_after(chosen.slots[eos_row])
            return self._finish_iteration(Kept(end))
        whole = global_prefix // k
        if whole > 0:
            # Whole slots verified together: keep their KV from this forward (they saw each other in order).
            self._commit(chosen.slots[:whole], flat[: whole * k])
            return self._finish_iteration(Kept(whole * k))
        # Not even the first slot: complete every chosen slot on its own, from its own verified prefix (its KV is
        # recomputed with the slot alone: here the slots saw each other).
        chosen.verified = own_prefixes
        chosen.cached, chosen.pending = [0] * n, [0] * n
        in_infill = set(chosen.slots)
        self.pool = [slot for slot in self.pool if slot not in in_infill]
        self.stage = Stage.INFILL_DRAFT
        return Kept(0)  # nothing of this query is kept

    def _examine_infill_draft(self, logits: torch.Tensor):
        k, chosen, feed = self.settings.slot_size, self.chosen, self._feed
        rows = feed.scored  # [m] the masks, each predicting itself
        scores = self._scores(logits[rows], lambda: feed.positions[rows])
        proposals = self.policy.draw(scores)  # [m]
        slot_index, offset_index = feed.slot_index[rows], feed.offset_index[rows]
        chosen.tokens[slot_index, offset_index] = proposals
        if not self.settings.plan_ahead:  # only planning ahead reads the draft probabilities
            return torch.zeros(0, dtype=torch.long, device=self.device), None
        chosen.draft_probs[slot_index, offset_index] = self.policy.token_probs(scores, proposals)
        # Per chosen slot: is every draft after its always-accepted token above the threshold, and is any draft
        # still to be verified (the always-accepted one included) an EOS?
        verified = torch.tensor(chosen.verified, device=self.device)
        offset = torch.arange(k, device=self.device)[None, :] - verified[:, None]  # [n, k]: 0 = first unverified
        confident = ((chosen.draft_probs > self.settings.token_threshold) | (offset <= 0)).all(-1)  # [n]
        ends = (self._is_eos(chosen.tokens) & (offset >= 0)).any(-1)  # [n]
        return torch.cat([confident, ends]).long(), None

    def _decide_infill_draft(self, _payload, values: list[int]) -> Kept:
        k, chosen = self.settings.slot_size, self.chosen
        if self.settings.plan_ahead:
            n = len(chosen.slots)
            chosen.confident, chosen.ends = [bool(v) for v in values[:n]], [bool(v) for v in values[n:]]
        # The verified tokens this query fed (before each slot's masks) stay in the cache, pending for their slot.
        runs = []
        for offset, _, i in self._feed.segments:
            fed = chosen.verified[i] - chosen.cached[i]
            if fed:
                runs.append((offset, fed, i * k + chosen.cached[i]))
            chosen.pending[i] += fed
            chosen.cached[i] = chosen.verified[i]
        self.stage = Stage.INFILL_VERIFY
        return Kept(0, tuple(runs))

    def _examine_infill_verify(self, logits: torch.Tensor):
        k, chosen, feed = self.settings.slot_size, self.chosen, self._feed
        n = len(chosen.slots)
        rows = feed.scored  # [s] fed tokens followed by another of their slot; row j scores the token after it
        slot_index, offset_index = feed.slot_index[rows], feed.offset_index[rows]
        scores = self._scores(logits[rows], lambda: feed.positions[rows] + 1)
        probs = DraftPolicy.token_probs(scores, chosen.tokens[slot_index, offset_index + 1])
        confidence = torch.zeros(n, k, dtype=probs.dtype, device=self.device)
        confidence[slot_index, offset_index + 1] = probs  # [n, k]: each token's probability given its prefix
        already = torch.tensor(chosen.verified, device=self.device)
        # Verified tokens stay verified; the first unverified one is always accepted (>= 1 token per round).
        arange = torch.arange(k, device=self.device)
        accepted = (confidence > self.settings.token_threshold) | (arange[None, :] <= already[:, None])
        verified = prefix_length(accepted)  # [n]
        within = arange[None, :] < verified[:, None]
        eos_in_slot = first_true(self._is_eos(chosen.tokens) & within)  # [n]; k: no EOS in the verified prefix
        return torch.cat([verified, eos_in_slot]), None  # each slot's verified prefix and where an EOS lies in it

    def _decide_infill_verify(self, _payload, values: list[int]) -> Kept:
        k, chosen = self.settings.slot_size, self.chosen
        n = len(chosen.slots)
        verified, eos_in_slot = values[:n], values[n:]
        ending = next((i for i in range(n) if eos_in_slot[i] < k), None)
        # What this query fed and verified stays in the cache for its slot (an ending slot's only up to its EOS;
        # nothing of the slots after it).
        runs = []
        for offset, _, i in self._feed.segments:
            if ending is not None and i > ending:
                break
            end = verified[i] if i != ending else min(verified[i], eos_in_slot[i] + 1)
            if end > chosen.cached[i]:
                runs.append((offset, end - chosen.cached[i], i * k + chosen.cached[i]))
                chosen.pending[i] += end - chosen.cached[i]
                chosen.cached[i] = end
        chosen.verified = verified
        keep_below, discarded = None, 0
        if ending is not None:
            # This slot ends the answer: later chosen slots and later undecoded slots are discarded, and so are
            # the pending entries after the EOS (the slot's own, verified before the EOS was seen, included).
            keep_below = ending * k + eos_in_slot[ending] + 1
            own = min(chosen.pending[ending], eos_in_slot[ending] + 1)
            discarded = sum(chosen.pending[ending + 1 :]) + chosen.pending[ending] - own
            chosen.pending[ending] = own
            chosen.keep_first(ending + 1)
            chosen.verified[ending] = chosen.cached[ending] = k  # complete: nothing more to feed
            self._drop_after(chosen.slots[ending])
        if min(chosen.verified) < k:
            self.stage = Stage.INFILL_DRAFT
            return Kept(0, tuple(runs), keep_below, discarded=discarded)
        # Every slot complete: append them in position order with the KV each computed on its own (this query's
        # kept tokens, a prefix of it, and the pending entries). Only the last one can hold an EOS (an earlier one
        # would have ended the answer), found in this round's read.
        flat = chosen.tokens.flatten()
        eos_at = None if ending is None else ending * k + eos_in_slot[ending]
        end = flat.shape[0] if eos_at is None else eos_at + 1
        self._commit(chosen.slots, flat[:end], eos_at=eos_at)
        committed = sum(length for _, length, _ in runs)
        return self._finish_iteration(Kept(committed, (), keep_below, promote=True, discarded=discarded))

    # ------------------------------------------------------------------------------------------ commit
    def _commit(self, slots: list[int], tokens: torch.LongTensor, eos_at: int | None = None) -> None:
        """Write `tokens` (the slots' tokens concatenated, possibly cut after an EOS) into the canvas; `eos_at` is
        the index in `tokens` of its first EOS, if it has one (the caller has read it already)."""
        k = self.settings.slot_size
        positions = [slot * k + j for slot in slots for j in range(k)][: tokens.shape[0]]
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        self.canvas[index] = tokens
        self.commit_step[index] = self.step
        for position in positions:
            self.written[position] = 1
        done = set(slots)
        self.pool = [slot for slot in self.pool if slot not in done]
        if eos_at is not None:
            first = positions[eos_at]
            self.first_eos = first if self.first_eos is None else min(self.first_eos, first)

    def _drop_after(self, eos_slot: int) -> None:
        """An EOS was accepted in `eos_slot`: drop undecoded slots after it; stop after this block."""
        self.pool = [slot for slot in self.pool if slot < eos_slot]
        self.ends_after_block = True

    def _finish_iteration(self, kept: Kept) -> Kept:
        self.chosen = None
        self.plan_drafts = None
        self.stage = Stage.PLAN
        if self.finished_prefix == self.answer_length:
            # Everything that will be returned is decoded; the rest of the canvas cannot change it.
            self.stage = Stage.DONE
        elif not self.pool:
            self.pool = self._next_block_slots()
            self.block += 1
            if not self.pool:
                self.stage = Stage.DONE
            else:
                self._reserve(self.pool)
        return kept


def examine_rows(decoders: list[SequenceDecoder], logits: torch.Tensor, num_scored: list[int]) -> list[list[int]]:
    """The device half of every row's step on one forward's logits [B, S, V] (row b's first `num_scored[b]`),
    the rows of one stage and width examined together, and every row's decision values read to the host in ONE
    transfer. Returns each row's values (its stage's, then those of a plan that rode along)."""
    groups: dict[tuple, list[ExaminedPart]] = {}
    for row, (decoder, width) in enumerate(zip(decoders, num_scored)):
        for part in decoder.examine_parts(row, logits, width):
            groups.setdefault(part.group_key(), []).append(part)
    reads = []  # one [R, m] tensor per group
    for parts in groups.values():
        read, payloads = _examine_group(parts, _gather_logits(logits, parts))
        reads.append(read)
        for part, payload in zip(parts, payloads):
            examined = part.decoder._examined
            if part.ahead:
                examined.ahead_payload = payload
            else:
                examined.payload, examined.size = payload, read.shape[1]
    flat = torch.cat([read.flatten() for read in reads]).tolist() if any(read.numel() for read in reads) else []
    own: list[list[int]] = [[] for _ in decoders]
    ahead: list[list[int]] = [[] for _ in decoders]
    offset = 0
    for read, parts in zip(reads, groups.values()):
        width = read.shape[1]
        for part in parts:
            (ahead if part.ahead else own)[part.row] = flat[offset : offset + width]
            offset += width
    return [mine + theirs for mine, theirs in zip(own, ahead)]


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


def _examine_group(parts: list[ExaminedPart], logits: torch.Tensor) -> tuple[torch.LongTensor, list]:
    decoders = [part.decoder for part in parts]
    stage = parts[0].stage
    if stage is Stage.PLAN:
        return examine_plans(decoders, logits, [part.pool for part in parts])
    if stage is Stage.VERIFY:
        return examine_verifications(decoders, logits)
    read, payload = getattr(decoders[0], f"_examine_{stage.value}")(logits[0])  # infill: one row
    return read[None], [payload]


def _constrained_scores(policy: DraftPolicy, logits: torch.Tensor, offsets) -> torch.Tensor:
    """logits [R, W, V] -> constrained scores [R * W, V]; `offsets()` gives the answer offset each logits row
    predicts (a host list; only called when a positional constraint needs it: off the hot path otherwise)."""
    offsets = torch.tensor(offsets(), device=logits.device) if policy.positional else None
    return policy.scores(logits.flatten(0, 1), offsets)


def examine_plans(decoders: list[SequenceDecoder], logits: torch.Tensor, pools: list[list[int]]):
    """Plans of R sequences (pools of P slots each; logits [R, P*k, V], a mask predicts itself) -> the values
    [R, 3P + 1] (per slot: passes the slot threshold; its later drafts all pass the token threshold; it drafts an
    EOS; then the best slot) and each row's (drafts [P, k], draft probabilities [P, k], first-token scores [P])."""
    settings, policy = decoders[0].settings, decoders[0].policy
    k, rows = settings.slot_size, len(decoders)
    scores = _constrained_scores(policy, logits, lambda: [o for pool in pools for o in slot_offsets(pool, k)])
    drafts = policy.draw(scores).view(rows, -1, k)  # [R, P, k]
    draft_probs = policy.token_probs(scores, drafts.flatten()).view(rows, -1, k)
    first = draft_probs[..., 0]  # [R, P] probability of each slot's first draft
    confident = (draft_probs[..., 1:] > settings.token_threshold).all(-1)  # [R, P]
    ends = decoders[0]._is_eos(drafts).any(-1)  # [R, P]
    passes = first > settings.slot_threshold
    read = torch.cat([passes.long(), confident.long(), ends.long(), first.argmax(-1, keepdim=True)], dim=-1)
    return read, list(zip(drafts.unbind(), draft_probs.unbind(), first.unbind()))


def examine_verifications(decoders: list[SequenceDecoder], logits: torch.Tensor):
    """Verifications of R sequences (n chosen slots each, drafts concatenated in position order; logits
    [R, n*k, V], row j scoring token j + 1) -> the values [R, 2 + n] (the longest accepted prefix of the
    concatenation, its first EOS (n*k: none), each slot's own accepted prefix) and each row's drafts [n*k]."""
    settings, policy = decoders[0].settings, decoders[0].policy
    k, rows = settings.slot_size, len(decoders)
    flat = torch.stack([decoder.chosen.tokens.flatten() for decoder in decoders])  # [R, n*k]
    n = flat.shape[1] // k

    def offsets() -> list[int]:
        predicted = []
        for decoder in decoders:
            own = slot_offsets(decoder.chosen.slots, k)
            predicted += own[1:] + [own[-1] + 1]
        return predicted

    scores = _constrained_scores(policy, logits, offsets).view(rows, n * k, -1)
    confidence = next_token_probs(scores, flat).view(rows, n, k)
    confidence[..., 0] = torch.stack([decoder.chosen.scores for decoder in decoders])  # first tokens keep their
    accepted = confidence > settings.token_threshold  # planning score ...
    accepted[..., 0] = True  # ... and are always accepted
    prefix = prefix_length(accepted.flatten(1))  # [R] the longest accepted prefix of each concatenation
    position = torch.arange(n * k, device=flat.device)
    eos_in_prefix = first_true(decoders[0]._is_eos(flat) & (position < prefix[:, None]))  # [R]
    read = torch.cat([prefix[:, None], eos_in_prefix[:, None], prefix_length(accepted)], dim=-1)
    return read, list(flat.unbind())


class PrefixStopping:
    """Stopping criteria applied to the final left-to-right prefix of every row, as stock `generate` applies them.

    Stock `generate` calls its criteria once per new token, for the whole batch, with `input_ids` of shape
    `[B, prompt_width + t]` (rows that ended are padded), and a row ends where a criterion first fires for it.
    Here a row's prefix becomes final at its own pace, so the criteria are called for answer length t as soon as
    every row still decoding has t final tokens: the same calls, in the same order, with the same inputs, so
    stateful criteria (lm-eval's `MultiTokenEOSCriteria` tracks rows by batch index) work unchanged. `scores` is
    None (ReFusion decoding refuses `output_scores`).
    """

    def __init__(self, criteria: StoppingCriteriaList, input_ids: torch.LongTensor, pad_token_id: int):
        self.criteria = criteria
        self.seen = input_ids  # [B, W + checked]
        self.pad = torch.tensor(pad_token_id, dtype=torch.long, device=input_ids.device)
        self.checked = 0  # answer positions already shown to the criteria

    def update(self, sequences: list[SequenceDecoder]) -> None:
        while any(s.answer_length > self.checked for s in sequences):  # stock stops calling when all rows ended
            decoding = [s.finished_prefix for s in sequences if s.stage is not Stage.DONE]
            if decoding and min(decoding) <= self.checked:
                return  # the next position is not final in every row still decoding
            t = self.checked
            column = torch.stack([s.canvas[t] if t < s.answer_length else self.pad for s in sequences])
            self.seen = torch.cat([self.seen, column[:, None]], dim=1)
            self.checked += 1
            fired = torch.as_tensor(self.criteria(self.seen, None), device=self.seen.device)
            fired = fired.expand(len(sequences)) if fired.dim() == 0 else fired
            for row in fired.nonzero().flatten().tolist():
                if self.checked < sequences[row].answer_length:
                    sequences[row].stop_at(self.checked)


@dataclass
class BatchDecodeResult:
    tokens: torch.LongTensor  # [B, A] generated tokens (A = longest answer), pad after each row's answer
    commit_step: torch.LongTensor  # [B, A]
    answer_lengths: list[int]
    forward_passes_per_row: list[int]
    num_forward_passes: int
    chosen_slots: list[list[list[int]]]


class RaggedKVCache:
    """A `DynamicCache` shared by the batch, plus which entries each row may attend to.

    Rows commit different numbers of tokens per forward: each forward's new segment is cut after the last entry any
    row keeps, and the validity mask covers the holes (left padding, and what shorter rows did not keep). Infill
    prefixes are kept as *pending* entries with a tag (chosen slot * k + index in the slot) that only query tokens
    whose `pending_view` covers it attend to, until they are committed or discarded. When holes make up most of the
    cache (rows that joined or kept little), `compact_if_sparse` moves each row's entries to the front.
    """

    COMPACT_SLACK = 32  # compact when the cache is more than twice as wide as its fullest row, and this much wider

    def __init__(self, config, batch_size: int, device):
        self.config = config
        self.cache = DynamicCache(config=config)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, T] committed entries
        self.tags: torch.LongTensor | None = None  # [B, T] pending entries' tags, -1 elsewhere; None: none pending
        self.lengths = [0] * batch_size  # host: entries each row holds (committed and pending)
        self.pending = [0] * batch_size  # host: pending entries per row

    def attention_mask(self, visible: torch.BoolTensor, dtype, views: torch.LongTensor | None = None) -> torch.Tensor:
        """visible: [B, Q, Q], views: [B, Q, 2] pending tags each query token sees ([lo, hi)) -> additive float
        mask [B, 1, Q, T+Q] (0 = attend, finfo.min = blocked)."""
        batch_size, q = visible.shape[:2]
        cached = self.valid[:, None, :].expand(batch_size, q, -1)
        if self.tags is not None and views is not None:
            tags = self.tags[:, None, :]  # [B, 1, T]
            cached = cached | ((tags >= views[..., :1]) & (tags < views[..., 1:]))
        allowed = torch.cat([cached, visible], dim=-1)
        mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(allowed, 0.0)[:, None]

    def keep_new_entries(self, spans: list[tuple[int, Kept]]) -> None:
        """After a forward appended W entries per row: row b keeps what `spans[b] = (start, kept)` says of its query,
        which starts at `start` of that new segment (after the row's left padding). The segment is cut after the last
        kept entry (`DynamicCache.crop`); entries not kept are holes, masked by `valid`. No K/V is copied."""
        old = self.valid.shape[1]
        device = self.valid.device
        bounds = [[start for start, _ in spans], [start + kept.committed for start, kept in spans]]
        starts, stops = torch.tensor(bounds, dtype=torch.long, device=device)  # [B] each
        width = max((start + kept.extent for start, kept in spans), default=0)
        cut = self.cache.get_seq_length() - (old + width)
        if cut > 0:
            self.cache.crop(-cut)  # DynamicCache's crop takes the number of entries to remove, negated
        index = torch.arange(width, device=device)[None, :]  # [1, width]
        self.valid = torch.cat([self.valid, (index >= starts[:, None]) & (index < stops[:, None])], dim=1)
        for row, (_, kept) in enumerate(spans):
            added = sum(length for _, length, _ in kept.pending)
            self.lengths[row] += kept.committed + added - kept.discarded
            self.pending[row] = 0 if kept.promote else self.pending[row] + added - kept.discarded
        if any(kept.pending for _, kept in spans) or self.tags is not None:
            self._update_pending(spans, old, width)

    def _update_pending(self, spans: list[tuple[int, Kept]], old: int, width: int) -> None:
        """Tag this forward's pending entries, then discard and promote (one batched op each)."""
        device = self.valid.device
        if any(kept.pending for _, kept in spans):
            rows = [[-1] * width for _ in spans]  # [B, width] host-built: one copy
            for row, (start, kept) in enumerate(spans):
                for offset, length, tag in kept.pending:
                    rows[row][start + offset : start + offset + length] = range(tag, tag + length)
            new = torch.tensor(rows, dtype=torch.long, device=device)
        else:
            new = torch.full((len(spans), width), -1, dtype=torch.long, device=device)
        self.tags = torch.cat([self.pending_tags()[:, :old], new], dim=1)
        if any(kept.keep_below is not None or kept.promote for _, kept in spans):
            below = [2**62 if kept.keep_below is None else kept.keep_below for _, kept in spans]
            settle = torch.tensor([below, [kept.promote for _, kept in spans]], dtype=torch.long, device=device)
            alive = (self.tags >= 0) & (self.tags < settle[0][:, None])  # [B, T]
            promote = settle[1][:, None].bool()
            self.valid |= alive & promote
            self.tags = torch.where(alive & ~promote, self.tags, -1)
        if not any(self.pending):
            self.tags = None

    def extend(self, other: RaggedKVCache) -> None:
        """Append `other`'s rows (requests that joined, prefilled in a cache of their own) after this cache's rows;
        the narrower of the two is padded with holes."""
        if not self.lengths:  # no rows left: the joining rows' cache is the cache
            self.cache, self.valid, self.tags = other.cache, other.valid, other.tags
            self.lengths, self.pending = list(other.lengths), list(other.pending)
            return
        width = max(self.valid.shape[1], other.valid.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            for name in ("keys", "values"):
                merged = [_pad_entries(getattr(layer, name), width) for layer in (mine, theirs)]
                setattr(mine, name, torch.cat(merged, dim=0))
        pad = [F.pad(v, (0, width - v.shape[1])) for v in (self.valid, other.valid)]
        if self.tags is not None or other.tags is not None:
            tags = [F.pad(c.pending_tags(), (0, width - c.valid.shape[1]), value=-1) for c in (self, other)]
            self.tags = torch.cat(tags, dim=0)
        self.valid = torch.cat(pad, dim=0)
        self.lengths = self.lengths + other.lengths
        self.pending = self.pending + other.pending

    def pending_tags(self) -> torch.LongTensor:
        """[B, T] the pending entries' tags, -1 elsewhere (everywhere when nothing is pending)."""
        return self.tags if self.tags is not None else torch.full(self.valid.shape, -1, device=self.valid.device)

    def select_rows(self, rows: list[int]) -> None:
        if not rows:  # nothing left to decode: an empty cache (joining rows become the whole cache)
            self.cache = DynamicCache(config=self.config)
            self.valid, self.tags, self.lengths, self.pending = self.valid[:0, :0], None, [], []
            return
        self.cache.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=self.valid.device))
        self.valid = self.valid[rows]
        self.lengths = [self.lengths[row] for row in rows]
        self.pending = [self.pending[row] for row in rows]
        self.tags = self.tags[rows] if self.tags is not None and any(self.pending) else None
        self.compact_if_sparse()

    def compact_if_sparse(self) -> None:
        """Move every row's entries (committed and pending) to the front, in order, when holes make up most of the
        cache."""
        width, fullest = self.valid.shape[1], max(self.lengths, default=0)
        if width <= 2 * fullest or width - fullest < self.COMPACT_SLACK:
            return
        held = self.valid if self.tags is None else self.valid | (self.tags >= 0)
        # Stable sort: each row's entries first, in cache order; [B, fullest]
        order = torch.sort((~held).to(torch.uint8), dim=1, stable=True).indices[:, :fullest]
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)  # [B, H, T, D]
                index = order[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                setattr(layer, name, tensor.gather(2, index))
        self.valid = self.valid.gather(1, order)
        if self.tags is not None:
            self.tags = self.tags.gather(1, order)


def _pad_entries(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, H, width, D], zeros after the T entries (holes)."""
    return F.pad(tensor, (0, 0, 0, width - tensor.shape[2]))


def forward_queries(model, kv: RaggedKVCache, queries: list[Query], pad_token_id: int) -> torch.Tensor:
    """ONE model forward for every row's query on top of the shared cache.

    Layout per row: [context tokens, left-padded to the batch's widest context] + [scored tokens, right-padded].
    Returns logits [B, S, V] for the scored parts (S = widest scored part).
    """
    context_width = max(q.num_context for q in queries)
    scored_width = max(q.num_scored for q in queries)
    if all(q.num_context == context_width and q.num_scored == scored_width for q in queries):
        input_ids, positions, visible, views = _stack_queries(queries)  # nothing to pad (always so at batch 1)
    else:
        input_ids, positions, visible, views = _pad_queries(queries, context_width, scored_width, pad_token_id)
    output = model(
        input_ids=input_ids,
        position_ids=positions,
        attention_mask=kv.attention_mask(visible, model.dtype, views),
        cache=kv.cache,
        use_cache=True,
        logits_to_keep=scored_width,
    )
    return output.logits


def _stack_queries(queries: list[Query]):
    """Queries of one shape -> input_ids, positions [B, q], visible [B, q, q], views [B, q, 2] or None."""
    views = None
    if any(query.pending_view is not None for query in queries):
        none = torch.zeros(queries[0].tokens.shape[0], 2, dtype=torch.long, device=queries[0].tokens.device)
        views = torch.stack([none if q.pending_view is None else q.pending_view for q in queries])
    fields = ([q.tokens for q in queries], [q.positions for q in queries], [q.visible for q in queries])
    return (*(torch.stack(field) for field in fields), views)


def _pad_queries(queries: list[Query], context_width: int, scored_width: int, pad_token_id: int):
    """Queries of different shapes -> the same tensors as `_stack_queries`, each row's context left-padded to
    `context_width` and its scored part right-padded to `scored_width` (one pad per row and tensor, one stack)."""
    pads = [(context_width - q.num_context, scored_width - q.num_scored) for q in queries]
    input_ids = torch.stack([F.pad(q.tokens, pad, value=pad_token_id) for q, pad in zip(queries, pads)])
    positions = torch.stack([F.pad(q.positions, pad) for q, pad in zip(queries, pads)])
    visible = torch.stack([F.pad(q.visible, pad + pad) for q, pad in zip(queries, pads)])
    # A padding query attends to nothing real; let it see itself so no softmax row is fully blocked.
    width = context_width + scored_width
    visible |= torch.eye(width, dtype=torch.bool, device=visible.device)[None] & ~visible.any(-1, keepdim=True)
    views = None  # [B, width, 2]: which pending infill entries each query token sees (default: none)
    if any(query.pending_view is not None for query in queries):
        none = torch.zeros(width, 2, dtype=torch.long, device=visible.device)
        views = torch.stack(
            [none if q.pending_view is None else F.pad(q.pending_view, (0, 0) + pad) for q, pad in zip(queries, pads)]
        )
    return input_ids, positions, visible, views


def decode_batch(
    model,
    prompts: list[torch.LongTensor],
    settings: DecodingSettings,
    pad_token_id: int,
    policy: DraftPolicy | None = None,
    stopping: PrefixStopping | None = None,
    on_step=None,
    forward=forward_queries,
    max_rows: int | None = None,
    on_finish=None,
) -> BatchDecodeResult:
    """Decode every prompt (unpadded 1-D tensors) with ReFusion; one forward per step serves all rows.

    `policy` turns logits into drafts (default: greedy, never drafting the mask token). `stopping` applies
    stopping criteria to the final prefixes after every forward. `on_step(sequences)` is called after that with
    the list of `SequenceDecoder`s (for streaming). `forward` runs one step's queries (`forward_queries`;
    benchmarks swap in alternative strategies).

    Continuous batching: with `max_rows`, at most that many prompts decode at once, and as soon as rows finish the
    next prompts take their places (prefilled in a forward of their own, then appended to the shared cache), so
    that a stream of requests longer than the batch keeps it full. `on_finish(index, sequence)` is called when a
    prompt's answer is decoded. Each prompt decodes as it would alone either way. Stopping criteria are called for
    the whole batch at once (stock's contract), so they need every row from the start: not with `max_rows`.
    """
    device = prompts[0].device
    if policy is None:
        policy = DraftPolicy.greedy([settings.mask_token_id], device)
    if max_rows is not None and (stopping is not None or on_step is not None):
        raise ValueError("continuous batching (`max_rows`) cannot apply batch-wide stopping criteria or stream steps")
    sequences: list[SequenceDecoder | None] = [None] * len(prompts)
    waiting = list(range(len(prompts)))[::-1]  # popped from the end: prompts join in order
    limit = len(prompts) if max_rows is None else max_rows
    active: list[int] = []  # rows of `kv`, in order
    kv = RaggedKVCache(model.config, 0, device)
    num_forward_passes = 0

    def step(rows: list[int], cache: RaggedKVCache) -> None:
        """One forward for `rows` on `cache`; each row advances and keeps its committed prefix."""
        decoders = [sequences[row] for row in rows]
        queries = [decoder.query() for decoder in decoders]
        logits = forward(model, cache, queries, pad_token_id)
        context_width = max(q.num_context for q in queries)
        values = examine_rows(decoders, logits, [q.num_scored for q in queries])  # one device-to-host transfer
        spans = []
        for decoder, query, row_values in zip(decoders, queries, values):
            kept = decoder.decide(row_values)
            # The row's query starts after its left padding in this forward's new cache segment.
            spans.append((context_width - query.num_context, kept))
        cache.keep_new_entries(spans)

    while active or waiting:
        if active:
            step(active, kv)
            num_forward_passes += 1
        joining = []
        # Joining costs a prefill forward of its own: wait until a quarter of the rows are free (or none is busy).
        free = limit - len(active)
        if free < max(1, limit // JOIN_FRACTION) and active:
            free = 0
        while waiting and len(joining) < free:
            index = waiting.pop()
            sequences[index] = SequenceDecoder(prompts[index], settings, policy)
            joining.append(index)
        if joining:
            # Requests that join are prefilled (prompt + first plan) in a cache of their own, so that the rows
            # already decoding are not padded to the prompts' width; their cache rows are appended after.
            fresh = RaggedKVCache(model.config, len(joining), device)
            step(joining, fresh)
            num_forward_passes += 1
            kv.extend(fresh)
            active.extend(joining)
        if stopping is not None:
            stopping.update(sequences)
        if on_step is not None:
            on_step(sequences)
        still = [i for i, row in enumerate(active) if sequences[row].stage is not Stage.DONE]
        if len(still) < len(active):
            if on_finish is not None:
                for row in active:
                    if sequences[row].stage is Stage.DONE:
                        on_finish(row, sequences[row])
            kv.select_rows(still)
            active = [active[i] for i in still]

    if stopping is not None:
        stopping.update(sequences)  # a cut in the last update may have left later positions of ended rows unchecked
    length = max(sequence.answer_length for sequence in sequences)
    tokens = torch.full((len(sequences), length), pad_token_id, dtype=torch.long, device=device)
    commit_step = torch.full((len(sequences), length), -1, dtype=torch.long, device=device)
    answer_lengths = []
    for row, sequence in enumerate(sequences):
        n = sequence.answer_length
        assert sequence.finished_prefix == n, "ReFusion decoding left a hole before the end of the answer"
        tokens[row, :n] = sequence.canvas[:n]
        commit_step[row, :n] = sequence.commit_step[:n]
        answer_lengths.append(n)
    return BatchDecodeResult(
        tokens=tokens,
        commit_step=commit_step,
        answer_lengths=answer_lengths,
        forward_passes_per_row=[s.forward_passes for s in sequences],
        num_forward_passes=num_forward_passes,
        chosen_slots=[s.trace_chosen for s in sequences],
    )
