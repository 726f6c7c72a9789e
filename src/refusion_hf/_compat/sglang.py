"""The seam to SGLang's diffusion-LLM internals (see `refusion_hf._compat`); tests/_compat/test_sglang.py checks
`PRIVATE_MEMBERS` against the installed SGLang (in `.venv-sglang`, `make sglang`; skipped where SGLang is absent).

SGLang's public extension points for diffusion decoding are `--dllm-algorithm NAME` (a `DllmAlgorithm` subclass) and
general plugins under the entry-point group `sglang.srt.plugins`. The rest is internal and declared here:

* the algorithm table `algo_name_to_cls` is filled by scanning SGLang's own package (pkgutil), so a plugin adds its
  class to the table (there is no registration function);
* the architecture table `DLLM_PARAMS` is a local of `DllmConfig.from_server_args`, so a plugin wraps that function
  (SGLang's `HookRegistry`, AROUND) to answer for ReFusion checkpoints and leaves every other model to it;
* the model-class table `ModelRegistry.models` gets the `RefusionForCausalLM` architecture name (SGLang's own
  Qwen3 class under that name: same weights, same forward);
* `sglang.cli.serve.serve(args, extra_argv)`: what the `sglang serve` command runs (its plugins loaded, the model's
  backend chosen, the server run until it stops, its child processes ended), called by `refusion serve --engine
  sglang` in its own interpreter with the launch arguments it built;
* `DllmAlgorithm.run`: the algorithm's whole contract with SGLang's worker (`(model_runner, forward_batch,
  algo_states) -> (logits output, tokens emitted per request, accept lengths, states, can run graph)`), called for
  a context's encoding and for each block; the algorithm runs its own forwards of the block's canvas
  (`forward_batch.input_ids` / `positions`, `block_size` tokens per request) through `model_runner.forward`, and
  reads `forward_batch.rids`, `extend_seq_lens` and `extend_prefix_lens`;
* attention: the backend registry (`register_attention_backend`, and `add_attention_backend_choices`, which
  SGLang offers for plugins' names), `TorchNativeAttnBackend`'s extend forward and its pools (the subclass
  `serving/sglang_attention.py`), the KV write (`KVWriteLoc`), and the model runner's `attn_backend`, to which
  the algorithm hands each forward's masks.
"""

from __future__ import annotations

from . import ATTRIBUTE, SET_BY_OWNER

SUPPORTED_VERSIONS = (">=0.5.23", "<0.5.24")  # the declarations below were read from 0.5.23's source

PRIVATE_MEMBERS = (
    ("sglang.srt.dllm.algorithm", "algo_name_to_cls", ATTRIBUTE),
    ("sglang.srt.dllm.algorithm.base:DllmAlgorithm", "requires_separate_context_encoding", ATTRIBUTE),
    ("sglang.srt.dllm.algorithm.base:DllmAlgorithm", "run", "(self, model_runner, forward_batch, algo_states)"),
    ("sglang.srt.dllm.algorithm.base:DllmAlgorithm", "required_attention_backend", ATTRIBUTE),
    ("sglang.srt.dllm.algorithm.base:DllmAlgorithm", "supported_attention_backends", ATTRIBUTE),
    ("sglang.srt.model_executor.forward_batch_info:ForwardBatch", "rids", SET_BY_OWNER),
    ("sglang.srt.model_executor.forward_batch_info:ForwardBatch", "positions", SET_BY_OWNER),
    (
        "sglang.srt.model_executor.forward_batch_info:ForwardBatch",
        "seq_lens",
        SET_BY_OWNER,
    ),  # before extend_seq_lens (a substring)
    ("sglang.srt.model_executor.forward_batch_info:ForwardBatch", "extend_seq_lens", SET_BY_OWNER),
    ("sglang.srt.model_executor.forward_batch_info:ForwardBatch", "extend_prefix_lens", SET_BY_OWNER),
    ("sglang.srt.model_executor.forward_batch_info:ForwardBatch", "out_cache_loc", SET_BY_OWNER),
    ("sglang.srt.model_executor.forward_batch_info:ForwardBatch", "req_pool_indices", SET_BY_OWNER),
    ("sglang.srt.layers.attention.attention_registry", "register_attention_backend", "(name)"),
    ("sglang.srt.model_executor.model_runner:ModelRunner", "attn_backend", SET_BY_OWNER),
    ("sglang.srt.arg_groups.choices", "add_attention_backend_choices", ATTRIBUTE),
    (
        "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend",
        "forward_extend",
        "(self, q, k, v, layer, forward_batch, save_kv_cache)",
    ),
    ("sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend", "token_to_kv_pool", SET_BY_OWNER),
    ("sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend", "req_to_token_pool", SET_BY_OWNER),
    ("sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend", "swa_out_cache_loc", SET_BY_OWNER),
    ("sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend", "device", SET_BY_OWNER),
    ("sglang.srt.mem_cache.memory_pool:KVWriteLoc", "__init__", "(self, loc, swa_loc, full_loc, physical)"),
    ("sglang.srt.dllm.algorithm.base:DllmAlgorithm", "configure_server_args", "(server_args)"),
    ("sglang.srt.dllm.algorithm.base:DllmAlgorithm", "validate_request", "(req)"),
    ("sglang.srt.dllm.config:DllmConfig", "from_server_args", "(server_args)"),
    (
        "sglang.srt.dllm.config:DllmConfig",
        "__init__",
        "(self, algorithm, algorithm_config, block_size, mask_id, max_running_requests, first_done_first_out_mode, "
        "requires_separate_context_encoding, capture_input_preparation, delete_token_id, split_token_id)",
    ),
    ("sglang.srt.models.registry:_ModelRegistry", "models", SET_BY_OWNER),
    ("sglang.srt.layers.logits_processor:LogitsProcessor", "return_full_logits", SET_BY_OWNER),
    ("sglang.srt.models.qwen3:Qwen3ForCausalLM", "logits_processor", SET_BY_OWNER),
    ("sglang.srt.arg_groups.overrides", "declare_resolution", "(server_args, source, fields)"),
    ("sglang.srt.plugins.hook_registry:HookRegistry", "register", "(target, hook, hook_type, source)"),
    ("sglang.cli.serve", "serve", "(args, extra_argv)"),
)


def installed_version_supported() -> bool:
    """Whether the installed SGLang's version lies in `SUPPORTED_VERSIONS`."""
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    return version("sglang") in SpecifierSet(",".join(SUPPORTED_VERSIONS))


def add_algorithm(cls) -> None:
    """Make `--dllm-algorithm <cls.__name__>` find `cls` (SGLang fills its table by scanning its own package)."""
    from sglang.srt.dllm import algorithm

    algorithm.algo_name_to_cls[cls.__name__] = cls


def add_model_architecture(name: str, cls) -> None:
    """Make SGLang load checkpoints whose `architectures[0]` is `name` with `cls`."""
    from sglang.srt.models.registry import ModelRegistry

    ModelRegistry.models[name] = cls


def return_full_logits(logits_processor) -> None:
    """Make SGLang's `LogitsProcessor` return every position's logits on the diffusion path (SGLang's diffusion
    models pass `return_full_logits=True` to its constructor; the Qwen3 class builds it without)."""
    logits_processor.return_full_logits = True


def attention_backend(model_runner):
    """The model runner's attention backend (the object the attention layers call)."""
    return model_runner.attn_backend


def save_kv(backend, layer, forward_batch, k, v) -> None:
    """Write a layer's new keys and values where SGLang allocated them (what `TorchNativeAttnBackend`'s
    `forward_extend` does first)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    location = KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc)
    backend.token_to_kv_pool.set_kv_buffer(layer, location, k, v)


def add_attention_backend(name: str, factory) -> None:
    """Make `--attention-backend name` build `factory(model_runner)` (SGLang's registry and its list of choices,
    which it extends for plugins)."""
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if name not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([name])
    register_attention_backend(name)(factory)


def wrap_dllm_config(answer) -> None:
    """Route `DllmConfig.from_server_args` through `answer(original, server_args)` (SGLang's AROUND hook)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.dllm.config.DllmConfig.from_server_args", answer, HookType.AROUND)


def declare_server_args(server_args, owner: str, **fields) -> None:
    """Set launch-time server arguments on behalf of `owner` (what SGLang's own algorithms do)."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, owner, **fields)


def serve(argv: list[str]) -> None:
    """Run SGLang's server with the launch arguments `argv` (what `sglang serve ARGV...` runs), until it stops."""
    from sglang.cli.serve import serve as sglang_serve

    sglang_serve(None, argv)
