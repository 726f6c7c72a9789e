"""The tiny official-format checkpoint (`Qwen3ForCausalLM` with a `mask_token_id`) on SGLang: the oracle's golden
cases of the one configuration SGLang runs exactly (slot = block = 8), the authors' float64 answers, decoded in
float32 (none of these cases is marked numerically sensitive). Runs in .venv-sglang (`make test-sglang`)."""

from __future__ import annotations

import json

import pytest

from tests.serving.sglang_engine import greedy, start_engine
from tests.serving.sglang_golden import DATA, GOLDEN

ORACLE = json.loads(GOLDEN.read_text())["oracle"]


@pytest.fixture(scope="module")
def engine():
    settings = {"slot_size": ORACLE["slot_size"], "block_size": ORACLE["slot_size"],
                "token_threshold": ORACLE["token_threshold"], "remask_threshold": None}  # fmt: skip
    engine = start_engine(DATA / "tiny-qwen3-refusion", settings)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("case", ORACLE["cases"], ids=[case["id"] for case in ORACLE["cases"]])
def test_golden_case(engine, case):
    output = engine.generate(input_ids=case["prompt_ids"], sampling_params=greedy(case["max_new_tokens"]))
    assert output["output_ids"] == case["expected"]
