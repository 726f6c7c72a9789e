"""Data-parallel evaluation: `accelerate launch --num_processes 2 -m refusion_hf.cli lm-eval --model refusion ...` on
CPU (ACCELERATE_USE_CPU=1: gloo) gives the per-sample answers, verdicts and metrics of one process (greedy), each
process decoding its half of the requests, and the speed record counts the requests, tokens and forward passes of
both processes once (batch 1, so the forward passes per request do not depend on which requests share a batch)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from refusion_hf.cli import main
from refusion_hf.modeling.loading import default_model_path
from tests.cli_errors import user_error

PROBLEMS = 5  # 3 + 2: lm-eval pads the process with fewer requests by repeating its last one (not counted)


def lm_eval_args(out) -> list[str]:
    return ["lm-eval", "--model", "refusion", "--model_args", f"pretrained={default_model_path()},dtype=float32",
            "--tasks", "refusion_synthetic", "--metadata", json.dumps({"seed": 7, "num_problems": PROBLEMS}),
            "--apply_chat_template", "--batch_size", "1", "--log_samples", "--output_path", str(out)]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def outputs(out) -> tuple[dict, dict, dict]:
    (samples,) = out.rglob("samples_refusion_synthetic_*.jsonl")
    (results,) = out.rglob("results_*.json")
    # the first response: lm-eval appends a padding copy's answer to its request's responses too
    lines = samples.read_text().splitlines()
    by_doc = {s["doc_id"]: (s["resps"][0][0], s["exact_match"]) for s in map(json.loads, lines)}
    results = json.loads(results.read_text())
    return by_doc, results["results"]["refusion_synthetic"], results["refusion_decoding"]["tasks"]["refusion_synthetic"]


def test_two_processes_answer_and_score_as_one(tmp_path, capsys):
    one = tmp_path / "one"
    assert main(lm_eval_args(one)) == 0
    capsys.readouterr()

    two = tmp_path / "two"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(free_port()), "-m", "refusion_hf.cli", *lm_eval_args(two)]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("[refusion] refusion_synthetic:") == 1, "the main process reports, once"

    samples, metrics, speed = outputs(two)
    expected_samples, expected_metrics, expected_speed = outputs(one)
    assert len(samples) == PROBLEMS and samples == expected_samples
    assert metrics.keys() == expected_metrics.keys()
    for key, value in expected_metrics.items():  # the stderr sums in another order
        assert metrics[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key
    for key in ("requests", "tokens", "forward_passes"):
        assert speed[key] == expected_speed[key], key
    assert speed["requests"] == PROBLEMS, "each process decoded its half (both decoding all would count twice)"
    assert speed["tokens_per_forward"] == speed["tokens"] / speed["forward_passes"]
    assert speed["tokens_per_second"] == speed["tokens"] / speed["seconds"]


def test_refusion_eval_says_it_runs_in_one_process(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "-m refusion_hf.cli lm-eval --model refusion" in capsys.readouterr().out.replace("\n", " ")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under accelerate launch / torchrun
    message = user_error(capsys, ["eval", "--limit", "1"])
    assert message.startswith("2 processes were launched, but refusion eval runs in one"), message


def test_a_launch_accelerate_does_not_see_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's, without ACCELERATE_USE_CPU on a machine without GPUs
    message = user_error(capsys, lm_eval_args(tmp_path / "out"))
    assert message.startswith("2 processes were launched (WORLD_SIZE) but accelerate sees no distributed setup")
    assert "ACCELERATE_USE_CPU=1" in message


def test_the_command_leaves_torch_distributed_s_process_group(tmp_path):
    """What ends every launched process cleanly: `refusion lm-eval` leaves the process group (barrier, destroy)
    before exiting. A process that exits with gloo's group alive can die of SIGABRT in the interpreter's teardown
    ("terminate called without an active exception"); here a one-process group stands in for the launch."""
    import torch.distributed as dist

    from refusion_hf.evaluation.lm_eval_cli import leave_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        leave_process_group()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    leave_process_group()  # no group: nothing to do
