"""`refusion serve --engine sglang [MODEL]`: SGLang's own OpenAI-compatible server (`sglang serve`, run in this
interpreter) decoding with `--dllm-algorithm ReFusion` (the plugin `sglang_plugin.py`, the algorithm
`sglang_algorithm.py`). This module only builds SGLang's launch arguments from `refusion serve`'s flags: SGLang does
the rest (its HTTP server, tokenizer and detokenizer processes, scheduler, paged KV cache, batching, tensor
parallelism).

Every `refusion serve` flag is either given SGLang's flag of the same meaning (`sglang_arguments`; the table is in
docs/serving.md) or refused by name (`REFUSED`); SGLang's other flags go through `--engine-args="..."` unchanged
(after ours: the last wins). On a machine without a GPU the CPU arguments are added (`SGLANG_USE_CPU_ENGINE=1`,
`--device cpu`, the plugin's attention backend (SGLang's `torch_native` with ReFusion's masks), no CUDA graphs, a
KV pool of the context length's tokens per running request and a small `--mem-fraction-static`: on CPU SGLang sizes
its pool from the machine's free RAM). The
decoding settings are checked here, before SGLang starts, so a setting the plugin cannot honour (an unknown one, a
block that is not a whole number of slots, a logits constraint in the checkpoint's generation config) is one line
naming it rather than a traceback from SGLang's scheduler process.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex

from ..command_inputs import CommandError
from ..generation.refusion_generate import DEFAULT_BATCH_ROWS
from .sglang_names import ATTENTION_BACKEND

INSTALL_HINT = "`make sglang` (CPU only: .venv-sglang/bin/refusion) or pip install -e '.[sglang,serving]' (a GPU)"
CPU_MEM_FRACTION = 0.05  # SGLang's --mem-fraction-static on CPU, where its KV budget is drawn from the free RAM
SGLANG_DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "float32": "float32"}

# refusion serve's own server features, which SGLang's server does not have: refused by name with --engine sglang
REFUSED = {
    "attn_implementation": ("--attn-implementation", 'pass SGLang\'s --engine-args="--attention-backend NAME"'),
    "trust_request_chat_template": ("--trust-request-chat-template", "SGLang's server has no such option"),
    "request_chat_template_seconds": ("--request-chat-template-seconds", "SGLang's server has no such option"),
    "shutdown_timeout": ("--shutdown-timeout", "SGLang's server has no such option"),
}


def add_engine_arguments(parser) -> None:
    """The flags that choose and configure the engine (`refusion serve`'s parser)."""
    parser.add_argument(
        "--engine",
        choices=("refusion", "sglang"),
        default="refusion",
        help="refusion: this package's server (generate()); sglang: SGLang's server with --dllm-algorithm ReFusion "
        "(needs SGLang: make sglang, or pip install -e '.[sglang,serving]'; docs/serving.md)",
    )
    parser.add_argument(
        "--dllm-algorithm-config",
        default=None,
        metavar="FILE",
        help="with --engine sglang: a YAML mapping of ReFusion settings (slot_size, block_size, token_threshold, "
        "remask_threshold, ...) over the checkpoint's generation config",
    )
    parser.add_argument(
        "--engine-args",
        default=None,
        metavar='"ARGS"',
        help='with --engine sglang: more of SGLang\'s own launch flags, as one string (--engine-args="--tp-size 2")',
    )


def refuse_engine_flags(args: argparse.Namespace) -> None:
    """With the default engine: the SGLang-only flags are refused by name."""
    if args.dllm_algorithm_config is not None:
        raise CommandError(
            "--dllm-algorithm-config is for --engine sglang; the refusion engine decodes with the model's generation "
            "config (and each request's fields)."
        )
    if args.engine_args is not None:
        raise CommandError("--engine-args passes SGLang's own flags: drop it, or pass --engine sglang.")


def settings_overrides(path: str | None) -> dict:
    """The `--dllm-algorithm-config` mapping ({} without one); one line naming the file when it is not one."""
    if path is None:
        return {}
    import yaml

    try:
        with open(path) as handle:
            overrides = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as error:
        raise CommandError(f"--dllm-algorithm-config {path}: {str(error).splitlines()[0]}") from None
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise CommandError(f"--dllm-algorithm-config {path}: not a YAML mapping of ReFusion settings")
    return overrides


def device_arguments(device: str, gpu: bool, kv_tokens: int) -> list[str]:
    """`--device` as SGLang's flags: the CPU arguments (a KV pool of `kv_tokens`), or CUDA with its first GPU."""
    if device == "auto":
        device = "cuda" if gpu else "cpu"
    if device == "cpu":
        return ["--device", "cpu", "--attention-backend", ATTENTION_BACKEND, "--disable-prefill-cuda-graph",
                "--disable-decode-cuda-graph", "--mem-fraction-static", str(CPU_MEM_FRACTION),
                "--max-total-tokens", str(kv_tokens)]  # fmt: skip
    if device == "cuda":
        return ["--device", "cuda"]
    index = device.removeprefix("cuda:")
    if device.startswith("cuda:") and index.isdigit():
        return ["--device", "cuda", "--base-gpu-id", index]
    raise CommandError(f"--device {device}: with --engine sglang, one of auto, cpu, cuda, cuda:N")


def sglang_arguments(args: argparse.Namespace, model: str, gpu: bool, context_length: int) -> list[str]:
    """SGLang's launch arguments for `refusion serve --engine sglang` with `args` (docs/serving.md's table); on CPU
    the KV pool holds `context_length` tokens (`--max-model-len`, else the model's) for each running request."""
    for name, (flag, instead) in REFUSED.items():
        if getattr(args, name) not in (None, False):
            raise CommandError(f"{flag} is refusion serve's own; with --engine sglang {instead}.")
    if args.dtype not in SGLANG_DTYPES:
        raise CommandError(f"--dtype {args.dtype}: SGLang serves {', '.join(SGLANG_DTYPES)}.")
    if args.served_model_name is not None and len(args.served_model_name) > 1:
        raise CommandError("--served-model-name: SGLang's server answers to one name; give one.")
    rows = args.max_requests_per_batch
    if not args.continuous_batching:
        rows = 1  # refusion serve's meaning: one request at a time (a larger --max-num-seqs is refused before)
    elif rows is None:
        rows = DEFAULT_BATCH_ROWS
    argv = ["--model-path", model, "--host", args.host, "--port", str(args.port), "--dtype",
            SGLANG_DTYPES[args.dtype], "--dllm-algorithm", "ReFusion", "--max-running-requests", str(rows),
            "--log-level", args.log_level]  # fmt: skip
    if args.dllm_algorithm_config is not None:
        argv += ["--dllm-algorithm-config", args.dllm_algorithm_config]
    if args.served_model_name is not None:
        argv += ["--served-model-name", args.served_model_name[0]]
    if args.max_model_len is not None:
        argv += ["--context-length", str(args.max_model_len)]
    if args.api_key is not None:
        argv += ["--api-key", args.api_key]
    if args.max_queued_requests is not None:
        argv += ["--max-queued-requests", str(args.max_queued_requests)]
    argv += device_arguments(args.device, gpu, kv_tokens=(args.max_model_len or context_length) * rows)
    try:
        argv += shlex.split(args.engine_args or "")
    except ValueError as error:
        raise CommandError(f"--engine-args: {error}") from None
    return argv


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


def run(args: argparse.Namespace, model: str) -> int:
    """Check the flags and the decoding settings, then run SGLang's server here until it stops."""
    if not sglang_installed():
        raise CommandError(f"--engine sglang: SGLang is not installed; install it with {INSTALL_HINT}.")
    import torch
    from transformers import AutoConfig

    from .sglang_plugin import refusion_settings

    context_length = AutoConfig.from_pretrained(model).max_position_embeddings
    argv = sglang_arguments(args, model, gpu=torch.cuda.is_available(), context_length=context_length)
    try:
        refusion_settings(model, settings_overrides(args.dllm_algorithm_config))
    except ValueError as error:
        raise CommandError(str(error)) from None
    if argv[argv.index("--device") + 1] == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # read when SGLang is imported: before it
    from .._compat import sglang as seam

    seam.serve(argv)
    return 0
