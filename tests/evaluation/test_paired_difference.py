"""The paired interval on an accuracy difference: against a computation by hand, and its properties."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refusion_hf.evaluation.paired_difference import paired_difference


def test_the_interval_matches_a_hand_computation():
    # differences 0, +1, 0, +1, -1: mean 0.2; squared deviations 0.04 + 0.64 + 0.04 + 0.64 + 1.44 = 2.8, over
    # n - 1 = 4: variance 0.7; standard error sqrt(0.7 / 5) = 0.374166; z(97.5%) = 1.959964
    result = paired_difference([1, 1, 0, 1, 0], [1, 0, 0, 0, 1])
    assert result["difference"] == pytest.approx(0.2)
    assert result["standard_error"] == pytest.approx(0.3741657, abs=1e-7)
    assert result["low"] == pytest.approx(0.2 - 1.959964 * 0.3741657, abs=1e-6)
    assert result["high"] == pytest.approx(0.2 + 1.959964 * 0.3741657, abs=1e-6)
    assert (result["first_better"], result["second_better"], result["num_problems"]) == (2, 1, 5)
    assert result["level"] == 0.95
    # 500 problems, 20 right only on the second side, 5 only on the first: -0.03 +- 1.96 * sqrt(var / 500), with
    # var = (25 - 500 * 0.03**2) / 499 (sum of squared differences is 25)
    first = [1] * 5 + [0] * 20 + [1] * 475
    second = [0] * 5 + [1] * 20 + [1] * 475
    result = paired_difference(first, second)
    half = 1.959964 * math.sqrt((25 - 500 * 0.03**2) / 499 / 500)
    assert result["difference"] == pytest.approx(-0.03)
    assert (result["low"], result["high"]) == pytest.approx((-0.03 - half, -0.03 + half), abs=1e-6)
    # a 90% interval is narrower: z(95%) = 1.644854
    ninety = paired_difference(first, second, level=0.9)
    assert ninety["high"] - ninety["low"] == pytest.approx(2 * 1.644854 * result["standard_error"], abs=1e-6)


scores = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1)), min_size=2, max_size=300)


@given(scores)
def test_the_interval_holds_the_difference_and_swapping_the_sides_mirrors_it(pairs):
    first, second = [a for a, _ in pairs], [b for _, b in pairs]
    result = paired_difference(first, second)
    assert result["difference"] == pytest.approx((sum(first) - sum(second)) / len(pairs))
    assert result["low"] <= result["difference"] <= result["high"]
    assert result["high"] - result["difference"] == pytest.approx(result["difference"] - result["low"])
    mirrored = paired_difference(second, first)
    assert (mirrored["low"], mirrored["high"]) == pytest.approx((-result["high"], -result["low"]))
    # the sample's standard deviation of -1/0/+1 differences, by its definition
    differences = [a - b for a, b in pairs]
    mean = sum(differences) / len(differences)
    variance = sum((d - mean) ** 2 for d in differences) / (len(differences) - 1)
    assert result["standard_error"] == pytest.approx(math.sqrt(variance / len(differences)), abs=1e-12)


def test_identical_answers_give_a_zero_width_interval_at_zero():
    result = paired_difference([1, 0, 1], [1, 0, 1])
    assert (result["difference"], result["low"], result["high"]) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("first", "second", "level", "message"),
    [
        ([1, 0], [1], 0.95, "one per problem on both sides"),
        ([1], [1], 0.95, "at least 2 paired problems"),
        ([1, 0], [0, 1], 1.0, "`level` must be between 0 and 1"),
    ],
)
def test_bad_inputs_are_refused_by_name(first, second, level, message):
    with pytest.raises(ValueError, match=message):
        paired_difference(first, second, level)
