"""A run stopped at step N and resumed from its checkpoint ends with exactly the weights of an uninterrupted run.

The uninterrupted run saves `checkpoint-2` (mid-epoch) on its way; a fresh output directory that holds only that
checkpoint, resumed through `refusion train --resume-from-checkpoint`, must reach bit-identical final weights. The
setup makes this a hard test: 11 examples, batch 2, gradient accumulation 2 (3 optimizer steps per epoch, the last
one short), 7 steps, so the resumed run skips batches mid-epoch and crosses two epoch boundaries, where the
collator's epoch-keyed draws must also match.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from refusion_hf.cli import main
from tests.training.toy import train_args, write_toy_jsonl

ARGS = [
    "--max-steps", "7",
    "--per-device-train-batch-size", "2",
    "--gradient-accumulation-steps", "2",
    "--learning-rate", "3e-3",
    "--save-steps", "2",
    "--logging-steps", "1",
    "--seed", "0",
    "--slot-sizes", "2,4",
    "--disable-tqdm", "true",
]  # fmt: skip


def test_resumed_run_matches_uninterrupted_run(fixture_path, tmp_path):
    data = write_toy_jsonl(tmp_path / "toy.jsonl", count=11, seed=1)
    full = tmp_path / "full"
    assert main(train_args(fixture_path, data, full, *ARGS)) == 0

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    assert main(train_args(fixture_path, data, resumed, *ARGS, "--resume-from-checkpoint", "last")) == 0

    expected, got = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after resuming"
    assert not torch.equal(
        expected["lm_head.weight"], load_file(full / "checkpoint-2" / "model.safetensors")["lm_head.weight"]
    ), "training went on after the checkpoint"

    def losses(folder):
        history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
        keys = ("loss", "ar_loss", "mdm_loss")
        return {entry["step"]: tuple(entry[key] for key in keys) for entry in history if "loss" in entry}

    full_losses, resumed_losses = losses(full), losses(resumed)
    assert set(full_losses) == set(range(1, 8))
    for step in range(3, 8):
        assert resumed_losses[step] == full_losses[step], f"step {step}: the resumed run saw different batches"


def _same_weights(a, b) -> bool:
    expected, got = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return expected.keys() == got.keys() and all(torch.equal(expected[name], got[name]) for name in expected)


@pytest.fixture(scope="module")
def full_run(fixture_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    data = write_toy_jsonl(root / "toy.jsonl", count=11, seed=1)
    assert main(train_args(fixture_path, data, root / "full", *ARGS)) == 0
    return root / "full", data


def _truncate(path):
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


@pytest.mark.parametrize(
    "damage",
    [
        lambda folder: _truncate(folder / "model.safetensors"),
        lambda folder: _truncate(folder / "optimizer.pt"),
        lambda folder: (folder / "trainer_state.json").unlink(),
        lambda folder: (folder / "scheduler.pt").unlink(),
    ],
    ids=["weights cut", "optimizer cut", "no state", "no scheduler"],
)
def test_last_skips_a_half_written_checkpoint(fixture_path, full_run, tmp_path, damage, capsys):
    """A kill during a save leaves the newest checkpoint half-written: `last` resumes from the newest complete one,
    says so, and ends with the uninterrupted run's weights."""
    full, data = full_run
    resumed = tmp_path / "resumed"
    for name in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        shutil.copytree(full / name, resumed / name)
    damage(resumed / "checkpoint-6")
    assert main(train_args(fixture_path, data, resumed, *ARGS, "--resume-from-checkpoint", "last")) == 0
    assert "resuming from checkpoint-4; skipped newer incomplete checkpoint-6" in capsys.readouterr().err
    assert _same_weights(full, resumed)


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.4, 1.0])
def test_a_killed_run_resumes_to_the_same_weights(fixture_path, full_run, tmp_path, delay):
    """SIGKILL a real training process as soon as (or a little after) it starts writing checkpoint-4, i.e. during
    that save or just after it, then resume with `last`."""
    full, data = full_run
    run = tmp_path / "killed"
    # Each optimizer step sleeps 0.3 s in the killed process (a sitecustomize on its path; results unchanged), so
    # the kill lands where the delay says instead of after the end of a run that lasts a fraction of a second.
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import time, transformers\n"
        "step = transformers.Trainer.training_step\n"
        "def slow_step(self, *args, **kwargs):\n    time.sleep(0.3)\n    return step(self, *args, **kwargs)\n"
        "transformers.Trainer.training_step = slow_step\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(slow), *sys.path])}
    command = [sys.executable, "-m", "refusion_hf.cli", *train_args(fixture_path, data, run, *ARGS)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 240
    while not (run / "checkpoint-4").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(delay)
    process.kill()
    process.wait()
    assert (run / "checkpoint-2").exists() and not (run / "model.safetensors").exists(), "killed mid-run"
    assert main(train_args(fixture_path, data, run, *ARGS, "--resume-from-checkpoint", "last")) == 0
    assert _same_weights(full, run)
