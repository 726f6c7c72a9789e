"""The evaluate seam (`refusion_hf._compat.evaluate`): replacing `evaluate.load` reaches lm-eval's code tasks."""

import ast
import importlib.util
from pathlib import Path

import evaluate
import pytest

from refusion_hf._compat import evaluate as seam


def test_replacing_load_answers_for_the_metric_only_within_the_block():
    real, made = evaluate.load, object()
    with seam.replacing_load("code_eval", lambda: made):
        assert evaluate.load("code_eval") is made and evaluate.load("evaluate-metric/code_eval/") is made
    assert evaluate.load is real


def code_eval_loads(source: str) -> list[str]:
    """How a module loads the `code_eval` metric: `module.load` for each `evaluate.load("code_eval")` made through
    the module `evaluate` (whatever it is imported as), `load` for one made otherwise (`from evaluate import load`)."""
    tree = ast.parse(source)
    modules = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names if alias.name == "evaluate"}  # fmt: skip
    loads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(getattr(arg, "value", None) == "code_eval" for arg in node.args):
            through_module = isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", None) in modules
            loads.append("module.load" if through_module and node.func.attr == "load" else "load")
    return loads


def lm_eval_code_metric_loads() -> list[str]:
    """lm-eval's code tasks (humaneval, mbpp) load their metric when imported: read, not imported."""
    origins = [importlib.util.find_spec(f"lm_eval.tasks.{task}.utils").origin for task in ("humaneval", "mbpp")]
    return [load for origin in origins for load in code_eval_loads(Path(origin).read_text())]


def check_lm_eval_loads_through_the_module(loads: list[str]) -> None:
    if not loads or any(load != "module.load" for load in loads):
        raise AssertionError(
            f"refusion_hf._compat.evaluate: lm-eval's code tasks no longer call `evaluate.load(...)` through the "
            f"module ({loads}); `replacing_load` would not reach them: update the seam"
        )


def test_lm_eval_code_tasks_load_their_metric_through_evaluate_load():
    check_lm_eval_loads_through_the_module(lm_eval_code_metric_loads())


def test_the_check_fails_naming_the_seam_when_lm_eval_imports_load_itself():
    with pytest.raises(AssertionError, match=r"^refusion_hf\._compat\.evaluate: "):
        check_lm_eval_loads_through_the_module(code_eval_loads('from evaluate import load\nm = load("code_eval")\n'))
    with pytest.raises(AssertionError, match=r"^refusion_hf\._compat\.evaluate: "):
        check_lm_eval_loads_through_the_module([])
