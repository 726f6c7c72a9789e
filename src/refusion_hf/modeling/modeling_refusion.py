"""`RefusionForCausalLM`: the stock Qwen3 causal LM, with ReFusion decoding in `generate()`.

The network is exactly transformers' Qwen3 (subclassed, not copied). Four things differ:

* `generate()` comes from `RefusionGenerationMixin` (placed first in the MRO, so it wins over
  `GenerationMixin.generate` while `prepare_inputs_for_generation` & co. stay the stock ones that PEFT uses);
* `forward(..., labels, mdm_weights)` computes the ReFusion training loss (`refusion_loss.py`, docs/design.md §2) when
  `mdm_weights` (built by `RefusionDataCollator`) is given: `labels` are then the collator's unshifted targets and
  the output carries `loss = ar_loss + mdm_loss` and both parts. That layout's `position_ids` are permuted on
  purpose, so there a missing attention mask means causal attention over the whole row (transformers >= 5 would
  read every position jump as the start of a packed sequence and cut attention there). Without `mdm_weights`,
  `forward` is stock Qwen3's: `labels` give the shifted causal-LM loss, `logits_to_keep` keeps the last rows, and
  position-id restarts without a mask are packed sequences (padding-free batches), so the model also trains, scores
  and generates as a plain autoregressive LM.
* a 4D boolean attention mask is made additive under eager attention (stock eager would add the booleans);
* `AutoModel` maps `RefusionConfig` to this LM-head class (as the official checkpoint's `auto_map` does), except
  for the backbone of a transformers Qwen3 task head, which gets the base `Qwen3Model` (`_task_head_backbone`).

`save_pretrained` (and so `push_to_hub`) also writes the flat remote-code bundle and `auto_map`, so the saved
folder loads with `trust_remote_code=True` where this package is not installed, and `custom_generate/`, so a stock
Qwen3 model decodes with ReFusion through `generate(custom_generate=folder, trust_remote_code=True)`.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import torch
from transformers import Qwen3ForCausalLM
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)

from .._compat.transformers import attn_implementation, cache_argument, output_cache
from ..generation.refusion_generation_config import RefusionGenerationConfig
from ..generation.refusion_generation_mixin import RefusionGenerationMixin
from .configuration_refusion import RefusionConfig
from .refusion_loss import RefusionCausalLMOutputWithPast, refusion_loss
from .remote_code import auto_map_for, write_model_bundle


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

    # The ReFusion loss is a mean over one micro-batch (the authors' normalisation), not a sum to be divided by a
    # token count across gradient-accumulation steps: this tells `Trainer` not to pass `num_items_in_batch` and to
    # divide by the accumulation steps itself (it would otherwise also count masked positions as AR tokens). Plain
    # causal-LM training (`labels` only) is then normalised per micro-batch too, like transformers < 4.46.
    accepts_loss_kwargs = False

    def __init__(self, config):
        super().__init__(config)
        # `mdm_weights` is consumed here, in `forward`; reaching the backbone means a trainer computed its own loss
        # from the hidden states and would silently train something else (TRL's SFTTrainer does).
        self.model.register_forward_pre_hook(_refuse_mdm_weights_in_backbone, with_kwargs=True)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        mdm_weights=None,
        **kwargs,
    ):
        r"""
        The stock Qwen3 causal-LM forward (same arguments, same meaning, `logits_to_keep` included; the KV cache
        is `cache` on every supported transformers release, `past_key_values` too), plus:

        mdm_weights (`torch.FloatTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Built by `RefusionDataCollator`: `1 / (p_mask * answer_length * num_examples)` at masked positions, 0
            elsewhere. It marks the ReFusion training layout: `labels` are then the collator's unshifted targets,
            the loss is ReFusion's `ar_loss + mdm_loss` (float32, both parts also returned), every position's
            logits are computed (`logits_to_keep` must be 0), and `position_ids` are permuted positions, so a
            missing `attention_mask` means causal attention over the whole row. Without `mdm_weights`, `labels`
            give the ordinary shifted causal-LM loss and `position_ids` without an `attention_mask` mean what they
            mean to stock Qwen3: a restart marks a new sequence packed in the row (padding-free batches).

        A 4D boolean `attention_mask` (True = may attend; `RefusionDataCollator(packing_length=...)` builds one) is
        turned into the additive float mask of the model's dtype when the attention implementation is eager,
        which would otherwise add the booleans to the scores (sdpa reads it as given).
        """
        attention_mask = self._additive_if_boolean_for_eager(attention_mask)
        if cache is not None:  # only when given: `past_key_values=` then still reaches stock forward
            if kwargs.get("past_key_values") is not None:
                raise ValueError("`cache` and `past_key_values` were both given: they name the same KV cache.")
            kwargs.update(cache_argument(cache))  # the installed release's keyword (`past_key_values` before 5.24)
        if mdm_weights is None:
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        if labels is None:
            raise ValueError(
                "`mdm_weights` was given without `labels`: the ReFusion loss needs both (`RefusionDataCollator` "
                "builds them together)."
            )
        if isinstance(logits_to_keep, torch.Tensor) or logits_to_keep not in (0, None):
            raise ValueError("`logits_to_keep` must be 0 with the ReFusion loss, which needs every position's logits.")
        if attention_mask is None and position_ids is not None:
            # ReFusion's positions are permuted on purpose: a jump is the next slot, not a new packed sequence.
            attention_mask = self._all_ones_attention_mask(input_ids, inputs_embeds, kwargs)
        kwargs.pop("num_items_in_batch", None)  # the ReFusion loss has its own normalisation
        return_dict = kwargs.pop("return_dict", None)
        outputs = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False if use_cache is None else use_cache,
            return_dict=True,
            **kwargs,
        )
        ar_loss, mdm_loss = refusion_loss(outputs.logits, labels, mdm_weights)
        result = RefusionCausalLMOutputWithPast(
            loss=ar_loss + mdm_loss,
            logits=outputs.logits,
            **cache_argument(output_cache(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            ar_loss=ar_loss,
            mdm_loss=mdm_loss,
        )
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return result if return_dict else result.to_tuple()

    def _additive_if_boolean_for_eager(self, attention_mask):
        if (
            torch.is_tensor(attention_mask)  # stock generation with a static cache passes a dict of masks
            and attention_mask.ndim == 4
            and attention_mask.dtype == torch.bool
            and attn_implementation(self.config) == "eager"
        ):
            additive = torch.zeros(attention_mask.shape, dtype=self.dtype, device=attention_mask.device)
            return additive.masked_fill_(~attention_mask, torch.finfo(self.dtype).min)
        return attention_mask

    @staticmethod
    def _all_ones_attention_mask(input_ids, inputs_embeds, kwargs) -> torch.Tensor:
        reference = input_ids if input_ids is not None else inputs_embeds
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past_length = cache.get_seq_length() if cache is not None else 0
        batch_size, query_length = reference.shape[:2]
        return torch.ones(batch_size, past_length + query_length, dtype=torch.long, device=reference.device)

    def save_pretrained(self, save_directory, *args, **kwargs):
        # The model's own class: FSDP2 (`fully_shard`) swaps in a subclass it defines in a torch module.
        model_class = next(cls for cls in type(self).__mro__ if not cls.__module__.startswith("torch."))
        self.config.auto_map = auto_map_for(self.config_class, model_class)
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_model_bundle(save_directory, self.config_class, model_class)


_TASK_HEADS = (GenericForSequenceClassification, GenericForQuestionAnswering, GenericForTokenClassification)


def _task_head_backbone(module, name, submodule):
    """`AutoModel` maps a `RefusionConfig` to `RefusionForCausalLM`, as the official checkpoint's `auto_map` maps
    `AutoModel` to its LM head (docs/design.md §1). transformers' Qwen3 task heads (sequence and token
    classification, question answering) build their backbone with `AutoModel.from_config(config)` and register it
    as `base_model_prefix`: built on a `RefusionConfig`, they get the LM head's base model instead, which is what
    every other config gives them there. A torch module-registration hook (`register_module_module_registration_hook`,
    public) sees that registration without looking at callers; the LM head's own `lm_head` is built and dropped (on
    the meta device under `from_pretrained`)."""
    if (
        isinstance(module, _TASK_HEADS)
        and isinstance(submodule, RefusionForCausalLM)
        and name == module.base_model_prefix
    ):
        return submodule.model
    return None


torch.nn.modules.module.register_module_module_registration_hook(_task_head_backbone)


def _refuse_mdm_weights_in_backbone(module, args, kwargs):
    if kwargs.get("mdm_weights") is not None:
        raise ValueError(
            "A ReFusion batch (`mdm_weights`, unshifted `labels`) reached the backbone without the ReFusion loss: "
            "the trainer computes its own causal-LM loss from the hidden states (TRL's `SFTTrainer` does), which "
            "would train a different objective. Train with `refusion_hf.RefusionSFTTrainer` (TRL) or "
            "`refusion_hf.training.RefusionTrainer` (Trainer)."
        )


__all__ = ["RefusionForCausalLM"]
