"""tests/data/sglang_golden.json (what the SGLang tests in .venv-sglang expect) still holds generate()'s greedy
answers and the oracle's cases: the file cannot drift from the decoder it stands for."""

import json

import pytest

from tests.serving.sglang_golden import (
    EMBEDDED_CONFIGURATIONS,
    GOLDEN,
    ORACLE_CONFIGURATIONS,
    embedded_prompts,
    generate_answers,
    oracle_cases,
    oracle_settings,
)

GOLDEN_DATA = json.loads(GOLDEN.read_text())


def test_embedded_prompts_are_the_synthetic_suites():
    assert GOLDEN_DATA["embedded"]["prompts"] == embedded_prompts()


@pytest.mark.parametrize("name", EMBEDDED_CONFIGURATIONS)
def test_embedded_answers_are_generates(name):
    entry = GOLDEN_DATA["embedded"]["configurations"][name]
    assert entry["settings"] == EMBEDDED_CONFIGURATIONS[name]
    assert entry["answers"] == generate_answers(GOLDEN_DATA["embedded"]["prompts"], entry["settings"])


@pytest.mark.parametrize("name", ORACLE_CONFIGURATIONS)
def test_oracle_cases_are_the_oracles(name):
    configuration = ORACLE_CONFIGURATIONS[name]
    assert GOLDEN_DATA["oracle"][name] == {
        "settings": oracle_settings(configuration),
        "cases": oracle_cases(configuration),
    }
    assert len(GOLDEN_DATA["oracle"][name]["cases"]) >= 4


def test_the_installed_configuration_decodes_several_slots_per_block_with_remasking():
    """What the "installed" answers stand for: the embedded model's own decoding is the multi-slot one."""
    from refusion_hf.serving.sglang_plugin import refusion_settings
    from tests.serving.sglang_golden import embedded_model_path

    knobs = refusion_settings(str(embedded_model_path()), {})["knobs"]
    assert knobs["block_size"] // knobs["slot_size"] >= 2 and knobs["remask_threshold"] is not None
