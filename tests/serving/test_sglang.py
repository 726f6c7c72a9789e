"""ReFusion decoding on SGLang (`--dllm-algorithm ReFusion`, the plugin `refusion_hf.serving.sglang_plugin`) gives
`generate()`'s greedy tokens on the embedded model: 50 prompts of the synthetic suite, alone and as concurrent
requests. Runs in .venv-sglang (`make test-sglang`); skipped where SGLang is not installed. The expected tokens are
tests/data/sglang_golden.json (generate()'s, re-checked by test_sglang_golden.py in the main suite)."""

from __future__ import annotations

import json

import pytest

from tests.serving.sglang_engine import greedy, start_engine
from tests.serving.sglang_golden import GOLDEN, embedded_model_path

GOLDEN_DATA = json.loads(GOLDEN.read_text())["embedded"]
ALONE = 12  # prompts sent one at a time (all 50 go concurrently)


@pytest.fixture(scope="module")
def engine():
    engine = start_engine(embedded_model_path(), GOLDEN_DATA["settings"])
    yield engine
    engine.shutdown()


def test_concurrent_requests_give_generates_tokens(engine):
    outputs = engine.generate(input_ids=GOLDEN_DATA["prompts"], sampling_params=greedy(GOLDEN_DATA["max_new_tokens"]))
    got = [output["output_ids"] for output in outputs]
    mismatched = [i for i, (a, b) in enumerate(zip(got, GOLDEN_DATA["answers"], strict=True)) if a != b]
    assert not mismatched, f"prompts {mismatched} differ from generate(): {[got[i] for i in mismatched[:3]]}"


def test_one_request_at_a_time_gives_generates_tokens(engine):
    for prompt, expected in list(zip(GOLDEN_DATA["prompts"], GOLDEN_DATA["answers"], strict=True))[:ALONE]:
        output = engine.generate(input_ids=prompt, sampling_params=greedy(GOLDEN_DATA["max_new_tokens"]))
        assert output["output_ids"] == expected


def test_a_sampled_request_is_refused_by_name(engine):
    with pytest.raises(ValueError, match="greedily only.*temperature 0.8"):
        engine.generate(input_ids=GOLDEN_DATA["prompts"][0], sampling_params={"temperature": 0.8})
