"""lm-eval's `code_eval` metric, routed to the sandbox: the stock interface and numbers, the opt-in, isolation."""

import evaluate
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refusion_hf.evaluation.code_eval import SandboxedCodeEval, execution_timeout, pass_at_k, sandboxed_code_eval
from tests.evaluation.test_verdict import EARLY_EXITS

ADD_TEST = "assert add(2, 3) == 5"


def test_the_hub_metric_load_is_answered_by_the_sandbox_only_inside_the_block():
    real = evaluate.load
    with sandboxed_code_eval():
        assert isinstance(evaluate.load("code_eval"), SandboxedCodeEval)
        assert isinstance(evaluate.load("evaluate-metric/code_eval"), SandboxedCodeEval)
    assert evaluate.load is real


def test_pass_at_k_and_per_candidate_results(monkeypatch):
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    right, wrong = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b"
    scores, results = SandboxedCodeEval().compute(
        references=[ADD_TEST, ADD_TEST], predictions=[[right, wrong], [wrong, wrong]], k=[1, 2, 3]
    )
    assert scores == {"pass@1": pytest.approx((0.5 + 0.0) / 2), "pass@2": pytest.approx((1.0 + 0.0) / 2)}
    assert [entry["passed"] for _, entry in results[0]] == [True, False]
    assert [completion for completion, _ in results[1]] == [0, 1]
    assert results[1][0][1]["result"].startswith("failed")


def test_a_wrong_answer_with_an_early_exit_scores_nothing(monkeypatch):
    """Each task: a wrong answer, and the same answer with an exit trick (scored pass@1 = 0.5 when the verdict was
    the exit status; test_verdict.py tries every trick); one more task, a right and a wrong answer, still counts."""
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    right, wrong = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a * b\n"
    tricks = [
        EARLY_EXITS[name]
        for name in ("sys.exit(0) before the tests", "os._exit(0)", "atexit handler calling os._exit(0)")
    ]
    predictions = [[wrong, wrong + trick] for trick in tricks] + [[right, wrong]]
    scores, results = SandboxedCodeEval().compute(
        references=[ADD_TEST] * len(predictions), predictions=predictions, k=[1], num_workers=2
    )
    assert scores == {"pass@1": pytest.approx(0.5 / len(predictions))}
    assert [entry["passed"] for task in results.values() for _, entry in task][-2:] == [True, False]


def test_no_execution_without_the_opt_in(monkeypatch):
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    with pytest.raises(PermissionError, match="HF_ALLOW_CODE_EVAL=1"):
        SandboxedCodeEval().compute(references=[ADD_TEST], predictions=[["def add(a, b): return a + b"]], k=[1])


def test_candidates_run_isolated_and_under_the_time_limit(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    secret = tmp_path / "secret.txt"
    secret.write_text("host data")
    reads_host = f"print(open({str(secret)!r}).read())"
    spins = "while True:\n    pass"
    with execution_timeout(1.0):
        scores, results = SandboxedCodeEval().compute(references=["", ""], predictions=[[reads_host], [spins]], k=1)
    assert scores == {"pass@1": 0.0}
    assert "FileNotFoundError" in results[0][0][1]["result"]
    assert results[1][0][1]["result"].startswith("timed out")


@given(st.integers(1, 30).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_chance_that_k_draws_without_replacement_include_a_correct_one(case):
    n, c, k = case
    none_correct = 1.0  # P(all k draws wrong) = prod over draws of (wrong left / left), Chen et al.'s product form
    for draw in range(k):
        none_correct *= max(n - c - draw, 0) / (n - draw)
    assert pass_at_k(n, c, k) == pytest.approx(1 - none_correct)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


MBPP_STYLE = [  # (solution, wrong solution, asserts) in MBPP's shape: tuples, sets, dicts, floats, a program's module
    (
        "def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n",
        "def similar_elements(a, b):\n    return tuple(set(a) | set(b))\n",
        "assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
    ),
    (
        "import heapq as hq\ndef heap_queue_largest(nums, n):\n    return hq.nlargest(n, nums)\n",
        "def heap_queue_largest(nums, n):\n    return sorted(nums)[:n]\n",
        "assert heap_queue_largest([25, 35, 22, 85, 14, 65, 75, 22, 58], 3) == [85, 75, 65]",
    ),
    (
        "import math\ndef volume_cone(r, h):\n    return (1.0 / 3) * math.pi * r * r * h\n",
        "import math\ndef volume_cone(r, h):\n    return math.pi * r * r * h\n",
        "assert math.isclose(volume_cone(5, 12), 314.15926535897927, rel_tol=0.001)",  # the program's `import math`
    ),
    (
        "import collections\ndef freq_count(items):\n    return dict(collections.Counter(items))\n",
        "def freq_count(items):\n    return {item: 1 for item in items}\n",
        "assert freq_count([10, 10, 10, 20, 20, 40]) == ({10: 3, 20: 2, 40: 1})\nassert freq_count([]) == {}",
    ),
    (
        "def is_not_prime(n):\n    return n > 1 and any(n % d == 0 for d in range(2, int(n ** 0.5) + 1))\n",
        "def is_not_prime(n):\n    return n % 2 == 0\n",
        "assert is_not_prime(2) == False\nassert is_not_prime(35) == True\nassert is_not_prime(37) is False",
    ),
]


def test_mbpp_style_asserts_pass_for_right_answers_only(monkeypatch):
    """MBPP's tests are bare asserts on the function's result, some using a module only the program imports."""
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    _, results = SandboxedCodeEval().compute(
        references=[tests for _, _, tests in MBPP_STYLE],
        predictions=[[right, wrong] for right, wrong, _ in MBPP_STYLE],
        k=[1],
    )
    assert [[entry["passed"] for _, entry in results[task]] for task in results] == [[True, False]] * len(MBPP_STYLE)
