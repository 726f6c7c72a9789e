"""The local `evaluate` metric scripts, loaded the way users load them: `evaluate.load(<path>)`, offline."""

import re

import evaluate
import pytest

from refusion_hf.evaluation.metrics import METRIC_NAMES, load_metric, metric_path
from refusion_hf.evaluation.sandbox import CodeExecutionNotAllowed


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.mark.parametrize("name", METRIC_NAMES)
def test_metric_scripts_load_offline_as_evaluate_modules(name):
    metric = evaluate.load(str(metric_path(name)), keep_in_memory=True)
    assert isinstance(metric, evaluate.EvaluationModule)
    assert isinstance(metric.info, evaluate.MetricInfo)
    assert metric.name == name
    # evaluate's dependency check needs one module per `import` line
    source = metric_path(name).read_text()
    assert not re.search(r"^import\s+\w+\s*,", source, re.MULTILINE)


def test_unknown_metric_is_named():
    with pytest.raises(ValueError, match="unknown metric 'bleu'"):
        metric_path("bleu")


def test_numeric_match():
    metric = load_metric("numeric_match")
    result = metric.compute(
        predictions=["Ann starts with 5. 5 + 3 = 8. #### 8", "The answer is 1,000.", "#### 7", "t5 t6", "so 12"],
        references=["8", "Work...\n#### 1000", "8", "5", "12"],
    )
    assert result["correct"] == [True, True, False, False, True]
    assert result["accuracy"] == pytest.approx(3 / 5)
    assert result["extracted"] == ["8", "1000", "7", None, "12"]
    strict = metric.compute(predictions=["so 12"], references=["12"], extraction="strict")
    assert strict["accuracy"] == 0.0
    with pytest.raises(ValueError, match="neither a number nor a worked answer"):
        metric.compute(predictions=["1"], references=["one"])


def test_listing_match():
    metric = load_metric("listing_match")
    result = metric.compute(
        predictions=["name: Ann\n- age: 12\n", "name: Ann\nage: 13", "age: 12\nname: Ann"],
        references=["name: Ann\nage: 12"] * 3,
    )
    assert result["correct"] == [True, False, False]
    assert result["accuracy"] == pytest.approx(1 / 3)
    assert result["line_accuracy"] == pytest.approx((1 + 0.5 + 0) / 3)


def test_code_execution_refuses_without_opt_in(monkeypatch):
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    metric = load_metric("code_execution")
    with pytest.raises(CodeExecutionNotAllowed, match="HF_ALLOW_CODE_EVAL=1"):
        metric.compute(predictions=["def f():\n    return 1"], references=["assert f() == 1"])
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")  # the environment variable is the other way to opt in
    assert metric.compute(predictions=["def f():\n    return 1"], references=["assert f() == 1"])["pass@1"] == 1.0


def test_code_execution_executes_in_the_sandbox(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    metric = load_metric("code_execution")
    outside = tmp_path / "written-by-candidate"
    predictions = [
        "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.",  # fenced answer: extracted
        "def add(a, b):\n    return a - b",  # wrong
        "def add(a, b):\n    while True:\n        pass",  # never returns
        f"open({str(outside)!r}, 'w').write('x')\ndef add(a, b):\n    return a + b",  # writes outside
    ]
    result = metric.compute(
        predictions=predictions,
        references=["assert add(2, 3) == 5"] * 4,
        allow_code_execution=True,
        timeout=1,
    )
    assert result["passed"] == [True, False, False, False]
    assert result["pass@1"] == pytest.approx(0.25)
    assert result["results"][0] == "passed"
    assert result["results"][1].startswith("failed: AssertionError")
    assert result["results"][2].startswith("timed out")
    assert result["results"][3].startswith("failed:")
    assert not outside.exists()


def test_throughput():
    metric = load_metric("throughput")
    result = metric.compute(
        num_tokens=[[10, 6], [8]],
        row_forward_passes=[[5, 3], [8]],
        num_forward_passes=[5, 8],
        seconds=[0.5, 1.5],
    )
    assert result["num_tokens"] == 24
    assert result["num_sequences"] == 3
    assert result["num_forward_passes"] == 13
    assert result["tokens_per_second"] == pytest.approx(24 / 2.0)
    assert result["median_call_tokens_per_second"] == pytest.approx((16 / 0.5 + 8 / 1.5) / 2)
    assert result["tokens_per_forward"] == pytest.approx(24 / 16)
    assert result["mean_tokens_per_forward"] == pytest.approx((2 + 2 + 1) / 3)
    assert result["seconds"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="must list the same sequences per call"):
        metric.compute(num_tokens=[[1, 2]], row_forward_passes=[[1]], num_forward_passes=[1], seconds=[1.0])
    with pytest.raises(ValueError, match="`seconds` must be > 0"):
        metric.compute(num_tokens=[[1]], row_forward_passes=[[1]], num_forward_passes=[1], seconds=[0.0])
