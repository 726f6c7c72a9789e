"""`refusion train` on a full disk: one line of error, and no checkpoint folder left half-written. The write fails at
the boundary with the file system, in the writer the Trainer calls (safetensors for the weights, `torch.save` for
the optimizer: each fails on a full disk with its own error, as measured on a small tmpfs), then the folder is looked
at from outside; as root, also on a real full disk (a 200 KiB tmpfs mounted for the test)."""

import os
import subprocess

import pytest
import torch
from safetensors import SafetensorError
from transformers import modeling_utils

from refusion_hf.cli import main
from tests.training.toy import train_args, write_toy_jsonl

ONE_SAVED_STEP = ["--max-steps", "1", "--save-steps", "1", "--report-to", "none", "--disable-tqdm", "true"]


def one_line_error(capsys, argv) -> str:
    """`refusion ARGV` fails as a user error: status 2, one line (progress bars aside), no traceback."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line and not line.startswith("note:")]
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("refusion train: error: "), lines
    return lines[0].removeprefix("refusion train: error: ")


def half_written(path) -> None:
    with open(path, "wb") as handle:
        handle.write(b"half")


def safetensors_on_a_full_disk(state, path, *args, **kwargs):
    half_written(path)
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def torch_save_on_a_full_disk(obj, path, *args, **kwargs):
    half_written(path)
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")


@pytest.fixture
def data(tmp_path):
    return write_toy_jsonl(tmp_path / "toy.jsonl", count=4)


def test_weights_failing_to_write_leave_no_checkpoint(fixture_path, data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(modeling_utils, "safe_save_file", safetensors_on_a_full_disk)
    out = tmp_path / "run"
    message = one_line_error(capsys, train_args(fixture_path, data, out, *ONE_SAVED_STEP))
    assert message.startswith(f"--output-dir {out}: the disk is full: writing the checkpoint checkpoint-1 failed "
                              "(SafetensorError: Error while serializing: I/O error: No space left")  # fmt: skip
    assert message.endswith("the partial checkpoint-1 was removed; free space and resume with --resume-from-checkpoint "
                            "last.")  # fmt: skip
    assert sorted(os.listdir(out)) == [], "no checkpoint folder, complete-looking or not"


def test_the_optimizer_failing_to_write_leaves_no_checkpoint(fixture_path, data, tmp_path, capsys, monkeypatch):
    """The weights and config are whole by then: the folder would pass for a model; it goes too. torch's serializer
    does not say the disk is full, so the message says what it does know."""
    monkeypatch.setattr(torch, "save", torch_save_on_a_full_disk)
    out = tmp_path / "run"
    message = one_line_error(capsys, train_args(fixture_path, data, out, *ONE_SAVED_STEP))
    assert message.startswith(f"--output-dir {out}: writing the checkpoint checkpoint-1 failed (RuntimeError: [enforce "
                              "fail at inline_container.cc:672]")  # fmt: skip
    assert "MiB were free there when it failed" in message and "check the disk (a full one fails so)" in message
    assert sorted(os.listdir(out)) == []


@pytest.fixture
def full_disk(tmp_path):
    """A 200 KiB tmpfs (the fixture's weights alone are 329 kB); root only."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small-disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_disk(fixture_path, data, full_disk, capsys):
    out = full_disk / "run"
    message = one_line_error(capsys, train_args(fixture_path, data, out, *ONE_SAVED_STEP))
    assert message.startswith(f"--output-dir {out}: the disk is full: writing the checkpoint checkpoint-1 failed")
    assert sorted(os.listdir(out)) == []
