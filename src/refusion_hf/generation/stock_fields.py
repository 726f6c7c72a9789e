"""How ReFusion decoding treats each stock `GenerationConfig` field, declared once per field in `STOCK_FIELDS`.

A `StockField` says whether ReFusion decoding honours the field (the whitelist, as transformers' DiffusionGemma
config keeps only the stock fields its decoding honours), leaves it inert (only read by decoding modes refused
anyway) or refuses it when set (with the reason), and which values it takes. Derived from it:
`generate_arguments.ARGUMENT_SUPPORT` (and the refusals), `HONOURED_FIELDS`, and the type and range checks that
`RefusionGenerationConfig.validate` runs on stock fields (`check_stock_types`, `stock_value_error`; stock
validation compares values, so a string or a list would reach it as a `TypeError`).

transformers does the rest: every field's meaning, default and its own `GenerationConfig.validate`; with
`decoding="autoregressive"` stock generate reads every field.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

from .._compat.transformers import stock_default_generation_params

HONOURED = "honoured"
INERT = "inert"  # only read by decoding modes ReFusion refuses anyway (beam search, assisted decoding, ...)
# Stock generate accepts negative special ids (transformers' own tests pass -1 for "never stop", "no padding"): the
# lowest id `decoding="autoregressive"` accepts. ReFusion decoding needs real ids (>= 0).
NEVER_ID = -1
_UNSET = object()


@dataclass(frozen=True)
class StockField:
    """A stock field: `support` (HONOURED, INERT or the reason it is refused when set to anything but None or its
    `neutral` value, stock's default unless given), the `kind` of value it takes (`int`, `float`, `bool`, or one
    of `TOKEN_ID`, `TOKEN_IDS`, `TOKEN_LIST`, `WORD_LISTS`, `STRINGS`; None: stock checks it) and its inclusive
    range (`low`, `high`)."""

    support: str
    kind: Any = None
    low: float | None = None
    high: float | None = None
    neutral: Any = _UNSET


TOKEN_ID = "a token id"  # an id >= 0 (>= NEVER_ID with decoding="autoregressive")
TOKEN_IDS = "a token id or a flat list of token ids"
TOKEN_LIST = "a list of token ids"  # ids >= 0
WORD_LISTS = "a non-empty list of non-empty lists of token ids"
STRINGS = "a string or a list of strings"
_BEAM_SEARCH = "beam search"
_OUT_OF_ORDER = "it depends on the tokens before each position, which out-of-order drafts do not have"
_AT_LENGTH = "it forces a token at a given sequence length, which out-of-order drafts do not have"
_PER_STEP = "ReFusion scores several positions per step, not one per token"
_NOT_THE_ANSWER = "its forwards score drafts, not the answer"
_HEALING = "it rewrites the prompt's last token, which ReFusion's cache has already committed"


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
    "num_beam_groups": StockField("group beam search"),
    "diversity_penalty": StockField("group beam search"),
    "constraints": StockField("constrained beam search"),
    "force_words_ids": StockField("constrained beam search"),
    "penalty_alpha": StockField("contrastive search"),
    "dola_layers": StockField("DoLa decoding"),
    "use_mtp": StockField("multi-token-prediction assisted decoding"),
    "prompt_lookup_num_tokens": StockField("prompt-lookup assisted decoding", int, 0),
    "assistant_early_exit": StockField("self-speculative assisted decoding"),
    "cache_implementation": StockField("ReFusion keeps its own ragged dynamic cache", neutral="dynamic"),
    "prefill_chunk_size": StockField("ReFusion prefills each prompt in its first forward"),
    "repetition_penalty": StockField(_OUT_OF_ORDER, float),
    "encoder_repetition_penalty": StockField("encoder-decoder models only"),
    "no_repeat_ngram_size": StockField(_OUT_OF_ORDER, int, 0),
    "encoder_no_repeat_ngram_size": StockField("encoder-decoder models only"),
    "forced_bos_token_id": StockField(_AT_LENGTH, TOKEN_ID),
    "forced_eos_token_id": StockField(_AT_LENGTH, TOKEN_ID),
    "exponential_decay_length_penalty": StockField("it depends on the current sequence length"),
    "token_healing": StockField(_HEALING, bool),
    "guidance_scale": StockField("classifier-free guidance needs a second, unconditional decode", float, neutral=1.0),
    "watermarking_config": StockField("watermarks are seeded by the previous token"),
    "use_cache": StockField("it reuses the KV cache of every committed token by design", bool, neutral=True),
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
_TYPED = tuple((name, field.kind) for name, field in STOCK_FIELDS.items() if field.kind is not None)
_RANGED = tuple((name, field.low, field.high) for name, field in STOCK_FIELDS.items() if field.low is not None)


def is_neutral(name: str, value) -> bool:
    """Whether `value` of the stock field `name` asks for nothing (None, or what stock generate does when unset)."""
    neutral = _NEUTRAL[name]
    return value is None or (neutral is not _UNSET and value == neutral)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_id(value, lowest: int) -> bool:
    return is_int(value) and value >= lowest


def _is_id_list(value, lowest: int = 0) -> bool:
    return isinstance(value, (list, tuple)) and all(_is_id(t, lowest) for t in value)


_HAS_KIND = {  # kind -> whether a value (not None) is one, given the lowest token id allowed
    int: lambda value, lowest: is_int(value),
    float: lambda value, lowest: is_number(value),
    bool: lambda value, lowest: isinstance(value, bool),
    TOKEN_ID: _is_id,
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
_EXPECTED = {int: "an integer", float: "a number", bool: "True or False", TOKEN_ID: "a token id (an integer >= {})"}


def check_stock_types(config: GenerationConfig, lowest: int) -> None:
    """`ValueError` naming the first stock field whose value (None always passes) is not of its declared kind;
    token ids are >= `lowest`, numbers are not NaN."""
    get = vars(config).get  # every field is an instance attribute (GenerationConfig.__init__ sets them all)
    for name, kind in _TYPED:
        value = get(name)
        if value is None:
            continue
        if not _HAS_KIND[kind](value, lowest):
            expected = _EXPECTED.get(kind, kind).format(lowest)
            raise ValueError(f"`{name}` must be {expected}, got {value!r}.")
        if kind is float and math.isnan(value):
            raise ValueError(f"`{name}` must be a number, not NaN, got {value!r}.")


def stock_value_error(config: GenerationConfig) -> str | None:
    """The `ValueError` message for the first stock field outside its declared range (ranges the stock warpers
    check only when they are built, and stock skips building some, e.g. top_p > 1); None when all are inside."""
    for name, low, high in _RANGED:
        value = getattr(config, name, None)
        if value is None:
            continue
        if high is not None and not low <= value <= high:
            return f"`{name}` must be in [{low}, {high}], got {value!r}."
        if value < low:
            return f"`{name}` must be >= {low}, got {value!r}."
    return None
