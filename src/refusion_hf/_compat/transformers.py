"""The seam to transformers' private names (see `refusion_hf._compat`): generation, cache, modeling and `Trainer`
(`refusion serve` uses public APIs only); and the differences between the supported releases (5.19 to 5.25,
setup.cfg), each declared once under "Release differences" below. tests/_compat/test_transformers.py checks
`PRIVATE_MEMBERS` and each difference against the installed transformers.

Part of the remote-code bundle (the decoder reaches it): standard library, torch and transformers imports only;
`Trainer` is imported inside the functions that use it.
The declarations use the plain strings "attribute" and "set by owner" (`refusion_hf._compat.ATTRIBUTE`,
`SET_BY_OWNER`): the bundle cannot import the package's `__init__`.
"""

from __future__ import annotations

import weakref

from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

_MIXIN = "transformers.generation.utils:GenerationMixin"

PRIVATE_MEMBERS = (
    # -- generate(): stock preparation, reused so that ReFusion decoding honours the config exactly as stock does.
    # No public alternative: `generate()` runs these internally and offers no hook between them and the decoding
    # loop (custom_generate receives the raw arguments).
    (_MIXIN, "_prepare_special_tokens", "(self, generation_config, kwargs_has_attention_mask, device, batch_size)"),
    (_MIXIN, "_prepare_attention_mask_for_generation", "(self, inputs_tensor, generation_config, model_kwargs)"),
    (
        _MIXIN,
        "_prepare_generated_length",
        "(self, generation_config, has_default_max_length, has_default_min_length, model_input_name, "
        "input_ids_length, inputs_tensor)",
    ),
    (_MIXIN, "_validate_generated_length", "(self, generation_config, input_ids_length, has_default_max_length)"),
    (_MIXIN, "_get_stopping_criteria", "(self, generation_config, stopping_criteria, tokenizer)"),
    (
        _MIXIN,
        "_get_logits_processor",
        "(self, generation_config, input_ids_seq_length, encoder_input_ids, prefix_allowed_tokens_fn, "
        "logits_processor, device, model_kwargs, negative_prompt_ids, negative_prompt_attention_mask)",
    ),
    # The tensors `_prepare_special_tokens` stores on the config: no public getter (the public ids are lists).
    ("transformers:GenerationConfig", "_pad_token_tensor", "set by owner"),
    ("transformers:GenerationConfig", "_eos_token_tensor", "set by owner"),
    # Stock defaults for unset fields: no public accessor (`GenerationConfig()` holds None for them).
    # `RefusionGenerationConfig` overrides it to add the knobs' defaults: stock generate merges through it.
    ("transformers:GenerationConfig", "_get_default_generation_params", "()"),
    # How stock generate tells a model's generation config the user modified: no public accessor.
    ("transformers:GenerationConfig", "_original_object_hash", "set by owner"),
    # -- modeling: the attention implementation a config selects; `PretrainedConfig` has no public getter.
    ("transformers:PretrainedConfig", "_attn_implementation", "attribute"),
    # What the public `set_attn_implementation` sets; it also re-validates and walks every module and sub-config on
    # each call (a walk of every module), and the decoding loop selects its split attention and
    # restores the model's own on every `generate()`: `select_attn_implementation` sets it directly where the
    # walk would find nothing more (one config shared by every sub-model, no sub-configs).
    ("transformers:PretrainedConfig", "_attn_implementation_internal", "set by owner"),
    # -- Trainer: the overrides `RefusionTrainer` / `RefusionSFTTrainer` define (the library calls them), and what
    # they call. No public hook adds model-input columns (`remove_unused_columns` would drop the collator's) or runs
    # after each checkpoint with the folder written (`on_save` callbacks run after the rotation, without errors).
    ("transformers:Trainer", "_set_signature_columns_if_needed", "(self)"),
    ("transformers:Trainer", "_signature_columns", "set by owner"),
    ("transformers:Trainer", "_save_checkpoint", "(self, model, trial)"),
    ("transformers:Trainer", "_get_output_dir", "(self, trial)"),
)  # fmt: skip


# ----------------------------------------------------------------------------------------------- Release differences
# The transformers releases this package supports: setup.cfg's requirement (its comment says why each bound), which
# a test holds equal to this, and the requirement a model folder's custom_generate/ states.
SUPPORTED_RELEASES = ">=5.19,<5.26"

# What differs between the supported releases, detected from the installed one (never from its version string),
# each used through the functions below only.


# The KV cache's keyword argument of a model's forward, and the output field that returns it: `past_key_values` up to
# 5.23, `cache` from 5.24 (which still takes `past_key_values`, deprecated). Before 5.24 a `cache=` keyword is not
# refused: it lands in the attention kwargs and the forward runs without the cache (the decoder's masks then cover
# more keys than the forward has: "The size of tensor a (64) must match the size of tensor b (76)").
def cache_name(output_class) -> str:
    """The cache's name where `output_class` (a transformers model output dataclass) has a field for it."""
    return "cache" if "cache" in output_class.__dataclass_fields__ else "past_key_values"


CACHE_NAME = cache_name(CausalLMOutputWithPast)


def cache_argument(cache) -> dict:
    """`{name: cache}`: the keyword argument that hands `cache` to a transformers forward (or an output class) on
    the installed release (`CACHE_NAME`)."""
    return {CACHE_NAME: cache}


def output_cache(outputs):
    """The cache a transformers model output carries (`CACHE_NAME`)."""
    return getattr(outputs, CACHE_NAME)


# ----------------------------------------------------------------------------------------------- generate()
def prepare_special_tokens_and_mask(model, config, input_ids, attention_mask):
    """Stock generate's special-token tensors on `config`; returns `attention_mask`, or, when None, the mask stock
    generate infers from padding."""
    device, batch_size = input_ids.device, input_ids.shape[0]
    model._prepare_special_tokens(config, attention_mask is not None, device=device, batch_size=batch_size)
    if attention_mask is None:
        attention_mask = model._prepare_attention_mask_for_generation(input_ids, config, {})
    return attention_mask


def prepare_generated_length(model, config, has_default_max_length, has_default_min_length, input_ids):
    """Stock generate's length preparation and validation; returns the config."""
    width = input_ids.shape[1]
    config = model._prepare_generated_length(
        config, has_default_max_length, has_default_min_length, "input_ids", width, input_ids
    )
    model._validate_generated_length(config, width, has_default_max_length)
    return config


def settled_pad_token_id(config) -> int:
    """The pad id `prepare_special_tokens` settled on (the EOS when none is set, as stock)."""
    return int(config._pad_token_tensor)


def without_eos_tensor(config):
    """`config`, changed so that the stock processors and criteria built from it leave EOS alone (the decoder ends
    rows itself)."""
    config._eos_token_tensor = None
    return config


def stock_stopping_criteria(model, config, criteria, tokenizer):
    return model._get_stopping_criteria(config, criteria, tokenizer)


def stock_logits_processor(model, **arguments):
    """The processors stock generate builds from `generation_config` (no caller's processors)."""
    return model._get_logits_processor(logits_processor=LogitsProcessorList(), **arguments)


def stock_default_generation_params() -> dict:
    return GenerationConfig._get_default_generation_params()


def original_object_hash(config):
    return getattr(config, "_original_object_hash", None)


def set_original_object_hash(config, value) -> None:
    config._original_object_hash = value


def attn_implementation(config):
    return config._attn_implementation


_SHARES_ONE_CONFIG: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> bool, walked once


def select_attn_implementation(model, name: str) -> None:
    """`model.set_attn_implementation(name)` for a registered implementation `name` (see PRIVATE_MEMBERS); models
    with sub-configs or sub-models of their own config go through the public method."""
    shares = _SHARES_ONE_CONFIG.get(model)
    if shares is None:
        config = model.config
        shares = not config.sub_configs and all(
            module.config is config for module in model.modules() if isinstance(module, PreTrainedModel)
        )
        _SHARES_ONE_CONFIG[model] = shares
    if shares:
        model.config._attn_implementation_internal = name
    else:
        model.set_attn_implementation(name)


# ----------------------------------------------------------------------------------------------- DynamicCache
def map_cache_tensors(cache, transform, *others) -> None:
    """Replace every layer's keys and values by `transform(tensor, *the same tensor of each cache in others)`.
    `DynamicLayer.keys` / `.values` are public attributes, but setting them is not an API: `DynamicCache` offers
    `crop`, `batch_select_indices` and `batch_repeat_interleave`, but no gather along positions or concatenation of
    caches, which the ragged cache needs (compaction, rows joining a running batch)."""
    for layers in zip(cache.layers, *(other.layers for other in others)):
        for name in ("keys", "values"):
            setattr(layers[0], name, transform(*(getattr(layer, name) for layer in layers)))


# ----------------------------------------------------------------------------------------------- Trainer
def stock_signature_columns(trainer) -> None:
    """`Trainer`'s own `_set_signature_columns_if_needed`, past any override between (TRL's)."""
    from transformers import Trainer

    Trainer._set_signature_columns_if_needed(trainer)


def add_signature_columns(trainer, names) -> None:
    trainer._signature_columns += [name for name in names if name not in trainer._signature_columns]


def save_stock_checkpoint(trainer, model, trial) -> None:
    """`Trainer`'s own `_save_checkpoint`, past any override between (TRL's writes a card first)."""
    from transformers import Trainer

    Trainer._save_checkpoint(trainer, model, trial)


def output_dir(trainer, trial) -> str:
    return trainer._get_output_dir(trial=trial)
