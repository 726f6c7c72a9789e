"""`RefusionForCausalLM`: the stock Qwen3 causal LM, with ReFusion decoding in `generate()`.

The network is exactly transformers' Qwen3 (subclassed, not copied). Two things differ:

* `generate()` comes from `RefusionGenerationMixin` (placed first in the MRO, so it wins over
  `GenerationMixin.generate` while `prepare_inputs_for_generation` & co. stay the stock ones that PEFT uses);
* `forward()` always passes an explicit attention mask. Without one, transformers >= 5 treats non-monotonic
  `position_ids` (ReFusion's permuted slots) as packed sequences and silently cuts attention at every position
  jump. Building an all-ones mask when none is given makes that impossible.

`save_pretrained` (and so `push_to_hub`) also writes the flat remote-code bundle and `auto_map`, so the saved
folder loads with `trust_remote_code=True` where this package is not installed.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import torch
from transformers import Qwen3ForCausalLM

from ..generation.refusion_generation_config import RefusionGenerationConfig
from ..generation.refusion_generation_mixin import RefusionGenerationMixin
from .configuration_refusion import RefusionConfig
from .remote_code import auto_map_for, write_remote_code


class RefusionForCausalLM(RefusionGenerationMixin, Qwen3ForCausalLM):
    config_class = RefusionConfig
    generation_config_class = RefusionGenerationConfig

    # transformers reloads generation_config.json as a plain `GenerationConfig` and callers may assign one:
    # every assignment is upcast so the ReFusion fields are always there (values are kept, nothing is lost).
    @property
    def generation_config(self) -> RefusionGenerationConfig | None:
        return self.__dict__.get("_generation_config")

    @generation_config.setter
    def generation_config(self, value) -> None:
        if value is not None:
            value = RefusionGenerationConfig.from_generation_config(value)
        self.__dict__["_generation_config"] = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None, **kwargs):
        if attention_mask is None and position_ids is not None:
            attention_mask = self._all_ones_attention_mask(input_ids, inputs_embeds, cache, kwargs)
        if cache is not None:
            kwargs["cache"] = cache
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )

    @staticmethod
    def _all_ones_attention_mask(input_ids, inputs_embeds, cache, kwargs) -> torch.Tensor:
        reference = input_ids if input_ids is not None else inputs_embeds
        cache = cache if cache is not None else kwargs.get("past_key_values")
        past_length = cache.get_seq_length() if cache is not None else 0
        batch_size, query_length = reference.shape[:2]
        return torch.ones(batch_size, past_length + query_length, dtype=torch.long, device=reference.device)

    def save_pretrained(self, save_directory, *args, **kwargs):
        self.config.auto_map = auto_map_for(self.config_class, type(self))
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_remote_code(save_directory, self.config_class, type(self))


__all__ = ["RefusionForCausalLM"]
