"""`RefusionGenerationConfig` (the decoding knobs) and `RefusionGenerationOutput` (what `generate` returns).

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.utils import ModelOutput

DECODING_MODES = ("refusion", "autoregressive")

# The ReFusion-specific fields, their defaults, and what they mean. Defaults follow the authors' GSM8K /
# HumanEval / MBPP evaluation settings (slot size 32, slot threshold 0.9, token threshold 0.4); the serial
# block size defaults to the whole canvas. A checkpoint's generation_config.json overrides them.
REFUSION_FIELDS: dict[str, Any] = {
    "decoding": "refusion",
    "slot_size": 32,
    "block_size": None,
    "slot_threshold": 0.9,
    "token_threshold": 0.4,
    "mask_token_id": None,
    "plan_ahead": True,
}

DEFAULT_MAX_NEW_TOKENS = 512


class RefusionGenerationConfig(GenerationConfig):
    r"""
    A [`GenerationConfig`] with the parameters of ReFusion's plan-and-infill decoding. Every stock field keeps
    its meaning; these are added:

    decoding (`str`, defaults to `"refusion"`):
        `"refusion"` for slot-parallel decoding, `"autoregressive"` for ordinary left-to-right decoding with the
        same weights (the baseline to compare against).
    slot_size (`int`, defaults to 32):
        k, the number of consecutive tokens in a slot. The canvas of `max_new_tokens` is rounded up to a multiple
        of k internally; positions past `max_new_tokens` are never returned.
    block_size (`int`, *optional*):
        Tokens per serial block (a positive multiple of `slot_size`). Blocks are decoded left to right; slots
        inside a block in any order. `None` means one block covering the whole canvas.
    slot_threshold (`float`, defaults to 0.9):
        A slot is chosen in a step when the probability of its first drafted token exceeds this; when none
        does, the single most confident slot is chosen. Values above 1 force one slot per step.
    token_threshold (`float`, defaults to 0.4):
        A drafted token is accepted when its autoregressive probability exceeds this. 0 accepts every draft,
        values above 1 accept only the tokens that are always accepted (one per round).
    mask_token_id (`int`, *optional*):
        Id of `<|mask|>`; taken from the model config when unset.
    plan_ahead (`bool`, defaults to `True`):
        When every draft of the current step was drafted above `token_threshold`, run the next step's plan inside
        the forward that verifies the current step, and use it if that step commits everything it verified
        (otherwise it is discarded). Same tokens (up to float rounding), fewer forward passes; `False` runs every
        plan as a forward of its own, as the authors' decoder does.

    `temperature` 0 (or unset) is greedy; above 0, drafts are drawn by Gumbel-max sampling at that temperature
    (reproducible with `torch.manual_seed`).
    """

    def __init__(self, **kwargs):
        for name, default in REFUSION_FIELDS.items():
            setattr(self, name, kwargs.pop(name, default))
        super().__init__(**kwargs)

    @classmethod
    def from_generation_config(cls, config: GenerationConfig) -> RefusionGenerationConfig:
        """Upcast a plain `GenerationConfig` (as transformers reloads generation_config.json) keeping every value."""
        if isinstance(config, cls):
            return config
        upcast = cls.from_dict(config.to_dict())
        upcast._original_object_hash = getattr(config, "_original_object_hash", None)
        return upcast

    def to_dict(self) -> dict[str, Any]:
        # A stock `GenerationConfig` reading a file marked `_from_model_config: true` ignores every field it does
        # not know, i.e. all of ours: never write that marker, so generation_config.json reloads completely.
        config_dict = super().to_dict()
        config_dict.pop("_from_model_config", None)
        return config_dict

    @classmethod
    def from_model_config(cls, model_config) -> RefusionGenerationConfig:
        # The stock implementation compares every field with a plain `GenerationConfig()`, which lacks ours.
        upcast = cls.from_generation_config(GenerationConfig.from_model_config(model_config))
        upcast._original_object_hash = hash(upcast)
        return upcast

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None):
        # `temperature` drives ReFusion's own Gumbel-max drafting (0 = greedy), independently of `do_sample`:
        # the stock "temperature without do_sample" check does not apply to it.
        temperature, self.temperature = self.temperature, None
        try:
            super().validate(strict=strict, user_set_attributes=user_set_attributes)
        finally:
            self.temperature = temperature
        if self.decoding not in DECODING_MODES:
            raise ValueError(f"`decoding` must be one of {DECODING_MODES}, got {self.decoding!r}.")
        if not _is_int(self.slot_size) or self.slot_size < 1:
            raise ValueError(f"`slot_size` must be an integer >= 1 (tokens per slot), got {self.slot_size!r}.")
        if self.block_size is not None and (
            not _is_int(self.block_size) or self.block_size < 1 or self.block_size % self.slot_size
        ):
            raise ValueError(
                f"`block_size` must be a positive multiple of `slot_size` ({self.slot_size}), got "
                f"{self.block_size!r}; use None for a single block over the whole canvas."
            )
        for name in ("slot_threshold", "token_threshold"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value < 0:
                raise ValueError(
                    f"`{name}` must be a number >= 0 (values above 1 are allowed and mean 'never'), got {value!r}."
                )
        if not isinstance(self.plan_ahead, bool):
            raise ValueError(f"`plan_ahead` must be True or False, got {self.plan_ahead!r}.")
        if self.temperature is not None and (math.isnan(self.temperature) or self.temperature < 0):
            raise ValueError(f"`temperature` must be >= 0 (0 is greedy), got {self.temperature!r}.")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class RefusionGenerationOutput(ModelOutput):
    """
    What `generate(..., return_dict_in_generate=True)` returns with ReFusion decoding.

    sequences (`torch.LongTensor` of shape `(batch_size, prompt_length + max_new_tokens)`):
        The prompts as given, then the generated tokens in their original order, `pad_token_id` after EOS.
    num_forward_passes (`int`):
        Model forward calls made by this `generate` call (one call serves every row of the batch).
    tokens_per_forward (`torch.FloatTensor` of shape `(batch_size,)`):
        Generated tokens of each row (up to and including EOS) divided by the forward passes it took part in.
    commit_step (`torch.LongTensor` of shape `(batch_size, max_new_tokens)`):
        For each generated position, the decoding step (planning iteration, from 0) that committed it; -1 for
        positions after the end of the answer.
    chosen_slots (`list[list[list[int]]]`):
        For each row and each step, the start offsets (relative to the first generated position) of the slots
        chosen by that step's plan.
    """

    sequences: torch.LongTensor | None = None
    num_forward_passes: int | None = None
    tokens_per_forward: torch.FloatTensor | None = None
    commit_step: torch.LongTensor | None = None
    chosen_slots: list | None = None
