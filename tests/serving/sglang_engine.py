"""One SGLang engine (in-process API, `sglang.Engine`) decoding with `--dllm-algorithm ReFusion` on this CPU, for the
tests in .venv-sglang (`make test-sglang`). Skips the test module where SGLang is not installed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def start_engine(model_path: Path | str, settings: dict, max_running_requests: int = 4):
    """The engine, with `settings` as the `--dllm-algorithm-config` file. float32, SGLang's torch_native attention."""
    pytest.importorskip("sglang")
    yaml = pytest.importorskip("yaml")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sglang

    config = Path(tempfile.mkdtemp(prefix="refusion-sglang-")) / "refusion.yaml"
    config.write_text(yaml.safe_dump(settings))
    return sglang.Engine(
        model_path=str(model_path),
        device="cpu",
        attention_backend="torch_native",
        skip_tokenizer_init=True,
        disable_prefill_cuda_graph=True,
        disable_decode_cuda_graph=True,
        dtype="float32",
        max_total_tokens=4096,
        max_running_requests=max_running_requests,
        mem_fraction_static=0.05,
        dllm_algorithm="ReFusion",
        dllm_algorithm_config=str(config),
        log_level="warning",
    )


def greedy(max_new_tokens: int) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens}
