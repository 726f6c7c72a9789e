"""Answer checks of the synthetic suite (lm_eval_tasks/synthetic_suite.py), standard library only.

* Numeric answers: GSM8K's `#### 42`, then "The answer is 42", then (flexible mode) the last number in the text.
* Code: the first fenced block when the text has one, else the whole text.
* Listings: lines with surrounding whitespace, bullets and runs of blanks normalised.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_HASHES = re.compile(rf"####\s*\$?\s*({_NUMBER})")
_THE_ANSWER_IS = re.compile(rf"answer\s+is\s*:?\s*\$?\s*({_NUMBER})", re.IGNORECASE)
_ANY_NUMBER = re.compile(rf"(?<![\w.]){_NUMBER}(?![\w])")  # not the 5 of "t5" or "x5y"
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)

EXTRACTION_MODES = ("strict", "flexible")


def normalize_number(text: str | None) -> str | None:
    """Canonical string of a number ("1,234.50" -> "1234.5", "-0" -> "0"); None when `text` is not a number."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if not cleaned:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_numeric_answer(text: str, mode: str = "flexible") -> str | None:
    """The final numeric answer in `text`, normalised, or None.

    `strict` accepts only `#### N` (GSM8K's format) or "The answer is N" (the first match, so that text generated
    after the answer does not count); `flexible` falls back to the last number in the text.
    """
    if mode not in EXTRACTION_MODES:
        raise ValueError(f"`mode` must be one of {EXTRACTION_MODES}, got {mode!r}.")
    for pattern in (_HASHES, _THE_ANSWER_IS):
        match = pattern.search(text)
        if match:
            return normalize_number(match.group(1))
    if mode == "flexible":
        numbers = _ANY_NUMBER.findall(text)
        if numbers:
            return normalize_number(numbers[-1])
    return None


def reference_number(reference: str) -> str:
    """The gold number of a reference: a bare number, or a worked answer ending in `#### N` (GSM8K)."""
    bare = normalize_number(reference)
    if bare is not None:
        return bare
    extracted = extract_numeric_answer(reference, mode="strict")
    if extracted is None:
        raise ValueError(
            f"reference {reference[:80]!r} is neither a number nor a worked answer with `#### N`: pass the gold "
            "numbers (or GSM8K `answer` fields) as `references`."
        )
    return extracted


def extract_code(text: str) -> str:
    """The program in a model answer: the first fenced code block (```python ... ```) if any, else the text."""
    match = _FENCE.search(text)
    if match:
        return match.group(1)
    return text


def normalize_listing(text: str) -> list[str]:
    """Non-empty lines, stripped, leading `-`/`*` bullets removed, inner whitespace collapsed."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"^\s*[-*]\s+", "", line)
        line = " ".join(line.split())
        if line:
            lines.append(line)
    return lines
