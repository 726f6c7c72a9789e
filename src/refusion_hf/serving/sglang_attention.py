"""SGLang's `torch_native` attention with a per-request mask over each request's new tokens: the attention backend
`refusion_torch_native` (`sglang_names.ATTENTION_BACKEND`: registered by the plugin, required by
`--dllm-algorithm ReFusion`).

ReFusion's decoder attends with structured masks inside one forward: a chosen slot completed by infill sees only
the context and itself, a committed slot's cache entries were computed without the slots written after it, a
revision re-scores a slot without the slot itself (`generation/ragged_kv_cache.py`). SGLang's attention backends run
a request's new tokens causally. This subclass of SGLang's `TorchNativeAttnBackend` (torch's
`scaled_dot_product_attention`, one request at a time, as its parent) takes, for the forwards the algorithm marks,
one boolean mask per request over that request's new tokens ([new, new], True = attend); every new token also sees
the whole of the request's cached context. Forwards without masks (every other model, the prompt's prefill) are
its parent's, unchanged. It runs wherever torch does (CPU or GPU), at `torch_native`'s speed.

The algorithm (`sglang_algorithm.py`) hands the masks to the model runner's backend (`carry`) before its forwards
and takes them back after (SGLang's `ForwardBatch` is not the object the attention layers receive).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from torch.nn.functional import scaled_dot_product_attention

from refusion_hf._compat import sglang as seam


class MaskedTorchNativeAttnBackend(TorchNativeAttnBackend):
    """`TorchNativeAttnBackend` whose extend forwards honour the per-request masks a forward carries."""

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self._carried: list[torch.BoolTensor] | None = None  # per request, [new, new]: the next forwards' masks
        self._masks: list[torch.BoolTensor] | None = None  # the same over each request's whole KV

    def carry(self, masks: list[torch.BoolTensor] | None) -> None:
        """Attend under `masks` (per request of the batch, in order: [new, new], True = attend) in the forwards from
        now on, until `carry(None)`; every new token also sees the request's whole cached context."""
        self._carried, self._masks = masks, None

    def _full_masks(self, forward_batch) -> list[torch.BoolTensor] | None:
        """The carried masks over each request's whole KV (its cached context, then its new tokens), built once."""
        if self._carried is None or self._masks is not None:
            return self._masks
        prefixes = forward_batch.extend_prefix_lens.tolist()
        if len(prefixes) != len(self._carried):
            raise RuntimeError(
                f"{len(self._carried)} attention masks carried for a forward of {len(prefixes)} requests"
            )
        full = []
        for mask, prefix in zip(self._carried, prefixes):
            new = mask.shape[0]
            context = torch.ones(new, prefix, dtype=torch.bool, device=mask.device)
            full.append(torch.cat([context, mask], dim=1).to(self.device))
        self._masks = full
        return full

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        masks = self._full_masks(forward_batch)
        if masks is None or layer.is_cross_attention:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            seam.save_kv(self, layer, forward_batch, k, v)
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        query = q.view(-1, heads, dim)  # [tokens, H, D]
        out = q.new_empty((query.shape[0], heads, layer.v_head_dim))
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        lengths = forward_batch.seq_lens.tolist()
        new_lengths = forward_batch.extend_seq_lens.tolist()
        pools = forward_batch.req_pool_indices.tolist()
        start = 0
        for mask, length, new, pool in zip(masks, lengths, new_lengths, pools):
            entries = req_to_token[pool, :length]  # [prefix + new] cache slots of the request, in order
            keys = k_cache[entries].movedim(0, 1)[None].to(query.dtype)  # [1, Hkv, prefix + new, D]
            values = v_cache[entries].movedim(0, 1)[None].to(query.dtype)
            rows = query[start : start + new].movedim(0, 1)[None]  # [1, H, new, D]
            attended = scaled_dot_product_attention(
                rows,
                keys,
                values,
                attn_mask=mask[None, None],
                scale=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            )
            out[start : start + new] = attended[0].movedim(0, 1)
            start += new
        return out.view(q.shape[0], -1)


def create(model_runner) -> MaskedTorchNativeAttnBackend:
    """The factory SGLang's attention registry calls."""
    return MaskedTorchNativeAttnBackend(model_runner)
