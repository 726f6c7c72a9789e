# Generated from refusion_hf.generation.refusion_generation_config by refusion_hf.modeling.remote_code (save_pretrained writes it; `make embedded-bundle` refreshes the embedded model's copy): edit the source, not this file.
"""`RefusionGenerationConfig` (the decoding knobs) and `RefusionGenerationOutput` (what `generate` returns).

transformers' `GenerationConfig` does the rest: every stock field, `update`, saving and loading, its own
validation (which runs after the type checks added here) and its default values (`_get_default_generation_params`,
extended here with ReFusion's).

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from transformers import GenerationConfig
from transformers.utils import ModelOutput

DECODING_MODES = ("refusion", "autoregressive")

# The values ReFusion fields take when neither the call, nor the passed config, nor the model's generation config
# sets them (the way `GenerationConfig._get_default_generation_params` fills stock fields). They follow the
# authors' GSM8K / HumanEval / MBPP evaluation settings (slot 32, thresholds 0.9 / 0.4). A checkpoint's
# generation_config.json overrides them.
REFUSION_FIELDS: dict[str, Any] = {
    "decoding": "refusion",
    "slot_size": 32,
    "block_size": None,  # unset: DEFAULT_BLOCK_SIZE rounded up to a multiple of slot_size
    "slot_threshold": 0.9,
    "token_threshold": 0.4,
    "mask_token_id": None,
    "plan_ahead": True,
}
# The knobs a user tunes (what presets set, CLIs expose and reports record); `decoding` picks the method and
# `mask_token_id` comes from the checkpoint.
DECODING_KNOBS: tuple[str, ...] = tuple(name for name in REFUSION_FIELDS if name not in ("decoding", "mask_token_id"))

# The authors' per-task evaluation settings (their eval.sh: generation length 512, the canvas cut into N serial
# blocks, so block_size = 512 / N). `generate(..., preset=NAME)`, `RefusionGenerationConfig.from_preset(NAME)`,
# `refusion eval --preset`, `refusion lm-eval --model refusion --model_args preset=NAME`.
DECODING_PRESETS: dict[str, dict[str, Any]] = {
    "gsm8k_cot": dict(slot_size=32, block_size=128, slot_threshold=0.9, token_threshold=0.4),
    "mbpp": dict(slot_size=32, block_size=128, slot_threshold=0.9, token_threshold=0.3),
    "humaneval_instruct_noprefix": dict(slot_size=32, block_size=128, slot_threshold=0.9, token_threshold=0.4),
    "minerva_math": dict(slot_size=32, block_size=64, slot_threshold=0.8, token_threshold=0.6),
    "mmlu_pro": dict(slot_size=16, block_size=128, slot_threshold=0.9, token_threshold=0.4),
    "gpqa_main_generative_n_shot": dict(slot_size=8, block_size=16, slot_threshold=0.8, token_threshold=0.2),
    "arc_challenge_chat": dict(slot_size=8, block_size=8, slot_threshold=0.8, token_threshold=0.1),
}
PRESET_MAX_NEW_TOKENS = 512  # the authors' generation length for every preset


def preset_settings(name: str) -> dict[str, Any]:
    """The decoding knobs of a preset (with its generation length), or a `ValueError` listing the presets."""
    if name not in DECODING_PRESETS:
        raise ValueError(f"`preset` must be one of {sorted(DECODING_PRESETS)}, got {name!r}.")
    return {**DECODING_PRESETS[name], "max_new_tokens": PRESET_MAX_NEW_TOKENS}


# Tokens per serial block when `block_size` is unset: inside the 32-128 range the paper reports as robust
# (appendix C.7), and fixed, so a step's cost does not grow with `max_new_tokens`.
DEFAULT_BLOCK_SIZE = 128


class RefusionGenerationConfig(GenerationConfig):
    r"""
    A [`GenerationConfig`] with the parameters of ReFusion's plan-and-infill decoding. Every stock field keeps
    its meaning (docs/generate_arguments.md says how ReFusion decoding honours each one); these are added, and like
    stock fields they are `None` (unset) until the call, the passed config, the model's generation config or the
    defaults (`REFUSION_FIELDS`) give them a value:

    decoding (`str`, defaults to `"refusion"`):
        `"refusion"` for slot-parallel decoding, `"autoregressive"` for transformers' own left-to-right decoding with
        the same weights (the baseline to compare against; every stock argument then has its stock meaning).
    slot_size (`int`, defaults to 32):
        k, the number of consecutive tokens in a slot. The canvas of `max_new_tokens` is rounded up to a multiple
        of k internally; positions past `max_new_tokens` are never returned.
    block_size (`int`, *optional*):
        Tokens per serial block (a positive multiple of `slot_size`). Blocks are decoded left to right; slots
        inside a block in any order. Unset: 128 rounded up to a multiple of `slot_size` (at most the canvas).
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

    Sampling follows stock semantics: `do_sample=True` draws every draft (plan and infill) from the distribution
    shaped by transformers' logits warpers (`temperature`, `top_k`, `top_p`, `min_p`, ...); `do_sample=False` is
    greedy whatever `temperature` says. Confidences (slot scores, verification) are always the model's own
    probabilities after the hard constraints (`suppress_tokens`, `bad_words_ids`, `min_new_tokens`, ...).
    """

    def __init__(self, **kwargs):
        self.decoding: str | None = kwargs.pop("decoding", None)
        self.slot_size: int | None = kwargs.pop("slot_size", None)
        self.block_size: int | None = kwargs.pop("block_size", None)
        self.slot_threshold: float | None = kwargs.pop("slot_threshold", None)
        self.token_threshold: float | None = kwargs.pop("token_threshold", None)
        self.mask_token_id: int | None = kwargs.pop("mask_token_id", None)
        self.plan_ahead: bool | None = kwargs.pop("plan_ahead", None)
        super().__init__(**kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> RefusionGenerationConfig:
        """A config with the authors' settings for a task (`DECODING_PRESETS`); keyword arguments override them."""
        return cls(**{**preset_settings(name), **overrides})

    @staticmethod
    def _get_default_generation_params() -> dict[str, Any]:
        defaults = GenerationConfig._get_default_generation_params()
        defaults.update({name: value for name, value in REFUSION_FIELDS.items() if value is not None})
        return defaults

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
        # Types first: stock validation compares values and would raise `TypeError` on a string or a list.
        check_argument_types(self)
        super().validate(strict=strict, user_set_attributes=user_set_attributes)
        if self.decoding is not None and self.decoding not in DECODING_MODES:
            raise ValueError(f"`decoding` must be one of {DECODING_MODES}, got {self.decoding!r}.")
        if self.slot_size is not None and self.slot_size < 1:
            raise ValueError(f"`slot_size` must be an integer >= 1 (tokens per slot), got {self.slot_size!r}.")
        if self.block_size is not None and (self.block_size < 1 or self.block_size % (self.slot_size or 1)):
            raise ValueError(
                f"`block_size` must be a positive multiple of `slot_size` ({self.slot_size}), got "
                f"{self.block_size!r}; leave it unset (None) for the default."
            )
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"`temperature` must be >= 0, got {self.temperature!r}.")
        if self.do_sample and self.temperature is not None and 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            raise ValueError(
                f"`temperature` {self.temperature!r} is too small to sample at (the scaled logits overflow); pass "
                "`do_sample=False` for greedy decoding, the limit of sampling as the temperature goes to 0."
            )
        # Ranges the stock warpers check only when they are built (and stock skips building some, e.g. top_p > 1).
        for name, low, high in _PROBABILITY_FIELDS:
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise ValueError(f"`{name}` must be in [{low}, {high}], got {value!r}.")
        for name, low in _LOWER_BOUNDS.items():
            if getattr(self, name, None) is not None and getattr(self, name) < low:
                raise ValueError(f"`{name}` must be >= {low}, got {getattr(self, name)!r}.")
        for name in ("slot_threshold", "token_threshold"):
            value = getattr(self, name)
            if value is not None and (math.isnan(value) or value < 0):
                raise ValueError(
                    f"`{name}` must be a number >= 0 (values above 1 are allowed and mean 'never'), got {value!r}."
                )


class FieldDoc(NamedTuple):
    type: str  # as the docstring writes it: "int", "float", "bool", "str"
    text: str


def documented_fields(config_class: type = RefusionGenerationConfig) -> dict[str, FieldDoc]:
    """Each field documented in `config_class`'s docstring (transformers' `name (`type`, ...):` entries, the text
    indented below, joined into one line): the model card and the commands' flags are built from it, so every knob
    is typed and explained once, in the class."""
    fields: dict[str, tuple[str, list[str]]] = {}
    name = None
    for line in inspect.cleandoc(config_class.__doc__ or "").splitlines():
        header = re.fullmatch(r"(\w+) \(`(\w+)`.*\):", line)
        if header:
            name = header.group(1)
            fields[name] = (header.group(2), [])
        elif name is not None and line.startswith(" "):
            fields[name][1].append(line.strip())
        else:
            name = None
    return {name: FieldDoc(kind, " ".join(lines)) for name, (kind, lines) in fields.items()}


def sampling_arguments(temperature: float | None) -> dict[str, Any]:
    """The command-line convention for `--temperature T` in `generate()` terms: T > 0 samples at T
    (`do_sample=True`), 0 is greedy, None leaves the model's generation config in charge."""
    if temperature is None:
        return {}
    return {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}


# ------------------------------------------------------------------------------------------- argument types
# Stock validation checks values, not types: `temperature='1'` or `max_new_tokens=True` would reach a comparison
# (TypeError) or be taken as 1. Every field that ReFusion decoding or these checks read is typed here.
_INTEGER_FIELDS = (
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "top_k", "num_return_sequences", "num_beams",
    "no_repeat_ngram_size", "slot_size", "block_size", "prompt_lookup_num_tokens",
)  # fmt: skip
_NUMBER_FIELDS = (
    "temperature", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
    "max_time", "slot_threshold", "token_threshold", "guidance_scale", "length_penalty",
)  # fmt: skip
_BOOLEAN_FIELDS = (
    "do_sample", "plan_ahead", "return_dict_in_generate", "use_cache", "output_scores", "output_logits",
    "output_attentions", "output_hidden_states", "remove_invalid_values", "renormalize_logits", "token_healing",
)  # fmt: skip
_TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "mask_token_id", "forced_bos_token_id", "forced_eos_token_id")
_TOKEN_LIST_FIELDS = ("suppress_tokens", "begin_suppress_tokens")
MIN_SAMPLING_TEMPERATURE = 1e-4
# Stock generate accepts negative special ids (transformers' own tests pass -1 for "never stop", "no padding"): the
# lowest id `decoding="autoregressive"` accepts. ReFusion decoding needs real ids (>= 0).
NEVER_ID = -1

# Lower bounds that stock validation leaves unchecked (a negative count reaches a tensor op as a RuntimeError).
_LOWER_BOUNDS = {
    "top_k": 0, "max_time": 0, "num_return_sequences": 1, "num_beams": 1, "max_length": 1, "min_length": 0,
    "min_new_tokens": 0, "no_repeat_ngram_size": 0, "prompt_lookup_num_tokens": 0,
}  # fmt: skip
_PROBABILITY_FIELDS = (
    ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0), ("top_h", 0.0, 1.0), ("typical_p", 0.0, 1.0),
    ("epsilon_cutoff", 0.0, 1.0), ("eta_cutoff", 0.0, 1.0),
)  # fmt: skip


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_argument_types(config: GenerationConfig) -> None:
    """`ValueError` naming the first field whose value has the wrong type (None always passes). Token ids are
    integers >= 0; with `decoding="autoregressive"` special ids may be negative, as stock generate allows."""

    def fail(name, expected):
        raise ValueError(f"`{name}` must be {expected}, got {getattr(config, name)!r}.")

    def get(name):
        return getattr(config, name, None)

    lowest = NEVER_ID if get("decoding") == "autoregressive" else 0

    for name in _INTEGER_FIELDS:
        if get(name) is not None and not _is_int(get(name)):
            fail(name, "an integer")
    for name in _NUMBER_FIELDS:
        if get(name) is not None and not _is_number(get(name)):
            fail(name, "a number")
    for name in _BOOLEAN_FIELDS:
        if get(name) is not None and not isinstance(get(name), bool):
            fail(name, "True or False")
    for name in _TOKEN_ID_FIELDS:
        if get(name) is not None and not (_is_int(get(name)) and get(name) >= lowest):
            fail(name, f"a token id (an integer >= {lowest})")
    eos = get("eos_token_id")
    if eos is not None and not (
        (_is_int(eos) and eos >= lowest)
        or (isinstance(eos, (list, tuple)) and all(_is_int(e) and e >= lowest for e in eos))
    ):
        fail("eos_token_id", "a token id or a flat list of token ids")
    for name in _TOKEN_LIST_FIELDS:
        value = get(name)
        if value is not None and not (isinstance(value, (list, tuple)) and all(_is_int(t) and t >= 0 for t in value)):
            fail(name, "a list of token ids")
    bad_words = get("bad_words_ids")
    if bad_words is not None and not (
        isinstance(bad_words, (list, tuple))
        and bad_words
        and all(
            isinstance(word, (list, tuple)) and word and all(_is_int(t) and t >= 0 for t in word) for word in bad_words
        )
    ):
        fail("bad_words_ids", "a non-empty list of non-empty lists of token ids")
    stops = get("stop_strings")
    if stops is not None and not (
        isinstance(stops, str)
        or (isinstance(stops, (list, tuple)) and stops and all(isinstance(s, str) for s in stops))
    ):
        fail("stop_strings", "a string or a list of strings")
    if get("decoding") is not None and not isinstance(get("decoding"), str):
        fail("decoding", f"one of {DECODING_MODES}")
    for name in ("temperature", "top_p", "min_p", "typical_p", "max_time", "slot_threshold", "token_threshold"):
        if get(name) is not None and math.isnan(get(name)):
            fail(name, "a number, not NaN")


@dataclass
class RefusionGenerationOutput(ModelOutput):
    """
    What `generate(..., return_dict_in_generate=True)` returns with ReFusion decoding.

    sequences (`torch.LongTensor` of shape `(batch_size * num_return_sequences, prompt_length + answer_length)`):
        The prompts as given, then the generated tokens in their original order, `pad_token_id` after each row's
        end; as wide as the longest answer in the batch (like stock `generate` when every row ends early).
    num_forward_passes (`int`):
        Model forward calls made by this `generate` call (one call serves every row of the batch).
    tokens_per_forward (`torch.FloatTensor` of shape `(batch_size,)`):
        Generated tokens of each row (up to and including its end) divided by the forward passes it took part in.
    answer_lengths (`torch.LongTensor` of shape `(batch_size,)`):
        Generated tokens of each row, up to and including its end (EOS, a stopping criterion's cut or the limit).
    forward_passes_per_row (`torch.LongTensor` of shape `(batch_size,)`):
        The forward passes each row took part in (a row leaves the batch when its answer is decoded).
    commit_step (`torch.LongTensor` of shape `(batch_size, answer_length)`):
        For each generated position, the decoding step (planning iteration, from 0) that committed it; -1 for
        positions after the end of the row's answer.
    chosen_slots (`list[list[list[int]]]`):
        For each row and each step, the start offsets (relative to the first generated position) of the slots
        chosen by that step's plan.
    """

    sequences: torch.LongTensor | None = None
    num_forward_passes: int | None = None
    tokens_per_forward: torch.FloatTensor | None = None
    answer_lengths: torch.LongTensor | None = None
    forward_passes_per_row: torch.LongTensor | None = None
    commit_step: torch.LongTensor | None = None
    chosen_slots: list | None = None
