"""The sandbox's kernel surface: every system call the filter must refuse (the probe's list, which must equal
`DENIED_SYSCALLS`; and clone with a namespace flag, clone3, fcntl growing a pipe's buffer, a nested user namespace)
is first made unsandboxed, where it reaches the kernel (it succeeds, or fails on its arguments: never with the
filter's errno), then inside the sandbox, where the filter refuses it. Socket buffers cannot be grown and socket
families other than AF_UNIX, AF_INET, AF_INET6 and netlink's NETLINK_ROUTE cannot be created (each shown to work
unsandboxed), also when the arguments' high 32 bits are set. Then the memory a run can hold: every writable path
filled stops at its cap, forked children together stop at `memory_limit_mb`, and concurrent runs do not share their
process limit. Only the tests whose unsandboxed half needs root are skipped for other users."""

import dataclasses
import errno
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from refusion_hf.evaluation import sandbox
from refusion_hf.evaluation.sandbox import run_program

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="unsandboxed, several of these calls need root to succeed")

# One call per system call, with arguments that do no harm on the host as root: the ones that change something act
# on the probe's own process, keyring, private mount namespace or objects it removes; the kernel's own calls
# (kexec, modules, reboot, swap, acct) get invalid arguments, so unsandboxed they fail on those (EINVAL, ENOENT,
# EBADF; ENOSYS where the kernel lacks them), never with EPERM.
PROBE = r"""
import ctypes, errno, json, os, signal, tempfile
NR, SANDBOXED = {numbers}, {sandboxed}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L, NULL = ctypes.c_long, None
outcomes = {{}}

def call(name, *args, key=None):
    ctypes.set_errno(0)
    result = libc.syscall(L(NR[name]), *[L(a) if isinstance(a, int) else a for a in args])
    outcomes[key or name] = 0 if result >= 0 else ctypes.get_errno()
    return result

def buffer(size, *words):
    data = ctypes.create_string_buffer(size)
    ctypes.memmove(data, (ctypes.c_uint32 * len(words))(*words), 4 * len(words))
    return data

def close(fd):
    if fd >= 0:
        os.close(fd)

close(call("io_uring_setup", 1, buffer(120)))
call("io_uring_enter", -1, 0, 0, 0, NULL, 0)
call("io_uring_register", -1, 0, NULL, 0)
call("keyctl", 0, -2, 1)  # KEYCTL_GET_KEYRING_ID of the process keyring, created
call("add_key", b"user", b"refusion-probe", b"x", 1, -2)
call("request_key", b"user", b"refusion-probe", NULL, 0)
child = os.fork()
if child == 0:
    signal.pause()
    os._exit(0)
call("ptrace", 16, child, 0, 0)  # PTRACE_ATTACH
os.kill(child, signal.SIGKILL)
os.waitpid(child, 0)
word, copy = ctypes.c_long(7), ctypes.c_long(0)
local = (ctypes.c_void_p * 2)(ctypes.addressof(copy), 8)
remote = (ctypes.c_void_p * 2)(ctypes.addressof(word), 8)
call("process_vm_readv", os.getpid(), local, 1, remote, 1, 0)
call("process_vm_writev", os.getpid(), remote, 1, local, 1, 0)
pidfd = libc.syscall(L(NR["pidfd_open"]), L(os.getpid()), L(0))  # allowed: a descriptor of this process
close(call("pidfd_getfd", pidfd, 0, 0))  # a copy of its own stdin
close(pidfd)
close(call("bpf", 0, buffer(72, 2, 4, 4, 1), 72))  # BPF_MAP_CREATE: an array map of one 4-byte value
close(call("perf_event_open", buffer(128, 1, 128), 0, -1, -1, 0))  # a software clock of this process
close(call("userfaultfd", 1))  # UFFD_USER_MODE_ONLY
call("unshare", 0x00020000 | 0x04000000)  # a mount and a UTS namespace of the probe's own
mountpoint = tempfile.mkdtemp()
call("mount", b"none", b"/", NULL, 0x4000 | 0x40000, NULL)  # MS_REC | MS_PRIVATE: nothing propagates out
call("mount", b"none", mountpoint.encode(), b"tmpfs", 0, b"size=1m")
call("umount2", mountpoint.encode(), 0)
os.rmdir(mountpoint)
namespace = os.open("/proc/self/ns/uts", os.O_RDONLY)
call("setns", namespace, 0x04000000)
os.close(namespace)
call("pivot_root", b"/refusion-no-such-dir", b"/refusion-no-such-dir")
call("chroot", b"/refusion-no-such-dir")
close(call("open_tree", -100, b"/", 0))
call("move_mount", -1, b"", -1, b"", 0)
close(call("fsopen", b"tmpfs", 0))
call("fsconfig", -1, 0, NULL, NULL, 0)
call("fsmount", -1, 0, 0)
close(call("fspick", -100, b"/", 0))
call("mount_setattr", -1, b"", 0, NULL, 0)
call("kexec_load", 0, 0, NULL, 0x100)  # an unknown flag: EINVAL before anything is loaded
call("kexec_file_load", -1, -1, 0, NULL, 0x100)
call("init_module", NULL, 0, b"")
call("finit_module", -1, b"", 0)
call("delete_module", b"refusion_no_such_module", 0o4000)
call("reboot", 0, 0, 0, NULL)  # a wrong magic number: EINVAL
call("swapon", b"/refusion-no-such-file", 0)
call("swapoff", b"/refusion-no-such-file")
call("acct", b"/refusion-no-such-dir/file")
call("quotactl", 0, b"/refusion-no-such-dev", 0, NULL)
call("syslog", 10, NULL, 0)  # SYSLOG_ACTION_SIZE_BUFFER
call("uselib", b"/refusion-no-such-file")
call("lookup_dcookie", 0, NULL, 0)
call("name_to_handle_at", -100, b"/", buffer(136, 128), buffer(4), 0)
call("open_by_handle_at", -1, buffer(16, 8), 0)
close(call("fanotify_init", 0, 0))
context = ctypes.c_ulong(0)
if call("io_setup", 1, ctypes.byref(context)) == 0:
    libc.syscall(L(NR["io_destroy"]), L(context.value))
close(call("memfd_create", b"refusion-probe", 0))
close(call("memfd_secret", 0))
segment = call("shmget", 0, 4096, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
if segment >= 0:
    libc.shmctl(int(segment), 0, NULL)  # IPC_RMID
queue = call("msgget", 0, 0o1600)
if queue >= 0:
    libc.msgctl(int(queue), 0, NULL)
queue = call("mq_open", b"refusion-probe", os.O_CREAT | os.O_RDWR, 0o600, NULL)
if queue >= 0:
    os.close(queue)
    libc.mq_unlink(b"/refusion-probe")
reader, writer = os.pipe()
call("fcntl", writer, 1031, 2**20)  # F_SETPIPE_SZ: a 1 MiB pipe buffer
os.close(reader)
os.close(writer)
call("clone3", NULL, 0)
pid = call("clone", 0x10000000 | signal.SIGCHLD, 0, 0, 0, 0)  # a child in a new user namespace
if pid == 0:
    os._exit(0)
if pid > 0:
    os.waitpid(pid, 0)
outcomes["clone"] = outcomes.pop("clone")
reader, writer = os.pipe()
call("fcntl", writer, (1 << 32) | 1031, 2**20, key="fcntl, high bits")  # the kernel reads `cmd` as an int
os.close(reader)
os.close(writer)
expected = {{name: errno.ENOSYS if name == "clone3" else errno.EPERM for name in outcomes}}
if SANDBOXED:
    wrong = {{name: os.strerror(code) for name, code in outcomes.items() if code != expected[name]}}
    assert not wrong, f"not refused by the filter: {{wrong}}"
else:
    print(json.dumps(outcomes))
"""


def syscall_numbers(names) -> dict:
    """The machine's numbers, from libseccomp (the library that builds the filter)."""
    program = "import json, sys, seccomp\nprint(json.dumps({n: seccomp.resolve_syscall(seccomp.Arch(), n) for n in "
    program += "json.loads(sys.argv[1])}))"
    out = subprocess.run(["/usr/bin/python3", "-I", "-c", program, json.dumps(names)], capture_output=True, text=True)
    return json.loads(out.stdout)


PROBED = list(dict.fromkeys(re.findall(r'call\("(\w+)"', PROBE)))


def probed_calls() -> tuple[list[str], dict]:
    """The refused calls (and clone and fcntl, refused with some arguments) and this machine's numbers for the
    probe's calls (from the probe's text, not from the module: a call dropped from DENIED_SYSCALLS is still probed)."""
    names = [*sandbox.DENIED_SYSCALLS, *sandbox.UNAVAILABLE_SYSCALLS, "clone", "fcntl"]
    return names, syscall_numbers([*PROBED, "io_destroy", "pidfd_open"])


def test_each_denied_system_call_is_refused_inside():
    """Inside, every probed call answers the filter's errno (for any caller: the root-only test below shows each
    reaching the kernel unsandboxed, which for a normal user several would not); then, that the probe has one call
    per refused call."""
    names, numbers = probed_calls()
    result = run_program(PROBE.format(numbers=numbers, sandboxed=True), allow_code_execution=True, timeout=20)
    assert result.passed, result
    assert sorted(PROBED) == sorted(names), "one probe per denied system call"


@needs_root
def test_each_denied_system_call_reaches_the_kernel_unsandboxed():
    names, numbers = probed_calls()
    assert sorted(PROBED) == sorted(names), "one probe per denied system call"
    plain = subprocess.run(
        [sys.executable, "-I", "-c", PROBE.format(numbers=numbers, sandboxed=False)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    outcomes = json.loads(plain.stdout.splitlines()[-1])
    assert set(outcomes) == {*names, "fcntl, high bits"}
    # ENOSYS unsandboxed only where this kernel lacks the call (kexec, modules, uselib, lookup_dcookie here)
    refused = {name: os.strerror(code) for name, code in outcomes.items() if code == errno.EPERM}
    assert not refused, f"unsandboxed, these did not reach the kernel: {refused}"
    succeeded = {name for name, code in outcomes.items() if code == 0}
    assert succeeded >= {
        "io_uring_setup", "io_setup", "keyctl", "add_key", "request_key", "ptrace", "process_vm_readv",
        "process_vm_writev", "pidfd_getfd", "bpf", "perf_event_open", "userfaultfd", "unshare", "setns", "mount",
        "umount2", "open_tree", "fsopen", "fspick", "syslog", "name_to_handle_at", "fanotify_init", "memfd_create",
        "shmget", "msgget", "mq_open", "clone", "fcntl", "fcntl, high bits",
    }, outcomes  # fmt: skip


SOCKETS = r"""
import ctypes, json, os, socket
NR = {numbers}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
outcomes = {{}}

def attempt(key, name, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(NR[name]), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    outcomes[key] = 0 if result >= 0 else ctypes.get_errno()
    if result >= 0 and name == "socket":
        os.close(result)

HIGH = 1 << 32  # set in an int argument: the kernel reads its low 32 bits only
one, other = socket.socketpair()
mebibyte = ctypes.c_int(2**20)  # the kernel doubles it (its bookkeeping), capped at net.core.wmem_max / rmem_max
for option, number in {options}.items():
    attempt(option, "setsockopt", one.fileno(), socket.SOL_SOCKET, number, ctypes.byref(mebibyte), 4)
    attempt(option + ", high bits", "setsockopt", one.fileno(), HIGH | socket.SOL_SOCKET, HIGH | number,
            ctypes.byref(mebibyte), 4)
outcomes["send buffer held"] = one.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
for key, family, kind, protocol in [
    ("AF_VSOCK", 40, socket.SOCK_STREAM, 0), ("AF_VSOCK, high bits", HIGH | 40, socket.SOCK_STREAM, 0),
    ("AF_PACKET", 17, socket.SOCK_DGRAM, 0), ("AF_NETLINK NETLINK_AUDIT", 16, socket.SOCK_RAW, 9),
    ("AF_NETLINK NETLINK_KOBJECT_UEVENT", 16, socket.SOCK_DGRAM, 15),
    ("AF_NETLINK NETLINK_ROUTE, high bits", 16, socket.SOCK_RAW, HIGH),
    ("AF_UNIX", 1, socket.SOCK_STREAM, 0), ("AF_INET", 2, socket.SOCK_STREAM, 0),
    ("AF_INET6", 10, socket.SOCK_DGRAM, 0),
    ("AF_NETLINK NETLINK_ROUTE", 16, socket.SOCK_RAW, 0),
]:
    attempt(key, "socket", family, kind, protocol)
pair = (ctypes.c_int * 2)()
attempt("socketpair AF_UNIX", "socketpair", 1, socket.SOCK_STREAM, 0, pair)
print(json.dumps(outcomes), flush=True)
"""


def test_socket_buffers_and_families():
    """Unsandboxed, a socket's buffers grow to the size asked for (a megabyte here, kept small; up to
    net.core.wmem_max each, and without that cap with the *FORCE options as root) and sockets of other families are
    created; inside, growing a buffer is refused (EPERM, the buffer keeps the kernel's default) and other families
    answer EAFNOSUPPORT, also with the high bits of the int arguments set; AF_UNIX, AF_INET(6) and netlink's
    NETLINK_ROUTE (what the C library reads interfaces with) still work."""
    options = {"SO_SNDBUF": 7, "SO_RCVBUF": 8, "SO_SNDBUFFORCE": 32, "SO_RCVBUFFORCE": 33}  # Linux's generic numbers
    program = SOCKETS.format(numbers=syscall_numbers(["setsockopt", "socket", "socketpair"]), options=options)
    plain = subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, text=True, timeout=30)
    outside = json.loads(plain.stdout)
    allowed = ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK NETLINK_ROUTE", "socketpair AF_UNIX"]
    refused = ["AF_VSOCK", "AF_VSOCK, high bits", "AF_NETLINK NETLINK_AUDIT", "AF_NETLINK NETLINK_KOBJECT_UEVENT",
               "AF_NETLINK NETLINK_ROUTE, high bits"] + (["AF_PACKET"] if ROOT else [])  # fmt: skip
    grown = [key for key in outcomes_keys(options) if ROOT or "FORCE" not in key]  # FORCE: CAP_NET_ADMIN
    assert {key: outside[key] for key in allowed + refused + grown} == dict.fromkeys(allowed + refused + grown, 0)
    assert outside["send buffer held"] >= 2 * 2**20
    result = run_program(program, allow_code_execution=True, timeout=20)
    inside = json.loads(result.stdout)
    assert {key: inside[key] for key in outcomes_keys(options)} == dict.fromkeys(outcomes_keys(options), errno.EPERM)
    assert inside["send buffer held"] < 2**20, "the send buffer grew"
    assert {key: inside[key] for key in refused} == dict.fromkeys(refused, errno.EAFNOSUPPORT)
    assert {key: inside[key] for key in allowed} == dict.fromkeys(allowed, 0)


FORCED_BUFFERS = r"""
import ctypes, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
if len(sys.argv) > 1:  # install the sandbox's filter on this process alone, as bwrap does
    program = open(sys.argv[1], "rb").read()

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(Program(len(program) // 8, program)), 0, 0) == 0  # SECCOMP_MODE_FILTER
one, _ = socket.socketpair()
for option in (32, 33):  # SO_SNDBUFFORCE, SO_RCVBUFFORCE: past net.core.wmem_max / rmem_max, with CAP_NET_ADMIN
    try:
        one.setsockopt(socket.SOL_SOCKET, option, 2**20)
        print(option, "set")
    except OSError as error:
        print(option, error.errno)
"""


@needs_root
def test_the_filter_alone_refuses_the_forced_buffer_options(tmp_path):
    """In the sandbox the kernel refuses SO_SNDBUFFORCE / SO_RCVBUFFORCE anyway (no CAP_NET_ADMIN); the filter
    refuses them too, should a capability ever be left: installed on a plain root process, where they work."""
    path = tmp_path / "filter.bpf"
    path.write_bytes(sandbox._sandbox().seccomp_filter)
    command = [sys.executable, "-I", "-c", FORCED_BUFFERS]
    assert subprocess.run(command, capture_output=True, text=True).stdout.split() == ["32", "set", "33", "set"]
    filtered = subprocess.run([*command, str(path)], capture_output=True, text=True)
    assert filtered.stdout.split() == ["32", str(errno.EPERM), "33", str(errno.EPERM)], filtered.stderr


def outcomes_keys(options):
    return [key for option in options for key in (option, option + ", high bits")]


def test_disable_userns_alone_refuses_a_nested_user_namespace(monkeypatch):
    """Defence in depth: with a seccomp filter that allows every call (memfd_create, which the real filter refuses,
    succeeds: the filter is gone), bwrap's --disable-userns still keeps the program from creating a user namespace
    (which works unsandboxed: test_no_nested_user_namespace)."""
    builder = "import seccomp, sys\nseccomp.SyscallFilter(defaction=seccomp.ALLOW).export_bpf(sys.stdout)"
    allow_all = subprocess.run(["/usr/bin/python3", "-I", "-c", builder], capture_output=True, check=True).stdout
    permissive = dataclasses.replace(sandbox._sandbox(), seccomp_filter=allow_all)
    monkeypatch.setattr(sandbox, "_sandbox", lambda: permissive)
    program = textwrap.dedent(
        """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print("memfd_create", libc.memfd_create(b"probe", 0) >= 0, flush=True)
        print("unshare", libc.unshare(0x10000000) == 0, flush=True)  # CLONE_NEWUSER
        """
    )
    result = run_program(program, allow_code_execution=True)
    assert result.stdout.split() == ["memfd_create", "True", "unshare", "False"], result


def test_no_nested_user_namespace():
    """Unsandboxed, the program becomes root of a user namespace of its own and mounts a tmpfs there (what the
    issue did inside the sandbox before); inside, creating the namespace fails."""
    program = textwrap.dedent(
        """
        import ctypes, os, tempfile
        libc = ctypes.CDLL(None, use_errno=True)
        uid, target = os.getuid(), tempfile.mkdtemp()
        created = libc.unshare(0x10000000 | 0x00020000) == 0  # CLONE_NEWUSER | CLONE_NEWNS
        if created:
            open('/proc/self/uid_map', 'w').write(f'0 {uid} 1')
            if libc.mount(b'none', target.encode(), b'tmpfs', 0, None) == 0:
                print('ESCAPED: mounted a tmpfs as root of a nested user namespace')
                libc.umount2(target.encode(), 0)
        os.rmdir(target)
        """
    )
    plain = subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, text=True, timeout=30)
    assert "ESCAPED" in plain.stdout, plain.stderr
    result = run_program(program + "assert not created\n", allow_code_execution=True)
    assert result.passed, result


# --------------------------------------------------------------------------------------------------- memory
FILL = """
import os
caps = {caps}
mounts = [line.split() for line in open('/proc/self/mounts')]
writable_tmpfs = {{point for _, point, kind, options, *_ in mounts if kind == 'tmpfs' and 'rw' in options.split(',')}}
assert writable_tmpfs == set(caps), writable_tmpfs
filled = {{}}
for point in ['/', '/sandbox', '/dev', '/proc', *caps]:
    filled[point] = 0
    try:
        for index in range(1024):  # files of 1 MiB (the file-size limit), up to 1 GiB
            with open(os.path.join(point, f'fill{{index}}'), 'wb') as handle:
                filled[point] += handle.write(b'x' * 2**20)
    except OSError:
        pass
wrong = {{point: size for point, size in filled.items() if size > caps.get(point, 0)
                                                      or point in caps and size < caps[point] - 2**20}}
assert not wrong, f'filled beyond (or short of) the cap: {{wrong}}'
"""


def test_every_writable_path_fills_up_to_its_cap_and_no_further():
    caps = {"/work": sandbox.WORK_DIR_BYTES, "/dev/shm": sandbox.SHM_BYTES}
    result = run_program(FILL.format(caps=caps), allow_code_execution=True, timeout=30)
    assert result.passed, result


INODES = """
import os
caps = {caps}
made = {{}}
for point, cap in caps.items():
    made[point] = 0
    try:
        for index in range(cap + 100):  # empty files: no byte cap stops them
            os.close(os.open(os.path.join(point, f'i{{index}}'), os.O_CREAT | os.O_WRONLY, 0o600))
            made[point] += 1
    except OSError as error:
        assert error.errno == 28, error  # ENOSPC
assert made == {{point: cap - 1 for point, cap in caps.items()}}, made  # the root directory is one inode
"""


def test_every_writable_tmpfs_holds_at_most_its_inode_cap():
    """Each file, directory or link holds kernel memory that a byte cap does not count (about 1.5 KiB: without an
    inode cap a run made 918k empty files, 1.37 GB): /work and /dev/shm stop at their inode caps."""
    caps = {"/work": 8192, "/dev/shm": 1024}
    assert (sandbox.WORK_DIR_INODES, sandbox.SHM_INODES) == tuple(caps.values())
    result = run_program(INODES.format(caps=caps), allow_code_execution=True, timeout=30)
    assert result.passed, result


def test_forked_children_together_hold_at_most_memory_limit_mb():
    program = textwrap.dedent(
        """
        import os, sys, time
        processes, attempt = {processes}, {attempt}
        reader, writer = os.pipe()
        children = []
        for _ in range(processes - 1):
            pid = os.fork()
            if pid == 0:
                children = None
                break
            children.append(pid)
        blocks = []
        try:
            while len(blocks) * 4 < attempt:
                blocks.append(b'x' * (4 * 2**20))  # touched: host memory, not just address space
        except MemoryError:
            pass
        os.write(writer, f'{{len(blocks) * 4}} '.encode())
        time.sleep(0.5)  # every process holds its blocks at once
        if children is None:
            os._exit(0)
        for pid in children:
            os.waitpid(pid, 0)
        os.close(writer)
        held = sum(int(size) for size in os.fdopen(reader).read().split())
        """
    )
    processes, limit_mb = 4, 256
    unsandboxed = program.format(processes=processes, attempt=128) + "print(held)\n"
    plain = subprocess.run([sys.executable, "-I", "-c", unsandboxed], capture_output=True, text=True, timeout=60)
    assert int(plain.stdout) == processes * 128 > limit_mb, "unsandboxed, the children hold more than the limit"
    bounded = program.format(processes=processes, attempt=128) + f"assert {limit_mb // 2} < held <= {limit_mb}, held\n"
    result = run_program(bounded, memory_limit_mb=limit_mb, max_processes=processes, allow_code_execution=True)
    assert result.passed, result


PROCESS_LIMIT_RUNS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sandbox_under_test", {path!r})
sandbox = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sandbox
spec.loader.exec_module(sandbox)
forks = '''
import os, time
got = 0
try:
    for _ in range({{0}}):
        if os.fork() == 0:
            time.sleep(0.5)
            os._exit(0)
        got += 1
except OSError:
    pass
assert got == {{0}}, f"got {{{{got}}}} of {{0}} forks"
'''
results = sandbox.run_programs([forks.format({forks}), forks.format({forks}), forks.format({forks} + 1)],
                               max_processes={processes}, memory_limit_mb=48 * {processes},
                               allow_code_execution=True, num_workers=3)
print([result.passed for result in results])
"""


@pytest.mark.parametrize(
    "caller", ["this user", pytest.param("another user", marks=pytest.mark.skipif(not ROOT, reason="needs root"))]
)
def test_concurrent_runs_each_have_their_own_process_limit(caller):
    """Two runs at once each start all the processes their limit allows (before, for a non-root caller, both drew
    on the caller's one RLIMIT_NPROC); one more than the limit fails. As another user, sandbox.py runs under
    Debian's Python as an unused uid (this package's interpreter may not be readable to it)."""
    processes = 8
    program = PROCESS_LIMIT_RUNS.format(path=sandbox.__file__, forks=processes - 1, processes=processes)
    if caller == "this user":
        command, user = [sys.executable, "-I", "-c", program], {}
    else:
        command, user = ["/usr/bin/python3", "-I", "-c", program], {"user": 60999, "group": 60999, "extra_groups": []}
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin"},
                         **user)  # fmt: skip
    assert out.stdout.strip() == "[True, True, False]", out.stderr[-2000:]
