"""benchmarks/engine_throughput.py: the stock Qwen3 folder it saves computes the ReFusion checkpoint's logits
(main suite), and a tiny run of all three engines (two SGLang servers, two requests at concurrencies 1 and 2, and the
held-out check on two problems) writes its JSON with ReFusion-on-SGLang's answers equal to generate()'s (`make
test-sglang`; skipped without SGLang)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_module():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import engine_throughput
    finally:
        sys.path.remove(str(BENCHMARKS))
    return engine_throughput


def test_the_stock_qwen3_folder_holds_the_same_network(tmp_path):
    from transformers import Qwen3ForCausalLM

    from refusion_hf import RefusionForCausalLM
    from tests.serving.sglang_golden import embedded_model_path

    folder = benchmark_module().save_stock_qwen3(str(embedded_model_path()), tmp_path / "qwen3")
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["architectures"], "mask_token_id" in config) == (
        "qwen3", ["Qwen3ForCausalLM"], False)  # fmt: skip
    assert not list(folder.glob("*.py"))  # a stock folder: no remote code
    stock = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    refusion = RefusionForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32)
    ids = torch.tensor([[768, 5, 17, 300, 41, 2]])
    torch.testing.assert_close(stock(ids).logits, refusion(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(("decoding", "configuration"), [("installed", "installed"), ("one-slot", "one_slot")])
def test_the_generate_engine_decodes_with_the_chosen_settings(decoding, configuration):
    """The `generate` engine's answers are generate()'s with `--decoding`'s settings (the golden file), alone and
    batched: prompts 12 and 24 are ones the two settings answer differently."""
    from refusion_hf import RefusionForCausalLM
    from tests.serving.sglang_golden import GOLDEN, embedded_model_path

    golden = json.loads(GOLDEN.read_text())["embedded"]
    answers = golden["configurations"][configuration]["answers"]
    engine_throughput = benchmark_module()
    model = RefusionForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32).eval()
    engine_throughput.decode_with(model, decoding, golden["max_new_tokens"])
    prompts = [golden["prompts"][12], golden["prompts"][24]]
    for concurrency in (1, 2):
        load = engine_throughput.generate_load(model, prompts, concurrency, golden["max_new_tokens"])
        assert load["answers"] == [answers[12], answers[24]]


def test_the_held_out_check_refuses_a_decision_seed_or_none():
    engine_throughput = benchmark_module()
    with pytest.raises(SystemExit, match="is a decision seed"):
        engine_throughput.check_seed_is_held_out(7)
    with pytest.raises(SystemExit, match="needs --check-seed"):
        engine_throughput.check_seed_is_held_out(None)


def test_a_tiny_run_of_all_three_engines(tmp_path):
    pytest.importorskip("sglang")
    out = tmp_path / "throughput.json"
    command = [sys.executable, "engine_throughput.py", "--concurrency", "1", "2", "--requests", "2",
               "--max-tokens", "16", "--check-problems", "2", "--check-seed", "550099", "--check-tiers", "standard",
               "--out", str(out)]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    written = json.loads(out.read_text())
    assert written["provenance"]["command"].startswith("python benchmarks/engine_throughput.py")
    rows = {(row["engine"], row["concurrency"]): row for row in written["results"]}
    assert set(rows) == {(engine, c) for engine in ("refusion-sglang", "qwen3-sglang", "generate") for c in (1, 2)}
    for row in rows.values():
        assert row["requests"] == 2 and 0 < row["completion_tokens"] <= 32 and row["tokens_per_s"] > 0
    assert rows[("refusion-sglang", 1)]["answers_equal_to_generate"] == 2
    assert rows[("refusion-sglang", 2)]["answers_equal_to_generate"] == 2
    pairs = {f"refusion-sglang/{base}@{c}" for base in ("qwen3-sglang", "generate") for c in (1, 2)}
    assert set(written["ratios"]) == pairs
    assert written["settings"]["decoding"] == "installed"
    (check,) = written["check"]
    assert (check["tier"], check["answers_equal_to_generate"], check["problems"]) == ("standard", 2, 2)
    assert check["sglang_forwards"] > check["generate_forwards"] > 0
