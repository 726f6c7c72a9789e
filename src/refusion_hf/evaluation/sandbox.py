"""Execute untrusted (model-generated) Python programs behind an OS-level boundary, after an explicit opt-in.

The boundary is [bubblewrap](https://github.com/containers/bubblewrap) (`bwrap`, Debian's `bubblewrap` package),
the sandbox Flatpak runs every desktop application in. Why it: it is a small, maintained, setuid-free tool that
builds the whole boundary from kernel namespaces in one exec (nsjail does the same with a larger surface and no
Debian package here; Landlock restricts files only, not network, processes or devices). This module adds no
boundary of its own: it only builds bwrap's command line, runs it and reads the exit status.

Each program runs as follows (every property has an escape test in tests/evaluation/test_sandbox.py):

* **Opt-in.** Nothing runs unless the caller passes `allow_code_execution=True` or the environment has
  `HF_ALLOW_CODE_EVAL=1` (the variable Hugging Face's `code_eval` uses); otherwise `CodeExecutionNotAllowed`.
* **Unprivileged.** When the caller is root, bwrap itself is started under an unused uid (one per run, from
  `SANDBOX_UID_BASE`), so the program is an unprivileged user on the host too; inside its user namespace it is
  uid 65534 with no capabilities.
* **Nothing of the host.** New mount, user, PID, network, IPC, UTS and cgroup namespaces. The file system is
  `/usr` (read-only: the Python runtime and its standard library), a fresh `/proc` of its own PID namespace, a
  minimal `/dev` (null, zero, full, random, urandom, tty and a private pts/shm; no device of the host), the
  program (read-only) and an empty size-limited tmpfs as working directory. No home, no repository, no `/etc`,
  no `/tmp`, no host sockets or FIFOs, no network interface but its own loopback.
* **Killed as a whole.** The program is a child of bwrap's init in its own PID namespace: when the run ends
  (exit, time-out, or the caller's death: `--die-with-parent`) the namespace goes and every process in it.
* **Limits** (`prlimit`): wall time (killed), CPU seconds, address space, processes (`RLIMIT_NPROC` of the
  run's own uid), file size (so stdout, stderr and every file it writes), no core dumps; the working directory is
  a tmpfs of `WORK_DIR_BYTES`.
* **Cleanup cannot fail because of the program**: all it can write is its tmpfs, which vanishes with its mount
  namespace; the host side is a temporary folder holding only the program and the two output files.
* **Verdict from outside.** Nothing inside the sandbox reports a result: the program is run by the plain
  interpreter (`python -I -S -B program.py`, as `__main__`), and it passes when the kernel reports that the
  interpreter exited with status 0. A failing assert, an uncaught exception, a signal or a limit is a failure,
  whatever the program did to its own modules (there is no runner code to patch, and no secret to read).
  A program can still choose its own exit status (`sys.exit(0)` or `os._exit(0)` before its tests run): that is
  the program deciding not to run its tests, which no in-process check can prevent; verdicts mean "the
  interpreter exited successfully", as with any test runner.

If bubblewrap is missing or cannot create its namespaces here, code execution is refused with `SandboxUnavailable`
saying why and how to fix it; there is no weaker fallback. `isolation_report()` says what is used, for logs and
results files.
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ALLOW_ENV_VAR = "HF_ALLOW_CODE_EVAL"
DEFAULT_TIMEOUT = 5.0
DEFAULT_MEMORY_LIMIT_MB = 1024
DEFAULT_MAX_PROCESSES = 16
OUTPUT_LIMIT_BYTES = 1024 * 1024  # per file the program writes, stdout and stderr included
WORK_DIR_BYTES = 64 * 1024 * 1024
SANDBOX_UID_BASE = 61000  # host uids for sandbox runs when the caller is root: SANDBOX_UID_BASE .. + 999
SANDBOX_INNER_UID = 65534  # the program's uid inside its user namespace ("nobody")
INSTALL_HINT = (
    "install bubblewrap (`apt-get install bubblewrap` on Debian/Ubuntu, `dnf install bubblewrap` on Fedora; "
    "`make test` installs it) on a kernel that allows user namespaces"
)

OPT_IN_MESSAGE = (
    "Executing model-generated code is refused without an explicit opt-in. The code runs inside a bubblewrap "
    "sandbox (no host files, no network, own PID namespace, resource limits), but it is still untrusted code. To "
    f"allow it, pass `allow_code_execution=True` (the `--allow-code-execution` flag of `refusion eval`) or set the "
    f"environment variable {ALLOW_ENV_VAR}=1."
)


class CodeExecutionNotAllowed(PermissionError):
    """Raised when code execution is requested without the explicit opt-in."""


class SandboxUnavailable(RuntimeError):
    """The OS sandbox cannot be set up on this machine; code execution is refused rather than run unconfined."""


@dataclass(frozen=True)
class ExecutionResult:
    passed: bool
    status: str  # "passed", "failed" or "timed out"
    detail: str  # the last line of the program's stderr (e.g. "AssertionError"), or why it stopped
    seconds: float


def code_execution_allowed(allow_code_execution: bool | None = None) -> bool:
    return bool(allow_code_execution) or os.environ.get(ALLOW_ENV_VAR) == "1"


def require_opt_in(allow_code_execution: bool | None = None) -> None:
    if not code_execution_allowed(allow_code_execution):
        raise CodeExecutionNotAllowed(OPT_IN_MESSAGE)


# ----------------------------------------------------------------------------------------------- the sandbox
_RUN_UIDS = itertools.count()
_RUN_UIDS_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Sandbox:
    bwrap: str
    prlimit: str
    python: str  # the interpreter inside the sandbox (under /usr)
    version: str  # bwrap --version

    def command(self, program_fd: int, *, memory_bytes: int, cpu_seconds: int, processes: int) -> list[str]:
        """The command line; `program_fd` is an open file of the program's source, passed to the child."""
        limits = [
            f"--as={memory_bytes}",
            f"--cpu={cpu_seconds}",
            f"--nproc={processes}",
            f"--fsize={OUTPUT_LIMIT_BYTES}",
            "--core=0",
        ]
        layout = ["--ro-bind", "/usr", "/usr"]
        for name in ("bin", "lib", "lib64", "sbin"):  # merged-/usr symlinks, or read-only copies of the real dirs
            path = Path("/") / name
            if path.is_symlink():
                layout += ["--symlink", os.readlink(path), f"/{name}"]
            elif path.is_dir():
                layout += ["--ro-bind", str(path), f"/{name}"]
        return [
            self.prlimit,
            *limits,
            "--",
            self.bwrap,
            "--unshare-all",  # user, mount, pid, net, ipc, uts, cgroup
            "--die-with-parent",
            "--new-session",
            "--uid", str(SANDBOX_INNER_UID),
            "--gid", str(SANDBOX_INNER_UID),
            "--hostname", "sandbox",
            "--cap-drop", "ALL",
            *layout,
            "--proc", "/proc",
            "--dev", "/dev",
            "--size", str(WORK_DIR_BYTES),
            "--tmpfs", "/work",
            "--ro-bind-data", str(program_fd), "/sandbox/program.py",
            "--chdir", "/work",
            "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "HOME", "/work",
            "--setenv", "TMPDIR", "/work",
            "--setenv", "LANG", "C.UTF-8",
            "--",
            self.python, "-I", "-S", "-B", "/sandbox/program.py",
        ]  # fmt: skip


def _run_as() -> dict:
    """`subprocess` arguments that start bwrap under a fresh unprivileged uid when the caller is root."""
    if os.geteuid() != 0:
        return {}
    with _RUN_UIDS_LOCK:
        uid = SANDBOX_UID_BASE + next(_RUN_UIDS) % 1000
    return {"user": uid, "group": uid, "extra_groups": []}


def _processes_of(uid: int) -> int:
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


@functools.lru_cache(maxsize=1)
def _sandbox() -> _Sandbox:
    """Find bubblewrap and check, once, that it builds the boundary here (else `SandboxUnavailable`)."""
    bwrap, prlimit = shutil.which("bwrap"), shutil.which("prlimit")
    if bwrap is None:
        raise SandboxUnavailable(
            f"code execution needs the bubblewrap sandbox, and `bwrap` is not on PATH: {INSTALL_HINT}."
        )
    if prlimit is None:
        raise SandboxUnavailable(
            "code execution needs `prlimit` (util-linux) for its resource limits: install util-linux."
        )
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if python is None:
        raise SandboxUnavailable(
            "code execution needs a Python interpreter under /usr (/usr/bin/python3) to run inside the sandbox: "
            "install python3."
        )
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    sandbox = _Sandbox(bwrap, prlimit, python, version)
    probe = (
        "import os, socket\nassert os.getuid() == 65534 and not os.path.exists('/etc')\n"
        "assert [name for _, name in socket.if_nameindex()] == ['lo']\n"
    )
    with tempfile.TemporaryFile() as source:
        source.write(probe.encode())
        source.flush()
        source.seek(0)
        command = sandbox.command(source.fileno(), memory_bytes=512 * 2**20, cpu_seconds=10, processes=4096)
        try:
            completed = subprocess.run(
                command, capture_output=True, text=True, timeout=60, pass_fds=(source.fileno(),), **_run_as()
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise SandboxUnavailable(
                f"the bubblewrap sandbox could not be started ({error}): {INSTALL_HINT}."
            ) from None
    if completed.returncode != 0:
        reason = (completed.stderr.strip().splitlines() or [f"exit status {completed.returncode}"])[-1]
        raise SandboxUnavailable(f"the bubblewrap sandbox cannot be set up on this machine ({reason}): {INSTALL_HINT}.")
    return sandbox


def isolation_report() -> dict:
    """What isolates generated code here (for logs and results files); raises `SandboxUnavailable` if nothing."""
    sandbox = _sandbox()
    return {
        "tool": sandbox.version,
        "namespaces": ["user", "mount", "pid", "network", "ipc", "uts", "cgroup"],
        "host_uid": f"{SANDBOX_UID_BASE}+ (one per run)" if os.geteuid() == 0 else str(os.geteuid()),
        "uid_inside": SANDBOX_INNER_UID,
        "capabilities": "none",
        "filesystem": "read-only /usr, own /proc, minimal /dev, read-only program, tmpfs /work "
        f"({WORK_DIR_BYTES // 2**20} MiB)",
        "python": sandbox.python,
        "limits": f"wall time, CPU, address space, processes, {OUTPUT_LIMIT_BYTES // 1024} KiB per written file",
    }


def _check_limits(timeout, memory_limit_mb, max_processes) -> None:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"`timeout` must be a number of seconds > 0, got {timeout!r}.")
    if isinstance(memory_limit_mb, bool) or not isinstance(memory_limit_mb, int) or memory_limit_mb < 64:
        raise ValueError(
            f"`memory_limit_mb` must be an integer >= 64 (the child Python needs ~30 MB), got {memory_limit_mb!r}."
        )
    if isinstance(max_processes, bool) or not isinstance(max_processes, int) or max_processes < 1:
        raise ValueError(f"`max_processes` must be an integer >= 1, got {max_processes!r}.")


def run_program(
    program: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    allow_code_execution: bool | None = None,
) -> ExecutionResult:
    """Run `program` (Python source) in the sandbox; passed = the interpreter exited with status 0."""
    require_opt_in(allow_code_execution)
    if not isinstance(program, str):
        raise TypeError(f"`program` must be a string of Python source, got {type(program).__name__}.")
    _check_limits(timeout, memory_limit_mb, max_processes)
    sandbox = _sandbox()
    run_as = _run_as()
    # RLIMIT_NPROC counts the host uid's processes: the run's own uid when root (none yet), else the caller's.
    processes = max_processes + 2 + (0 if run_as else _processes_of(os.geteuid()))
    with tempfile.TemporaryDirectory(prefix="refusion-sandbox-") as base:
        program_path = Path(base) / "program.py"  # private: bwrap gets it as an open file, copied into its tmpfs
        program_path.write_text(program, encoding="utf-8")
        source = os.open(program_path, os.O_RDONLY)
        command = sandbox.command(
            source,
            memory_bytes=memory_limit_mb * 2**20,
            cpu_seconds=int(timeout) + 1,
            processes=processes,
        )
        stdout_path, stderr_path = Path(base) / "stdout", Path(base) / "stderr"
        start = time.perf_counter()
        timed_out = False
        with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
            try:
                process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    cwd="/",
                    env={"PATH": "/usr/bin:/bin"},
                    pass_fds=(source,),
                    start_new_session=True,
                    **run_as,
                )
            finally:
                os.close(source)
            try:
                returncode = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(process)
                returncode = process.wait()
        seconds = time.perf_counter() - start
        stderr_text = _tail(stderr_path)
    if timed_out:
        return ExecutionResult(False, "timed out", f"killed after {timeout:g} s", seconds)
    if returncode == 0:
        return ExecutionResult(True, "passed", "", seconds)
    return ExecutionResult(False, "failed", _failure_detail(stderr_text, returncode), seconds)


def run_programs(
    programs: Sequence[str],
    *,
    num_workers: int = 2,
    **kwargs,
) -> list[ExecutionResult]:
    """`run_program` over many programs, `num_workers` at a time, results in input order."""
    require_opt_in(kwargs.get("allow_code_execution"))
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"`num_workers` must be an integer >= 1, got {num_workers!r}.")
    if not programs:
        return []
    with ThreadPoolExecutor(max_workers=min(num_workers, len(programs))) as pool:
        return list(pool.map(lambda program: run_program(program, **kwargs), programs))


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # bwrap; its PID namespace (the program and all it started) goes too
    except ProcessLookupError:
        pass


def _tail(path: Path, limit: int = 4096) -> str:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - limit))
        return handle.read().decode(errors="replace")


def _failure_detail(stderr_text: str, returncode: int) -> str:
    lines = [line.strip() for line in stderr_text.splitlines() if line.strip()]
    if lines:
        return lines[-1][:300]
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode > 128:  # bwrap reports a signalled child as 128 + signal
        try:
            return f"killed by {signal.Signals(returncode - 128).name}"
        except ValueError:
            pass
    return f"exit code {returncode}"


__all__ = [
    "ALLOW_ENV_VAR",
    "CodeExecutionNotAllowed",
    "ExecutionResult",
    "SandboxUnavailable",
    "code_execution_allowed",
    "isolation_report",
    "require_opt_in",
    "run_program",
    "run_programs",
]
