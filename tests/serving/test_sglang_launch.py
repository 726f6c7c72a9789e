"""`refusion serve --engine sglang`'s flags (`refusion_hf.serving.sglang_launch`): each `refusion serve` flag becomes
SGLang's flag of the same meaning or is refused by name, the CPU arguments come with a CPU, decoding settings the
plugin cannot honour are one line before SGLang starts, and a missing SGLang is one line naming how to install
it. SGLang itself is replaced by a recorder of the launch arguments (`_compat.sglang.serve`), so these run in the main
suite; the real server is tests/serving/test_sglang_serve.py (`make test-sglang`)."""

from __future__ import annotations

import os
import re

import pytest

from refusion_hf import cli
from refusion_hf._compat import sglang as seam
from refusion_hf.serving import sglang_launch
from refusion_hf.serving.sglang_names import ATTENTION_BACKEND
from tests.serving.sglang_golden import embedded_model_path

EXACT = "block_size: 8\nslot_size: 8\nremask_threshold: null\n"


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Runs `refusion serve --engine sglang ARGS` with SGLang "installed" and its server replaced by a recorder;
    returns (exit status, SGLang's arguments as {flag: value}, SGLANG_USE_CPU_ENGINE at launch)."""
    calls = []
    monkeypatch.setattr(sglang_launch, "sglang_installed", lambda: True)
    monkeypatch.setattr(seam, "serve", lambda argv: calls.append((list(argv), os.environ.get("SGLANG_USE_CPU_ENGINE"))))
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    config = tmp_path / "refusion.yaml"
    config.write_text(EXACT)

    def launch(*args, config_file=True):
        extra = ["--dllm-algorithm-config", str(config)] if config_file else []
        status = cli.main(["serve", "--engine", "sglang", *args, *extra])
        if not calls:
            return status, None, None
        argv, cpu_engine = calls.pop()
        return status, as_flags(argv), cpu_engine

    return launch


def as_flags(argv: list[str]) -> dict:
    """SGLang's argument list as {flag: value} (a flag without a value: True; a repeated flag: its last value)."""
    flags, i = {}, 0
    while i < len(argv):
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        flags[argv[i]] = argv[i + 1] if takes_value else True
        i += 2 if takes_value else 1
    return flags


def test_each_flag_becomes_sglangs_flag_of_the_same_meaning(launched, tmp_path):
    status, flags, cpu_engine = launched(
        str(embedded_model_path()), "--host", "127.0.0.2", "--port", "4321", "--dtype", "float32",
        "--continuous-batching", "--max-num-seqs", "4", "--served-model-name", "tiny", "--max-model-len", "256",
        "--api-key", "k3y", "--max-queued-requests", "7", "--log-level", "info",
    )  # fmt: skip
    assert status == 0
    assert flags["--model-path"] == str(embedded_model_path())
    assert (flags["--host"], flags["--port"], flags["--dtype"]) == ("127.0.0.2", "4321", "float32")
    assert flags["--dllm-algorithm"] == "ReFusion"
    assert flags["--dllm-algorithm-config"] == str(tmp_path / "refusion.yaml")
    assert (flags["--max-running-requests"], flags["--served-model-name"]) == ("4", "tiny")
    assert (flags["--context-length"], flags["--api-key"], flags["--max-queued-requests"]) == ("256", "k3y", "7")
    assert flags["--log-level"] == "info"
    # no GPU here: the CPU arguments, a KV pool of the context for each running request
    assert (flags["--device"], flags["--attention-backend"], cpu_engine) == ("cpu", ATTENTION_BACKEND, "1")
    assert flags["--disable-prefill-cuda-graph"] and flags["--disable-decode-cuda-graph"]
    assert flags["--max-total-tokens"] == str(256 * 4)


def test_defaults_are_refusion_serves(launched):
    status, flags, _ = launched()
    assert status == 0
    assert flags["--model-path"] == str(embedded_model_path())  # the embedded model
    assert (flags["--host"], flags["--port"], flags["--dtype"]) == ("127.0.0.1", "8000", "auto")
    assert flags["--max-running-requests"] == "1"  # one request at a time without --continuous-batching
    assert flags["--max-total-tokens"] == "512"  # the model's max_position_embeddings
    assert "--api-key" not in flags and "--served-model-name" not in flags


def test_continuous_batching_runs_sixteen_requests_at_once_by_default(launched):
    assert launched("--continuous-batching")[1]["--max-running-requests"] == "16"


def test_engine_args_go_to_sglang_last(launched):
    _, flags, _ = launched("--engine-args=--tp-size 2 --max-total-tokens 99 --enable-metrics")
    assert (flags["--tp-size"], flags["--max-total-tokens"], flags["--enable-metrics"]) == ("2", "99", True)


@pytest.mark.parametrize(
    ("device", "gpu", "expected"),
    [("auto", True, {"--device": "cuda"}), ("cuda", True, {"--device": "cuda"}),
     ("cuda:1", True, {"--device": "cuda", "--base-gpu-id": "1"}), ("cpu", True, {"--device": "cpu"}),
     ("auto", False, {"--device": "cpu", "--attention-backend": ATTENTION_BACKEND})],
)  # fmt: skip
def test_device(device, gpu, expected):
    args = cli.build_parser().parse_args(["serve", "--engine", "sglang", "--device", device])
    flags = as_flags(sglang_launch.sglang_arguments(args, "M", gpu=gpu, context_length=64))
    assert {flag: flags.get(flag) for flag in expected} == expected
    assert ("--attention-backend" in flags) == (expected["--device"] == "cpu")


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--attn-implementation", "sdpa"], "--attn-implementation is refusion serve's own"),
     (["--trust-request-chat-template"], "--trust-request-chat-template is refusion serve's own"),
     (["--request-chat-template-seconds", "10"], "--request-chat-template-seconds is refusion serve's own"),
     (["--shutdown-timeout", "10"], "--shutdown-timeout is refusion serve's own"),
     (["--dtype", "float64"], "--dtype float64: SGLang serves auto, bfloat16, float32"),
     (["--served-model-name", "a", "b"], "--served-model-name: SGLang's server answers to one name"),
     (["--device", "mps"], "--device mps: with --engine sglang, one of auto, cpu, cuda, cuda:N"),
     (["--max-num-seqs", "4"], "--max-num-seqs .* 4: without --continuous-batching"),
     (['--engine-args=--tp-size "2'], "--engine-args: No closing quotation")],
)  # fmt: skip
def test_a_flag_sglang_cannot_honour_is_refused_by_name(launched, capsys, args, message):
    status, flags, _ = launched(*args)
    assert (status, flags) == (2, None)
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1
    assert re.search(f"refusion serve: error: {message}", error), error


def test_the_installed_decoding_launches_without_a_settings_file(launched):
    """The embedded model's own decoding (block 16, two slots, remasking) is what SGLang decodes by default."""
    status, flags, _ = launched(config_file=False)
    assert status == 0 and "--dllm-algorithm-config" not in flags


@pytest.mark.parametrize(
    ("generation_config", "named"),
    [({"suppress_tokens": [5]}, "suppress_tokens"), ({"min_new_tokens": 3}, "min_new_tokens"),
     ({"bad_words_ids": [[5]], "renormalize_logits": True}, "bad_words_ids, renormalize_logits")],
)  # fmt: skip
def test_a_logits_constraint_in_the_checkpoint_is_one_line_before_sglang_starts(
    launched, capsys, tmp_path, generation_config, named
):
    """generate() applies a checkpoint's logits constraints; SGLang's drafts are the plain argmax: refused, named."""
    import json
    import shutil

    folder = tmp_path / "constrained"
    shutil.copytree(embedded_model_path(), folder)
    own = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**own, **generation_config}))
    status, flags, _ = launched(str(folder), config_file=False)
    assert (status, flags) == (2, None)
    error = capsys.readouterr().err
    assert error.startswith(f"refusion serve: error: {folder}: its generation config sets {named}, "), error
    assert "refusion serve" in error and len(error.strip().splitlines()) == 1


def test_an_unknown_setting_is_one_line(launched, capsys, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("slot_sise: 8\n")
    status, _, _ = launched("--dllm-algorithm-config", str(config), config_file=False)
    assert status == 2
    assert "unknown ReFusion setting(s) ['slot_sise']" in capsys.readouterr().err


def test_an_unreadable_settings_file_is_one_line(launched, capsys, tmp_path):
    status, _, _ = launched("--dllm-algorithm-config", str(tmp_path / "missing.yaml"), config_file=False)
    assert status == 2
    assert capsys.readouterr().err.startswith(f"refusion serve: error: --dllm-algorithm-config {tmp_path}")


def test_without_sglang_one_line_names_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(sglang_launch, "sglang_installed", lambda: False)
    assert cli.main(["serve", "--engine", "sglang"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("refusion serve: error: --engine sglang: SGLang is not installed")
    assert "make sglang" in error and "pip install -e '.[sglang,serving]'" in error
    assert len(error.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [["--dllm-algorithm-config", "x.yaml"], ["--engine-args=--tp-size 2"]])
def test_the_refusion_engine_refuses_sglangs_flags(args, capsys):
    assert cli.main(["serve", *args]) == 2
    assert capsys.readouterr().err.startswith(f"refusion serve: error: {args[0].split('=')[0]} ")


def test_knobs_a_checkpoint_leaves_unset_take_generates_defaults(tmp_path):
    """A folder whose generation config has no ReFusion knob (a `save_pretrained` of a fresh model) decodes with the
    knobs' declared defaults, as `generate()` merges them; an unset block_size is derived from slot_size as there."""
    import shutil

    from refusion_hf.generation.refusion_generation_config import REFUSION_FIELDS
    from refusion_hf.serving.sglang_plugin import refusion_settings

    shutil.copy(embedded_model_path() / "config.json", tmp_path / "config.json")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2}')
    knobs = refusion_settings(str(tmp_path), {"slot_size": 8, "block_size": 8})["knobs"]
    assert (knobs["slot_size"], knobs["token_threshold"]) == (8, REFUSION_FIELDS["token_threshold"])
    assert refusion_settings(str(tmp_path), {"slot_size": 8})["knobs"]["block_size"] == 128  # 128 is a multiple of 8


def test_a_folder_without_tokenizer_files_is_one_line(launched, capsys, tmp_path):
    import shutil

    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(embedded_model_path() / name, folder / name)
    status, flags, _ = launched(str(folder))
    assert (status, flags) == (2, None)
    error = capsys.readouterr().err
    assert error.startswith(f"refusion serve: error: MODEL {folder}: the folder has no tokenizer files")
