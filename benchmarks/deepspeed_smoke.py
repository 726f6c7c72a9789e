"""DeepSpeed smoke run on GPUs: `refusion train` under configs/accelerate/deepspeed_zero2.yaml and
deepspeed_zero3.yaml, each trained, checkpointed in DeepSpeed's own format, resumed with
`--resume-from-checkpoint last`, and its final save loaded with from_pretrained; plus a LoRA run under ZeRO-2.

DeepSpeed cannot run on a machine without GPUs through accelerate (docs/training.md says why), so the CPU suite tests
the configs and the refusals only (tests/training/test_engine_configs.py) and this script is the check of the runs
themselves. It uses the suite's tiny fixture checkpoint and toy data, 4 steps each (about a minute per stage, most
of it process start-up). NCCL refuses two processes on one GPU, so it launches one process per GPU, at most 2
(`--num-processes` to change); ZeRO on one process still runs the engine, its checkpoints and its saves.

    pip install -e ".[deepspeed]"                       # DeepSpeed (compiles its ops on first use)
    python benchmarks/deepspeed_smoke.py                # writes benchmarks/results/deepspeed_smoke.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.training.toy: the suite's toy data

from results_file import write_results  # noqa: E402
from tests.training.toy import train_args, write_toy_jsonl  # noqa: E402

FIXTURE = REPO / "tests" / "data" / "tiny-qwen3-refusion"
STEPS = ["--max-steps", "4", "--save-steps", "2", "--per-device-train-batch-size", "2", "--logging-steps", "1",
         "--learning-rate", "3e-3", "--bf16", "--disable-tqdm", "true"]  # fmt: skip


def launch(config: str, processes: int, out: Path, data: Path, *extra: str) -> float:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "configs" / "accelerate" / f"{config}.yaml"), "--num_processes", str(processes),
               "-m", "refusion_hf.cli", *train_args(FIXTURE, data, out, *STEPS, *extra)]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if result.returncode != 0:
        raise SystemExit(f"{config} {' '.join(extra)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return time.perf_counter() - start


def logged_losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def check_run(config: str, processes: int, work: Path, data: Path) -> dict:
    """Train, resume from the copied checkpoint-2 into a fresh folder, compare, and load the final saves."""
    from refusion_hf import RefusionForCausalLM

    full, resumed = work / f"{config}_full", work / f"{config}_resumed"
    seconds = launch(config, processes, full, data)
    checkpoint = full / "checkpoint-2"
    engine_files = sorted(str(path.relative_to(checkpoint)) for path in checkpoint.rglob("*") if path.is_file())
    assert (checkpoint / "latest").is_file(), f"{config}: checkpoint-2 is not in DeepSpeed's format: {engine_files}"
    resumed.mkdir()
    shutil.copytree(checkpoint, resumed / "checkpoint-2")
    seconds += launch(config, processes, resumed, data, "--resume-from-checkpoint", "last")
    losses, resumed_losses = logged_losses(full), logged_losses(resumed)
    for step in (3, 4):
        assert abs(resumed_losses[step] - losses[step]) <= 1e-2 * abs(losses[step]), (config, step)
    trained = RefusionForCausalLM.from_pretrained(full, dtype=torch.float32)
    again = RefusionForCausalLM.from_pretrained(resumed, dtype=torch.float32)
    base = RefusionForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32)
    differs = not torch.equal(trained.lm_head.weight, base.lm_head.weight)
    drift = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), again.parameters()))
    assert differs, f"{config}: the saved model equals the base model"
    return {"seconds": round(seconds, 1), "losses": losses, "resumed_losses": resumed_losses,
            "max_weight_difference_resumed": drift, "checkpoint_files": engine_files}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-processes", type=int, default=None, help="default: min(2, GPUs)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "deepspeed_smoke.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("deepspeed_smoke.py needs a CUDA GPU (accelerate runs DeepSpeed only on GPUs).")
    if importlib.util.find_spec("deepspeed") is None:
        raise SystemExit("deepspeed_smoke.py needs DeepSpeed: pip install -e '.[deepspeed]'.")
    processes = args.num_processes or min(2, torch.cuda.device_count())
    results = {"gpu": torch.cuda.get_device_name(0), "processes": processes, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        data = write_toy_jsonl(work / "toy.jsonl", count=16, seed=2)
        for config in ("deepspeed_zero2", "deepspeed_zero3"):
            results[config] = check_run(config, processes, work, data)
        lora = work / "zero2_lora"
        results["deepspeed_zero2_lora_seconds"] = round(launch("deepspeed_zero2", processes, lora, data, "--lora"), 1)
        assert (lora / "adapter_model.safetensors").is_file()
    write_results(results, args.out)


if __name__ == "__main__":
    main()
