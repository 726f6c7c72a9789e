"""`RefusionGenerationMixin.generate()`: ReFusion decoding behind Hugging Face's `generate()` contract.

The whole call is `refusion_generate` (refusion_generate.py), shared with the `custom_generate/generate.py` that
gives stock Qwen3 models the same decoding, and `generate_batch` is `refusion_generate_batch` (generate_batch.py);
the algorithm lives in `batch_scheduler.py` and its stages. Their signatures are stock `GenerationMixin`'s, derived
from the declaration of its named arguments (`generate_arguments.GENERATE_SIGNATURE`, `BATCH_SIGNATURE`).

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import torch

from .generate_arguments import BATCH_SIGNATURE, GENERATE_SIGNATURE, method_signature
from .generate_batch import refusion_generate_batch
from .refusion_generate import refusion_generate


class RefusionGenerationMixin:
    """Adds ReFusion's plan-and-infill decoding as `generate()`; place it before the transformers base class."""

    @torch.no_grad()
    def generate(self, *args, **kwargs):
        r"""
        Generate with ReFusion's slot-level plan-and-infill decoding (or, with `decoding="autoregressive"`,
        transformers' own decoding with the same weights). The signature and the meaning of every argument are
        stock `GenerationMixin.generate`'s; an argument ReFusion decoding cannot honour raises a `ValueError`
        that names it (docs/generate_arguments.md has the table).

        Args:
            inputs / input_ids (`torch.LongTensor` of shape `(batch_size, prompt_length)`): prompts, left-padded;
                without them (and without `inputs_embeds`), each row starts from `bos_token_id`, as in stock
                `generate` (one row, or as many as `attention_mask` has).
            attention_mask (`torch.LongTensor` of the same shape, *optional*): 1 for prompt tokens, 0 for left
                padding. Right padding is rejected.
            generation_config (`GenerationConfig`, *optional*): merged with the model's generation config as stock
                `generate` merges it (fields left unset keep the model's values); keyword arguments win over both.
            stopping_criteria (`StoppingCriteria` or `StoppingCriteriaList`, *optional*), `stop_strings` (with
                `tokenizer=`), `max_time`: applied to the final left-to-right answer as it grows, token by token.
            streamer (`BaseStreamer`, *optional*): receives the prompt, then each piece of the answer as soon as
                every position before it is final (`put`); if it has `put_draft`, also the current drafts.
            kwargs: generation-config fields (stock ones and ReFusion's knobs: [`RefusionGenerationConfig`]
                documents both, from their declarations), `preset`, `tokenizer`, `attention_mask`.

        Returns:
            `torch.LongTensor` of shape `(batch_size * num_return_sequences, prompt_length + longest answer)`,
            `pad_token_id` after each row's end; or a [`RefusionGenerationOutput`] when
            `return_dict_in_generate=True`.
        """
        return refusion_generate(self, *args, **kwargs)

    generate.__signature__ = method_signature(GENERATE_SIGNATURE)

    @torch.no_grad()
    def generate_batch(self, *args, **kwargs):
        r"""
        Continuous batching with ReFusion decoding, behind transformers' `generate_batch` interface: `inputs` is a
        list of prompts (token id lists), the result `{"req_0": GenerationOutput, ...}` in input order
        (`generated_tokens`: the answer, up to and including its EOS). At most
        `continuous_batching_config.max_requests_per_batch` requests (default 16) decode at once in the ragged
        cache; as soon as one finishes, the next takes its place. Every request decodes as it would alone.
        Generation-config fields and keyword arguments mean what they mean in `generate()`; stopping criteria,
        `stop_strings` and `max_time` are refused (cut the answers afterwards), as are `record_timestamps`,
        `persistent_manager` and what the prompts list stands for (`input_ids`, `inputs_embeds`, `attention_mask`,
        `return_dict_in_generate`, `custom_generate`). `decoding="autoregressive"` runs transformers' own
        `generate_batch`.
        """
        return refusion_generate_batch(self, *args, **kwargs)

    generate_batch.__signature__ = method_signature(BATCH_SIGNATURE)
