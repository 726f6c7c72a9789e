"""A request's decoding on an engine that recomputes the current block at every forward (SGLang's canvas): the
decoder's cache entries of the current block, and each forward's canvas built from them (`BlockLedger`).

The package's decoder keeps every cache entry it computes (`generation/ragged_kv_cache.py`): committed slots, and
infill's pending entries that only their own slot sees. An engine whose forward recomputes the block's tokens every
time (SGLang's diffusion canvas, `sglang_algorithm.py`) reproduces that cache when each entry is recomputed seeing
exactly what it saw when the decoder computed it: in one forward, any pattern of who-sees-whom is computable layer
by layer, so the canvas [the block's entries] + [the decoder's query], each token at its own position, under the
mask built here, computes what the decoder's forward computes. `BlockLedger.keep` applies the decoder's `Kept` entry
by entry, as `RaggedKVCache.keep_new_entries` applies it to the tensors; `BlockLedger.close` gives the finished
block's mask for its encoding as context.

torch only (no engine import): tests/serving/test_recomputed_canvas.py decodes through it with transformers' own
forward and checks generate()'s tokens, in the main suite.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch

from refusion_hf.generation.refusion_generation_config import DecodingSettings
from refusion_hf.generation.sequence_state import Kept, Query

CANVAS_BLOCKS = 2  # a canvas holds a block's entries (at most a block) and one query (at most a block), in blocks


@dataclass
class Entry:
    """One cache entry of the current block: its token, original position, infill tag (None: committed) and the
    entries of the block it attended to when it was computed (ids); it also saw the whole context."""

    token: int
    position: int
    tag: int | None
    sees: frozenset[int]


@dataclass
class CanvasLayout:
    """One forward's canvas for one request: what each token is and what it sees."""

    tokens: list[int]
    positions: list[int]
    mask: torch.BoolTensor  # [W, W]
    entry_ids: list[int]  # canvas index -> entry id, for the first len(entry_ids) tokens
    query_start: int  # canvas index of the query's first canvas token
    skipped: int  # leading context tokens of the query already in SGLang's context (the prompt)
    scored_start: int  # canvas index of the first scored token


@dataclass
class BlockLedger:
    """The decoder's cache entries of one request's current block (`RaggedKVCache`'s bookkeeping, entry by entry:
    `keep` applies a `Kept` as `RaggedKVCache.keep_new_entries` does), from which each forward's canvas is built."""

    block_start: int  # original position of the block's first token
    entries: dict[int, Entry] = field(default_factory=dict)  # in the order they were computed
    ids: itertools.count = field(default_factory=itertools.count)

    def canvas(self, query: Query, width: int, mask_token: int) -> CanvasLayout:
        entry_ids = list(self.entries)
        index = {entry_id: i for i, entry_id in enumerate(entry_ids)}
        e = len(entry_ids)
        positions = query.positions.tolist()
        c = query.num_context
        skipped = sum(1 for p in positions[:c] if p < self.block_start)  # the prompt: SGLang encoded it
        if skipped not in (0, c):
            raise RuntimeError("a query's context mixes the prompt and the current block")
        context = c - skipped
        s = query.num_scored
        total = e + context + s
        if total > width:
            raise RuntimeError(f"a ReFusion query of {context + s} tokens on {e} block entries exceeds the canvas")
        mask = torch.eye(width, dtype=torch.bool)  # filler tokens see themselves only
        for i, entry_id in enumerate(entry_ids):
            for seen in self.entries[entry_id].sees:
                mask[i, index[seen]] = True
        committed = torch.tensor([self.entries[i].tag is None for i in entry_ids], dtype=torch.bool)
        q0, s0 = e, e + context
        if context:  # causal among themselves, every committed entry
            mask[q0:s0, :e] = committed
            mask[q0:s0, q0:s0] = torch.ones(context, context, dtype=torch.bool).tril()
        if s:
            seen = committed[None, :].expand(s, e).clone()
            if query.pending_view is not None and e:
                tags = torch.tensor([-1 if self.entries[i].tag is None else self.entries[i].tag for i in entry_ids])
                view = query.pending_view.cpu()
                seen |= (tags[None, :] >= view[:, :1]) & (tags[None, :] < view[:, 1:]) & (tags[None, :] >= 0)
            if query.hidden is not None and e:
                where = torch.tensor([self.entries[i].position for i in entry_ids])
                hidden = query.hidden.cpu()
                seen &= ~((where[None, :] >= hidden[:, :1]) & (where[None, :] < hidden[:, 1:]))
            mask[s0 : s0 + s, :e] = seen
            if context:
                sees_context = query.sees_context
                mask[s0 : s0 + s, q0:s0] = True if sees_context is None else sees_context[:, skipped:].cpu()
            mask[s0 : s0 + s, s0 : s0 + s] = query.visible.cpu()
        tokens = [self.entries[i].token for i in entry_ids] + query.tokens[skipped:].tolist()
        tokens += [mask_token] * (width - total)
        filler = self.block_start
        where = [self.entries[i].position for i in entry_ids] + positions[skipped:] + [filler] * (width - total)
        return CanvasLayout(tokens, where, mask, entry_ids, q0, skipped, s0)

    def keep(self, layout: CanvasLayout, query: Query, kept: Kept) -> None:
        """What the decoder's cache keeps of the query just forwarded (`Kept`), applied to the block's entries."""
        tokens = query.tokens.tolist()
        positions = query.positions.tolist()
        new: dict[int, int] = {}  # query index -> new entry id

        def add(query_index: int, tag: int | None) -> None:
            if query_index < layout.skipped:
                return  # the prompt: SGLang's context
            row = layout.query_start + query_index - layout.skipped
            seen = layout.mask[row].nonzero().flatten().tolist()
            sees = set()
            for column in seen:
                if column < len(layout.entry_ids):
                    sees.add(layout.entry_ids[column])
                elif column != row:
                    earlier = column - layout.query_start + layout.skipped
                    if earlier not in new:
                        raise RuntimeError("a kept query token attended to a query token that was not kept")
                    sees.add(new[earlier])
            entry_id = next(self.ids)
            new[query_index] = entry_id
            self.entries[entry_id] = Entry(tokens[query_index], positions[query_index], tag, frozenset(sees))

        for i in range(kept.committed):
            add(i, None)
        for offset, length, first_tag in kept.pending:
            for j in range(length):
                add(offset + j, first_tag + j)
        if kept.keep_below is not None or kept.promote:
            below = kept.keep_below
            for entry_id, entry in list(self.entries.items()):
                if entry.tag is None:
                    continue
                if below is not None and entry.tag >= below:
                    del self.entries[entry_id]
                elif kept.promote:
                    self.entries[entry_id] = replace(entry, tag=None)
        if kept.invalidate_from is not None:
            for entry_id, entry in list(self.entries.items()):
                if entry.position >= kept.invalidate_from:
                    del self.entries[entry_id]

    def close(self, length: int, refed: list[int] | None = None) -> torch.BoolTensor:
        """The block is final: [length, length] what each of its first `length` tokens (position order) saw of the
        others, for its encoding as context. `refed`: the positions the decoder feeds again as the next forward's
        context (a revision dropped every entry of the block, then closed it: `SequenceState._remask`); that forward
        computes them causally in position order, so their mask is causal."""
        block = list(range(self.block_start, self.block_start + length))
        if not self.entries and refed == block:
            return torch.ones(length, length, dtype=torch.bool).tril()
        by_position = {entry.position: entry_id for entry_id, entry in self.entries.items() if entry.tag is None}
        order = [by_position.get(position) for position in block]
        if None in order or len(by_position) != len(self.entries) or refed:
            raise RuntimeError("a finished block's cache entries do not cover its tokens once each")
        column = {entry_id: j for j, entry_id in enumerate(order)}
        mask = torch.eye(length, dtype=torch.bool)
        for j, entry_id in enumerate(order):
            for seen in self.entries[entry_id].sees:
                mask[j, column[seen]] = True
        return mask


def context_mask(prompt_length: int, blocks: list[torch.BoolTensor], start: int, count: int) -> torch.BoolTensor:
    """[count, count] what each token at positions `start` .. `start + count - 1` sees of the others when an engine
    encodes them as context (their KV is then what the decoder keeps): the prompt causally, each finished block under
    its `BlockLedger.close` mask (`blocks`, in order, the answer's first blocks from `prompt_length` on), every token
    of a later block all of an earlier one. Usually one block; several after an engine dropped and re-encodes a
    request's KV."""
    mask = torch.ones(count, count, dtype=torch.bool).tril()
    block_start = prompt_length
    for block in blocks:
        block_end = block_start + block.shape[0]
        low, high = max(block_start, start), min(block_end, start + count)
        if low < high:
            if (low, high) != (block_start, block_end):
                raise RuntimeError(f"positions {start}..{start + count - 1} encode part of a finished block")
            i = low - start
            mask[i : i + block.shape[0], i : i + block.shape[0]] = block
        block_start = block_end
    return mask


def request_settings(knobs: dict, eos_token_ids: list[int], max_new_tokens: int) -> DecodingSettings:
    """The decoder's settings for one request of `max_new_tokens`, from the checkpoint's resolved knobs (as
    `refusion_generate.decoding_settings` makes them), planning ahead off: the next plan is a forward of its own
    (same tokens; the canvas holds one query)."""
    knobs = dict(knobs)
    slot = knobs["slot_size"]
    canvas_length = -(-max_new_tokens // slot) * slot
    knobs["block_size"] = min(knobs["block_size"], canvas_length)
    knobs["plan_ahead"] = False
    return DecodingSettings(**knobs, max_new_tokens=max_new_tokens, eos_token_ids=tuple(eos_token_ids))
