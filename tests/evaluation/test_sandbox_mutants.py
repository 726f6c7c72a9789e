"""The mutation check of the sandbox (tests/evaluation/sandbox_mutants.py, run by hand: see tests/README.md) cannot
rot silently: every mutant still finds the text it changes, exactly once, in the current sandbox.py."""

import pytest

from refusion_hf.evaluation import sandbox
from tests.evaluation.sandbox_mutants import EQUIVALENT, SOURCE, Mutant, mutants


def test_every_mutant_applies_to_the_current_source():
    source = SOURCE.read_text()
    assert SOURCE.samefile(sandbox.__file__)
    found = mutants(source)
    names = [mutant.name for mutant in found]
    assert len(names) == len(set(names)), "mutant names are unique"
    for mutant in found:
        mutated = mutant.apply(source)
        assert mutated != source, mutant.name
        compile(mutated, mutant.name, "exec")
    assert set(EQUIVALENT) <= set(names)
    assert {f"{name} allowed" for name in sandbox.DENIED_SYSCALLS} <= set(names), "one mutant per denied call"


def test_a_mutant_whose_text_is_gone_is_an_error():
    with pytest.raises(ValueError, match="found 0 times, expected once"):
        Mutant("gone", (("text that sandbox.py does not hold", ""),)).apply(SOURCE.read_text())
    with pytest.raises(ValueError, match="found 2 times"):
        Mutant("twice", (("x", ""),)).apply("x x")
