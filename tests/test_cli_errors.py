"""Every `refusion` command reports a user error as one line `refusion <command>: error: ...`, exit status 2, no
traceback, and writes nothing broken."""

import shutil

import pytest

from refusion_hf.cli import main
from tests.oracle import FIXTURE

UNWRITABLE = "/proc/refusion-no-such-dir/out"  # /proc refuses new entries, even for root


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    folders = {}
    for name in ("noconfig", "garbage", "truncated", "notokenizer", "good"):
        folders[name] = root / name
        shutil.copytree(FIXTURE, folders[name])
    (folders["noconfig"] / "config.json").unlink()
    (folders["garbage"] / "config.json").write_text("{not json")
    weights = folders["truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    for path in folders["notokenizer"].iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            path.unlink()
    data = root / "train.jsonl"
    data.write_text('{"query": "t5 t6", "response": "t7 t8"}\n' * 4)
    folders["data"] = data
    folders["root"] = root
    return folders


def _generate(bad, *args):
    return ["generate", "t5 t6", "--no-compare", "--max-new-tokens", "4", *args]


def _generate_good(bad, *args):
    return _generate(bad, "--model", str(bad["good"]), *args)


def _train_good(bad, out, *args):
    return _train(bad, "--model", str(bad["good"]), "--output-dir", out, *args)


def _train(bad, *args):
    return ["train", "--data", str(bad["data"]), "--max-steps", "1", "--report-to", "none", *args]


# name -> argv built from the `bad` folders (and `out`, a fresh output path)
CASES = {
    "generate missing model": lambda bad, out: _generate(bad, "--model", str(bad["root"] / "missing")),
    "generate no config": lambda bad, out: _generate(bad, "--model", str(bad["noconfig"])),
    "generate garbage config": lambda bad, out: _generate(bad, "--model", str(bad["garbage"])),
    "generate truncated weights": lambda bad, out: _generate(bad, "--model", str(bad["truncated"])),
    "generate no tokenizer": lambda bad, out: _generate(bad, "--model", str(bad["notokenizer"])),
    "generate bad slot size": lambda bad, out: _generate_good(bad, "--slot-size", "0"),
    "generate bad length": lambda bad, out: _generate_good(bad, "--max-new-tokens", "-3"),
    "generate bad trace format": lambda bad, out: _generate_good(bad, "--trace-out", f"{out}.svg"),
    "generate unwritable trace": lambda bad, out: _generate_good(bad, "--trace-out", f"{UNWRITABLE}.png"),
    "generate bad dtype": lambda bad, out: _generate(bad, "--dtype", "float16"),
    "generate negative temperature": lambda bad, out: _generate_good(bad, "--temperature", "-1"),
    "generate empty prompt": lambda bad, out: ["generate", "", "--model", str(bad["good"]), "--no-compare"],
    "generate unknown flag": lambda bad, out: _generate(bad, "--bogus"),
    "eval unwritable json": lambda bad, out: ["eval", "--limit", "1", "--json", f"{UNWRITABLE}.json"],
    "eval missing model": lambda bad, out: ["eval", "--limit", "1", "--model", str(bad["root"] / "missing")],
    "eval missing baseline model": lambda bad, out: ["eval", "--limit", "1", "--baseline-model",
                                                     str(bad["root"] / "missing")],
    "eval bad timeout": lambda bad, out: ["eval", "--limit", "1", "--code-timeout", "0"],
    "train no tokenizer": lambda bad, out: _train(bad, "--model", str(bad["notokenizer"]), "--output-dir", out),
    "train missing data": lambda bad, out: ["train", "--data", str(bad["root"] / "none.jsonl"), "--model",
                                            str(bad["good"]), "--output-dir", out],
    "train bad slot sizes": lambda bad, out: _train_good(bad, out, "--slot-sizes", "4,x"),
    "train bad ar fraction": lambda bad, out: _train_good(bad, out, "--ar-fraction", "1.5"),
    "train unwritable output": lambda bad, out: _train(bad, "--model", str(bad["good"]), "--output-dir", UNWRITABLE),
    "train unknown flag": lambda bad, out: _train_good(bad, out, "--bogus-flag", "1"),
    "train garbage config": lambda bad, out: _train(bad, "--model", str(bad["garbage"]), "--output-dir", out),
    "convert no tokenizer": lambda bad, out: ["convert", "--base", str(bad["notokenizer"]), "--out", out],
    "convert garbage config": lambda bad, out: ["convert", "--base", str(bad["garbage"]), "--out", out],
    "convert truncated weights": lambda bad, out: ["convert", "--base", str(bad["truncated"]), "--out", out],
    "convert unwritable out": lambda bad, out: ["convert", "--base", str(bad["good"]), "--out", UNWRITABLE],
    "publish truncated weights": lambda bad, out: ["publish", "--model", str(bad["truncated"]), "--out", out],
    "publish garbage config": lambda bad, out: ["publish", "--model", str(bad["garbage"]), "--out", out],
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_user_errors_are_one_line_with_status_2(bad, name, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    argv = CASES[name](bad, str(out))
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse
        code = exit.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("Loading", "note:"))]
    assert code == 2, (name, err)
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith(f"refusion {argv[0]}: error: "), lines
    assert not (out / "model.safetensors").exists(), "nothing half-written"


def test_tokenizer_less_folders_are_refused_before_anything_is_written(bad, tmp_path, capsys):
    out = tmp_path / "converted"
    assert main(["convert", "--base", str(bad["notokenizer"]), "--out", str(out)]) == 2
    assert "no tokenizer files" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir()), "nothing written"
