"""The bubblewrap sandbox that runs generated code. Every escape test runs its attack twice: first as a plain
subprocess of the same interpreter (no sandbox), where it must succeed, so the test can fail; then in the
sandbox, where it must not."""

import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from refusion_hf.evaluation import sandbox
from refusion_hf.evaluation.sandbox import (
    CodeExecutionNotAllowed,
    SandboxUnavailable,
    isolation_report,
    run_program,
    run_programs,
)

ESCAPED = "ESCAPED"  # what an attack prints when it got through


def run(program, **kwargs):
    kwargs.setdefault("allow_code_execution", True)
    kwargs.setdefault("timeout", 5)
    return run_program(textwrap.dedent(program), **kwargs)


def unsandboxed(program, timeout=10) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-I", "-c", textwrap.dedent(program)], capture_output=True, text=True, timeout=timeout
    )


def attack(program, **kwargs):
    """The attack prints ESCAPED when it works: it must work unsandboxed and fail (no ESCAPED, not passed) inside."""
    plain = unsandboxed(program)
    assert ESCAPED in plain.stdout, f"the attack does not even work unsandboxed: {plain.stderr[-500:]}"
    program = textwrap.dedent(program) + "\nassert False, 'the attack returned without escaping'\n"
    result = run(program, **kwargs)
    assert not result.passed, result
    return result


# ------------------------------------------------------------------------------------------------ contract
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
    assert run("raise SystemExit(3)").status == "failed"
    assert "EOFError" in run("input()").detail, "stdin is empty: a program waiting for input fails at once"
    assert run("assert __name__ == '__main__'").passed


def test_patching_the_interpreter_cannot_turn_a_failure_into_a_pass():
    """The runner took what it needs before the program ran, so patching the program's own modules cannot turn a
    failure into a pass (test_verdict.py has the early exits)."""
    for program in (
        "import os\nos._exit = lambda *a: None\nassert False",
        "import sys\nsys.exit = lambda *a: None\nsys.excepthook = lambda *a: None\nassert False",
        "import builtins\nbuiltins.SystemExit = None\nraise ValueError('no')",
        "import sys\nfor depth in range(5):\n    try:\n        sys._getframe(depth).f_globals.clear()\n"
        "    except ValueError:\n        break\nassert False",
    ):
        assert not run(program).passed, program


def test_isolation_is_reported():
    report = isolation_report()
    assert report["tool"].startswith("bubblewrap")
    assert set(report["namespaces"]) >= {"user", "mount", "pid", "network"}
    assert report["nested_user_namespaces"] == "disabled" and report["seccomp"].startswith("libseccomp filter")


def test_unavailable_sandbox_refuses_with_the_fix(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, path=None: None)
    sandbox._sandbox.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match=r"`bwrap` is not on PATH.*apt-get install bubblewrap"):
            run_program("pass", allow_code_execution=True)
    finally:
        sandbox._sandbox.cache_clear()
    monkeypatch.undo()
    assert run_program("pass", allow_code_execution=True).passed


def test_a_missing_seccomp_binding_refuses_with_the_fix():
    """This package's interpreter has no libseccomp bindings (Debian's python3 does): building the filter with it
    is refused with the package to install."""
    with pytest.raises(SandboxUnavailable, match=r"cannot import `seccomp`: install python3-seccomp \(`apt-get"):
        sandbox._seccomp_filter(sys.executable)


@pytest.mark.parametrize("release", ["5.10.0-28-amd64", "4.19.0", "unknown"])
def test_a_kernel_without_per_namespace_process_counts_is_refused(release):
    with pytest.raises(SandboxUnavailable, match=rf"needs Linux >= 5.14 \(this kernel is '{release}'\)"):
        sandbox._check_kernel(release)
    sandbox._check_kernel("5.14.0")  # and from 5.14 on it is not
    sandbox._check_kernel("6.18.44-fc-v1098")


def test_arguments_are_checked():
    results = run_programs(["assert True", "assert False", "assert 2 > 1"], allow_code_execution=True, num_workers=2)
    assert [r.passed for r in results] == [True, False, True]
    with pytest.raises(ValueError, match="`num_workers` must be an integer >= 1"):
        run_programs(["pass"], allow_code_execution=True, num_workers=0)
    with pytest.raises(ValueError, match="`timeout` must be a number of seconds > 0"):
        run_program("pass", allow_code_execution=True, timeout=0)
    with pytest.raises(ValueError, match=r"`memory_limit_mb` must be an integer >= 48 x `max_processes` \(= 192"):
        run_program("pass", allow_code_execution=True, memory_limit_mb=100)
    with pytest.raises(ValueError, match=r"`memory_limit_mb` must be an integer >= 48 x `max_processes` \(= 48"):
        run_program("pass", allow_code_execution=True, memory_limit_mb=47, max_processes=1)
    with pytest.raises(ValueError, match="`max_processes` must be an integer >= 1"):
        run_program("pass", allow_code_execution=True, max_processes=0)
    with pytest.raises(TypeError, match="`program` must be a string"):
        run_program(b"pass", allow_code_execution=True)
    with pytest.raises(TypeError, match="`tests` must be a string"):
        run_program("pass", tests=["assert True"], allow_code_execution=True)
    with pytest.raises(ValueError, match="`tests` must have one entry per program: 1 for 2 programs"):
        run_programs(["pass", "pass"], tests=["pass"], allow_code_execution=True)


# ------------------------------------------------------------------------------------------------- escapes
def test_unprivileged_without_capabilities():
    attack(
        """
        import os
        caps = int(open('/proc/self/status').read().split('CapEff:')[1].split()[0], 16)
        if os.getuid() == 0 or caps:
            print('ESCAPED')
        """
    )
    assert run("import os\nassert os.getuid() == 65534 and os.geteuid() == 65534").passed
    assert run("import os\ntry:\n    os.setuid(0)\nexcept OSError:\n    pass\nelse:\n    raise SystemExit(1)").passed


def test_no_host_files(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    secret.chmod(0o600)
    for path in (secret, "/etc/passwd", "/root", os.getcwd(), os.path.expanduser("~"), "/tmp"):
        result = attack(
            f"""
            import os
            path = {str(path)!r}
            readable = os.path.isdir(path) and os.listdir(path) or os.path.isfile(path) and open(path).read()
            if os.path.exists(path) and readable:
                print('ESCAPED')
            """
        )
        assert "top secret" not in result.detail
    assert run("import os\nassert not {'etc', 'root', 'home', 'tmp', 'work'} - set(os.listdir('/')) == {'work'}").passed


@pytest.mark.skipif(os.geteuid() != 0, reason="unsandboxed, only root can write /usr")
def test_read_only_runtime_and_writable_work_dir():
    target = f"/usr/local/refusion-sandbox-probe-{uuid.uuid4().hex}"
    try:
        attack(f"open({target!r}, 'w').write('x')\nprint('ESCAPED')")
    finally:
        os.remove(target)
    assert run("open('out.txt', 'w').write('ok')\nassert open('/work/out.txt').read() == 'ok'").passed


def test_minimal_dev():
    attack(
        """
        import os, stat
        devices = [name for name in os.listdir('/dev') if stat.S_ISBLK(os.stat('/dev/' + name).st_mode)]
        if devices:
            print('ESCAPED', devices[:3])
        """
    )
    allowed = {"null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm", "fd", "stdin", "stdout",
               "stderr", "core", "console"}  # fmt: skip
    assert run(f"import os\nassert set(os.listdir('/dev')) <= {allowed!r}, os.listdir('/dev')").passed


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.5)
    yield server
    server.close()


def test_no_network(listener):
    port = listener.getsockname()[1]
    attack(
        f"""
        import socket
        socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')
        print('ESCAPED')
        """
    )
    listener.accept()  # the unsandboxed attack connected
    with pytest.raises(socket.timeout):
        listener.accept()  # the sandboxed one never did
    attack("import socket\nprint([name for _, name in socket.if_nameindex()] != ['lo'] and 'ESCAPED')")


def test_no_host_sockets_or_fifos(tmp_path):
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "host.sock"))
    server.listen(1)
    os.mkfifo(tmp_path / "host.fifo")
    try:
        attack(
            f"""
            import socket
            client = socket.socket(socket.AF_UNIX)
            client.connect({str(tmp_path / "host.sock")!r})
            print('ESCAPED')
            """
        )
        reader = os.open(tmp_path / "host.fifo", os.O_RDONLY | os.O_NONBLOCK)
        try:
            attack(
                f"""
                import os
                os.write(os.open({str(tmp_path / "host.fifo")!r}, os.O_WRONLY | os.O_NONBLOCK), b'x')
                print('ESCAPED')
                """
            )
        finally:
            os.close(reader)
    finally:
        server.close()


def test_own_pid_namespace():
    me = os.getpid()
    attack(f"import os\nos.kill({me}, 0)\nprint('ESCAPED')")
    attack(f"import os\nif any(p == '{me}' for p in os.listdir('/proc')):\n    print('ESCAPED')")


def test_killed_as_a_whole():
    """A child that outlives the program (daemonised, new session) is gone when the run ends."""
    marker = f"refusion-survivor-{uuid.uuid4().hex}"
    program = f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)  # {marker}'], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        print('ESCAPED')
        """

    def survivors():
        found = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and marker in open(f"/proc/{entry}/cmdline").read():
                    found.append(int(entry))
            except OSError:
                pass
        return found

    unsandboxed(program)
    time.sleep(0.2)
    left = survivors()
    assert left, "unsandboxed, the child survives"
    for pid in left:
        os.kill(pid, 9)
    run(textwrap.dedent(program))
    time.sleep(0.3)
    assert survivors() == []
    run(textwrap.dedent(program).replace("time.sleep(0.3)", "time.sleep(60)"), timeout=1)  # killed by the timeout
    time.sleep(0.3)
    assert survivors() == []


def test_limits():
    assert run("while True:\n    pass\n", timeout=1).status == "timed out"
    memory = attack("x = bytearray(512 * 1024 ** 2)\nprint('ESCAPED')", memory_limit_mb=256)
    assert "MemoryError" in memory.detail
    assert run("x = bytearray(50 * 1024 ** 2)\nassert len(x) > 0").passed
    output = attack("import sys\nsys.stdout.write('x' * 5_000_000)\nsys.stdout.flush()\nprint('ESCAPED')")
    assert "File too large" in output.detail
    forks = attack(
        """
        import os, time
        children = 0
        try:
            for _ in range(64):
                if os.fork() == 0:
                    time.sleep(2)
                    os._exit(0)
                children += 1
        except OSError:
            pass
        if children >= 64:
            print('ESCAPED')
        """,
        max_processes=8,
    )
    assert forks.status == "failed"
    big = run("import sys\nsys.stdout.write('x' * 50_000_000)\nsys.stdout.flush()")
    assert not big.passed and "File too large" in big.detail
    assert not run("open('big', 'wb').write(b'x' * 100_000_000)").passed


def test_cleanup_cannot_fail_because_of_the_program():
    result = run(
        """
        import os, subprocess
        os.makedirs('a/b/c')
        open('a/b/c/f', 'w').write('x')
        os.chmod('a/b', 0)
        os.chmod('.', 0o500)
        subprocess.run(['chattr', '+i', 'a'], capture_output=True)
        """
    )
    assert result.passed, result  # it did all that to its own tmpfs; the run returned and cleaned up
    assert run("pass").passed


def test_the_run_folder_is_removed(tmp_path, monkeypatch):
    """The host side of a run (program, stdout, stderr) is removed with everything in it."""
    monkeypatch.setattr(sandbox.tempfile, "tempdir", str(tmp_path))
    assert run("open('x', 'w').write('y')\nprint('z' * 1000)").passed
    assert list(tmp_path.iterdir()) == []
