"""`RefusionGenerationMixin.generate()`: ReFusion decoding behind Hugging Face's `generate()` conventions.

Argument handling (generation config + keyword overrides, left-padded batches, streamers, dict outputs) lives
here; the algorithm lives in `refusion_decoder.py`. `decoding="autoregressive"` hands the call to the stock
`GenerationMixin.generate` with the same weights.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig

from .refusion_decoder import DecodingSettings, SequenceDecoder, decode_batch
from .refusion_generation_config import (
    DEFAULT_MAX_NEW_TOKENS,
    REFUSION_FIELDS,
    RefusionGenerationConfig,
    RefusionGenerationOutput,
)


class RefusionGenerationMixin:
    """Adds ReFusion's plan-and-infill decoding as `generate()`; place it before the transformers base class."""

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.LongTensor | None = None,
        generation_config=None,
        logits_processor=None,
        stopping_criteria=None,
        prefix_allowed_tokens_fn=None,
        synced_gpus=None,
        assistant_model=None,
        streamer=None,
        **kwargs,
    ):
        r"""
        Generate with ReFusion's slot-level plan-and-infill decoding (or, with `decoding="autoregressive"`,
        ordinary left-to-right decoding with the same weights). The signature is `GenerationMixin.generate`'s.

        Args:
            inputs / input_ids (`torch.LongTensor` of shape `(batch_size, prompt_length)`): prompts, left-padded.
            attention_mask (`torch.LongTensor` of the same shape, *optional*): 1 for prompt tokens, 0 for left
                padding. Right padding is rejected.
            generation_config (`GenerationConfig`, *optional*): base parameters; defaults to the model's.
            streamer (`BaseStreamer`, *optional*): receives the prompt, then each piece of the answer as soon as
                every position before it is final (`put`); if it has `put_draft`, also the current drafts.
            logits_processor, stopping_criteria, prefix_allowed_tokens_fn, synced_gpus, assistant_model:
                autoregressive decoding only (`decoding="autoregressive"`).
            kwargs: overrides of generation-config fields: `max_new_tokens`, `slot_size`, `block_size`,
                `slot_threshold`, `token_threshold`, `plan_ahead`, `temperature`, `mask_token_id`, `eos_token_id`,
                `pad_token_id`, `return_dict_in_generate`, `decoding`.

        Returns:
            `torch.LongTensor` of shape `(batch_size, prompt_length + max_new_tokens)`, or a
            [`RefusionGenerationOutput`] when `return_dict_in_generate=True`.
        """
        config, unused = self._prepare_refusion_generation_config(generation_config, kwargs)
        autoregressive_only = dict(
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
            synced_gpus=synced_gpus,
            assistant_model=assistant_model,
        )
        if config.decoding == "autoregressive":
            return super().generate(
                inputs,
                generation_config=self._autoregressive_config(config),
                streamer=streamer,
                **autoregressive_only,
                **unused,
            )
        input_ids = unused.pop("input_ids", None) if inputs is None else inputs
        attention_mask = unused.pop("attention_mask", None)
        given = sorted(name for name, value in autoregressive_only.items() if value is not None)
        if given:
            raise ValueError(
                f"{given} only apply to autoregressive decoding; pass `decoding='autoregressive'` to use them."
            )
        if unused:
            raise ValueError(
                f"generate() got arguments it does not use with ReFusion decoding: {sorted(unused)}. Decoding "
                f"knobs are {sorted(REFUSION_FIELDS)} plus `max_new_tokens`, `temperature`, `eos_token_id`, "
                "`pad_token_id`, `return_dict_in_generate`."
            )
        prompts, settings, pad_token_id = self._prepare_refusion_inputs(input_ids, attention_mask, config)
        if streamer is not None and len(prompts) > 1:
            raise ValueError(
                f"`streamer` follows one sequence, but `input_ids` has {len(prompts)} rows: stream batch-1 calls."
            )
        if streamer is not None:
            streamer.put(input_ids.cpu())
        stream = _StreamForwarder(streamer) if streamer is not None else None
        result = decode_batch(
            self, prompts, settings, pad_token_id, on_step=stream.on_step if stream is not None else None
        )
        if stream is not None:
            stream.finish()
        sequences = torch.cat([input_ids, result.tokens], dim=1)
        if not config.return_dict_in_generate:
            return sequences
        lengths = torch.tensor(result.answer_lengths, dtype=torch.float32)
        passes = torch.tensor(result.forward_passes_per_row, dtype=torch.float32)
        return RefusionGenerationOutput(
            sequences=sequences,
            num_forward_passes=result.num_forward_passes,
            tokens_per_forward=lengths / passes,
            commit_step=result.commit_step,
            chosen_slots=result.chosen_slots,
        )

    # ------------------------------------------------------------------------------------- preparation
    def _prepare_refusion_generation_config(self, generation_config, kwargs):
        base = generation_config if generation_config is not None else self.generation_config
        config = copy.deepcopy(RefusionGenerationConfig.from_generation_config(base))
        unused = config.update(**kwargs)
        model_config = self.config
        if config.mask_token_id is None:
            config.mask_token_id = getattr(model_config, "mask_token_id", None)
        if config.eos_token_id is None:
            config.eos_token_id = model_config.eos_token_id
        if config.pad_token_id is None:
            config.pad_token_id = model_config.pad_token_id
        return config, unused

    def _prepare_refusion_inputs(self, input_ids, attention_mask, config):
        if input_ids is None or not torch.is_tensor(input_ids) or input_ids.dim() != 2:
            raise ValueError("`input_ids` must be a 2-D LongTensor of shape (batch_size, prompt_length).")
        batch_size, width = input_ids.shape
        if batch_size == 0:
            raise ValueError("`input_ids` is an empty batch: pass at least one prompt.")
        if width == 0:
            raise ValueError("`input_ids` has no tokens: ReFusion needs a prompt of at least one token.")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        elif attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"`attention_mask` has shape {tuple(attention_mask.shape)} but `input_ids` has "
                f"{tuple(input_ids.shape)}; they must match."
            )
        attention_mask = attention_mask.bool()
        if (attention_mask[:, 1:] < attention_mask[:, :-1]).any():
            raise ValueError(
                "`attention_mask` shows right padding (a 0 after a 1); ReFusion generation needs left padding: "
                "set `tokenizer.padding_side = 'left'`."
            )
        lengths = attention_mask.sum(1)
        if (lengths == 0).any():
            raise ValueError("A row of `attention_mask` is all zeros: every prompt needs at least one token.")

        mask_token_id = config.mask_token_id
        if mask_token_id is None:
            self.config.require_mask_token_id("ReFusion decoding")
        eos = config.eos_token_id
        if eos is None or eos == []:
            raise ValueError(
                "ReFusion decoding needs an EOS token: pass `eos_token_id=` or set `generation_config.eos_token_id`."
            )
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
        pad_token_id = config.pad_token_id if config.pad_token_id is not None else eos_ids[0]
        if (input_ids[attention_mask] == mask_token_id).any():
            raise ValueError(
                f"`input_ids` contains the mask token (id {mask_token_id}); prompts must not contain `<|mask|>`."
            )

        max_new_tokens = config.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = (config.max_length - width) if config.max_length is not None else DEFAULT_MAX_NEW_TOKENS
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be an integer >= 1, got {max_new_tokens!r}.")
        slot_size = config.slot_size
        canvas_length = -(-max_new_tokens // slot_size) * slot_size
        block_size = config.block_size if config.block_size is not None else canvas_length
        if block_size > canvas_length:
            block_size = canvas_length  # one block; a larger block size means the same thing
        temperature = float(config.temperature or 0.0)
        settings = DecodingSettings(
            max_new_tokens=max_new_tokens,
            slot_size=slot_size,
            block_size=block_size,
            slot_threshold=float(config.slot_threshold),
            token_threshold=float(config.token_threshold),
            temperature=temperature,
            mask_token_id=int(mask_token_id),
            eos_token_ids=eos_ids,
            plan_ahead=config.plan_ahead,
        )
        limit = getattr(self.config, "max_position_embeddings", None)
        longest = int(lengths.max()) + canvas_length
        if limit is not None and longest > limit:
            raise ValueError(
                f"The longest prompt ({int(lengths.max())} tokens) plus the canvas ({canvas_length} = "
                f"`max_new_tokens` {max_new_tokens} rounded up to a multiple of `slot_size` {slot_size}) needs "
                f"{longest} positions, more than `max_position_embeddings` ({limit}): lower `max_new_tokens`."
            )
        prompts = [row[mask] for row, mask in zip(input_ids, attention_mask)]
        return prompts, settings, pad_token_id

    @staticmethod
    def _autoregressive_config(config: RefusionGenerationConfig) -> GenerationConfig:
        """The baseline's config: a plain `GenerationConfig` (stock generate must not see ReFusion knobs);
        `temperature > 0` means sampling there too, 0 means greedy."""
        plain = GenerationConfig.from_dict(
            {key: value for key, value in config.to_dict().items() if key not in REFUSION_FIELDS}
        )
        if plain.temperature:
            plain.do_sample = True if plain.do_sample is None else plain.do_sample
        else:
            plain.temperature, plain.do_sample = None, False
        if plain.max_new_tokens is None and plain.max_length is None:
            plain.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        return plain


class _StreamForwarder:
    """Feeds a (batch-1) streamer: final tokens via `put` as the left-to-right prefix grows; drafts via
    `put_draft` when the streamer has it."""

    def __init__(self, streamer):
        self.streamer = streamer
        self.sent = 0
        self.takes_drafts = callable(getattr(streamer, "put_draft", None))

    def on_step(self, sequences: list[SequenceDecoder]) -> None:
        sequence = sequences[0]
        ready = sequence.finished_prefix
        if ready > self.sent:
            self.streamer.put(sequence.canvas[self.sent : ready].cpu())
            self.sent = ready
        if self.takes_drafts and sequence.chosen is not None:
            self.streamer.put_draft(sequence.draft_view()[self.sent :].cpu())

    def finish(self) -> None:
        self.streamer.end()
