"""tests/data/sglang_golden.json (what the SGLang tests in .venv-sglang expect) still holds generate()'s greedy
answers and the oracle's cases: the file cannot drift from the decoder it stands for."""

import json

from tests.serving.sglang_golden import GOLDEN, embedded_prompts, generate_answers, oracle_cases

GOLDEN_DATA = json.loads(GOLDEN.read_text())


def test_embedded_prompts_are_the_synthetic_suites():
    assert GOLDEN_DATA["embedded"]["prompts"] == embedded_prompts()


def test_embedded_answers_are_generates():
    assert GOLDEN_DATA["embedded"]["answers"] == generate_answers(GOLDEN_DATA["embedded"]["prompts"])


def test_oracle_cases_are_the_oracles():
    assert GOLDEN_DATA["oracle"]["cases"] == oracle_cases()
