"""A run stopped at step N and resumed from its checkpoint ends with exactly the weights of an uninterrupted run.

The uninterrupted run saves `checkpoint-2` (mid-epoch) on its way; a fresh output directory that holds only that
checkpoint, resumed through `refusion train --resume-from-checkpoint`, must reach bit-identical final weights. The
setup makes this a hard test: 11 examples, batch 2, gradient accumulation 2 (3 optimizer steps per epoch, the last
one short), 7 steps, so the resumed run skips batches mid-epoch and crosses two epoch boundaries, where the
collator's epoch-keyed draws must also match.
"""

import json
import shutil

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
