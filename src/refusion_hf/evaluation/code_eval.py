"""Execution-based scoring of lm-eval's code tasks in the bubblewrap sandbox (sandbox.py).

lm-eval's `humaneval*` and `mbpp*` tasks score candidates with the Hub metric `evaluate.load("code_eval")`, which
their `utils.py` loads when the task is built. That needs the network, and `code_eval` runs candidates with `exec`
in a child process of the evaluator (no OS isolation). `sandboxed_code_eval()` makes that one load return
`SandboxedCodeEval`: the same interface (`compute(references, predictions, k, num_workers, timeout)` ->
`(pass@k dict, per-candidate results)`), each candidate program run in the sandbox (no host files, no network,
own PID namespace, unprivileged, resource limits) and its test program (the reference) run by the sandbox's judge,
a process the candidate cannot reach, against proxies of the candidate's functions that return plain data only
(verdict_runner.py). A candidate passes only when the judge's tests passed: an early exit, a forged record, an
object equal to everything is a failure (sandbox.py says what the verdict means and what it cannot check); the
per-candidate `result` is "passed" or "failed: " / "timed out: " and the judge's reason. lm-eval keeps everything
else: prompts, filters (`build_predictions*`), the metric functions and their aggregation.

The opt-in is the ecosystem's: `HF_ALLOW_CODE_EVAL=1` (and lm-eval's `confirm_run_unsafe_code`), checked before a
candidate runs. `execution_timeout(seconds)` sets the per-candidate limit of everything scored inside it (lm-eval's
tasks do not pass one; `code_eval`'s default is 3 s, ours `sandbox.DEFAULT_TIMEOUT`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

from .._compat.evaluate import replacing_load
from .sandbox import DEFAULT_TIMEOUT, require_opt_in, run_programs

_TIMEOUT: contextvars.ContextVar[float] = contextvars.ContextVar("code_execution_timeout", default=DEFAULT_TIMEOUT)


@contextlib.contextmanager
def execution_timeout(seconds: float) -> Iterator[None]:
    """Candidates scored inside this block get `seconds` each."""
    token = _TIMEOUT.set(float(seconds))
    try:
        yield
    finally:
        _TIMEOUT.reset(token)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. (2021): 1 - C(n - c, k) / C(n, k)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def score_programs(
    programs: Sequence[str], num_workers: int = 2, tests: Sequence[str] | None = None
) -> list[tuple[bool, str]]:
    """Run programs (each followed by its `tests`, when given) in the sandbox: per program (passed, "passed" /
    reason)."""
    require_opt_in(None)
    results = run_programs(
        list(programs),
        tests=None if tests is None else list(tests),
        num_workers=num_workers,
        timeout=_TIMEOUT.get(),
        allow_code_execution=True,
    )
    return [(r.passed, r.status if r.passed or not r.detail else f"{r.status}: {r.detail}") for r in results]


class SandboxedCodeEval:
    """`code_eval`'s interface, executed in the sandbox."""

    def compute(
        self,
        references: Sequence[str],
        predictions: Sequence[Sequence[str]],
        k: Sequence[int] | int = (1, 10, 100),
        num_workers: int = 2,
        timeout: float | None = None,
    ) -> tuple[dict[str, float], dict[int, list[tuple[int, dict]]]]:
        if len(references) != len(predictions):
            raise ValueError(f"code_eval: {len(predictions)} predictions for {len(references)} references.")
        ks = [k] if isinstance(k, int) else list(k)
        programs, test_programs, owners = [], [], []
        for task_id, (candidates, tests) in enumerate(zip(predictions, references)):
            for completion_id, candidate in enumerate(candidates):
                programs.append(candidate)
                test_programs.append(tests)
                owners.append((task_id, completion_id))
        with execution_timeout(timeout) if timeout is not None else contextlib.nullcontext():
            outcomes = score_programs(programs, num_workers=num_workers, tests=test_programs)
        results: dict[int, list[tuple[int, dict]]] = {task_id: [] for task_id in range(len(references))}
        for (task_id, completion_id), (passed, detail) in zip(owners, outcomes):
            results[task_id].append((completion_id, {"task_id": task_id, "passed": passed, "result": detail}))
        totals = [len(results[t]) for t in results]
        correct = [sum(entry["passed"] for _, entry in results[t]) for t in results]
        scores = {
            f"pass@{kk}": sum(pass_at_k(n, c, kk) for n, c in zip(totals, correct)) / len(totals)
            for kk in ks
            if totals and min(totals) >= kk
        }
        return scores, results


@contextlib.contextmanager
def sandboxed_code_eval() -> Iterator[None]:
    """Within this block `evaluate.load("code_eval")` returns a `SandboxedCodeEval` (other loads are untouched):
    build lm-eval's code tasks inside it."""
    with replacing_load("code_eval", SandboxedCodeEval):
        yield
