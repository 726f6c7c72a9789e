"""`refusion train` under `accelerate launch` with two processes on CPU (DDP over gloo): a few steps, one save.

accelerate 1.x starts several CPU processes only through mpirun (`--cpu --num_processes 2` without a hostfile
starts one), so the CPU DDP launch is `--multi_gpu --num_processes 2` (torchrun) with the TrainingArguments flag
`--use-cpu`.
"""

import json
import os
import socket
import subprocess
import sys

import torch
from safetensors.torch import load_file

from tests.training.toy import train_args, write_toy_jsonl


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def teardown_abort_after_training(result: subprocess.CompletedProcess, out) -> bool:
    """Whether a failed launch is the gloo teardown abort seen with torch 2.13 on this 2-core machine: training
    finished and everything was written, then one process aborted at interpreter exit ("terminate called without
    an active exception", SIGABRT) and the launcher stopped the other. Measured: 2 launches in 17. Destroying
    the process group before exit (`Accelerator.end_training`) traded it for a hang at exit (2 in 38), so the
    code is unchanged and the test launches once more in exactly this case; any other failure fails at once."""
    finished = "'train_loss'" in result.stdout and (out / "model.safetensors").exists()
    return finished and "terminate called without an active exception" in result.stderr


def test_accelerate_launch_two_cpu_processes(fixture_path, tmp_path):
    data = write_toy_jsonl(tmp_path / "toy.jsonl", count=16, seed=2)
    out = tmp_path / "ddp"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port()), "-m", "refusion_hf.cli"]
    command = launch + train_args(
        fixture_path,
        data,
        out,
        "--use-cpu",
        "--max-steps", "4",
        "--per-device-train-batch-size", "2",
        "--logging-steps", "2",
        "--learning-rate", "3e-3",
        "--save-strategy", "no",
        "--disable-tqdm", "true",
    )  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    if result.returncode != 0 and teardown_abort_after_training(result, out):
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("[refusion train]") == 1, "only the main process reports"
    assert "2 process(es)" in result.stdout

    state = json.loads((out / "trainer_state.json").read_text())
    # 4 steps x 2 processes x batch 2 = 16 examples = exactly one epoch (a single process would be at 0.5)
    assert state["epoch"] == 1.0 and state["global_step"] == 4
    logs = [entry for entry in state["log_history"] if "loss" in entry]
    assert [entry["step"] for entry in logs] == [2, 4]
    assert all({"ar_loss", "mdm_loss"} <= set(entry) for entry in logs)
    assert not list(out.glob("checkpoint-*")), "saved once, at the end"
    trained, base = load_file(out / "model.safetensors"), load_file(fixture_path / "model.safetensors")
    assert not torch.equal(trained["lm_head.weight"], base["lm_head.weight"])
