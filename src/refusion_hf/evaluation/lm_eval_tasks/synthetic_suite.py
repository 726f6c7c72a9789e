"""Data and scoring of the `refusion_synthetic` lm-eval task: the problems `refusion eval --suite synthetic` draws
(`synthetic_tasks.generate_problems`, test split) and the same answer checks (numeric `#### N` extraction,
line-by-line listing match)."""

from __future__ import annotations

import datasets

from refusion_hf.evaluation.extraction import extract_numeric_answer, normalize_listing, reference_number
from refusion_hf.evaluation.synthetic_tasks import generate_problems

FAMILIES = ("arithmetic", "listing")


def load(seed: int = 0, num_problems: int = 60, **_metadata) -> datasets.DatasetDict:
    problems = generate_problems("test", int(num_problems), seed=int(seed), families=FAMILIES)
    rows = [{"id": p.id, "family": p.family, "prompt": p.prompt, "target": p.target} for p in problems]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def is_correct(family: str, answer: str, target: str) -> bool:
    if family == "arithmetic":
        extracted = extract_numeric_answer(answer)
        return extracted is not None and extracted == reference_number(target)
    return normalize_listing(answer) == normalize_listing(target)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(is_correct(doc["family"], results[0], doc["target"]))}
