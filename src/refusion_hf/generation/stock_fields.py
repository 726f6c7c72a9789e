"""How a generate argument's value is checked, and how ReFusion decoding treats each stock field and argument.

`ArgumentValues` is the one check of a value, for ReFusion's knobs (`refusion_generation_config.DecodingKnob`) and
the stock fields alike: its kind, its range and its choices, refused with a `ValueError` that names the argument.
`StockField` declares, once per stock `GenerationConfig` field in `STOCK_FIELDS`, its `Support` (honoured: the
whitelist, as transformers' DiffusionGemma config keeps only the stock fields its decoding honours; inert: only read
by decoding modes refused anyway; or refused when set, with the reason) and its values. `STOCK_ARGUMENTS` and
`STOCK_BATCH_ARGUMENTS` declare stock `generate()`'s and `generate_batch()`'s own named arguments the same way, in
their order: the signatures of `generate` and `generate_batch` are derived from them (generate_arguments.py).
Derived too: `generate_arguments.ARGUMENT_SUPPORT` (and the refusals), `HONOURED_FIELDS`, and the type and range
checks `RefusionGenerationConfig.validate` runs (stock validation compares values, so a string or a list would reach
it as a `TypeError`).

transformers does the rest: every field's meaning, default and its own `GenerationConfig.validate`; with
`decoding="autoregressive"` stock generate reads every field.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .._compat.transformers import stock_default_generation_params

# Stock generate accepts negative special ids (transformers' own tests pass -1 for "never stop", "no padding"): the
# lowest id `decoding="autoregressive"` accepts. ReFusion decoding needs real ids (>= 0).
NEVER_ID = -1
_UNSET = object()


@dataclass(frozen=True)
class Support:
    """How ReFusion decoding treats a stock field or argument: `HONOURED`, `INERT` (only read by decoding modes
    ReFusion refuses anyway: beam search, assisted decoding, ...) or refused when set (`refused(reason)`). Its text
    is the tag, or the reason a refusal gives."""

    tag: str
    reason: str | None = None

    def __str__(self) -> str:
        return self.tag if self.reason is None else self.reason

    @property
    def is_refused(self) -> bool:
        return self.reason is not None


HONOURED = Support("honoured")
INERT = Support("inert")


def refused(reason: str) -> Support:
    return Support("refused", reason)


TOKEN_ID = "a token id"  # an id >= 0 (>= NEVER_ID with decoding="autoregressive")
TOKEN_IDS = "a token id or a flat list of token ids"
TOKEN_LIST = "a list of token ids"  # ids >= 0
WORD_LISTS = "a non-empty list of non-empty lists of token ids"
STRINGS = "a string or a list of strings"


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_id(value, lowest: int) -> bool:
    return is_int(value) and value >= lowest


def _is_id_list(value, lowest: int = 0) -> bool:
    return isinstance(value, (list, tuple)) and all(_is_id(t, lowest) for t in value)


_IS_COMPOUND = {  # a compound kind (its name is its description) -> whether a value (not None) is one
    TOKEN_IDS: lambda value, lowest: _is_id(value, lowest) or _is_id_list(value, lowest),
    TOKEN_LIST: lambda value, lowest: _is_id_list(value),
    WORD_LISTS: lambda value, lowest: (
        isinstance(value, (list, tuple)) and bool(value) and all(_is_id_list(w) and w for w in value)
    ),
    STRINGS: lambda value, lowest: (
        isinstance(value, str)
        or (isinstance(value, (list, tuple)) and bool(value) and all(isinstance(s, str) for s in value))
    ),
}


class ArgumentValues:
    """The values a generate argument takes, and the one check of them, for ReFusion's knobs and the stock fields:
    a declaration gives `value_kind` (`int`, `float`, `bool`, `str`, `TOKEN_ID` or a compound kind; None: any),
    `low` / `high` (inclusive; `low_open=True` excludes `low`) and `choices`. A knob's range is said with its kind
    ("an integer >= 1"), a stock field's without ("in [0.0, 1.0]": `range_names_kind` False), the words each
    refusal has always had."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] | None = None
    range_names_kind: bool = True

    @property
    def value_kind(self) -> Any:
        raise NotImplementedError

    def type_error(self, value, lowest_id: int = 0) -> str | None:
        """What a value of the right kind is, when `value` (not None) is not one: "an integer", "True or False"...
        Token ids are integers >= `lowest_id`; numbers are not NaN."""
        kind = self.value_kind
        if kind is TOKEN_ID:
            return None if _is_id(value, lowest_id) else f"a token id (an integer >= {lowest_id})"
        if self.choices is not None:
            return None if isinstance(value, str) else f"one of {self.choices}"
        if kind is bool:
            return None if isinstance(value, bool) else "True or False"
        if kind is int:
            return None if is_int(value) else "an integer"
        if kind is float:
            if not is_number(value):
                return "a number"
            return "a number, not NaN" if math.isnan(value) else None
        if kind is str:
            return None if isinstance(value, str) else "a string"
        if kind is None:
            return None
        return None if _IS_COMPOUND[kind](value, lowest_id) else kind

    def range_text(self) -> str | None:
        """The allowed range in words ("an integer >= 1", "a number in (0, 1]"), None when any value is allowed."""
        noun = ("an integer " if self.value_kind is int else "a number ") if self.range_names_kind else ""
        if self.low is not None and self.high is not None:
            return f"{noun}in {'(' if self.low_open else '['}{self.low}, {self.high}]"
        if self.low is not None:
            return f"{noun}{'>' if self.low_open else '>='} {self.low}"
        if self.high is not None:
            return f"{noun}<= {self.high}"
        return None

    def in_range(self, value) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return above and (self.high is None or value <= self.high)

    def range_error(self, name: str, value) -> str | None:
        """The `ValueError` message when `value` (of the right kind; None passes) is not among the choices or is
        outside the range."""
        if value is None:
            return None
        if self.choices is not None and value not in self.choices:
            return f"`{name}` must be one of {self.choices}, got {value!r}."
        if (self.low is not None or self.high is not None) and not self.in_range(value):
            return f"`{name}` must be {self.range_text()}, got {value!r}."
        return None


@dataclass(frozen=True)
class StockField(ArgumentValues):
    """A stock field: its `support`, the `kind` of value it takes (None: stock checks it), its inclusive range
    (`low`, `high`) and its `neutral` value (what asks for nothing besides None; stock's default unless given)."""

    support: Support
    kind: Any = None
    low: float | None = None
    high: float | None = None
    neutral: Any = _UNSET
    range_names_kind = False

    @property
    def value_kind(self) -> Any:
        return self.kind


@dataclass(frozen=True)
class StockArgument:
    """A named argument of stock `generate()` / `generate_batch()`: its `support` and its default."""

    support: Support
    default: Any = None


_BEAM_SEARCH = refused("beam search")
_OUT_OF_ORDER = refused("it depends on the tokens before each position, which out-of-order drafts do not have")
_AT_LENGTH = refused("it forces a token at a given sequence length, which out-of-order drafts do not have")
_PER_STEP = refused("ReFusion scores several positions per step, not one per token")
_NOT_THE_ANSWER = refused("its forwards score drafts, not the answer")
_GUIDANCE = refused("classifier-free guidance needs a second, unconditional decode")
_HEALING = refused("it rewrites the prompt's last token, which ReFusion's cache has already committed")


def _honoured(kind=None, low=None, high=None) -> StockField:
    return StockField(HONOURED, kind, low, high)


STOCK_FIELDS: dict[str, StockField] = {
    # The whitelist: the stock fields ReFusion decoding honours.
    "max_length": _honoured(int, 1), "max_new_tokens": _honoured(int), "min_length": _honoured(int, 0),
    "min_new_tokens": _honoured(int, 0), "max_time": _honoured(float, 0), "stop_strings": _honoured(STRINGS),
    "do_sample": _honoured(bool), "temperature": _honoured(float, 0), "top_k": _honoured(int, 0),
    "top_p": _honoured(float, 0.0, 1.0), "min_p": _honoured(float, 0.0, 1.0), "top_h": _honoured(float, 0.0, 1.0),
    "typical_p": _honoured(float, 0.0, 1.0), "epsilon_cutoff": _honoured(float, 0.0, 1.0),
    "eta_cutoff": _honoured(float, 0.0, 1.0), "bad_words_ids": _honoured(WORD_LISTS), "sequence_bias": _honoured(),
    "suppress_tokens": _honoured(TOKEN_LIST), "begin_suppress_tokens": _honoured(TOKEN_LIST),
    "renormalize_logits": _honoured(bool), "remove_invalid_values": _honoured(bool),
    "num_return_sequences": _honoured(int, 1), "return_dict_in_generate": _honoured(bool),
    "pad_token_id": _honoured(TOKEN_ID), "bos_token_id": _honoured(TOKEN_ID), "eos_token_id": _honoured(TOKEN_IDS),
    # Inert.
    **dict.fromkeys(
        (
            "early_stopping", "num_assistant_tokens", "num_assistant_tokens_schedule",
            "assistant_confidence_threshold", "max_matching_ngram_size", "assistant_lookbehind", "target_lookbehind",
            "assistant_ensemble_weight", "is_assistant", "speculation_type", "decoder_start_token_id",
            "compile_config", "disable_compile", "max_cache_len", "cache_config", "continuous_batching_config",
            "low_memory", "_from_model_config", "transformers_version",
        ),
        StockField(INERT),
    ),
    "length_penalty": StockField(INERT, float),
    # Refused when set, with the reason.
    "num_beams": StockField(_BEAM_SEARCH, int, 1),
    "num_beam_groups": StockField(refused("group beam search")),
    "diversity_penalty": StockField(refused("group beam search")),
    "constraints": StockField(refused("constrained beam search")),
    "force_words_ids": StockField(refused("constrained beam search")),
    "penalty_alpha": StockField(refused("contrastive search")),
    "dola_layers": StockField(refused("DoLa decoding")),
    "use_mtp": StockField(refused("multi-token-prediction assisted decoding")),
    "prompt_lookup_num_tokens": StockField(refused("prompt-lookup assisted decoding"), int, 0),
    "assistant_early_exit": StockField(refused("self-speculative assisted decoding")),
    "cache_implementation": StockField(refused("ReFusion keeps its own ragged dynamic cache"), neutral="dynamic"),
    "prefill_chunk_size": StockField(refused("ReFusion prefills each prompt in its first forward")),
    "repetition_penalty": StockField(_OUT_OF_ORDER, float),
    "encoder_repetition_penalty": StockField(refused("encoder-decoder models only")),
    "no_repeat_ngram_size": StockField(_OUT_OF_ORDER, int, 0),
    "encoder_no_repeat_ngram_size": StockField(refused("encoder-decoder models only")),
    "forced_bos_token_id": StockField(_AT_LENGTH, TOKEN_ID),
    "forced_eos_token_id": StockField(_AT_LENGTH, TOKEN_ID),
    "exponential_decay_length_penalty": StockField(refused("it depends on the current sequence length")),
    "token_healing": StockField(_HEALING, bool),
    "guidance_scale": StockField(_GUIDANCE, float, neutral=1.0),
    "watermarking_config": StockField(refused("watermarks are seeded by the previous token")),
    "use_cache": StockField(refused("it reuses the KV cache of every committed token by design"), bool, neutral=True),
    "output_attentions": StockField(_NOT_THE_ANSWER, bool, neutral=False),
    "output_hidden_states": StockField(_NOT_THE_ANSWER, bool, neutral=False),
    "output_scores": StockField(_PER_STEP, bool),
    "output_logits": StockField(_PER_STEP, bool),
}  # fmt: skip

HONOURED_FIELDS: tuple[str, ...] = tuple(name for name, field in STOCK_FIELDS.items() if field.support == HONOURED)
_STOCK_DEFAULTS = stock_default_generation_params()
_NEUTRAL = {  # each field's neutral value besides None, where it has one
    name: _STOCK_DEFAULTS.get(name, _UNSET) if field.neutral is _UNSET else field.neutral
    for name, field in STOCK_FIELDS.items()
}

# Stock `generate()`'s named arguments between `generation_config` and `custom_generate`, in its order.
STOCK_ARGUMENTS: dict[str, StockArgument] = {
    "logits_processor": StockArgument(refused(
        "custom processors may read the tokens before each position, which out-of-order drafts do not have"
    )),
    "stopping_criteria": StockArgument(HONOURED),
    "prefix_allowed_tokens_fn": StockArgument(refused("it reads the tokens before each position")),
    "synced_gpus": StockArgument(refused(
        "ranks decode in lock step only in stock decoding; ReFusion ranks finish independently"
    )),
    "assistant_model": StockArgument(refused("assisted decoding")),
    "streamer": StockArgument(HONOURED),
    "negative_prompt_ids": StockArgument(refused("classifier-free guidance")),
    "negative_prompt_attention_mask": StockArgument(refused("classifier-free guidance")),
}  # fmt: skip
# Stock `generate_batch()`'s named arguments after `generation_config`, in its order.
STOCK_BATCH_ARGUMENTS: dict[str, StockArgument] = {
    "continuous_batching_config": StockArgument(HONOURED),  # `max_requests_per_batch` only (generate_batch.py)
    "record_timestamps": StockArgument(refused("tokens are committed out of order"), False),
    "progress_bar": StockArgument(HONOURED, False),
    "persistent_manager": StockArgument(refused("there is no background manager"), False),
    "warmup": StockArgument(INERT, True),  # no CUDA graphs are captured
}


def is_neutral(name: str, value) -> bool:
    """Whether `value` of the stock field `name` asks for nothing (None, or what stock generate does when unset)."""
    neutral = _NEUTRAL[name]
    return value is None or (neutral is not _UNSET and value == neutral)
