"""`refusion generate`: streams the answer, prints the numbers, compares with AR, draws the decoding order."""

import re

import pytest

from refusion_hf.cli import main
from tests.cli_errors import user_error

ARGS = ["--max-new-tokens", "12", "--slot-size", "4", "--slot-threshold", "0.6", "--token-threshold", "0.3"]


def test_generate_prints_refusion_and_autoregressive(fixture_path, capsys):
    assert main(["generate", "t5 t6 t7 t8", "--model", str(fixture_path), *ARGS]) == 0
    out = capsys.readouterr().out
    refusion = re.search(r"\[refusion\] (\d+) tokens, (\d+) forward passes, ([\d.]+) tokens/forward, ([\d.]+) tok", out)
    autoregressive = re.search(r"\[autoregressive\] (\d+) tokens, (\d+) forward passes", out)
    assert refusion and autoregressive
    tokens, passes, per_forward = int(refusion[1]), int(refusion[2]), float(refusion[3])
    assert 1 <= tokens <= 12 and abs(per_forward - tokens / passes) < 0.01
    assert int(autoregressive[1]) == int(autoregressive[2])


def test_default_model_is_embedded(capsys):
    assert main(["generate", "t5 t6", "--max-new-tokens", "4", "--slot-size", "2", "--no-compare"]) == 0
    assert "[refusion]" in capsys.readouterr().out


@pytest.mark.parametrize("suffix", [".png", ".html"])
def test_show_order_and_trace_picture(fixture_path, tmp_path, capsys, suffix):
    target = tmp_path / f"trace{suffix}"
    args = ["generate", "t5 t6 t7 t8", "--model", str(fixture_path), *ARGS, "--no-compare", "--show-order"]
    assert main([*args, "--trace-out", str(target)]) == 0
    out = capsys.readouterr().out
    assert "\033[" in out and "step 0" in out
    assert re.search(r"\[refusion\] slots committed per step: [\d ]+ \(slot size 4\); \d+ of \d+ steps", out)
    data = target.read_bytes()
    if suffix == ".png":
        assert data.startswith(b"\x89PNG") and len(data) > 1000
    else:
        [legend] = [line for line in out.split("\n") if line.startswith("\033[") and "step 0" in line]
        steps = len(re.findall(r"step \d+", legend))
        assert data.decode().count("<tr>") == steps >= 1


def test_trace_out_rejects_other_formats(fixture_path, tmp_path, capsys):
    assert re.search(
        r"--trace-out must end in .html or .png",
        user_error(
            capsys,
            [
                "generate",
                "t5",
                "--model",
                str(fixture_path),
                *ARGS,
                "--no-compare",
                "--trace-out",
                str(tmp_path / "t.svg"),
            ],
        ),
    )


@pytest.fixture
def bfloat16_checkpoint(fixture_path, tmp_path):
    import torch

    from refusion_hf import RefusionForCausalLM

    folder = tmp_path / "bf16"
    RefusionForCausalLM.from_pretrained(fixture_path, dtype=torch.bfloat16).save_pretrained(folder)
    for item in fixture_path.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens")):
            (folder / item.name).write_bytes(item.read_bytes())
    return folder


def test_auto_dtype_keeps_the_checkpoints_unless_the_cpu_lacks_bfloat16(bfloat16_checkpoint, monkeypatch, capsys):
    import torch

    from refusion_hf.modeling import loading as cli

    monkeypatch.setattr(cli, "cpu_has_bfloat16_instructions", lambda: True)
    assert cli.load_model_and_tokenizer(str(bfloat16_checkpoint))[0].dtype == torch.bfloat16
    assert cli.load_model_and_tokenizer(str(bfloat16_checkpoint), "float32")[0].dtype == torch.float32
    monkeypatch.setattr(cli, "cpu_has_bfloat16_instructions", lambda: False)
    assert cli.load_model_and_tokenizer(str(bfloat16_checkpoint))[0].dtype == torch.float32
    assert "no bfloat16 instructions: running in float32" in capsys.readouterr().err
    assert cli.load_model_and_tokenizer(str(bfloat16_checkpoint), "bfloat16")[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype must be one of"):
        cli.load_model_and_tokenizer(str(bfloat16_checkpoint), "float16")


def test_cpu_bfloat16_detection_reads_cpuinfo_flags(tmp_path):
    from refusion_hf.modeling.loading import cpu_has_bfloat16_instructions

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
    assert not cpu_has_bfloat16_instructions(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n")
    assert cpu_has_bfloat16_instructions(info)
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")  # Arm
    assert cpu_has_bfloat16_instructions(info)
    assert cpu_has_bfloat16_instructions(tmp_path / "missing")
