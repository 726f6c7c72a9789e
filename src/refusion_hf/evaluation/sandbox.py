"""Execute untrusted (model-generated) Python programs in a sandboxed subprocess, after an explicit opt-in.

Layers, outermost first:

1. **Opt-in.** Nothing runs unless the caller passes `allow_code_execution=True` or the environment has
   `HF_ALLOW_CODE_EVAL=1` (the variable Hugging Face's `code_eval` uses); otherwise `CodeExecutionNotAllowed`.
2. **OS isolation** (where `unshare` works: root, or unprivileged user namespaces): new network namespace (no
   network at all), PID and IPC namespaces, and a private mount namespace in which every mount is read-only except
   the program's temporary working directory; then every capability is dropped (`setpriv`), with no_new_privs.
3. **Resource limits** in the child: address space (`RLIMIT_AS`), CPU seconds, file size, no core dumps; a wall
   clock timeout after which the whole process group is killed.
4. **Python guard**: an audit hook refusing writes outside the working directory, process creation, signals,
   sockets, ctypes and raising limits (see `_sandbox_runner.py`). This is what stands where layer 2 is unavailable.
5. A fresh temporary directory as working directory and HOME/TMPDIR, an empty environment, `python -I -S -B`
   (no site-packages, no user paths), and stdout/stderr to files rather than pipes.

A program passes when it runs to completion without raising (SystemExit counts as a failure).
"""

from __future__ import annotations

import functools
import math
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ALLOW_ENV_VAR = "HF_ALLOW_CODE_EVAL"
ISOLATION_MODES = ("auto", "namespaces", "none")
DEFAULT_TIMEOUT = 5.0
DEFAULT_MEMORY_LIMIT_MB = 1024
FILE_SIZE_LIMIT_BYTES = 16 * 1024 * 1024
_SETUP_FAILED_EXIT = 97
_RUNNER = Path(__file__).with_name("_sandbox_runner.py")

OPT_IN_MESSAGE = (
    "Executing model-generated code is refused without an explicit opt-in. The code runs in a sandboxed subprocess "
    "(timeout, memory limit, no network, temporary directory), but it is still untrusted code running on this "
    f"machine. To allow it, pass `allow_code_execution=True` (the `--allow-code-execution` flag of `refusion eval`) "
    f"or set the environment variable {ALLOW_ENV_VAR}=1."
)


class CodeExecutionNotAllowed(PermissionError):
    """Raised when code execution is requested without the explicit opt-in."""


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


_SETUP_SCRIPT = """
work="$1"; shift
{mount} --bind "$work" "$work" || {{ echo "sandbox setup: cannot bind-mount $work" >&2; exit {code}; }}
{mount} -o remount,bind,ro / || {{ echo "sandbox setup: cannot make / read-only" >&2; exit {code}; }}
while read -r _device point _rest; do
    [ "$point" = "$work" ] && continue
    {mount} -o remount,bind,ro "$point" 2>/dev/null
done < /proc/self/mounts
exec "$@"
"""


def _namespace_prefix(user_namespace: bool) -> list[str] | None:
    unshare, mount, setpriv, sh = (shutil.which(name) for name in ("unshare", "mount", "setpriv", "sh"))
    if not (unshare and mount and setpriv and sh):
        return None
    command = [unshare, "--mount", "--net", "--ipc", "--pid", "--fork", "--kill-child", "--mount-proc"]
    command += ["--propagation", "private"]
    if user_namespace:
        command.append("--map-root-user")
    script = _SETUP_SCRIPT.format(mount=shlex.quote(mount), code=_SETUP_FAILED_EXIT)
    return command + [sh, "-c", script, "sandbox-setup"]


def _setpriv_prefix() -> list[str]:
    return [shutil.which("setpriv"), "--bounding-set", "-all", "--inh-caps", "-all", "--no-new-privs", "--"]


@functools.lru_cache(maxsize=1)
def namespace_isolation() -> tuple[str, ...] | None:
    """The command prefix that runs a command inside the isolating namespaces, or None where this machine cannot
    create them (probed once: the probe must see no network interface up and a read-only filesystem)."""
    probe = (
        "import socket\n"
        "try:\n    open('/refusion-sandbox-probe', 'w')\nexcept OSError:\n    pass\nelse:\n    raise SystemExit(3)\n"
        "if [name for _, name in socket.if_nameindex()] != ['lo']:\n    raise SystemExit(4)\n"
    )
    for user_namespace in (False, True) if os.geteuid() == 0 else (True,):
        prefix = _namespace_prefix(user_namespace)
        if prefix is None:
            return None
        with tempfile.TemporaryDirectory(prefix="refusion-sandbox-probe-") as work:
            try:
                completed = subprocess.run(
                    [*prefix, work, *_setpriv_prefix(), sys.executable, "-I", "-S", "-c", probe],
                    capture_output=True,
                    timeout=30,
                    env={"PATH": "/usr/bin:/bin"},
                    cwd=work,
                )
            except (OSError, subprocess.TimeoutExpired):
                continue
        if completed.returncode == 0:
            return tuple(prefix)
    return None


def _check_limits(timeout: float, memory_limit_mb: int) -> None:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"`timeout` must be a number of seconds > 0, got {timeout!r}.")
    if isinstance(memory_limit_mb, bool) or not isinstance(memory_limit_mb, int) or memory_limit_mb < 64:
        raise ValueError(
            f"`memory_limit_mb` must be an integer >= 64 (the child Python needs ~30 MB), got {memory_limit_mb!r}."
        )


def run_program(
    program: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    allow_code_execution: bool | None = None,
    isolation: str = "auto",
    python_guard: bool = True,
) -> ExecutionResult:
    """Run `program` (Python source) in the sandbox; passed = it ran to the end without raising.

    `isolation`: "auto" (namespaces where available), "namespaces" (required; error where unavailable) or "none"
    (resource limits and the Python guard only). `python_guard=False` leaves out the audit hook (to test the OS
    layer alone).
    """
    require_opt_in(allow_code_execution)
    if not isinstance(program, str):
        raise TypeError(f"`program` must be a string of Python source, got {type(program).__name__}.")
    _check_limits(timeout, memory_limit_mb)
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"`isolation` must be one of {ISOLATION_MODES}, got {isolation!r}.")
    prefix: list[str] = []
    if isolation != "none":
        found = namespace_isolation()
        if found is None and isolation == "namespaces":
            raise RuntimeError(
                "isolation='namespaces' was requested but this machine cannot create namespaces with `unshare` "
                "(needs root or unprivileged user namespaces, and util-linux `unshare`, `mount`, `setpriv`); use "
                "isolation='auto' to fall back to resource limits and the Python guard."
            )
        if found is not None:
            prefix = [*found]

    with tempfile.TemporaryDirectory(prefix="refusion-sandbox-") as base:
        work = os.path.join(base, "work")
        os.mkdir(work)
        program_path = os.path.join(base, "program.py")
        with open(program_path, "w", encoding="utf-8") as handle:
            handle.write(program)
        nonce = secrets.token_hex(16)
        read_end, write_end = os.pipe()
        cpu_seconds = math.ceil(timeout) + 1
        command = [
            sys.executable,
            "-I",
            "-S",
            "-B",
            str(_RUNNER),
            program_path,
            work,
            str(write_end),
            str(memory_limit_mb * 1024 * 1024),
            str(cpu_seconds),
            str(FILE_SIZE_LIMIT_BYTES),
            "1" if python_guard else "0",
        ]
        if prefix:
            command = [*prefix, work, *_setpriv_prefix(), *command]
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
        stdout_path, stderr_path = os.path.join(base, "stdout"), os.path.join(base, "stderr")
        start = time.perf_counter()
        timed_out = False
        with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
            try:
                process = subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE,
                    stdout=stdout,
                    stderr=stderr,
                    cwd=work,
                    env=env,
                    pass_fds=(write_end,),
                    start_new_session=True,
                )
            finally:
                os.close(write_end)
            try:
                process.stdin.write(nonce.encode() + b"\n")
                process.stdin.close()
            except BrokenPipeError:
                pass
            try:
                returncode = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(process)
                returncode = process.wait()
        seconds = time.perf_counter() - start
        os.set_blocking(read_end, False)  # a stray descendant holding the write end must not block us
        with os.fdopen(read_end, "rb") as result:
            reported = (result.read(64) or b"").decode(errors="replace")
        stderr_text = _tail(stderr_path)

    if returncode == _SETUP_FAILED_EXIT and "sandbox setup:" in stderr_text:
        raise RuntimeError(f"the sandbox could not be set up: {stderr_text.strip()}")
    if timed_out:
        return ExecutionResult(False, "timed out", f"killed after {timeout:g} s", seconds)
    if returncode == 0 and reported == nonce:
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
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: str, limit: int = 4096) -> str:
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
    return f"exit code {returncode}"
