"""Smoke test of the GPU-readiness benchmark at its CPU shape (the real run needs a GPU; see its docstring)."""

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_gpu_readiness_runs_end_to_end_at_the_tiny_shape(tmp_path):
    out = tmp_path / "gpu_readiness.json"
    command = [sys.executable, "gpu_readiness.py", "--shape", "tiny", "--device", "cpu", "--repeats", "1", "--out",
               str(out)]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads(out.read_text())
    kinds = {(row["cache"], row["query"]) for row in results["forward_latency"]}
    assert {(64, 1), (256, 128)} <= kinds
    decodings = {(row["batch"], row["decoding"]) for row in results["end_to_end"]}
    assert (8, "HF greedy") in decodings and (1, "ReFusion, forced: all accepted") in decodings
    assert results["overhead"]["forward_passes"] > 0 and 0 <= results["overhead"]["share_outside_forward"] < 1
