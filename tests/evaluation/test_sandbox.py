"""The bubblewrap sandbox that runs generated code, observed from the host.

Every escape test plants canaries on the host before the run (`Canaries`: a world-writable marker directory, a
listening unix socket at a path and one in the abstract namespace, a FIFO, a loopback TCP listener, a SysV shared
memory segment, a process whose command line holds a secret, and world-readable files holding that secret under
/tmp, the repository and, as root, /etc, /home, /opt, /srv, /mnt, /run and /var/tmp), runs the attack, and asserts
from the host that no canary was touched: the directory unchanged, no connection accepted, nothing written to the
FIFO, and the secret in nothing the run returned (stdout, stderr, detail). Each attack is first run as a plain
subprocess of the sandbox's own interpreter, as an unprivileged uid when the caller is root (as the sandboxed program
is on the host), where it must touch the canaries: so file permissions alone do not keep them out, and the test can
fail. tests/evaluation/sandbox_mutants.py checks that these tests catch a weakened sandbox."""

import ctypes
import dataclasses
import functools
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

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
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="unsandboxed, this attack needs root to work")
HOST_PYTHON = "/usr/bin/python3"  # the interpreter the sandbox runs
UNSANDBOXED_UID = 60998  # an unused uid, outside the sandbox's range


def run(program, **kwargs):
    kwargs.setdefault("allow_code_execution", True)
    kwargs.setdefault("timeout", 5)
    return run_program(textwrap.dedent(program), **kwargs)


def unsandboxed(program, timeout=10, as_root=False) -> subprocess.CompletedProcess:
    """The program in a plain subprocess of the sandbox's interpreter: as an unprivileged uid when the caller is
    root (unless `as_root`), as the sandboxed program is on the host."""
    user = {"user": UNSANDBOXED_UID, "group": UNSANDBOXED_UID, "extra_groups": []} if ROOT and not as_root else {}
    return subprocess.run(
        [HOST_PYTHON, "-I", "-c", textwrap.dedent(program)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        **user,
    )


def returned(result) -> str:
    """Everything a sandboxed run gave back to the host."""
    return f"{result.stdout}\n{result.stderr}\n{result.detail}"


def attack(program, as_root=False, **kwargs):
    """The attack prints ESCAPED when it works: it must print it unsandboxed, and not in the sandbox (stdout is
    unbuffered there: all the program printed comes back)."""
    plain = unsandboxed(program, as_root=as_root)
    assert ESCAPED in plain.stdout, f"the attack does not even work unsandboxed: {plain.stderr[-500:]}"
    result = run(program, **kwargs)
    assert ESCAPED not in result.stdout, result
    return result


class Canaries:
    """Host-side objects a sandboxed program must not reach, planted before the run and read after it."""

    def __init__(self):
        self.secret = f"refusion-canary-{uuid.uuid4().hex}"
        self.base = Path(tempfile.mkdtemp(prefix="refusion-canaries-", dir="/tmp"))
        self.base.chmod(0o755)
        self.marker = self.base / "marker"
        self.marker.mkdir(mode=0o777)
        self.marker.chmod(0o777)
        (self.marker / "planted").write_text("planted")
        self.marker_state = self._marker_state()
        name = f".refusion-canary-file-{uuid.uuid4().hex}"  # not the secret: an error message may name the file
        self.files = [self.base / "secret.txt", Path(__file__).parent / name]
        if ROOT:
            self.files += [Path(folder) / name for folder in
                           ("/etc", "/home", "/opt", "/srv", "/mnt", "/run", "/var/tmp")]  # fmt: skip
        for path in self.files:
            path.write_text(self.secret)
            path.chmod(0o644)
        self.sockets = {}
        self.unix_path = str(self.base / "host.sock")
        self.abstract = f"\0{self.secret}"
        for name, family, address in (
            ("unix", socket.AF_UNIX, self.unix_path),
            ("abstract", socket.AF_UNIX, self.abstract),
            ("tcp", socket.AF_INET, ("127.0.0.1", 0)),
        ):
            server = socket.socket(family)
            server.bind(address)
            server.listen(8)
            server.setblocking(False)
            self.sockets[name] = server
        os.chmod(self.unix_path, 0o777)
        self.tcp_port = self.sockets["tcp"].getsockname()[1]
        self.fifo = self.base / "host.fifo"
        os.mkfifo(self.fifo, 0o666)
        self.fifo.chmod(0o666)
        self.fifo_reader = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK)
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.shmat.restype = ctypes.c_void_p
        self.shm = self.libc.shmget(0, 4096, 0o1666)  # IPC_PRIVATE, IPC_CREAT | 0666
        address = self.libc.shmat(self.shm, None, 0)
        ctypes.memmove(address, self.secret.encode(), len(self.secret))
        self.libc.shmdt(ctypes.c_void_p(address))
        self.process = subprocess.Popen([HOST_PYTHON, "-c", "import time; time.sleep(120)", self.secret])

    def _marker_state(self):
        return sorted((entry.name, entry.stat().st_mtime_ns) for entry in os.scandir(self.marker)), self.marker.stat()

    def program(self) -> str:
        """A literal the attacks start from: where the canaries are."""
        canaries = {
            "files": [str(path) for path in self.files], "marker": str(self.marker), "unix": self.unix_path,
            "abstract": self.abstract, "tcp": self.tcp_port, "fifo": str(self.fifo), "shm": self.shm,
        }  # fmt: skip
        return f"CANARIES = {canaries!r}\n"

    def touched(self, result=None) -> list[str]:
        """What was touched, seen from the host (and whether the secret is in what the run returned)."""
        found = []
        if self._marker_state() != self.marker_state:
            found.append(f"marker directory changed: {sorted(os.listdir(self.marker))}")
        for name, server in self.sockets.items():
            try:
                server.accept()[0].close()
                found.append(f"a connection to the {name} socket")
            except BlockingIOError:
                pass
        try:
            if os.read(self.fifo_reader, 64):
                found.append("data in the FIFO")
        except BlockingIOError:
            pass
        if any(path.read_text() != self.secret for path in self.files):
            found.append("a secret file changed")
        if self.process.poll() is not None:
            found.append("the canary process was killed")
        if result is not None and self.secret in (result if isinstance(result, str) else returned(result)):
            found.append("the secret came back")
        return found

    def remove(self):
        self.process.kill()
        self.process.wait()
        self.libc.shmctl(self.shm, 0, None)  # IPC_RMID
        os.close(self.fifo_reader)
        for server in self.sockets.values():
            server.close()
        for path in self.files:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.base)


@pytest.fixture
def canaries():
    """`canaries()` plants a fresh set; all are removed at the end."""
    planted = []

    def plant():
        planted.append(Canaries())
        return planted[-1]

    yield plant
    for each in planted:
        each.remove()


def escape(canaries, attack_source, expected, **kwargs):
    """Run `attack_source` (code after `CANARIES = {...}`) unsandboxed, where it must touch canaries (`expected`: a
    substring of each thing it must touch), then sandboxed, where it must touch none. Returns the sandboxed result.
    The attack flushes what it printed (the runner leaves with os._exit, which does not)."""
    attack_source = textwrap.dedent(attack_source) + "\nimport sys\nsys.stdout.flush()\n"
    outside = canaries()
    plain = unsandboxed(outside.program() + textwrap.dedent(attack_source))
    touched = outside.touched(plain.stdout + plain.stderr)
    missing = [what for what in expected if not any(what in thing for thing in touched)]
    assert not missing, f"unsandboxed, the attack did not touch {missing} ({touched}): {plain.stderr[-800:]}"
    inside = canaries()
    result = run(inside.program() + textwrap.dedent(attack_source), **kwargs)
    assert inside.touched(result) == [], result
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


def test_writing_to_the_evidence_file_without_the_nonce_is_a_failure():
    """The program can find the runner's evidence file among its open files; what it writes there is no evidence."""
    forged = run(
        """
        import os
        for fd in os.listdir('/proc/self/fd'):
            try:
                os.write(int(fd), b'0' * 64 + b'\\n')
            except OSError:
                pass
        os._exit(0)
        """,
        tests="assert False",
    )
    assert not forged.passed and forged.status == "failed", forged


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
READ_HOST_FILES = """
import os
for path in CANARIES["files"]:
    try:
        print(open(path).read())
    except OSError as error:
        print(type(error).__name__)
for folder in ["/", *sorted({os.path.dirname(path) for path in CANARIES["files"]})]:
    try:
        print(folder, os.listdir(folder))
    except OSError as error:
        print(type(error).__name__)
try:
    open(os.path.join(CANARIES["marker"], "planted-by-the-attack"), "w").write("x")
except OSError as error:
    print(type(error).__name__)
"""

CONNECT = """
import os, socket
for name, family, address in [("unix", socket.AF_UNIX, CANARIES["unix"]),
                              ("abstract", socket.AF_UNIX, CANARIES["abstract"]),
                              ("tcp", socket.AF_INET, ("127.0.0.1", CANARIES["tcp"]))]:
    try:
        with socket.socket(family) as client:
            client.settimeout(2)
            client.connect(address)
            client.sendall(b"leak")
    except OSError as error:
        print(name, type(error).__name__)
try:
    os.write(os.open(CANARIES["fifo"], os.O_WRONLY | os.O_NONBLOCK), b"leak")
except OSError as error:
    print("fifo", type(error).__name__)
"""

READ_HOST_IPC = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
address = libc.shmat(CANARIES["shm"], None, 0o10000)  # SHM_RDONLY
if address not in (None, ctypes.c_void_p(-1).value):
    print(ctypes.string_at(address, 64).split(b"\\0")[0].decode())
"""
READ_HOST_PROCESSES = """
import os
for entry in os.listdir("/proc"):
    try:
        print(open(f"/proc/{entry}/cmdline").read().replace("\\0", " "))
    except OSError:
        pass
"""


def test_no_host_files(canaries):
    escape(canaries, READ_HOST_FILES, ["marker directory changed", "the secret came back"])
    top = {"usr", "bin", "lib", "lib64", "sbin", "proc", "dev", "work", "sandbox"}
    assert run(f"import os\nassert set(os.listdir('/')) <= {top!r}, os.listdir('/')").passed


def test_no_network_and_no_host_sockets_or_fifos(canaries):
    escape(canaries, CONNECT, ["tcp socket", "unix socket", "abstract socket", "data in the FIFO"])
    attack("import socket\nprint([name for _, name in socket.if_nameindex()] != ['lo'] and 'ESCAPED')")


def test_no_host_ipc_or_processes(canaries):
    """The host's SysV shared memory (its IPC namespace) and its processes' command lines (its PID namespace)."""
    escape(canaries, READ_HOST_IPC, ["the secret came back"])
    escape(canaries, READ_HOST_PROCESSES, ["the secret came back"])


PRIVILEGED = """
import os
caps = int(open('/proc/self/status').read().split('CapEff:')[1].split()[0], 16)
if os.getuid() == 0 or caps:
    print('ESCAPED')
"""


def test_unprivileged_without_capabilities():
    """Inside, uid 65534 without capabilities, and setuid(0) fails (for any caller; as root the attack is first
    shown to work unsandboxed: test_a_root_caller_is_unprivileged_inside)."""
    assert ESCAPED not in run(PRIVILEGED).stdout
    assert run("import os\nassert os.getuid() == 65534 and os.geteuid() == 65534").passed
    assert run("import os\ntry:\n    os.setuid(0)\nexcept OSError:\n    pass\nelse:\n    raise SystemExit(1)").passed


@needs_root
def test_a_root_caller_is_unprivileged_inside():
    attack(PRIVILEGED, as_root=True)


def test_read_only_runtime_and_writable_work_dir():
    """Inside, /usr cannot be written and /work can (for any caller: the write to /usr is first shown to work
    unsandboxed as root in test_usr_is_read_only_for_a_root_caller)."""
    target = f"/usr/local/refusion-sandbox-probe-{uuid.uuid4().hex}"
    result = run(f"open({target!r}, 'w').write('x')")
    assert not result.passed and "OSError: [Errno 30] Read-only file system" in result.detail, result
    assert not os.path.exists(target)
    assert run("open('out.txt', 'w').write('ok')\nassert open('/work/out.txt').read() == 'ok'").passed


@needs_root
def test_usr_is_read_only_for_a_root_caller():
    target = f"/usr/local/refusion-sandbox-probe-{uuid.uuid4().hex}"
    try:
        attack(f"open({target!r}, 'w').write('x')\nprint('ESCAPED')", as_root=True)
        assert os.path.getsize(target) == 1  # the unsandboxed write; the sandboxed one would have failed here
    finally:
        os.remove(target)
    assert not os.path.exists(target)


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


# ------------------------------------------------------------------------------------- seen from the host
def spawn_marked_child(marker, seconds) -> str:
    """A program that runs a child whose command line holds `marker` (and whose own source does not)."""
    half = len(marker) // 2
    return (
        f"import subprocess, sys\nmarker = {marker[:half]!r} + {marker[half:]!r}\n"
        f"subprocess.run([sys.executable, '-c', 'import time; time.sleep({seconds})', marker])\n"
    )


def find_process(marker, deadline) -> int | None:
    """The process whose command line holds `marker`, looked for until `deadline` (at least once)."""
    while True:
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and marker in open(f"/proc/{entry}/cmdline").read():
                    return int(entry)
            except OSError:
                pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def observe(start) -> dict:
    """Start a program (`start(source)`, in a thread) that runs a child whose command line holds a marker; read
    the child's state from the host's /proc, then kill it."""
    marker = f"refusion-observed-{uuid.uuid4().hex}"
    source = spawn_marked_child(marker, seconds=30)
    thread = threading.Thread(target=start, args=(source,))
    thread.start()
    pid = find_process(marker, time.monotonic() + 20)
    assert pid is not None, "the program's child never appeared"
    try:
        status = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
        seen = {
            "status": {key: value.strip() for key, value in status.items()},
            "limits": {
                line[:26].strip(): line[26:47].split()[0]
                for line in open(f"/proc/{pid}/limits")
                if not line.startswith("Limit")
            },  # fmt: skip
            "mounts": [line.split() for line in open(f"/proc/{pid}/mountinfo")],
            "namespaces": {name: os.readlink(f"/proc/{pid}/ns/{name}") for name in NAMESPACES},
        }
    finally:
        os.kill(pid, signal.SIGKILL)
        thread.join()
    return seen


NAMESPACES = ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup")
ALLOWED_HOST_MOUNTS = {  # (a path of a host file system, the mount point): nothing else of the host is mounted
    **{(f"/{name}", f"/{name}"): "ro" for name in ("usr", "bin", "lib", "lib64", "sbin")},
    **{(f"/{name}", f"/dev/{name}"): "rw" for name in ("null", "zero", "full", "random", "urandom", "tty")},
}
OWN_WRITABLE_MOUNTS = {  # the options each must have: a cap in bytes and one in inodes on every writable tmpfs
    "/work": {"size=65536k", "nr_inodes=8192"}, "/dev/shm": {"size=16384k", "nr_inodes=1024"}, "/proc": set(),
    "/dev/pts": set(),
}  # fmt: skip
DOCUMENTED_LIMITS = {  # run with timeout 10 s, 1024 MB, 4 processes (+ the judge)
    "Max cpu time": "11", "Max file size": str(2**20), "Max core file size": "0", "Max processes": "5",
    "Max open files": "64", "Max address space": str(256 * 2**20),
}  # fmt: skip


def raised_core_limit(popen, *args, **kwargs):
    """subprocess.Popen with RLIMIT_CORE raised to 1 MiB in the child (a caller that allows core dumps)."""
    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    kwargs["preexec_fn"] = lambda: resource.setrlimit(resource.RLIMIT_CORE, (2**20, hard))
    return popen(*args, **kwargs)


def test_the_sandboxed_process_seen_from_the_host(monkeypatch):
    """What the host's /proc says about a sandboxed process: other namespaces than the host's, an unprivileged host
    uid, no capabilities, the seccomp filter and no-new-privileges, the documented limits, and a mount table with
    nothing of the host but /usr (read-only) and the harmless device nodes. Unsandboxed, each differs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    if soft == 0 and (hard == resource.RLIM_INFINITY or hard >= 2**20):  # a caller allowing core dumps: not inside
        monkeypatch.setattr(sandbox.subprocess, "Popen", functools.partial(raised_core_limit, subprocess.Popen))
    host_devices = {line.split()[2] for line in open("/proc/self/mountinfo")}
    host_namespaces = {name: os.readlink(f"/proc/self/ns/{name}") for name in NAMESPACES}
    plain = observe(lambda source: unsandboxed(source, timeout=30, as_root=True))
    assert plain["namespaces"] == host_namespaces and plain["status"]["Seccomp"] == "0"
    assert plain["limits"]["Max open files"] != DOCUMENTED_LIMITS["Max open files"]
    assert plain["limits"]["Max core file size"] != "0"
    assert any(line[4] == "/tmp" or line[4] == "/" and line[2] in host_devices for line in plain["mounts"])

    seen = observe(lambda source: run(source, timeout=10))
    shared = {name for name in NAMESPACES if seen["namespaces"][name] == host_namespaces[name]}
    assert not shared, f"namespaces shared with the host: {shared}"
    status = seen["status"]
    uids = {int(uid) for uid in status["Uid"].split() + status["Gid"].split()}
    if ROOT:
        assert all(sandbox.SANDBOX_UID_BASE <= uid < sandbox.SANDBOX_UID_BASE + 1000 for uid in uids), uids
    else:
        assert uids == {os.geteuid(), os.getegid()}, uids  # the caller's own, unchanged
    capabilities = {key: status[key] for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    assert set(capabilities.values()) == {"0000000000000000"}, capabilities
    assert (status["Seccomp"], status["NoNewPrivs"]) == ("2", "1")
    limits = {key: seen["limits"][key] for key in DOCUMENTED_LIMITS}
    assert limits == DOCUMENTED_LIMITS
    wrong = []
    for _, _, device, root, point, options, *rest in seen["mounts"]:
        kind, super_options = rest[-3], rest[-1]
        access = options.split(",")[0]
        if device in host_devices:  # a host file system: only the allowed paths, as allowed
            if ALLOWED_HOST_MOUNTS.get((root, point)) != access and not (point == "/" and kind == "tmpfs"):
                wrong.append(f"host {root} at {point} ({access})")
        elif access == "rw":  # the sandbox's own: writable only where documented, at the documented caps
            caps = OWN_WRITABLE_MOUNTS.get(point)
            if caps is None or not caps <= set(super_options.split(",")):
                wrong.append(f"writable {kind} at {point} ({super_options})")
    assert not wrong, wrong
    assert {point for *_, point, _, _, _, _, _ in seen["mounts"]} >= {"/usr", "/work", "/dev/shm", "/proc"}


def test_killed_with_its_caller():
    """When the process that called `run_program` dies (SIGKILL: no cleanup of its own), the sandbox and every
    process in it go too (bwrap's --die-with-parent). Unsandboxed, a child outlives its killed parent."""
    for name in ("unsandboxed", "sandboxed"):
        marker = f"refusion-orphan-{uuid.uuid4().hex}"
        child = spawn_marked_child(marker, seconds=60)
        if name == "unsandboxed":
            caller = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}])"
        else:
            caller = SANDBOX_BY_PATH.format(path=sandbox.__file__)
            caller += f"sandbox.run_program({child!r}, timeout=60, allow_code_execution=True)"
        process = subprocess.Popen([sys.executable, "-I", "-c", caller], cwd="/")
        try:
            pid = find_process(marker, time.monotonic() + 30)
            assert pid is not None, f"{name}: the program never started"
        finally:
            process.kill()
            process.wait()
        deadline = time.monotonic() + (1 if name == "unsandboxed" else 5)
        while os.path.exists(f"/proc/{pid}/cmdline") and time.monotonic() < deadline:
            time.sleep(0.05)
        if name == "unsandboxed":
            assert find_process(marker, 0) == pid, "unsandboxed, the child outlives its killed caller"
            os.kill(pid, signal.SIGKILL)
        else:
            assert find_process(marker, 0) is None, "the sandbox outlived its killed caller"


SANDBOX_BY_PATH = """\
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sandbox_under_test", {path!r})
sandbox = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sandbox
spec.loader.exec_module(sandbox)
"""


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
        print('children', children, flush=True)
        if children >= 64:
            print('ESCAPED')
        """,
        max_processes=8,
    )
    assert forks.stdout.split() == ["children", "7"], forks  # 8 tasks: the program and 7 children
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


def test_the_run_folder_is_removed(monkeypatch):
    """The host side of a run (program, stdout, stderr, the tmpfs' mount points) is removed with everything in it.
    (As root, the run's uid passes through the temporary folder: a folder closed to it is refused with the fix.)"""
    folder = Path(tempfile.mkdtemp(prefix="refusion-run-folders-"))
    try:
        folder.chmod(0o755)
        monkeypatch.setattr(sandbox.tempfile, "tempdir", str(folder))
        assert run("open('x', 'w').write('y')\nprint('z' * 1000)").passed
        assert list(folder.iterdir()) == []
        if ROOT:
            folder.chmod(0o700)
            with pytest.raises(SandboxUnavailable, match=f"{folder} is closed to other users: as root, set TMPDIR"):
                run("pass")
            assert list(folder.iterdir()) == []
    finally:
        shutil.rmtree(folder)


# ------------------------------------------------------------------------------- process 1 and the terminal
REACH_PROCESS_1 = """
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
seen = {}
try:
    with open('/proc/1/mem', 'r+b'):
        seen['/proc/1/mem'] = 'opened for writing'
except OSError as error:
    seen['/proc/1/mem'] = errno.errorcode[error.errno]
pidfd, eventfds = os.pidfd_open(1), []
for fd in range(64):
    ctypes.set_errno(0)
    copy = libc.syscall(ctypes.c_long(438), ctypes.c_long(pidfd), ctypes.c_long(fd), ctypes.c_long(0))  # pidfd_getfd
    if copy < 0:
        if ctypes.get_errno() != errno.EBADF:  # a descriptor process 1 does not have
            seen.setdefault('pidfd_getfd', errno.errorcode[ctypes.get_errno()])
    elif 'eventfd' in os.readlink(f'/proc/self/fd/{copy}'):
        eventfds.append(copy)
        seen['eventfd'] = 'written'
print(json.dumps(seen), flush=True)  # first: the run may end at once
for copy in eventfds:
    os.write(copy, (42).to_bytes(8, 'little'))  # bwrap's init adds exit status + 1; the host sees the sum - 1
"""


def test_the_program_cannot_reach_process_1(monkeypatch):
    """A right answer that also attacks process 1 of its PID namespace. In a sandbox without `--as-pid-1` (and with
    `pidfd_getfd` allowed), process 1 is bwrap's init, of the program's uid and dumpable: the program opens its
    memory for writing and writes 42 to its exit-status eventfd, and the host sees exit status 41 or 42 (the run fails;
    another value could mask a judge killed by a signal). Here process 1 is the judge, non-dumpable: both are
    refused and the host sees the judge's own exit status (the run passes)."""
    program = "def add(a, b):\n    return a + b\n" + REACH_PROCESS_1
    real, command = sandbox._sandbox(), sandbox._Sandbox.command
    monkeypatch.setattr(sandbox, "DENIED_SYSCALLS", tuple(n for n in sandbox.DENIED_SYSCALLS if n != "pidfd_getfd"))
    weakened = dataclasses.replace(real, seccomp_filter=sandbox._seccomp_filter(real.python))
    monkeypatch.setattr(sandbox, "_sandbox", lambda: weakened)
    monkeypatch.setattr(sandbox._Sandbox, "command", lambda *a, **k: [w for w in command(*a, **k) if w != "--as-pid-1"])
    weak = run(program, tests="assert add(2, 3) == 5")
    assert json.loads(weak.stdout) == {"/proc/1/mem": "opened for writing", "eventfd": "written"}, weak
    assert not weak.passed and re.search(r"exit status 4[12]\b", weak.detail), weak  # before or after the record
    monkeypatch.undo()
    result = run(program, tests="assert add(2, 3) == 5")
    assert json.loads(result.stdout) == {"/proc/1/mem": "EACCES", "pidfd_getfd": "EPERM"}, result
    assert result.passed, result


TERMINAL_CALLER = (
    """
import fcntl, subprocess, sys, termios
fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # stdin is the test's pty: it becomes this session's controlling terminal
if sys.argv[1] == "unsandboxed":
    subprocess.run([sys.executable, "-c", sys.argv[2]], stdin=subprocess.DEVNULL)
else:
"""
    + textwrap.indent(SANDBOX_BY_PATH, "    ")
    + """
    sandbox.run_program(sys.argv[2], timeout=30, allow_code_execution=True)
"""
)


def session_and_terminal(pid) -> tuple[int, int]:
    """(session id, tty_nr) of a process, read from the host's /proc/<pid>/stat."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[3]), int(fields[4])


def test_the_program_has_no_controlling_terminal():
    """Seen from the host: a caller whose session has a controlling terminal (a pty of the test's) runs a program
    that starts a child. Unsandboxed, the child has that terminal (it could inject input with TIOCSTI); sandboxed,
    it has none and is in a session other than the caller's (bwrap's --new-session)."""
    caller_source = TERMINAL_CALLER.format(path=sandbox.__file__)
    controller, terminal = os.openpty()
    try:
        for name in ("unsandboxed", "sandboxed"):
            marker = f"refusion-terminal-{uuid.uuid4().hex}"
            caller = subprocess.Popen(
                [sys.executable, "-I", "-c", caller_source, name, spawn_marked_child(marker, seconds=30)],
                stdin=terminal, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, cwd="/",
            )  # fmt: skip
            try:
                pid = find_process(marker, time.monotonic() + 30)
                assert pid is not None, f"{name}: the program never started ({caller.stderr.read1().decode()})"
                caller_session, caller_terminal = session_and_terminal(caller.pid)
                session, terminal_number = session_and_terminal(pid)
                os.kill(pid, signal.SIGKILL)
            finally:
                caller.kill()
                caller.wait()
                caller.stderr.close()
            assert caller_terminal == os.fstat(terminal).st_rdev != 0, "the caller has the pty as its terminal"
            if name == "unsandboxed":
                assert (session, terminal_number) == (caller_session, caller_terminal), name
            else:
                assert terminal_number == 0 and session != caller_session, (session, terminal_number)
    finally:
        os.close(controller)
        os.close(terminal)
