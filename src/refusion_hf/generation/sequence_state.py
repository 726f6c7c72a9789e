"""The decoding state of one sequence: its canvas, what is written, the block and pool being decoded, the slots
in flight, and the stage it is in (docs/design.md §3).

This module owns the state: `SequenceState.apply` executes the transitions the stages decide (transitions.py:
choosing slots, committing them, entering and going on with infill, remasking, closing a block, stopping) and is
the only code that writes it. It does no model work: the stages (`stages.py`, `plan_and_verify.py`, `infill.py`,
`revision.py`, `plan_ahead.py`) build queries from this state and decide from the logits; the batch scheduler
(`batch_scheduler.py`) runs the forwards.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .draft_policy import DraftPolicy
from .refusion_generation_config import DecodingSettings  # declared there, derived from `KNOBS`
from .transitions import (
    Choose,
    CloseBlock,
    Commit,
    EnterInfill,
    Forwarded,
    InfillChecked,
    Kept,
    Redraft,
    Remask,
    StopAt,
    Transition,
)

MAX_REVISIONS = 2  # with `remask_threshold`: a position is remasked at most this many times, so decoding ends
INITIAL_CANVAS = 256  # positions the canvas starts with (fewer when it is shorter): short answers never grow it


class Stage(enum.Enum):
    """Where a sequence is in its planning iteration; `StageRegistry.units` gives the unit serving each (but DONE)."""

    PLAN = "plan"  # one forward of the block's undecoded slots (masks): drafts + slot scores; choose slots
    VERIFY = "verify"  # one forward of the chosen drafts in position order: commit whole slots, else infill
    INFILL_DRAFT = "infill_draft"  # each unfinished chosen slot re-drafts its unverified tail
    INFILL_VERIFY = "infill_verify"  # each unfinished chosen slot verifies its drafts autoregressively
    REVISE = "revise"  # with `remask_threshold`: re-score the block's written slots; remask low tails (revision.py)
    DONE = "done"


@dataclass
class Query:
    """What one sequence feeds to one forward.

    The first `num_context` tokens need no logits (the prompt, on the first forward; a revised block's kept tokens
    after a revision): they are causal among themselves and see every committed cache entry of the sequence, and
    their visibility is never built as a matrix (split_attention.py). Logits are returned for the remaining ones, the
    *scored* tokens, whose visibility the stage chooses: `visible[i, j]` says whether scored token i may attend to
    scored token j; `sees_context[i, j]` whether it sees context token j (None: every one); every scored token also
    sees all of the sequence's committed cache entries, and the pending infill entries whose tags lie in
    `[pending_view[i, 0], pending_view[i, 1])` (a pending entry's tag is chosen slot * k + index in the slot, so a
    slot's range is its own entries; None: no token sees any). `hidden[i]` is a range of original positions whose
    cache entries scored token i must not see (a revision re-scores a slot without the slot itself; None: no token
    hides any).
    """

    tokens: torch.LongTensor  # [c + s]
    positions: torch.LongTensor  # [c + s] original positions
    visible: torch.BoolTensor  # [s, s]
    num_context: int = 0  # c
    pending_view: torch.LongTensor | None = None  # [s, 2]
    hidden: torch.LongTensor | None = None  # [s, 2]
    sees_context: torch.BoolTensor | None = None  # [s, c]

    @property
    def num_scored(self) -> int:
        return self.tokens.shape[0] - self.num_context


def consecutive(indices: list[int]) -> bool:
    """Whether ascending `indices` are consecutive (one range; then a slice or an arange serves)."""
    return bool(indices) and indices[-1] - indices[0] + 1 == len(indices)


def consecutive_runs(slots: list[int]) -> list[tuple[int, int]]:
    """Ascending `slots` as runs of consecutive slots: (first slot, number of slots) each."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


def slot_offsets(slots: list[int], k: int) -> list[int]:
    """Answer offsets (position minus prompt length) of the slots' tokens, slot after slot (host list)."""
    return [slot * k + j for slot in slots for j in range(k)]


@dataclass
class ChosenSlots:
    """The slots picked by one plan, in position order, and their state through verification and infill."""

    slots: list[int]  # slot indices (slot s covers canvas [s*k, (s+1)*k))
    tokens: torch.LongTensor  # [n, k] current drafts
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


class SequenceState:
    """ReFusion decoding state of one sequence. The stages read it to build their queries; what they decide is a
    transition (transitions.py) that `apply` executes: nothing else writes it (tests/generation/
    test_state_ownership.py checks both)."""

    def __init__(self, prompt: torch.LongTensor, settings: DecodingSettings, policy: DraftPolicy):
        device = prompt.device
        self.settings = settings
        self.policy = policy
        self.device = device
        self.prompt_length = prompt.shape[0]
        k, length = settings.slot_size, settings.canvas_length
        # The canvas grows as blocks are entered (`reserve`), so memory follows the decoded answer, never
        # `max_new_tokens`: positions not allocated yet are masks, uncommitted.
        self.canvas = torch.empty(0, dtype=torch.long, device=device)
        self.written = bytearray()  # 1 where the canvas holds a committed token (host-side: no device sync)
        self._prefix = 0  # committed positions 0 .. _prefix - 1 (grows, except when a revision takes tokens back)
        self.revisions = bytearray()  # per canvas position, how many times it was remasked (revision.py)
        # Canvas positions before `closed` are final. Without revision every committed token is; with it, a token
        # is final once its block is closed (revised, nothing more to revise): streamers and criteria lag a block.
        self.closed = 0 if settings.remask_threshold is not None else None
        self.commit_step = torch.empty(0, dtype=torch.long, device=device)
        self.eos_ids = torch.tensor(settings.eos_token_ids, dtype=torch.long, device=device)
        self.first_eos: int | None = None  # canvas index of the first committed EOS
        self.stop_length: int | None = None  # set by a stopping criterion: the answer ends after this many tokens
        self.ends_after_block = False  # an EOS was accepted: no block after the current one is decoded
        self.slots_per_block = settings.block_size // k
        self.num_slots = length // k
        self.block = 0
        self.pool: list[int] = self.block_slots(0)  # undecoded slots of the current block, in order
        self._reserve(self.pool)
        self.context: torch.LongTensor | None = prompt  # tokens to cache with the next forward (the prompt, once)
        self.context_positions = torch.arange(prompt.shape[0], device=device)  # their original positions
        self.stage = Stage.PLAN
        self.step = -1  # planning iteration
        self.forward_passes = 0
        self.trace_chosen: list[list[int]] = []
        self.plan_drafts: torch.LongTensor | None = None  # [len(pool), k], for draft streaming
        self.chosen: ChosenSlots | None = None

    # ------------------------------------------------------------------------------------------- reading
    def block_slots(self, block: int) -> list[int]:
        start = block * self.slots_per_block
        return list(range(start, min(start + self.slots_per_block, self.num_slots)))

    def slot_positions(self, slots: list[int]) -> torch.LongTensor:
        """[n*k] original positions of the slots' tokens."""
        k, start = self.settings.slot_size, self.prompt_length
        if consecutive(slots):  # the usual case: one range
            return torch.arange(start + slots[0] * k, start + (slots[-1] + 1) * k, device=self.device)
        return torch.tensor([start + offset for offset in slot_offsets(slots, k)], dtype=torch.long, device=self.device)

    def num_context(self) -> int:
        return 0 if self.context is None else self.context.shape[0]

    def is_eos(self, tokens: torch.Tensor) -> torch.BoolTensor:
        return torch.isin(tokens, self.eos_ids)

    def scores(self, logits: torch.Tensor, predicted_positions) -> torch.Tensor:
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

    @property
    def written_prefix(self) -> int:
        """Length of the left-to-right prefix of the answer that is committed (nothing missing)."""
        while self._prefix < len(self.written) and self.written[self._prefix]:
            self._prefix += 1
        return min(self._prefix, self.answer_length)

    @property
    def finished_prefix(self) -> int:
        """Length of the left-to-right prefix of the answer that is final: committed and, with revision, in a
        closed block."""
        prefix = self.written_prefix
        return prefix if self.closed is None else min(prefix, self.closed)

    @property
    def revised_tokens(self) -> int:
        """Positions remasked by revisions, in all (a position remasked twice counts twice)."""
        return sum(self.revisions)

    def next_block_slots(self) -> list[int]:
        """The slots of the block after the current one; none when decoding ends with the current block."""
        if self.ends_after_block or self.block + 1 >= self.settings.num_blocks:
            return []
        return self.block_slots(self.block + 1)

    def undecoded_after_commit(self) -> list[int]:
        """The current block's slots still undecoded if this iteration commits every chosen slot."""
        chosen = set(self.chosen.slots)
        return [slot for slot in self.pool if slot not in chosen]

    def pool_after_commit(self) -> list[int]:
        """The pool of the next plan if this iteration commits every chosen slot (none when a revision comes
        first: the block is re-scored before the next one is planned)."""
        undecoded = self.undecoded_after_commit()
        if undecoded or self.closed is not None:
            return undecoded
        return self.next_block_slots()

    def revisable_slots(self) -> list[int]:
        """The current block's slots a revision may re-score: written, wholly inside the answer and before its EOS
        (the EOS and what it ended stay as decided), whose last position was remasked fewer than `MAX_REVISIONS`
        times (a revision remasks from a token to the end of its slot)."""
        k = self.settings.slot_size
        slots = []
        for slot in self.block_slots(self.block):
            start, end = slot * k, (slot + 1) * k
            if end > self.answer_length or (self.first_eos is not None and end > self.first_eos):
                continue
            if all(self.written[start:end]) and self.revisions[end - 1] < MAX_REVISIONS:  # a cut ends the slot
                slots.append(slot)
        return slots

    def block_positions(self) -> tuple[int, int]:
        """[start, end) canvas positions of the current block."""
        start = self.block * self.settings.block_size
        return start, min(start + self.settings.block_size, self.settings.canvas_length)

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

    # ------------------------------------------------------------------------------------------- writing
    def apply(self, transition: Transition) -> Kept | None:
        """Execute a stage's decision (transitions.py): the one way the state changes. Returns its `Kept`."""
        return _HANDLERS[type(transition)](self, transition)

    def _forwarded(self, _transition: Forwarded) -> None:
        self.forward_passes += 1

    def _choose(self, choice: Choose) -> Kept:
        self.context = None
        self.step += 1
        self.plan_drafts = choice.plan_drafts
        self.chosen = ChosenSlots(choice.slots, choice.tokens, choice.draft_probs, choice.confident, choice.ends)
        k = self.settings.slot_size
        self.trace_chosen.append([slot * k for slot in choice.slots])
        self.stage = Stage.VERIFY
        return choice.kept

    def _commit_slots(self, commit: Commit) -> Kept:
        self._commit(commit.slots, commit.tokens, commit.eos_at)
        if commit.eos_at is not None:
            self._drop_after(commit.slots[commit.eos_at // self.settings.slot_size])
        return self._finish_iteration(commit.kept)

    def _enter_infill(self, infill: EnterInfill) -> Kept:
        chosen, n = self.chosen, len(infill.verified)
        chosen.verified, chosen.cached, chosen.pending = infill.verified, [0] * n, [0] * n
        in_infill = set(chosen.slots)
        self.pool = [slot for slot in self.pool if slot not in in_infill]
        self.stage = Stage.INFILL_DRAFT
        return infill.kept

    def _redraft(self, redraft: Redraft) -> Kept:
        chosen = self.chosen
        chosen.tokens.view(-1)[redraft.target_index] = redraft.proposals
        if redraft.probs is not None:
            chosen.draft_probs.view(-1)[redraft.target_index] = redraft.probs
        if redraft.confident is not None:
            chosen.confident, chosen.ends = redraft.confident, redraft.ends
        self.context = None
        # The verified tokens this query fed (before each slot's masks) stay in the cache, pending for their slot
        # (a complete slot fed nothing: its verified and cached lengths are equal).
        for i, verified in enumerate(chosen.verified):
            chosen.pending[i] += verified - chosen.cached[i]
            chosen.cached[i] = verified
        self.stage = Stage.INFILL_VERIFY
        return redraft.kept

    def _infill_checked(self, checked: InfillChecked) -> Kept:
        chosen = self.chosen
        for i, end in checked.grown:
            chosen.pending[i] += end - chosen.cached[i]
            chosen.cached[i] = end
        chosen.verified = checked.verified
        ending = checked.ending
        if ending is not None:  # later chosen slots and undecoded slots after it are discarded
            chosen.pending[ending] = checked.ending_pending
            chosen.keep_first(ending + 1)
            chosen.verified[ending] = chosen.cached[ending] = self.settings.slot_size  # complete
            self._drop_after(chosen.slots[ending])
        if checked.commit is not None:
            return self._commit_slots(checked.commit)
        self.stage = Stage.INFILL_DRAFT
        return checked.kept

    def _remask(self, remask: Remask) -> Kept:
        k = self.settings.slot_size
        self.context = None
        self.step += 1
        start, end = self.block_positions()
        infill = []  # (slot, verified prefix)
        for slot, first, replacement in remask.cuts:
            self._take_back(slot * k + first, (slot + 1) * k)
            self._put(slot * k + first, replacement)
            if first + 1 < k:
                infill.append((slot, first + 1))
        in_infill = {slot for slot, _ in infill}
        kept = [p for p in range(start, min(end, len(self.written))) if self.written[p] and p // k not in in_infill]
        index = torch.tensor(kept, dtype=torch.long, device=self.device)
        self.context = self.canvas[index] if kept else None
        self.context_positions = self.prompt_length + index
        self.trace_chosen.append([slot * k for slot, _, _ in remask.cuts])
        if not infill:  # every revised slot is complete: re-score the block (its entries re-fed first), if any
            return remask.kept if self.revisable_slots() else self._close_block(remask.kept)
        slots = [slot for slot, _ in infill]
        n = len(slots)
        rows = torch.tensor([[slot * k + j for j in range(k)] for slot in slots], device=self.device)
        rescored = remask.probs[[remask.rescored_slots.index(slot) for slot in slots]]  # [n, k]
        # tokens [n, k]: each kept prefix and second opinion, then masks; draft probabilities as re-scored (infill's
        # re-drafts overwrite the remasked tail)
        prefixes, no = [prefix for _, prefix in infill], [False] * n
        self.chosen = ChosenSlots(slots, self.canvas[rows], rescored.clone(), no, list(no), prefixes, [0] * n, [0] * n)
        self.stage = Stage.INFILL_DRAFT
        return remask.kept

    def _reserve(self, slots: list[int]) -> None:
        """Grow the canvas, its commit steps and written flags to hold `slots` (a block's, when it is entered):
        doubling from `INITIAL_CANVAS` positions, at most to the canvas length, so a long answer costs amortised
        O(1) copies per position."""
        have, need = len(self.written), (max(slots) + 1) * self.settings.slot_size
        if need <= have:
            return
        extra = min(self.settings.canvas_length, max(need, 2 * have, INITIAL_CANVAS)) - have
        canvas = self.canvas.new_full((extra,), self.settings.mask_token_id)
        steps = self.commit_step.new_full((extra,), -1)
        self.canvas = torch.cat([self.canvas, canvas]) if have else canvas
        self.commit_step = torch.cat([self.commit_step, steps]) if have else steps
        self.written += bytes(extra)
        self.revisions += bytes(extra)

    def _commit(self, slots: list[int], tokens: torch.LongTensor, eos_at: int | None = None) -> None:
        """Write `tokens` (the slots' tokens concatenated, possibly cut after an EOS) into the canvas; `eos_at` is
        the index in `tokens` of its first EOS, if it has one (the caller has read it already)."""
        k, n = self.settings.slot_size, tokens.shape[0]
        done = 0  # tokens written so far; a run of consecutive slots is one canvas range: one slice each
        for first, count in consecutive_runs(slots):
            start, length = first * k, min(count * k, n - done)
            if length <= 0:
                break
            self.canvas[start : start + length] = tokens[done : done + length]
            self.commit_step[start : start + length] = self.step
            self.written[start : start + length] = b"\x01" * length
            done += length
        done_slots = set(slots)
        self.pool = [slot for slot in self.pool if slot not in done_slots]
        if eos_at is not None:
            first = slots[eos_at // k] * k + eos_at % k
            self.first_eos = first if self.first_eos is None else min(self.first_eos, first)

    def _take_back(self, start: int, end: int) -> None:
        """Remask canvas positions [start, end) (a revision): no longer written, decoded again."""
        self.canvas[start:end] = self.settings.mask_token_id
        self.commit_step[start:end] = -1
        self.written[start:end] = bytes(end - start)
        for position in range(start, end):
            self.revisions[position] += 1
        self._prefix = min(self._prefix, start)

    def _put(self, position: int, token: int) -> None:
        """Write one token (a revision's second opinion), committed in the current step."""
        self.canvas[position] = token
        self.commit_step[position] = self.step
        self.written[position] = 1

    def _drop_after(self, eos_slot: int) -> None:
        """An EOS was accepted in `eos_slot`: drop undecoded slots after it; stop after this block."""
        self.pool = [slot for slot in self.pool if slot < eos_slot]
        self.ends_after_block = True

    def _stop_at(self, stop: StopAt) -> None:
        """A stopping criterion fired after `length` final answer tokens: the answer ends there (tokens decoded
        out of order beyond it are discarded, undecoded slots after it are never decoded)."""
        self.stop_length = stop.length if self.stop_length is None else min(self.stop_length, stop.length)
        if self.finished_prefix == self.answer_length:
            self.chosen, self.plan_drafts = None, None
            self.stage = Stage.DONE

    def _finish_iteration(self, kept: Kept) -> Kept:
        """The chosen slots are committed: plan next (in the next block when this one is decoded, after its
        revision if `remask_threshold` is set), or stop."""
        self.chosen = None
        self.plan_drafts = None
        self.stage = Stage.PLAN
        if self.pool and self.written_prefix < self.answer_length:
            return kept  # more slots of this block to decode
        if self.closed is not None and self.revisable_slots():
            self.stage = Stage.REVISE
            return kept
        return self._close_block(kept)

    def _close_block(self, kept: Kept, consumed: bool = False) -> Kept:
        """The current block is decoded (and revised): its tokens are final; go on with the next block, or stop.
        `consumed`: the context fed is cached."""
        if consumed:
            self.context = None
        if self.closed is not None:
            self.closed = self.block_positions()[1]
        self.stage = Stage.PLAN
        if self.finished_prefix == self.answer_length:
            # Everything that will be returned is decoded; the rest of the canvas cannot change it.
            self.stage = Stage.DONE
        elif not self.pool:
            self.pool = self.next_block_slots()
            self.block += 1
            if not self.pool:
                self.stage = Stage.DONE
            else:
                self._reserve(self.pool)
        return kept


_HANDLERS = {
    Forwarded: SequenceState._forwarded,
    Choose: SequenceState._choose,
    Commit: SequenceState._commit_slots,
    EnterInfill: SequenceState._enter_infill,
    Redraft: SequenceState._redraft,
    InfillChecked: SequenceState._infill_checked,
    Remask: SequenceState._remask,
    CloseBlock: lambda state, close: state._close_block(close.kept, consumed=True),
    StopAt: SequenceState._stop_at,
}
