"""pass@1 of generated Python code, executed with its tests in the OS sandbox, as a local `evaluate`
metric. Requires an explicit opt-in, like Hugging Face's `code_eval`."""

import datasets
import evaluate

from refusion_hf.evaluation import extraction
from refusion_hf.evaluation.sandbox import DEFAULT_MEMORY_LIMIT_MB, DEFAULT_TIMEOUT, require_opt_in, run_programs

_DESCRIPTION = """
pass@1 with one candidate per problem: the fraction of candidates whose program (candidate + tests) exits with
status 0. Each candidate (the first fenced code block of the prediction, or the whole prediction) is concatenated
with its test program and executed in the bubblewrap sandbox of `refusion_hf.evaluation.sandbox` (no host files,
no network, own PID namespace, unprivileged, time / memory / process / output limits).

Executing model-generated code is refused unless `allow_code_execution=True` is passed or the environment has
HF_ALLOW_CODE_EVAL=1.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `str`): one candidate per problem (model answers, or programs with
        `extract_code=False`).
    references (`list` of `str`): test code per problem (e.g. `assert f(1) == 2` lines, or HumanEval's `check`
        function followed by a call to it).
    allow_code_execution (`bool`, *optional*): the opt-in (else HF_ALLOW_CODE_EVAL=1 is required).
    timeout (`float`, defaults to 5.0): seconds per candidate.
    memory_limit_mb (`int`, defaults to 1024): address-space limit per candidate.
    num_workers (`int`, defaults to 2): candidates run in parallel.
    extract_code (`bool`, defaults to `True`): take the first fenced code block of each prediction.
Returns:
    pass@1 (`float`), passed (`list` of `bool`), results (`list` of `str`: "passed", "failed: <reason>" or
    "timed out").
"""


class CodeExecution(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(
        self,
        predictions,
        references,
        allow_code_execution=None,
        timeout=DEFAULT_TIMEOUT,
        memory_limit_mb=DEFAULT_MEMORY_LIMIT_MB,
        num_workers=2,
        extract_code=True,
    ):
        require_opt_in(allow_code_execution)
        candidates = [extraction.extract_code(p) if extract_code else p for p in predictions]
        programs = [f"{candidate}\n\n{tests}\n" for candidate, tests in zip(candidates, references)]
        results = run_programs(
            programs,
            num_workers=num_workers,
            timeout=timeout,
            memory_limit_mb=memory_limit_mb,
            allow_code_execution=True,
        )
        passed = [result.passed for result in results]
        return {
            "pass@1": sum(passed) / len(passed) if passed else 0.0,
            "passed": passed,
            "results": [r.status if r.passed or not r.detail else f"{r.status}: {r.detail}" for r in results],
        }
