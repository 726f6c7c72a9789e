"""Runs ONE untrusted program inside the sandbox's child process (standard library only; started by sandbox.py).

    python -I -S -B _sandbox_runner.py PROGRAM WORKDIR RESULT_FD MEMORY_BYTES CPU_SECONDS FILE_BYTES GUARD

Reads a nonce from stdin, applies resource limits, installs the Python-level guard (when GUARD is 1), executes
PROGRAM with WORKDIR as the working directory, and writes the nonce to RESULT_FD only if the program ran to the
end without raising (SystemExit included). Anything else (an exception, a limit hit, `os._exit`) leaves the result
empty, which the parent reads as a failure.

The guard is an audit hook (`sys.addaudithook`, which cannot be removed): it refuses writes, renames, deletions
and links outside WORKDIR, process creation and signals, sockets, ctypes, and raising resource limits. It is
defence in depth against accidents of generated code, not a security boundary on its own; the OS layer (namespaces
set up by sandbox.py) is that boundary where the machine allows it.
"""

import os
import resource
import sys
import traceback

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_ALLOWED_WRITE_FILES = frozenset({"/dev/null"})
_BLOCKED_PREFIXES = (
    "socket.",
    "ctypes.",
    "subprocess.",
    "os.exec",
    "os.spawn",
    "os.posix_spawn",
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.kill",
    "os.killpg",
    "signal.pthread_kill",
    "pty.",
    "resource.setrlimit",
    "resource.prlimit",
    "urllib.",
    "http.",
    "ftplib.",
    "smtplib.",
    "poplib.",
    "imaplib.",
    "nntplib.",
    "telnetlib.",
    "webbrowser.",
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
)
_BLOCKED_IMPORTS = frozenset({"ctypes", "_ctypes", "cffi", "_posixsubprocess"})
# event -> indices of its path arguments, and the index of its dir_fd argument (or None)
_PATH_EVENTS = {
    "os.remove": ((0,), 1),
    "os.rmdir": ((0,), 1),
    "os.mkdir": ((0,), 2),
    "os.rename": ((0, 1), 2),
    "os.chmod": ((0,), 2),
    "os.chown": ((0,), 3),
    "os.truncate": ((0,), None),
    "os.utime": ((0,), 3),
    "os.link": ((0, 1), 2),
    "os.symlink": ((0, 1), 2),
    "os.setxattr": ((0,), None),
    "os.removexattr": ((0,), None),
    "shutil.rmtree": ((0,), 1),
    "shutil.copyfile": ((1,), None),
    "shutil.copytree": ((1,), None),
    "shutil.move": ((0, 1), None),
    "shutil.chown": ((0,), None),
}


def _install_guard(workdir: str) -> None:
    root = os.path.realpath(workdir)
    busy = []

    def resolve(path, dir_fd=None):
        if isinstance(path, int):
            return None  # an already-open descriptor
        path = os.fsdecode(path)
        if dir_fd is not None and dir_fd >= 0 and not os.path.isabs(path):
            base = os.readlink(f"/proc/self/fd/{dir_fd}")
        else:
            base = os.getcwd()
        return os.path.realpath(os.path.join(base, path))

    def inside(path, dir_fd=None):
        resolved = resolve(path, dir_fd)
        return resolved is None or resolved == root or resolved.startswith(root + os.sep)

    def refuse(event, detail=""):
        raise PermissionError(f"sandbox: {event} is not allowed {detail}".rstrip())

    def hook(event, args):
        if busy:
            return
        busy.append(True)
        try:
            if event == "open":
                path, _mode, flags = args
                if isinstance(path, int):
                    return
                resolved = resolve(path)
                if flags is not None and flags & _WRITE_FLAGS:
                    if resolved not in _ALLOWED_WRITE_FILES and not inside(path):
                        refuse("writing", f"outside the sandbox directory: {resolved}")
                elif os.path.isdir(resolved) and not inside(path):
                    refuse("opening a directory", f"outside the sandbox directory: {resolved}")
            elif event == "import":
                if args[0] in _BLOCKED_IMPORTS:
                    refuse(f"importing {args[0]}")
            elif event in _PATH_EVENTS:
                indices, dir_fd_index = _PATH_EVENTS[event]
                dir_fd = args[dir_fd_index] if dir_fd_index is not None and dir_fd_index < len(args) else None
                for index in indices:
                    if index < len(args) and not inside(args[index], dir_fd if isinstance(dir_fd, int) else None):
                        refuse(event, f"outside the sandbox directory: {args[index]}")
            elif event.startswith(_BLOCKED_PREFIXES):
                refuse(event)
        finally:
            busy.clear()

    sys.addaudithook(hook)


def main() -> int:
    program_path, workdir, result_fd, memory, cpu, file_bytes, guard = sys.argv[1:8]
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # input() gets EOF instead of waiting
    result = os.fdopen(int(result_fd), "w")
    with open(program_path, encoding="utf-8") as handle:
        source = handle.read()
    os.chdir(workdir)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
    resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu)))
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(file_bytes), int(file_bytes)))
    if guard == "1":
        _install_guard(workdir)
    try:
        code = compile(source, "program.py", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "program.py"})
    except BaseException:  # SystemExit too: a program that exits before its asserts has not passed
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    result.write(nonce)
    result.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
