"""Smoke tests of the benchmarks at tiny sizes (the GPU-readiness one at its CPU shape; the real run needs a GPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_decoder_profile_runs_end_to_end_on_a_few_prompts(tmp_path):
    """The decoder-overhead and batch-scaling benchmark at a tiny size: every figure it reports is there and sane,
    and continuous batching gives the same answers as fixed batches."""
    out = tmp_path / "decoder_profile.json"
    command = [sys.executable, "decoder_profile.py", "--prompts", "2", "--stream", "3", "--batch-sizes", "1,2",
               "--repeats", "1", "--skip-wide", "--out", str(out)]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads(out.read_text())
    for dtype in ("bfloat16", "float32"):
        for batch in ("1", "2"):
            refusion = results["embedded"][dtype][batch]["refusion"]
            assert 0 <= refusion["outside_forward_share"] < 1 and refusion["host_reads_per_forward"] > 0
            assert 0 <= refusion["padding_share"] < 1 and 1 <= refusion["rows_active_per_forward"] <= int(batch)
        stream = results["continuous_batching"][dtype]["2"]
        assert stream["prompts"] == 3 and stream["continuous"]["rows_active_per_forward"] <= 2
    # float32 is batch-invariant (bfloat16 may flip a near tie when the batch's composition changes)
    assert results["continuous_batching"]["float32"]["2"]["same_answers"] == 3


def test_decoder_ab_compares_against_a_commit_with_identical_tokens(tmp_path):
    """The A/B of this checkout's decoder against a commit's (here HEAD's, the one commit a clone surely has)."""
    out = tmp_path / "decoder_ab.json"
    command = [sys.executable, "decoder_ab.py", "--baseline", "HEAD", "--prompts", "2", "--batch-sizes", "1,2",
               "--repeats", "1", "--max-new-tokens", "16", "--out", str(out)]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch_size"] for row in rows] == [1, 2]
    assert all(row["baseline_over_current_wall_time"] > 0 for row in rows)


def test_heldout_comparison_runs_end_to_end_on_the_fixture(tmp_path):
    """The held-out comparison at a tiny size: ReFusion decoding of a model beside a baseline model, plus a previous
    model, on two seeds; every row has what the summary needs."""
    fixture = BENCHMARKS.parent / "tests" / "data" / "tiny-qwen3-refusion"
    out = tmp_path / "heldout.json"
    command = [sys.executable, "heldout_comparison.py", "--model", str(fixture), "--baseline-model", str(fixture),
               "--previous-model", str(fixture), "--seeds", "1,2", "--limit", "2", "--num-threads", "1",
               "--out", str(out), "--", "--max-new-tokens", "6", "--timing-repeats", "1"]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [row["seed"] for row in results["seeds"]] == [1, 2]
    targets = results["targets"]
    for row in results["seeds"]:
        assert row["speedup"] > 0 and 0 <= row["refusion_accuracy"] <= 1 and "previous_accuracy" in row
        behind = 100 * (row["baseline_accuracy"] - row["refusion_accuracy"])
        assert row["points_behind"] == pytest.approx(behind, abs=0.01)
        assert row["speedup"] == pytest.approx(row["refusion_tokens_per_second"] / row["baseline_tokens_per_second"])
        close = row["points_behind"] <= targets["points_behind_at_most"]
        assert row["meets_targets"] is (close and row["speedup"] >= targets["speedup_at_least"])
    summary = results["summary"]
    assert summary["seeds_meeting_targets"] == sum(row["meets_targets"] for row in results["seeds"])
    assert summary["min_speedup"] == min(row["speedup"] for row in results["seeds"])
