"""The seam to lm-eval's private names (see `refusion_hf._compat`); tests/_compat/test_lm_eval.py checks
`PRIVATE_MEMBERS` against the installed lm-eval (setup.cfg pins the tested range)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from . import ATTRIBUTE, SET_BY_OWNER

_HFLM = "lm_eval.models.huggingface:HFLM"

PRIVATE_MEMBERS = (
    # `refusion lm-eval` is lm-eval's own CLI with our model, tasks and metric registered: lm-eval's public entry
    # point (`lm_eval.__main__.cli_evaluate`) parses `sys.argv` and exits; `HarnessCLI` is the parser and runner
    # behind it, which lets us check the parsed arguments before the run and read the results after.
    ("lm_eval._cli", "HarnessCLI", ATTRIBUTE),
    ("lm_eval._cli:HarnessCLI", "parse_args", "(self)"),
    # Reading a task's YAML as lm-eval does (`!function` tags, `include:`): lm-eval offers no public loader.
    ("lm_eval.tasks._yaml_loader", "load_yaml", "(path, resolve_func, recursive, _seen)"),
    # `RefusionLM` / `SideBySideLM` subclass HFLM (lm-eval's documented way to add a HF-based model) and override
    # these private steps of its `__init__` and generation (HFLM has no public hooks for them): the config class,
    # the tokenizer's error, loading without remote code, and the generate call.
    (_HFLM, "_get_config", "(self, pretrained, revision, trust_remote_code, gguf_file, subfolder)"),
    (
        _HFLM,
        "_create_tokenizer",
        "(self, pretrained, tokenizer, revision, trust_remote_code, use_fast_tokenizer, gguf_file, add_bos_token, "
        "subfolder)",
    ),
    (
        _HFLM,
        "_create_model",
        "(self, pretrained, revision, dtype, trust_remote_code, parallelize, gpus, max_memory_per_gpu, "
        "max_cpu_memory, offload_folder, tp_plan, peft, delta, autogptq, gptqmodel, gguf_file, quantization_config, "
        "subfolder, kwargs)",
    ),
    (_HFLM, "_model_generate", "(self, context, max_length, stop, generation_kwargs)"),
    # The process's rank and count behind HFLM's public `rank` / `world_size` (read-only properties), which HFLM
    # sets only when a process sees 2+ GPUs.
    (_HFLM, "_rank", SET_BY_OWNER),
    (_HFLM, "_world_size", SET_BY_OWNER),
)


@contextlib.contextmanager
def harness_cli(argv: list[str]) -> Iterator[object]:
    """lm-eval's CLI object, with `sys.argv` set to `lm-eval ARGV` within the block: `HarnessCLI.parse_args()` takes
    no arguments, it reads (and edits) `sys.argv`; `execute(parsed)` runs the command."""
    from lm_eval._cli import HarnessCLI

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        yield HarnessCLI()
    finally:
        sys.argv = saved


def load_task_yaml(path):
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=True)


def set_rank(lm, rank: int, world_size: int) -> None:
    """What HFLM's `rank` and `world_size` return from now on."""
    lm._rank, lm._world_size = rank, world_size


def stock_model_generate(lm, context, max_length, stop, **generation_kwargs):
    """HFLM's own `_model_generate`, past any override."""
    from lm_eval.models.huggingface import HFLM

    return HFLM._model_generate(lm, context, max_length, stop, **generation_kwargs)
