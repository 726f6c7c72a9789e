"""Local `evaluate` metric scripts (the Hub's `evaluate.load("accuracy")` / `"code_eval"` need the network).

Each module here is a metric script in `evaluate`'s format, loaded by path with `evaluate.load`, fully offline:

* `numeric_match`: exact match of the final number, with answer extraction (`#### N`, "The answer is N", last
  number);
* `code_execution`: pass@1 by executing each candidate with its tests in the sandbox (explicit opt-in);
* `listing_match`: exact match of line-by-line answers after normalising whitespace and bullets;
* `throughput`: tokens per second, tokens per forward pass and forward passes of a set of `generate` calls.
"""

from __future__ import annotations

from pathlib import Path

METRIC_NAMES = ("numeric_match", "code_execution", "listing_match", "throughput")


def metric_path(name: str) -> Path:
    """Path of the metric script `name` (one of `METRIC_NAMES`), for `evaluate.load(str(path))`."""
    if name not in METRIC_NAMES:
        raise ValueError(f"unknown metric {name!r}; the local metrics are {METRIC_NAMES}.")
    return Path(__file__).with_name(f"{name}.py")


def load_metric(name: str):
    """`evaluate.load` of the local metric script `name`, kept in memory (no cache files)."""
    import evaluate

    return evaluate.load(str(metric_path(name)), keep_in_memory=True)
