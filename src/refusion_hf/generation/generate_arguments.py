"""Which stock `generate()` arguments ReFusion decoding honours, its signatures, and the checks every call's inputs
pass first.

`ARGUMENT_SUPPORT` classifies every `GenerationConfig` field (honoured, inert, or refused with the reason), from
its declaration in `stock_fields.STOCK_FIELDS`; `refuse_unsupported` raises the `ValueError` naming the first
argument set to anything it cannot honour, stock generate's named arguments included (`stock_fields.STOCK_ARGUMENTS`,
from which `GENERATE_SIGNATURE`, the signature of `generate()`, is derived; `BATCH_SIGNATURE` likewise for
`generate_batch()`). The input checks turn what stock `generate` would meet as a
`TypeError` / `IndexError` deep in a forward into a `ValueError` naming the argument. transformers does the rest:
its own `GenerationConfig.validate` and `GenerationMixin`'s preparation (refusion_generate.py calls them).

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import inspect

import torch
from transformers import GenerationConfig, StopStringCriteria

from .refusion_generation_config import REFUSION_FIELDS, RefusionGenerationConfig
from .stock_fields import HONOURED, INERT, NEVER_ID, STOCK_ARGUMENTS, STOCK_BATCH_ARGUMENTS, STOCK_FIELDS, is_neutral

# How ReFusion decoding treats every stock `GenerationConfig` field (HONOURED, INERT, or the reason it is refused
# when set to anything but its neutral value), from its declaration in `STOCK_FIELDS`.
ARGUMENT_SUPPORT: dict[str, str] = {name: field.support for name, field in STOCK_FIELDS.items()}
REFUSE_SUFFIX = "pass `decoding='autoregressive'` to use it with ordinary left-to-right decoding of the same weights."


def _signature(named: dict, *last: str, inputs=None) -> inspect.Signature:
    """`(model, inputs=<inputs>, generation_config=None, <named>, <last>=None, **kwargs)`, each named argument with
    its declared default (`inputs=inspect.Parameter.empty`: required)."""
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    defaults = {"inputs": inputs, "generation_config": None}
    defaults.update({name: argument.default for name, argument in named.items()}, **dict.fromkeys(last))
    return inspect.Signature([
        inspect.Parameter("model", keyword),
        *(inspect.Parameter(name, keyword, default=default) for name, default in defaults.items()),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
    ])  # fmt: skip


# Stock `GenerationMixin.generate`'s and `generate_batch`'s signatures (names, order, defaults), model first: what
# `refusion_generate(model, ...)` and `refusion_generate_batch(model, ...)` take (the mixin's, with `self`).
GENERATE_SIGNATURE = _signature(STOCK_ARGUMENTS, "custom_generate")
BATCH_SIGNATURE = _signature(STOCK_BATCH_ARGUMENTS, inputs=inspect.Parameter.empty)


def bound_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, as a function with `signature` would receive them (`kwargs`: the rest)."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def method_signature(signature: inspect.Signature) -> inspect.Signature:
    """`signature` with `self` in place of the model: the mixin's methods."""
    parameters = list(signature.parameters.values())
    return signature.replace(parameters=[parameters[0].replace(name="self"), *parameters[1:]])


def refuse_unsupported(config: RefusionGenerationConfig, model_kwargs: dict, stock_arguments: dict) -> None:
    """`ValueError` for the first argument ReFusion decoding cannot honour."""
    for name, support in ARGUMENT_SUPPORT.items():
        value = getattr(config, name, None)
        if support not in (HONOURED, INERT) and not is_neutral(name, value):
            raise ValueError(f"`{name}={value!r}` is not supported by ReFusion decoding ({support}); {REFUSE_SUFFIX}")
    for name, lengths in (("bad_words_ids", config.bad_words_ids), ("sequence_bias", config.sequence_bias)):
        if lengths is not None:
            words = lengths if name == "bad_words_ids" else _sequence_bias_keys(lengths)
            if any(len(word) != 1 for word in words):
                raise ValueError(
                    f"`{name}` with sequences of more than one token is not supported by ReFusion decoding (whether a "
                    f"sequence is completed depends on the tokens before each position); single tokens are. "
                    f"{REFUSE_SUFFIX[0].upper()}{REFUSE_SUFFIX[1:]}"
                )
    for name, argument in STOCK_ARGUMENTS.items():
        value = stock_arguments[name]
        # None, False and an empty list (of logits processors) ask for nothing
        if argument.support.is_refused and not (
            value is None or value is False or (isinstance(value, list) and not value)
        ):
            raise ValueError(f"`{name}` is not supported by ReFusion decoding ({argument.support}); {REFUSE_SUFFIX}")
    if model_kwargs:
        raise ValueError(
            f"generate() got arguments that ReFusion decoding does not use: {sorted(model_kwargs)}. Its knobs are "
            f"{sorted(REFUSION_FIELDS)} plus the stock generation-config fields (see docs/generate_arguments.md)."
        )


def _sequence_bias_keys(sequence_bias) -> list:
    if isinstance(sequence_bias, dict):
        return list(sequence_bias)
    return [entry[0] for entry in sequence_bias]


def check_generation_config(generation_config) -> None:
    """`ValueError` unless `generation_config` is a `GenerationConfig` (or None), on both decoding paths (stock
    generate fails on a dict with an `AttributeError`)."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(
            f"`generation_config` must be a `GenerationConfig` (or None), got {type(generation_config).__name__}: "
            "pass `RefusionGenerationConfig(**fields)` (or `GenerationConfig(**fields)`), or give the fields as "
            "keyword arguments."
        )


def check_integer_ids(name: str, ids: torch.Tensor) -> None:
    """`ValueError` unless the tensor `ids` holds integers (float, complex and bool tensors are not token ids)."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"`{name}` must hold integer token ids, got dtype {ids.dtype}.")


def check_token_ids(input_ids, attention_mask, config: RefusionGenerationConfig, vocab_size: int) -> None:
    """`ValueError` for prompts (None: none given) and token ids that are not ids of this model. With
    `decoding="autoregressive"` special ids may be negative, as stock generate allows (`eos_token_id=-1`: never
    stop)."""
    if input_ids is not None:
        _check_prompts(input_ids, attention_mask, vocab_size)
    eos = config.eos_token_id
    named = {
        "pad_token_id": [config.pad_token_id],
        "bos_token_id": [config.bos_token_id],
        "mask_token_id": [config.mask_token_id],
        "eos_token_id": eos if isinstance(eos, (list, tuple)) else [eos],
        "suppress_tokens": config.suppress_tokens or [],
        "begin_suppress_tokens": config.begin_suppress_tokens or [],
    }
    lowest = NEVER_ID if config.decoding == "autoregressive" else 0  # stock reads a negative id as "none"
    for name, ids in named.items():
        outside = [i for i in ids if i is not None and not lowest <= i < vocab_size]
        if outside:
            raise ValueError(f"`{name}` {outside} is outside the vocabulary (0 .. {vocab_size - 1}).")


def check_stop_strings(config: GenerationConfig, tokenizer) -> None:
    """`ValueError` naming `stop_strings` when transformers' `StopStringCriteria` cannot be built from this tokenizer
    (it reads every vocabulary entry's text through the tokenizer, which fails for some vocabularies, for example
    word-level ones, with a bare "substring not found"). transformers caches the criteria's tables, so the stock
    criteria built next only read the vocabulary again. Without a tokenizer, stock generate's own message stands."""
    if config.stop_strings is None or tokenizer is None:
        return
    try:
        StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings)
    except ValueError as failed:
        raise ValueError(
            f"`stop_strings` {config.stop_strings!r}: transformers' StopStringCriteria cannot read this tokenizer's "
            f"vocabulary ({failed}); leave `stop_strings` unset and cut the answers at the strings afterwards."
        ) from None


def _check_prompts(input_ids, attention_mask, vocab_size: int) -> None:
    """`ValueError` unless `input_ids` are prompts of token ids of this model, and `attention_mask` their mask."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise ValueError("`input_ids` must be a 2-D tensor of token ids, shape (batch_size, prompt_length).")
    check_integer_ids("input_ids", input_ids)
    if input_ids.shape[0] == 0:
        raise ValueError("`input_ids` is an empty batch: pass at least one prompt.")
    if input_ids.shape[1] == 0:
        raise ValueError("`input_ids` has no tokens: pass a prompt of at least one token.")
    if attention_mask is not None:
        if not torch.is_tensor(attention_mask) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
            raise ValueError(
                f"`attention_mask` has shape {shape} but `input_ids` has {tuple(input_ids.shape)}; they must match."
            )
        if not ((attention_mask == 0) | (attention_mask == 1)).all():
            raise ValueError("`attention_mask` must hold only 0 (padding) and 1 (prompt token).")
    real = input_ids if attention_mask is None else input_ids[attention_mask.bool()]
    low, high = torch.stack(torch.aminmax(real)).tolist() if real.numel() else (0, 0)  # one host read
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"`input_ids` holds ids outside the vocabulary (0 .. {vocab_size - 1}): min {low}, max {high}."
        )


def check_left_padding(input_ids, attention_mask, config: RefusionGenerationConfig) -> torch.LongTensor:
    """The attention mask, after ReFusion's own input checks."""
    mask = attention_mask.bool()
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise ValueError(
            "`attention_mask` shows right padding (a 0 after a 1); ReFusion generation needs left padding: "
            "set `tokenizer.padding_side = 'left'`."
        )
    if not mask.any(1).all():
        raise ValueError("A row of `attention_mask` is all zeros: every prompt needs at least one token.")
    if config.mask_token_id is None:
        raise ValueError(
            "ReFusion decoding needs a mask token, but `config.mask_token_id` is not set. Set it to the id of "
            "`<|mask|>` (e.g. `model.config.mask_token_id = tokenizer.mask_token_id`), or pass `mask_token_id=`; "
            "`refusion convert` adds the token to an autoregressive checkpoint."
        )
    if config.eos_token_id is None or config.eos_token_id == []:
        raise ValueError(
            "ReFusion decoding needs an EOS token: pass `eos_token_id=` or set `generation_config.eos_token_id`."
        )
    for name, ids in (("eos_token_id", eos_token_ids(config)), ("pad_token_id", [config.pad_token_id])):
        if config.mask_token_id in ids:
            raise ValueError(
                f"`{name}` equals the mask token id ({config.mask_token_id}): ReFusion decoding fills the answer's "
                "masks with drafts, so the mask can be neither the end of an answer nor its padding. Pass the "
                f"tokenizer's own `{name}` (or another `mask_token_id`)."
            )
    if (input_ids[mask] == config.mask_token_id).any():
        raise ValueError(
            f"`input_ids` contains the mask token (id {config.mask_token_id}); prompts must not contain `<|mask|>`."
        )
    return attention_mask.long()


def eos_token_ids(config: GenerationConfig) -> tuple[int, ...]:
    eos = config.eos_token_id
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
