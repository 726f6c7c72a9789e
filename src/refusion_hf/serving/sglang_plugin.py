"""The SGLang plugin (entry point `refusion = refusion_hf.serving.sglang_plugin:register` in the group
`sglang.srt.plugins`, installed with the `sglang` extra): SGLang loads it in every one of its processes.

It makes `--dllm-algorithm ReFusion` decode ReFusion checkpoints of both layouts:

* this package's folders (`architectures: ["RefusionForCausalLM"]`, `model_type: refusion`): the config class is
  registered with transformers' `AutoConfig` (importing `refusion_hf`), the architecture name with SGLang's model
  table (SGLang's own Qwen3 network: ReFusion's weights are Qwen3's);
* the official checkpoint's layout (`Qwen3ForCausalLM`, `model_type: qwen3`, with a `mask_token_id`).

SGLang's architecture table (`DLLM_PARAMS`) is a local of `DllmConfig.from_server_args`; the plugin wraps that
function so that, for `--dllm-algorithm ReFusion` only, the diffusion config comes from the checkpoint: the mask token
from `config.json`, the decoding settings from `generation_config.json` (ReFusion's knobs,
`refusion_hf.generation.RefusionGenerationConfig`), overridden by `--dllm-algorithm-config FILE.yaml`. Its block
size is SGLang's canvas: `CANVAS_BLOCKS` decoder blocks (a block's cache entries and one query; `sglang_algorithm.py`).

It also registers the attention backend the algorithm requires, `ATTENTION_BACKEND` (SGLang's `torch_native` with
per-request masks, `sglang_attention.py`), through SGLang's attention registry.
"""

from __future__ import annotations

import logging

from refusion_hf._compat import sglang as seam
from refusion_hf.serving.sglang_names import ALGORITHM, ATTENTION_BACKEND

logger = logging.getLogger(__name__)

SETTINGS = ("slot_size", "block_size", "token_threshold", "slot_threshold", "remask_threshold", "plan_ahead")
# generate()'s logits constraints (transformers' processors, `DraftPolicy`) read from a checkpoint's generation config,
# with their neutral values: ReFusion on SGLang drafts greedily without them, so a checkpoint setting one is refused.
UNAPPLIED_CONSTRAINTS = {
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "bad_words_ids": (None, []),
    "sequence_bias": (None, {}, []),
    "min_new_tokens": (None, 0),
    "min_length": (None, 0),
    "renormalize_logits": (None, False),
    "remove_invalid_values": (None, False),
}


def register() -> None:
    """The plugin: called by SGLang's `load_plugins` in every SGLang process."""
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM

    import refusion_hf  # noqa: F401  (registers `RefusionConfig` with AutoConfig)
    from refusion_hf.serving import sglang_attention
    from refusion_hf.serving.sglang_algorithm import ReFusion

    if not seam.installed_version_supported():
        logger.warning("refusion_hf's SGLang plugin was written for sglang %s", ",".join(seam.SUPPORTED_VERSIONS))
    seam.add_algorithm(ReFusion)
    seam.add_attention_backend(ATTENTION_BACKEND, sglang_attention.create)
    seam.add_model_architecture("RefusionForCausalLM", _with_full_logits("RefusionForCausalLM", Qwen3ForCausalLM))
    # The official layout declares stock Qwen3: SGLang's Qwen3 class, returning every canvas position's logits on
    # SGLang's diffusion path (`return_full_logits` is read there only; autoregressive decoding is unchanged).
    seam.add_model_architecture("Qwen3ForCausalLM", _with_full_logits("Qwen3ForCausalLM", Qwen3ForCausalLM))
    seam.wrap_dllm_config(_dllm_config)


def _with_full_logits(name: str, base: type) -> type:
    """`base` under the architecture name `name`, its logits processor returning the logits of every position of a
    diffusion canvas (what SGLang's own diffusion models construct theirs with)."""

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        seam.return_full_logits(self.logits_processor)

    return type(name, (base,), {"__init__": __init__, "__module__": __name__})


def _dllm_config(original, server_args):
    if getattr(server_args, "dllm_algorithm", None) != ALGORITHM:
        return original(server_args)
    return refusion_dllm_config(server_args)


def refusion_settings(model_path: str, overrides: dict) -> dict:
    """The decoding settings SGLang decodes `model_path` with: its generation config's ReFusion knobs, then
    `overrides` (the `--dllm-algorithm-config` mapping). `ValueError` naming a setting SGLang cannot honour."""
    from transformers import AutoConfig

    from refusion_hf.generation import RefusionGenerationConfig
    from refusion_hf.generation.refusion_generation_config import REFUSION_FIELDS, decoding_knob_values

    model_config = AutoConfig.from_pretrained(model_path)
    mask_id = getattr(model_config, "mask_token_id", None)
    if mask_id is None:
        raise ValueError(f"{model_path}: config.json has no mask_token_id; it is not a ReFusion checkpoint")
    unknown = sorted(set(overrides) - set(SETTINGS))
    if unknown:
        raise ValueError(f"--dllm-algorithm-config: unknown ReFusion setting(s) {unknown}; known: {list(SETTINGS)}")
    try:
        config = RefusionGenerationConfig.from_pretrained(model_path)
    except OSError:
        config = RefusionGenerationConfig.from_model_config(model_config)
    for name, value in overrides.items():
        setattr(config, name, value)
    if config.mask_token_id is None:
        config.mask_token_id = mask_id
    for name, default in REFUSION_FIELDS.items():  # unset: the knob's default, as generate() merges it
        if getattr(config, name, None) is None and default is not None:
            setattr(config, name, default)
    knobs = decoding_knob_values(config)  # block_size unset: derived from slot_size, as generate() does
    if knobs["block_size"] % knobs["slot_size"]:
        raise ValueError(f"block_size {knobs['block_size']} is not a multiple of slot_size {knobs['slot_size']}")
    shaping = [name for name, neutral in UNAPPLIED_CONSTRAINTS.items() if getattr(config, name, neutral) not in neutral]
    if shaping:
        raise ValueError(
            f"{model_path}: its generation config sets {', '.join(shaping)}, which ReFusion on SGLang does not apply "
            "(its drafts are the model's argmax); serve it with `refusion serve` (this package's server applies them), "
            "or save the checkpoint without them"
        )
    eos = config.eos_token_id if config.eos_token_id is not None else model_config.eos_token_id
    eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    special = {config.pad_token_id, config.bos_token_id} - {None} - set(eos_ids)
    return {
        "mask_id": int(config.mask_token_id),
        "knobs": knobs,
        "eos_token_ids": [int(t) for t in eos_ids],
        "never_drafted": sorted({int(config.mask_token_id)} | {int(t) for t in special}),
    }


def refusion_dllm_config(server_args):
    """SGLang's `DllmConfig` for a ReFusion checkpoint (what `DLLM_PARAMS` holds for SGLang's own models)."""
    from sglang.srt.dllm.config import DllmConfig

    overrides = {}
    if server_args.dllm_algorithm_config is not None:
        import yaml

        with open(server_args.dllm_algorithm_config) as handle:
            overrides = yaml.safe_load(handle) or {}
        if not isinstance(overrides, dict):
            raise ValueError(f"--dllm-algorithm-config {server_args.dllm_algorithm_config}: not a YAML mapping")
    from refusion_hf.serving.recomputed_canvas import CANVAS_BLOCKS

    settings = refusion_settings(server_args.model_path, overrides)
    if settings["knobs"]["plan_ahead"]:
        logger.info("ReFusion on SGLang: plan_ahead runs each plan as a forward of its own (the same tokens)")
    if server_args.dllm_fdfo:
        logger.info("ReFusion on SGLang: blocks are decoded synchronously (--dllm-fdfo does not apply)")
    return DllmConfig(
        algorithm=ALGORITHM,
        algorithm_config=settings,
        block_size=CANVAS_BLOCKS * settings["knobs"]["block_size"],  # SGLang's canvas: a block's entries + a query
        mask_id=settings["mask_id"],
        max_running_requests=server_args.max_running_requests or 1,
        first_done_first_out_mode=False,  # a block is decoded to its end in one round: its canvas is wider than it
        requires_separate_context_encoding=True,
        capture_input_preparation=False,
        delete_token_id=None,
        split_token_id=None,
    )
