import pytest
from hypothesis import given
from hypothesis import strategies as st

from refusion_hf.evaluation.extraction import (
    extract_code,
    extract_numeric_answer,
    normalize_listing,
    normalize_number,
    reference_number,
)


@pytest.mark.parametrize(
    ("text", "mode", "expected"),
    [
        ("Ann starts with 5. 5 + 3 = 8. #### 8", "strict", "8"),
        ("#### 1,234", "strict", "1234"),
        ("so #### $ 42.", "strict", "42"),
        ("The answer is 17. Then 99 more words 3", "strict", "17"),
        ("the answer is: -4", "strict", "-4"),
        ("#### 7.50", "strict", "7.5"),
        ("#### 12 and later #### 13", "strict", "12"),  # the first final answer counts, not later babble
        ("5 + 3 = 8", "strict", None),
        ("5 + 3 = 8", "flexible", "8"),
        ("we get 3.0 apples", "flexible", "3"),
        ("t5 t6 t7", "flexible", None),  # the digits of word tokens are not numbers
        ("x5y and v2", "flexible", None),
        ("", "flexible", None),
    ],
)
def test_numeric_extraction(text, mode, expected):
    assert extract_numeric_answer(text, mode=mode) == expected


@given(
    prefix=st.text(alphabet=st.characters(blacklist_characters="#"), max_size=40),
    number=st.integers(min_value=-(10**9), max_value=10**9),
)
def test_the_gsm8k_marker_wins_over_any_preceding_text(prefix, number):
    assert extract_numeric_answer(f"{prefix}\n#### {number}", mode="strict") == str(number)
    assert extract_numeric_answer(f"{prefix}\n#### {number:,}", mode="flexible") == str(number)


def test_normalize_number_and_references():
    assert normalize_number("1,000") == "1000"
    assert normalize_number("-0") == "0"
    assert normalize_number("2.500") == "2.5"
    assert normalize_number("abc") is None
    assert normalize_number("nan") is None
    assert reference_number("72") == "72"
    assert reference_number("Natalia sold 48/2 = 24 clips in May.\n#### 72") == "72"
    with pytest.raises(ValueError, match="neither a number nor a worked answer"):
        reference_number("no number here")
    with pytest.raises(ValueError, match="`mode` must be one of"):
        extract_numeric_answer("#### 1", mode="loose")


def test_extract_code():
    fenced = "Here you go:\n```python\ndef f(x):\n    return x\n```\nThis works because..."
    assert extract_code(fenced) == "def f(x):\n    return x\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("```python\ndef g():\n    pass") == "def g():\n    pass"  # unterminated fence
    assert extract_code("def h():\n    return 2") == "def h():\n    return 2"


def test_normalize_listing():
    assert normalize_listing("- name:  Ann\n\n  * age: 12  \n") == ["name: Ann", "age: 12"]
    assert normalize_listing("") == []
