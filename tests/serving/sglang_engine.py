"""One SGLang engine (in-process API, `sglang.Engine`) decoding with `--dllm-algorithm ReFusion` on this CPU, for the
tests in .venv-sglang (`make test-sglang`). Skips the test module where SGLang is not installed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def start_engine(model_path: Path | str, settings: dict, max_running_requests: int = 4):
    """The engine, with `settings` as the `--dllm-algorithm-config` file (empty: none, the checkpoint's own settings).
    float32, the plugin's attention backend (SGLang's torch_native with ReFusion's masks)."""
    pytest.importorskip("sglang")
    yaml = pytest.importorskip("yaml")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sglang

    from refusion_hf.serving.sglang_names import ATTENTION_BACKEND

    config = None
    if settings:
        config = Path(tempfile.mkdtemp(prefix="refusion-sglang-")) / "refusion.yaml"
        config.write_text(yaml.safe_dump(settings))
    return sglang.Engine(
        model_path=str(model_path),
        device="cpu",
        attention_backend=ATTENTION_BACKEND,
        skip_tokenizer_init=True,
        disable_prefill_cuda_graph=True,
        disable_decode_cuda_graph=True,
        dtype="float32",
        max_total_tokens=4096,
        max_running_requests=max_running_requests,
        mem_fraction_static=0.05,
        dllm_algorithm="ReFusion",
        dllm_algorithm_config=None if config is None else str(config),
        log_level="warning",
    )


def greedy(max_new_tokens: int) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens}
