"""The KV cache a batch of ReFusion rows shares, and the one forward that feeds every row's query on top of it.

transformers' `DynamicCache` holds the keys and values (appending, `crop`, `batch_select_indices`), its
full-attention layers appending in place (`InPlaceLayer`: a forward's few entries are written after the others,
where `DynamicLayer` copies the whole layer to append them); this module adds which entries each row may attend to
(rows keep different numbers of tokens per forward, and infill keeps
*pending* entries only one slot sees), which canvas position each entry holds, and the 4-D attention mask built
from both. The model is any Qwen3-shaped causal LM: it takes the mask, `position_ids` and the cache as stock.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, DynamicLayer

from .._compat.transformers import cache_argument, map_cache_tensors
from .sequence_state import Kept, Query
from .split_attention import SplitMask
from .stage_interface import stack_rows

# Split only where the context rows' dense mask would hold at least this many entries per row (C * (T + C + S)):
# below it, one dense mask and one kernel call per layer cost less than two calls and a concatenation (a 200-token
# prompt, the embedded model's typical chat prompt, is fed dense; from a 512-token prompt on, split).
SPLIT_FROM = 2**18


class InPlaceLayer(DynamicLayer):
    """transformers' `DynamicLayer` whose keys and values fill the front of a buffer with room after them. An append
    writes into the room, where `DynamicLayer.update` concatenates: a copy of the layer's whole cache on every
    forward, which after a long prompt is much of what each later forward costs (7247c5f's benchmarks/README.md, "Long
    prompts"). When an append outgrows the room, the buffer is allocated again with room for a sixteenth more
    entries (at least `MIN_ROOM`): one copy. `keys` / `values` are views of the filled front, as `DynamicLayer`
    exposes its tensors; `crop` only shortens the front; setting them (`batch_select_indices`, `map_cache_tensors`,
    offloading) replaces the buffer by the tensor given."""

    # Room a buffer gets at least: a few forwards' worth at a short prompt. More is not free: at batch 16 a room of
    # 256 made the prompt's forward slower than the same forward on exact-size tensors (7247c5f's benchmarks/README.md,
    # "Grouped key/value heads").
    MIN_ROOM = 64

    def __init__(self, **kwargs):
        self.buffers = {"keys": None, "values": None}  # [B, H, capacity, D] each (or the tensor last set)
        self.filled = {"keys": 0, "values": 0}  # entries at the front of each buffer
        super().__init__(**kwargs)

    @property
    def keys(self) -> torch.Tensor | None:
        return self._front("keys")

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._hold("keys", tensor)

    @property
    def values(self) -> torch.Tensor | None:
        return self._front("values")

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._hold("values", tensor)

    def _front(self, name: str) -> torch.Tensor | None:
        buffer = self.buffers[name]
        return buffer if buffer is None or buffer.dim() < 3 else buffer[..., : self.filled[name], :]

    def _hold(self, name: str, tensor: torch.Tensor | None) -> None:
        self.buffers[name] = tensor  # None, or DynamicLayer's empty 1-D tensor before the first append
        self.filled[name] = tensor.shape[-2] if tensor is not None and tensor.dim() >= 3 else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states / value_states [B, H, W, D] appended after the filled entries -> keys, values [B, H, filled + W,
        D] (views of the buffers)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._append("keys", key_states), self._append("values", value_states)

    def _append(self, name: str, new: torch.Tensor) -> torch.Tensor:
        buffer, filled = self.buffers[name], self.filled[name]
        end = filled + new.shape[-2]
        if buffer.dim() < 3 or buffer.shape[-2] < end or buffer.shape[:2] != new.shape[:2]:
            grown = new.new_empty(*new.shape[:-2], end + max(self.MIN_ROOM, end // 16), new.shape[-1])
            if filled:
                grown[..., :filled, :] = buffer[..., :filled, :]
            self.buffers[name] = buffer = grown
        buffer[..., filled:end, :] = new
        self.filled[name] = end
        return buffer[..., :end, :]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` entries (a negative count, as `DynamicLayer.crop` takes)."""
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes a negative count of entries to remove, got {tokens_to_remove}.")
        for name, filled in self.filled.items():
            self.filled[name] = max(0, filled + tokens_to_remove)


class InPlaceKVCache(DynamicCache):
    """transformers' `DynamicCache` for `config`, its full-attention layers `InPlaceLayer`s (other kinds as built)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.layers = [InPlaceLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]


class RaggedKVCache:
    """A `DynamicCache` shared by the batch, plus which entries each row may attend to.

    Rows commit different numbers of tokens per forward: each forward's new segment is cut after the last entry any
    row keeps, and the validity mask covers the holes (left padding, and what shorter rows did not keep). Infill
    prefixes are kept as *pending* entries with a tag (chosen slot * k + index in the slot) that only query tokens
    whose `pending_view` covers it attend to, until they are committed or discarded. When holes make up most of the
    cache (rows that joined or kept little), `compact_if_sparse` moves each row's entries to the front.

    `positions` maps every cache column to the original position its entry holds (the map from canvas position to
    cache column, read the other way): `invalidate` drops a row's entries from a position on, so that tokens can be
    taken back (their entries, and those of every later token that attended to them).
    """

    COMPACT_SLACK = 32  # compact when the cache is more than twice as wide as its fullest row, and this much wider

    def __init__(self, config, batch_size: int, device, dtype: torch.dtype):
        self.config = config
        # Qwen3 layers' kinds (`config.layer_types`); the decoder's masks are the same for every kind
        self.layer_types = tuple(set(getattr(config, "layer_types", None) or ("full_attention",)))
        # the additive mask's two values, in the model's dtype (0 = attend, finfo.min = blocked)
        self.attend, self.blocked = torch.tensor([0.0, torch.finfo(dtype).min], dtype=dtype, device=device).unbind()
        # None while the cache has no rows (building a DynamicCache is not free; rows that join bring their own)
        self.cache: DynamicCache | None = InPlaceKVCache(config) if batch_size else None
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, T] committed entries
        self.tags: torch.LongTensor | None = None  # [B, T] pending entries' tags, -1 elsewhere; None: none pending
        self.positions = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # [B, T] original positions
        self.lengths = [0] * batch_size  # host: entries each row holds (committed and pending)
        self.pending = [0] * batch_size  # host: pending entries per row

    def attention_mask(
        self,
        visible: torch.BoolTensor,
        sees_context: torch.BoolTensor,
        context_pads: torch.LongTensor | None = None,
        views: torch.LongTensor | None = None,
        hidden=None,
    ) -> SplitMask:
        """One forward's mask (split_attention.py) for rows that feed [C context tokens, left-padded by
        `context_pads` ([B]; None: no row is)] + [S scored tokens]. visible: [B, S, S] among the scored tokens,
        sees_context: [B, S, C] (False on pads), views: [B, S, 2] pending tags each scored token sees ([lo, hi)),
        hidden: [B, S, 2] original positions whose entries each scored token must not see ([lo, hi)).

        The scored rows' part is additive, [B, 1, S, T + C + S] (0 = attend, finfo.min = blocked). The context rows
        see the committed entries and, causally, each other: boolean [B, 1, C, T + C], or nothing built at all (None:
        sdpa's causal kernel) when the cache is empty and no row is padded, as on a prompt's prefill. A context
        whose rows would hold fewer than `SPLIT_FROM` entries is not split: the forward gets one dense additive
        [B, 1, C + S, T + C + S] mask for all its rows (one kernel call per layer, as stock's padded prefill), as a
        `SplitMask` of context width 0."""
        batch_size, s, c = sees_context.shape
        t = self.valid.shape[1]
        cached = self.valid[:, None, :].expand(batch_size, s, -1)  # [B, S, T]
        if self.tags is not None and views is not None:
            tags = self.tags[:, None, :]  # [B, 1, T]
            cached = cached | ((tags >= views[..., :1]) & (tags < views[..., 1:]))
        if hidden is not None:
            positions = self.positions[:, None, :]  # [B, 1, T]
            cached = cached & ~((positions >= hidden[..., :1]) & (positions < hidden[..., 1:]))
        allowed = torch.cat([cached, sees_context, visible], dim=-1)  # [B, S, T + C + S]
        if c and c * (t + c + s) < SPLIT_FROM:
            context = F.pad(self._context_rows(c, context_pads), (0, s))  # [B, C, T + C + S]: no scored token
            dense = torch.where(torch.cat([context, allowed], dim=1)[:, None], self.attend, self.blocked)
            return SplitMask(0, None, dense)  # every row masked as a scored one is: one kernel call per layer
        scored = torch.where(allowed[:, None], self.attend, self.blocked)
        if not c or (context_pads is None and not t):
            return SplitMask(c, None, scored)
        return SplitMask(c, self._context_rows(c, context_pads)[:, None], scored)

    def _context_rows(self, c: int, context_pads: torch.LongTensor | None) -> torch.BoolTensor:
        """[B, C, T + C]: the context tokens see the committed entries and, causally, each other; pads are seen by
        no token, each sees itself (no row fully blocked). Built for this forward only (a prompt's [C, C] is not
        worth caching)."""
        batch_size, device = self.valid.shape[0], self.valid.device
        context = torch.ones(c, c, dtype=torch.bool, device=device).tril()[None].expand(batch_size, c, c)
        if context_pads is not None:
            real = torch.arange(c, device=device)[None, :] >= context_pads[:, None]  # [B, C]
            context = context & (real[:, None, :] | torch.eye(c, dtype=torch.bool, device=device)[None])
        return torch.cat([self.valid[:, None, :].expand(batch_size, c, -1), context], dim=-1)

    def keep_new_entries(self, spans: list[tuple[int, Kept]], queries: list[Query]) -> None:
        """After a forward appended W entries per row: row b keeps what `spans[b] = (start, kept)` says of its query
        `queries[b]`, which starts at `start` of that new segment (after the row's left padding). The segment is cut
        after the last kept entry (`DynamicCache.crop`); entries not kept are holes, masked by `valid`. No K/V is
        copied."""
        old = self.valid.shape[1]
        width = max((start + kept.extent for start, kept in spans), default=0)
        fed = max(q.num_context for q in queries) + max(q.num_scored for q in queries)  # the segment's width
        if fed > width:
            self.cache.crop(width - fed)  # DynamicCache's crop takes the number of entries to remove, negated
        # Each row's kept entries, [start, start + committed) of the segment: host-built, one copy to the device.
        kept_flags = bytearray(len(spans) * width)
        for row, (start, kept) in enumerate(spans):
            kept_flags[row * width + start : row * width + start + kept.committed] = b"\x01" * kept.committed
        new_valid = torch.frombuffer(kept_flags, dtype=torch.bool) if kept_flags else torch.zeros(0, dtype=torch.bool)
        self.valid = torch.cat([self.valid, new_valid.view(len(spans), width).to(self.valid.device)], dim=1)
        if all(start == 0 and query.positions.shape[0] >= width for (start, _), query in zip(spans, queries)):
            rows = [query.positions[:width] for query in queries]  # no left padding (always so at batch 1)
        else:
            rows = [
                F.pad(query.positions, (start, max(0, width - start - query.positions.shape[0])), value=-1)[:width]
                for (start, _), query in zip(spans, queries)
            ]
        self.positions = torch.cat([self.positions, stack_rows(rows)], dim=1)
        for row, (_, kept) in enumerate(spans):
            added = sum(length for _, length, _ in kept.pending)
            self.lengths[row] += kept.committed + added - kept.discarded
            self.pending[row] = 0 if kept.promote else self.pending[row] + added - kept.discarded
        if any(kept.pending for _, kept in spans) or self.tags is not None:
            self._update_pending(spans, old, width)
        for row, (_, kept) in enumerate(spans):
            if kept.invalidate_from is not None:
                self.invalidate(row, kept.invalidate_from)

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
            self.cache, self.valid, self.tags, self.positions = other.cache, other.valid, other.tags, other.positions
            self.lengths, self.pending = list(other.lengths), list(other.pending)
            return
        width = max(self.valid.shape[1], other.valid.shape[1])
        map_cache_tensors(
            self.cache,
            lambda mine, theirs: torch.cat([_pad_entries(mine, width), _pad_entries(theirs, width)]),
            other.cache,
        )
        pad_from = (self, other)
        pad = [F.pad(v, (0, width - v.shape[1])) for v in (self.valid, other.valid)]
        if self.tags is not None or other.tags is not None:
            tags = [F.pad(c.pending_tags(), (0, width - c.valid.shape[1]), value=-1) for c in (self, other)]
            self.tags = torch.cat(tags, dim=0)
        self.valid = torch.cat(pad, dim=0)
        self.positions = torch.cat([F.pad(c.positions, (0, width - c.positions.shape[1]), value=-1) for c in pad_from])
        self.lengths = self.lengths + other.lengths
        self.pending = self.pending + other.pending

    def pending_tags(self) -> torch.LongTensor:
        """[B, T] the pending entries' tags, -1 elsewhere (everywhere when nothing is pending)."""
        return self.tags if self.tags is not None else torch.full(self.valid.shape, -1, device=self.valid.device)

    def select_rows(self, rows: list[int]) -> None:
        if not rows:  # nothing left to decode: an empty cache (joining rows become the whole cache)
            self.cache = None
            self.valid, self.tags, self.lengths, self.pending = self.valid[:0, :0], None, [], []
            self.positions = self.positions[:0, :0]
            return
        self.cache.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=self.valid.device))
        self.valid = self.valid[rows]
        self.positions = self.positions[rows]
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

        def gathered(tensor):  # each layer's keys and values: [B, H, T, D]
            return tensor.gather(2, order[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3]))

        map_cache_tensors(self.cache, gathered)
        self.valid = self.valid.gather(1, order)
        self.positions = self.positions.gather(1, order)
        if self.tags is not None:
            self.tags = self.tags.gather(1, order)

    def invalidate(self, row: int, first_position: int) -> int:
        """Drop row `row`'s entries (committed and pending) that hold original positions `first_position` or later;
        returns how many. Their columns become holes (the K/V stays until compaction)."""
        held = self.valid[row] if self.tags is None else self.valid[row] | (self.tags[row] >= 0)
        dropped = held & (self.positions[row] >= first_position)
        count = int(dropped.sum())
        if count:
            pending = 0 if self.tags is None else int((dropped & (self.tags[row] >= 0)).sum())
            self.valid[row] &= ~dropped
            if self.tags is not None:
                self.tags[row] = torch.where(dropped, -1, self.tags[row])
            self.lengths[row] -= count
            self.pending[row] -= pending
            if not any(self.pending):
                self.tags = None
        return count


def _pad_entries(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, H, width, D], zeros after the T entries (holes)."""
    return F.pad(tensor, (0, 0, 0, width - tensor.shape[2]))


def forward_queries(model, kv: RaggedKVCache, queries: list[Query], pad_token_id: int) -> torch.Tensor:
    """ONE model forward for every row's query on top of the shared cache (the model's attention selected by
    `split_attention.split_attention`, which `decode_batch` holds for its loop).

    Layout per row: [context tokens, left-padded to the batch's widest context] + [scored tokens, right-padded].
    Returns logits [B, S, V] for the scored parts (S = widest scored part).
    """
    context_width = max(q.num_context for q in queries)
    scored_width = max(q.num_scored for q in queries)
    if all(q.num_context == context_width and q.num_scored == scored_width for q in queries):
        pads = None  # nothing to pad (always so at batch 1)
        input_ids, positions, visible, sees_context = (stack_rows(field) for field in _fields(queries))
    else:
        pads = [(context_width - q.num_context, scored_width - q.num_scored) for q in queries]
        input_ids, positions, visible, sees_context = _pad_queries(queries, pads, pad_token_id)
    context_pads = None
    if pads is not None and any(pad for pad, _ in pads):
        context_pads = torch.tensor([pad for pad, _ in pads], device=input_ids.device)
    views = _stack_ranges([q.pending_view for q in queries], pads, visible)  # which pending entries each sees
    hidden = _stack_ranges([q.hidden for q in queries], pads, visible)  # which positions each must not see
    mask = kv.attention_mask(visible, sees_context, context_pads, views, hidden)
    output = model(
        input_ids=input_ids,
        position_ids=positions,
        attention_mask=dict.fromkeys(kv.layer_types, mask),  # a mask per layer type, taken as given by the model
        **cache_argument(kv.cache),
        use_cache=True,
        logits_to_keep=scored_width,
    )
    return output.logits


def _sees_context(query: Query) -> torch.BoolTensor:
    """[s, c] which context tokens each scored token sees."""
    if query.sees_context is not None:
        return query.sees_context
    return torch.ones(1, 1, dtype=torch.bool, device=query.tokens.device).expand(query.num_scored, query.num_context)


def _fields(queries: list[Query]):
    return (
        [q.tokens for q in queries],
        [q.positions for q in queries],
        [q.visible for q in queries],
        [_sees_context(q) for q in queries],
    )


def _pad_queries(queries: list[Query], pads: list[tuple[int, int]], pad_token_id: int):
    """Queries of different shapes -> input_ids, positions [B, C + S], visible [B, S, S], sees_context [B, S, C], each
    row's context left-padded and its scored part right-padded by `pads` (one pad per row and tensor, one stack)."""
    tokens, positions, visible, sees_context = _fields(queries)
    input_ids = torch.stack([F.pad(t, pad, value=pad_token_id) for t, pad in zip(tokens, pads)])
    positions = torch.stack([F.pad(p, pad) for p, pad in zip(positions, pads)])
    visible = torch.stack([F.pad(v, (0, scored_pad, 0, scored_pad)) for v, (_, scored_pad) in zip(visible, pads)])
    sees_context = torch.stack(
        [F.pad(v, (context_pad, 0, 0, scored_pad)) for v, (context_pad, scored_pad) in zip(sees_context, pads)]
    )
    # A padding query attends to nothing real; let it see itself so no softmax row is fully blocked.
    width = visible.shape[1]
    visible |= torch.eye(width, dtype=torch.bool, device=visible.device)[None] & ~visible.any(-1, keepdim=True)
    return input_ids, positions, visible, sees_context


def _stack_ranges(ranges: list, pads: list[tuple[int, int]] | None, visible: torch.BoolTensor):
    """Per-scored-token [lo, hi) ranges of the rows ([s, 2] each, None: the empty range [0, 0) for every token),
    padded like the scored tokens -> [B, S, 2]; None when no row has any."""
    if all(r is None for r in ranges):
        return None
    none = torch.zeros(visible.shape[1], 2, dtype=torch.long, device=visible.device)
    if pads is None:
        return torch.stack([none if r is None else r for r in ranges])
    return torch.stack(
        [none if r is None else F.pad(r, (0, 0, 0, scored_pad)) for r, (_, scored_pad) in zip(ranges, pads)]
    )
