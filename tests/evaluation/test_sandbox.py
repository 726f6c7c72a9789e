"""The sandbox that runs generated code: opt-in, timeout, memory limit, no writes outside its directory, no network,
no child processes, each layer checked on its own where it can be."""

import os
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from refusion_hf.evaluation import sandbox
from refusion_hf.evaluation.sandbox import CodeExecutionNotAllowed, namespace_isolation, run_program, run_programs

HAS_NAMESPACES = namespace_isolation() is not None
needs_namespaces = pytest.mark.skipif(not HAS_NAMESPACES, reason="this machine cannot create namespaces (unshare)")

# (isolation, python_guard): the full sandbox, the Python guard alone, the OS layer alone
LAYERS = [
    pytest.param("auto", True, id="full"),
    pytest.param("none", True, id="guard-only"),
    pytest.param("namespaces", False, id="namespaces-only", marks=needs_namespaces),
]


def run(program, **kwargs):
    kwargs.setdefault("allow_code_execution", True)
    kwargs.setdefault("timeout", 5)
    return run_program(program, **kwargs)


def test_refused_without_opt_in(monkeypatch):
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    with pytest.raises(CodeExecutionNotAllowed, match="HF_ALLOW_CODE_EVAL=1"):
        run_program("assert True")
    with pytest.raises(CodeExecutionNotAllowed, match="--allow-code-execution"):
        run_programs(["assert True"])
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "0")
    with pytest.raises(CodeExecutionNotAllowed):
        run_program("assert True")
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    assert run_program("assert True").passed


def test_pass_and_fail():
    assert run("def f(x):\n    return x + 1\nassert f(1) == 2\n").status == "passed"
    failed = run("assert 1 == 2, 'wrong'")
    assert (failed.passed, failed.status) == (False, "failed")
    assert "AssertionError: wrong" in failed.detail
    assert "SyntaxError" in run("def f(:\n").detail
    # exiting early is not passing, whatever the exit code
    assert run("import sys\nsys.exit(0)\nassert False").status == "failed"
    assert run("raise SystemExit").status == "failed"
    # stdin is closed: a program waiting for input fails at once instead of hanging
    assert "EOFError" in run("input()").detail


@pytest.mark.parametrize(("isolation", "guard"), LAYERS)
def test_infinite_loop_times_out(isolation, guard):
    start = time.perf_counter()
    result = run("while True:\n    pass\n", timeout=1, isolation=isolation, python_guard=guard)
    assert (result.passed, result.status) == (False, "timed out")
    assert time.perf_counter() - start < 6


def test_sleeping_program_is_killed_at_the_wall_clock_timeout():
    start = time.perf_counter()
    result = run("import time\ntime.sleep(60)\n", timeout=1)
    assert result.status == "timed out"
    assert time.perf_counter() - start < 6


@pytest.mark.parametrize(("isolation", "guard"), LAYERS)
def test_huge_allocation_fails(isolation, guard):
    result = run("x = bytearray(8 * 1024 ** 3)\nassert len(x) > 0\n", isolation=isolation, python_guard=guard)
    assert not result.passed
    assert "MemoryError" in result.detail
    # within the limit, allocation works
    assert run("x = bytearray(50 * 1024 ** 2)\nassert len(x) > 0\n", isolation=isolation, python_guard=guard).passed


@pytest.mark.parametrize(("isolation", "guard"), LAYERS)
def test_writes_outside_the_temporary_directory_do_not_happen(isolation, guard, tmp_path):
    # tmp_path lies outside the sandbox's own temporary directory; so do /dev/shm and the temp root
    targets = [tmp_path / f"escape-{uuid.uuid4().hex}", Path(tempfile.gettempdir()) / f"escape-{uuid.uuid4().hex}"]
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        targets.append(Path("/dev/shm") / f"escape-{uuid.uuid4().hex}")
    try:
        for target in targets:
            attempts = [
                f"open({str(target)!r}, 'w').write('x')",
                f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
                f"import pathlib\npathlib.Path({str(target)!r}).mkdir()",
                f"import os\nos.symlink('/etc/hostname', {str(target)!r})",
            ]
            for program in attempts:
                result = run(program, isolation=isolation, python_guard=guard)
                assert not result.passed, program
                assert not os.path.lexists(target), program
        # existing files outside cannot be deleted or renamed either
        victim = tmp_path / "victim.txt"
        victim.write_text("keep me")
        for program in (f"import os\nos.remove({str(victim)!r})", f"import os\nos.rename({str(victim)!r}, 'x')"):
            assert not run(program, isolation=isolation, python_guard=guard).passed
        assert victim.read_text() == "keep me"
    finally:
        for target in targets:
            if os.path.lexists(target):
                os.remove(target) if not target.is_dir() or target.is_symlink() else os.rmdir(target)


@pytest.mark.parametrize(("isolation", "guard"), LAYERS)
def test_writes_inside_the_temporary_directory_work(isolation, guard):
    program = (
        "import os, tempfile\n"
        "open('data.txt', 'w').write('hello')\n"
        "assert open('data.txt').read() == 'hello'\n"
        "os.mkdir('sub')\n"
        "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n"
        "    f.write('x')\n"
        "assert os.path.exists(f.name)\n"
    )
    assert run(program, isolation=isolation, python_guard=guard).passed


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    yield server
    server.close()


@pytest.mark.parametrize(("isolation", "guard"), LAYERS)
def test_network_attempts_fail(isolation, guard, listener):
    port = listener.getsockname()[1]
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'leak')\n"
    result = run(program, isolation=isolation, python_guard=guard)
    assert not result.passed
    with pytest.raises(socket.timeout):
        listener.accept()  # nothing ever connected


@pytest.mark.parametrize(("isolation", "guard"), LAYERS)
def test_child_processes_cannot_escape(isolation, guard, tmp_path):
    target = tmp_path / "spawned"
    program = f"import os\nassert os.system('touch {target}') == 0\n"
    assert not run(program, isolation=isolation, python_guard=guard).passed
    assert not target.exists()


def test_guard_blocks_process_creation_and_ctypes():
    for program in (
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.fork()",
        "import ctypes",
        "import os, signal\nos.kill(os.getppid(), signal.SIGTERM)",
        "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
    ):
        result = run(program, isolation="none")
        assert not result.passed, program
        assert "sandbox:" in result.detail, (program, result.detail)


def test_program_output_is_capped():
    # unbounded printing does not fill the parent's memory: the file-size limit stops it
    result = run("while True:\n    print('x' * 10000)\n", timeout=10)
    assert not result.passed
    assert result.status in ("failed", "timed out")


def test_run_programs_keeps_order_and_checks_arguments():
    results = run_programs(["assert True", "assert False", "assert 2 > 1"], allow_code_execution=True, num_workers=2)
    assert [r.passed for r in results] == [True, False, True]
    with pytest.raises(ValueError, match="`num_workers` must be an integer >= 1"):
        run_programs(["pass"], allow_code_execution=True, num_workers=0)
    with pytest.raises(ValueError, match="`timeout` must be a number of seconds > 0"):
        run_program("pass", allow_code_execution=True, timeout=0)
    with pytest.raises(ValueError, match="`memory_limit_mb` must be an integer >= 64"):
        run_program("pass", allow_code_execution=True, memory_limit_mb=8)
    with pytest.raises(ValueError, match="`isolation` must be one of"):
        run_program("pass", allow_code_execution=True, isolation="docker")
    with pytest.raises(TypeError, match="`program` must be a string"):
        run_program(b"pass", allow_code_execution=True)


def test_namespace_isolation_is_required_when_asked(monkeypatch):
    monkeypatch.setattr(sandbox, "namespace_isolation", lambda: None)
    with pytest.raises(RuntimeError, match="cannot create namespaces"):
        run_program("pass", allow_code_execution=True, isolation="namespaces")
    # "auto" falls back to limits + guard, which still refuse a write outside
    assert run_program("pass", allow_code_execution=True, isolation="auto").passed
