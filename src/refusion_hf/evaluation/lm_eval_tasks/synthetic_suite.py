"""Data and scoring of the `refusion_synthetic` lm-eval task: the seeded synthetic suite
(`synthetic_tasks.generate_problems`) and its answer checks: numeric `#### N` extraction (arithmetic), line-by-line
listing match (listing), the function's asserts executed in the sandbox (code; needs `HF_ALLOW_CODE_EVAL=1`).

Metadata (`--metadata` of lm-eval, or `refusion eval`'s flags): `seed`, `num_problems`, `families` (a list or a
comma-separated string; default arithmetic and listing: the code family executes generated code), `split` and
`tier` (`standard`, or `hard`: the task `refusion_synthetic_hard`).
"""

from __future__ import annotations

import datasets

from refusion_hf.evaluation.code_eval import score_programs
from refusion_hf.evaluation.extraction import extract_code, extract_numeric_answer, normalize_listing, reference_number
from refusion_hf.evaluation.synthetic_tasks import generate_problems

DEFAULT_FAMILIES = ("arithmetic", "listing")


def load(
    seed=0, num_problems=60, families=DEFAULT_FAMILIES, split="test", tier="standard", **_metadata
) -> datasets.DatasetDict:
    if isinstance(families, str):
        families = [part.strip() for part in families.split(",") if part.strip()]
    problems = generate_problems(split, int(num_problems), seed=int(seed), families=list(families), tier=tier)
    rows = [{"id": p.id, "family": p.family, "prompt": p.prompt, "target": p.target} for p in problems]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def is_correct(family: str, answer: str, target: str) -> bool:
    if family == "arithmetic":
        extracted = extract_numeric_answer(answer)
        return extracted is not None and extracted == reference_number(target)
    if family == "code":
        [(passed, _)] = score_programs([extract_code(answer)], tests=[target])
        return passed
    return normalize_listing(answer) == normalize_listing(target)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(is_correct(doc["family"], results[0], doc["target"]))}
