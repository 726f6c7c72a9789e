"""ReFusion decoding on SGLang (`--dllm-algorithm ReFusion`, the plugin `refusion_hf.serving.sglang_plugin`) gives
`generate()`'s greedy tokens on the embedded model: 50 prompts of the synthetic suite, alone and as concurrent
requests, in its installed decoding (block 16, two slots of 8, remasking 0.1) and with one slot per block. Runs in
.venv-sglang (`make test-sglang`); skipped where SGLang is not installed. The expected tokens are
tests/data/sglang_golden.json (generate()'s, re-checked by test_sglang_golden.py in the main suite)."""

from __future__ import annotations

import json

import pytest

from tests.serving.sglang_engine import greedy, start_engine
from tests.serving.sglang_golden import GOLDEN, embedded_model_path, generate_answers

GOLDEN_DATA = json.loads(GOLDEN.read_text())["embedded"]
ALONE = 12  # prompts sent one at a time (all 50 go concurrently)


@pytest.fixture(scope="module", params=["installed", "one_slot"])
def configured(request):
    """(engine, generate()'s answers, the settings) for one configuration of the golden file (one engine at a time)."""
    configuration = GOLDEN_DATA["configurations"][request.param]
    engine = start_engine(embedded_model_path(), configuration["settings"])
    yield engine, configuration["answers"], configuration["settings"]
    engine.shutdown()


def test_concurrent_requests_give_generates_tokens(configured):
    engine, answers, _ = configured
    outputs = engine.generate(input_ids=GOLDEN_DATA["prompts"], sampling_params=greedy(GOLDEN_DATA["max_new_tokens"]))
    got = [output["output_ids"] for output in outputs]
    mismatched = [i for i, (a, b) in enumerate(zip(got, answers, strict=True)) if a != b]
    assert not mismatched, f"prompts {mismatched} differ from generate(): {[got[i] for i in mismatched[:3]]}"


def test_one_request_at_a_time_gives_generates_tokens(configured):
    engine, answers, _ = configured
    for prompt, expected in list(zip(GOLDEN_DATA["prompts"], answers, strict=True))[:ALONE]:
        output = engine.generate(input_ids=prompt, sampling_params=greedy(GOLDEN_DATA["max_new_tokens"]))
        assert output["output_ids"] == expected


def test_a_shorter_budget_ends_where_generates_does(configured):
    """max_new_tokens off a block boundary (20: a block and a slot and a half): generate()'s answers at that budget."""
    engine, _, settings = configured
    prompts = GOLDEN_DATA["prompts"][:8]
    outputs = engine.generate(input_ids=prompts, sampling_params=greedy(20))
    assert [output["output_ids"] for output in outputs] == generate_answers(prompts, settings, max_new_tokens=20)


def test_a_sampled_request_is_refused_by_name(configured):
    engine, _, _ = configured
    with pytest.raises(ValueError, match="greedily only.*temperature 0.8"):
        engine.generate(input_ids=GOLDEN_DATA["prompts"][0], sampling_params={"temperature": 0.8})


@pytest.mark.parametrize(
    "field, value",
    [("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("repetition_penalty", 1.2), ("regex", "a+")],
)
def test_a_field_that_would_shape_the_drafts_is_refused_by_name(configured, field, value):
    engine, _, _ = configured
    with pytest.raises(ValueError, match=f"does not apply {field}"):
        engine.generate(input_ids=GOLDEN_DATA["prompts"][0], sampling_params={**greedy(8), field: value})
