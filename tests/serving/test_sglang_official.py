"""The tiny official-format checkpoint (`Qwen3ForCausalLM` with a `mask_token_id`) on SGLang: the oracle's golden
cases of two configurations (one slot per block; two slots per block), the authors' float64 answers, decoded in
float32 (cases marked numerically sensitive are left out). Runs in .venv-sglang (`make test-sglang`)."""

from __future__ import annotations

import json

import pytest

from tests.serving.sglang_engine import greedy, start_engine
from tests.serving.sglang_golden import DATA, GOLDEN

ORACLE = json.loads(GOLDEN.read_text())["oracle"]


@pytest.fixture(scope="module", params=sorted(ORACLE))
def configuration(request):
    """(engine, the configuration's cases), one engine at a time."""
    engine = start_engine(DATA / "tiny-qwen3-refusion", ORACLE[request.param]["settings"])
    yield engine, ORACLE[request.param]["cases"]
    engine.shutdown()


def test_golden_cases_one_at_a_time_and_together(configuration):
    engine, cases = configuration
    for case in cases:
        output = engine.generate(input_ids=case["prompt_ids"], sampling_params=greedy(case["max_new_tokens"]))
        assert output["output_ids"] == case["expected"], case["id"]
    budgets = [greedy(case["max_new_tokens"]) for case in cases]
    outputs = engine.generate(input_ids=[case["prompt_ids"] for case in cases], sampling_params=budgets)
    assert [output["output_ids"] for output in outputs] == [case["expected"] for case in cases]
