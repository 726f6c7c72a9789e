"""Attention for the decoder's forwards without dense masks over the context (docs/design.md §3, "Attention").

Every forward of the decoder feeds, per row, `C` context tokens (the prompt on the first forward, a revised block's
kept tokens after a revision) and then `S` scored tokens (the stage's query). The context is causal among itself and
sees the row's committed cache entries; only the scored tokens need the visibility a stage chooses. So the forward's
mask comes in two parts (`SplitMask`): the scored rows' `[S, T + C + S]` (T cached entries; S is a query's width:
plan masks, drafts, infill rounds), and the context rows' `[C, T + C]`, which is *not built at all* when the cache is
empty and no row is padded (the prompt's prefill, as in stock generate: sdpa's causal kernel, no materialised
`[L, L]` mask). Left-padded contexts (a batch of prompts of different lengths) get a boolean `[C, C]` mask, as stock
builds for a padded batch; a revised block re-fed on a filled cache gets `[C, T + C]` with C at most a block. A
short context (below `ragged_kv_cache.SPLIT_FROM` entries per row) is not split at all: one dense mask over the
whole forward costs less there than a second kernel call per layer.

The attention itself stays transformers' (`sdpa_attention_forward`, and the Qwen3 module's
`eager_attention_forward`): this module registers, with transformers' `AttentionInterface`, one function per backend
that runs it once per part and concatenates the two outputs. With grouped-query attention the masked rows skip the
backends' copy of the cache per query head (`repeat_kv`): packed by key/value head from a long cache, and on CPU
through torch's own SDPA with `enable_gqa` (`_grouped_sdpa`; transformers' sdpa wrapper passes it only without a
mask). `split_attention(model)` selects it for the decoding loop through the public `set_attn_implementation`
(`_compat.transformers.select_attn_implementation`: what it sets, without its walk over the modules on every call)
and restores the model's own implementation afterwards; for any other mask (a training step, stock generate on the
same model meanwhile) the registered function is exactly the backend's, so selecting it changes nothing else.
flash-attention and flex-attention kernels take no arbitrary per-query masks in this form: a model that uses them is
refused with a message naming `set_attn_implementation("sdpa")`.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

from .._compat.transformers import attn_implementation, select_attn_implementation

SUPPORTED_BACKENDS = ("sdpa", "eager")


@dataclass(frozen=True)
class SplitMask:
    """One forward's attention mask in its two parts (see the module docstring). Masks are 4-D, broadcast over heads.

    context: [B, 1, C, T + C] boolean (True = attend), or None: causal over the C context tokens alone (the cache is
             empty and no row is padded);
    scored:  [B, 1, S, T + C + S] additive (0 = attend, finfo.min = blocked), in the model's dtype.
    A context width of 0 puts every row of the forward in `scored`: a forward of scored tokens only, or a short
    context and its scored tokens under one dense mask (`ragged_kv_cache.SPLIT_FROM`)."""

    context_width: int  # C
    context: torch.BoolTensor | None
    scored: torch.Tensor
    packed: dict = field(default_factory=dict, compare=False, repr=False)  # (B, n_rep) -> its `scored_packed`

    def scored_packed(self, batch_size: int, n_rep: int) -> torch.Tensor:
        """The scored rows' mask for queries packed by key/value head (`_scored_attention`): [B, 1, n_rep * S, K],
        rows (r, s), each of `scored`'s rows once per query head of a group. Built once per forward: every layer
        reads the same."""
        packed = self.packed.get((batch_size, n_rep))
        if packed is None:
            _, _, s, k = self.scored.shape
            packed = self.scored.expand(batch_size, 1, s, k).repeat(1, 1, n_rep, 1)
            self.packed[batch_size, n_rep] = packed
        return packed


def _split(backend: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        """query [B, H, C + S, D], key / value [B, Hkv, T + C + S, D] -> output [B, C + S, H, D] (the backends'
        layout), no attention weights."""
        if not isinstance(attention_mask, SplitMask):
            return _BACKENDS[backend](module, query, key, value, attention_mask, **kwargs)
        c = attention_mask.context_width
        if not c:  # most forwards: scored rows only
            return _scored_attention(backend, module, query, key, value, attention_mask, **kwargs), None
        scored = _scored_attention(backend, module, query[:, :, c:], key, value, attention_mask, **kwargs)
        fed_so_far = key.shape[2] - (query.shape[2] - c)  # T + C: the scored tokens come after the context
        keys, values = key[:, :, :fed_so_far], value[:, :, :fed_so_far]
        context_mask = attention_mask.context
        if context_mask is None and backend == "sdpa":  # sdpa's causal kernel: no mask at all
            context = sdpa_attention_forward(module, query[:, :, :c], keys, values, None, is_causal=True, **kwargs)[0]
        else:
            if context_mask is None:  # eager materialises its [C, C] scores anyway
                context_mask = torch.ones(c, c, dtype=torch.bool, device=query.device).tril()[None, None]
            if backend == "eager":  # eager adds its mask to the scores
                blocked = torch.finfo(query.dtype).min
                context_mask = torch.zeros(context_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                    ~context_mask, blocked
                )
            context = _masked_attention(backend, module, query[:, :, :c], keys, values, context_mask, **kwargs)
        return torch.cat([context, scored], dim=1), None

    return attention


# Pack only where `repeat_kv` would copy at least this many entries per tensor (H * K * D): below it the packing's
# own three small copies cost more than they save (measured on the embedded model, 4 heads of 64 and a cache of a
# few hundred entries: 4% to 12% slower whole calls packed, by a one-off uncommitted script; 7247c5f's
# benchmarks/README.md). 2**20 is a 4k cache there, 256 entries for Qwen3-8B.
PACK_FROM = 2**20
# Devices whose torch SDPA takes grouped key/value heads under a mask as they are cached (`enable_gqa`), faster than
# on heads repeated in every shape benchmarks/grouped_attention.py (in git at b70485a) timed (CPU). The outputs are
# the same attention summed in another order, not the same bits: equal on some AVX2 CPUs, up to 9.5e-7 apart in
# float32 on an AVX-512/AMX one (within torch.testing's float32 tolerance, which that benchmark checked); the tokens
# decoded on the golden cases are the same either way (tests/generation/test_oracle.py, exact).
# transformers passes `enable_gqa` only without a mask: CUDA's kernels fall back to the math one for a masked call.
GROUPED_SDPA_DEVICES = ("cpu",)


@dataclass(frozen=True)
class _OneGroup:
    """What the backends read of an attention module, for queries whose heads are already packed by key/value
    head: no `repeat_kv`."""

    training: bool
    is_causal: bool = False
    num_key_value_groups: int = 1


def _scored_attention(backend, module, query, key, value, mask: SplitMask, **kwargs) -> torch.Tensor:
    """query [B, H, S, D], key / value [B, Hkv, K, D], mask.scored [B, 1, S, K] -> [B, S, H, D].

    With grouped-query attention and a mask, transformers' backends copy every cached key and value once per query
    head of a group (`repeat_kv`: the whole cache, every layer, every forward; sdpa packs the heads instead only for
    one query token, `pack_gqa`). The scored rows are few, so from a long enough cache (`PACK_FROM`) they are packed
    the same way for any S: the `n_rep` query heads of a key/value head become `n_rep * S` rows of one head, the
    mask's rows repeated to match (`n_rep * S * K` entries instead of `2 * H * K * D` copied), and the backend runs
    on the key/value heads as they are cached. Below it, they run as `_masked_attention` does."""
    n_rep = getattr(module, "num_key_value_groups", 1)
    if n_rep == 1 or query.shape[1] * key.shape[2] * key.shape[3] < PACK_FROM:
        return _masked_attention(backend, module, query, key, value, mask.scored, **kwargs)
    b, h, s, d = query.shape
    kv_heads = h // n_rep
    packed_query = query.reshape(b, kv_heads, n_rep * s, d)  # head h = kv * n_rep + r: rows (r, s) of head kv
    packed_mask = mask.scored_packed(b, n_rep)  # [B, 1, n_rep * S, K]
    out = _BACKENDS[backend](_OneGroup(module.training), packed_query, key, value, packed_mask, **kwargs)[0]
    # out [B, n_rep * S, Hkv, D] -> [B, S, Hkv, n_rep, D] -> [B, S, H, D]
    return out.reshape(b, n_rep, s, kv_heads, d).permute(0, 2, 3, 1, 4).reshape(b, s, h, d)


def _masked_attention(backend, module, query, key, value, mask, **kwargs) -> torch.Tensor:
    """The backend's attention under `mask` ([B, 1, Q, K], the backend's kind), [B, Q, H, D] out; sdpa with grouped
    key/value heads on a `GROUPED_SDPA_DEVICES` device runs them grouped (`_grouped_sdpa`) instead of repeated."""
    if (
        backend == "sdpa"
        and getattr(module, "num_key_value_groups", 1) > 1
        and query.device.type in GROUPED_SDPA_DEVICES
    ):
        return _grouped_sdpa(module, query, key, value, mask, **kwargs)
    return _BACKENDS[backend](module, query, key, value, mask, **kwargs)[0]


def _grouped_sdpa(module, query, key, value, mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """query [B, H, S, D], key / value [B, Hkv, K, D] (H a multiple of Hkv), mask [B, 1, S, K] (additive or
    boolean) -> [B, S, H, D]: `sdpa_attention_forward`'s call of torch's SDPA with `enable_gqa`, which transformers
    makes only without a mask (see `GROUPED_SDPA_DEVICES`). What else that wrapper handles (softcap, attention
    weights, position biases) is no part of a Qwen3 decoding forward: any of it is left to the wrapper."""
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)[0]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # [B, H, S, D]
    return out.transpose(1, 2).contiguous()


_BACKENDS = {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}
# Named after this module: a model folder's remote-code copy of it (another `SplitMask` class) registers its own.
_MODULE_TAG = re.sub(r"\W", "_", __name__)
IMPLEMENTATIONS = {backend: f"refusion_split_{backend}__{_MODULE_TAG}" for backend in SUPPORTED_BACKENDS}
for _backend, _name in IMPLEMENTATIONS.items():
    AttentionInterface.register(_name, _split(_backend))

_selected: dict[int, list] = {}  # id(config) -> [the model's own implementation, decoding loops using the split one]
_selected_lock = threading.Lock()


@contextlib.contextmanager
def split_attention(model):
    """Within the block, `model`'s attention layers take `SplitMask`s (and every other mask as before); several
    decoding loops may run on one model at once (threads): the model's own implementation is restored when the
    last one ends."""
    config = model.config
    with _selected_lock:
        entry = _selected.get(id(config))
        if entry is None:
            own = attn_implementation(config)
            if own not in SUPPORTED_BACKENDS:
                raise ValueError(
                    f"ReFusion decoding runs on the 'sdpa' or 'eager' attention implementation; this model uses "
                    f"{own!r}, whose kernels take no per-query masks. Call `model.set_attn_implementation('sdpa')` "
                    f"(or load it with `attn_implementation='sdpa'`), or use `decoding='autoregressive'`."
                )
            select_attn_implementation(model, IMPLEMENTATIONS[own])
            entry = _selected[id(config)] = [own, 0]
        entry[1] += 1
    try:
        yield
    finally:
        with _selected_lock:
            entry[1] -= 1
            if not entry[1]:
                del _selected[id(config)]
                select_attn_implementation(model, entry[0])
