"""The two processes of a code verdict, both inside the sandbox (sandbox.py runs this file there as a script, with
the sandbox's own interpreter; it imports nothing but the standard library).

* **The judge** (`judge`, the sandbox's first process) holds what decides the verdict: the tests' source (read from a
  descriptor and closed, never a file in the sandbox), the per-run nonce and the descriptor of the host's verdict
  file. It makes itself non-dumpable (`prctl(PR_SET_DUMPABLE, 0)`: no process without `CAP_SYS_PTRACE`, and the
  sandbox has none, may open its `/proc/<pid>/mem`, `fd`, `environ`...; ptrace and process_vm_readv are refused by the
  seccomp filter besides), starts the candidate and runs the tests itself, with every name the program defines
  replaced by a proxy that forwards the call. The verdict, a JSON record with the nonce, is written by the judge
  alone, through a descriptor the candidate closes before any of the program's code runs.
* **The candidate** (`serve`, forked by the judge before the judge reads the nonce or the tests, keeping no descriptor
  but stdin, stdout, stderr and its two channel ends, and waiting for the judge's start until the judge is protected)
  runs the program as `__main__`, reports what it defined, then answers calls. Everything it sends is untrusted:
  length-prefixed JSON frames (at most `MAX_FRAME` bytes), each reply checked against the request's id, and values
  decoded by `decode` into plain data only (None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset). An
  object of any other type (an always-equal object, a generator, a class instance, a function) cannot be sent, and is
  a failure; so is any broken frame, a wrong id, or the candidate exiting. These failures are sticky: tests that catch
  the exception still fail.

The names the tests can get from the program: its callables (as proxies), its plain-data globals (as values), and
`import x` of a standard module `x` among `TESTS_MAY_USE_MODULES` (the judge imports its own). Never a builtin's
name (`abs`, `print`, ...): the tests always see Python's builtins, so a program cannot redefine what the tests
compare with. Any other failure inside a call (the judge out of memory decoding a reply, too deep a value) is
sticky too.
"""

from __future__ import annotations

import builtins
import itertools
import json
import os
import signal
import struct
import sys
import time

MAX_FRAME = 16 * 2**20  # bytes of one message, either way
MAX_DEPTH = 100  # nesting of a value
TESTS_FILE = "<tests>"
# Modules the program imported that its tests may use without importing them (MBPP's `math.isclose`): the judge
# imports its own, and only these (importing a module runs its code: `site` would read .pth files, `this` prints).
TESTS_MAY_USE_MODULES = frozenset(
    "array bisect cmath collections copy datetime decimal fractions functools hashlib heapq itertools json math "
    "numbers operator random re statistics string struct textwrap typing unicodedata".split()
)
_HEADER = struct.Struct(">I")


class ChannelError(Exception):
    """The candidate broke the protocol (ended, sent a bad frame, a wrong id, or a value that is not plain data)."""


class Forfeit(BaseException):
    """Raised into the tests when a call cannot be checked; a BaseException so `except Exception` cannot swallow it,
    and recorded, so the run fails even if the tests swallow it anyway."""


class ProgramError(Exception):
    """An exception the program raised whose type is not a builtin exception (its name is in the message)."""


# ------------------------------------------------------------------------------------------ plain data
def encode(value, depth: int = 0):
    """`value` as JSON-ready data; ValueError naming the type if it is not plain data (exact types only)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        return value if -(2**53) < value < 2**53 else ["i", format(value, "x")]
    if kind is bytes:
        return ["b", value.hex()]
    if kind is dict:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}.get(kind)
    if tag is None:
        raise ValueError(f"a {kind.__module__}.{kind.__qualname__}, which is not plain data")
    return [tag, [encode(item, depth + 1) for item in value]]


def decode(data, depth: int = 0):
    """The plain value `data` (from `json.loads`) stands for; ChannelError for anything else."""
    if depth > MAX_DEPTH:
        raise ChannelError(f"a value nested deeper than {MAX_DEPTH}")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is not list or len(data) != 2 or type(data[0]) is not str:
        raise ChannelError(f"not an encoded value: {_quote(str(data)[:80])}")
    tag, body = data
    try:
        if tag == "i" and type(body) is str:
            return int(body, 16)
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if type(body) is list:
            if tag == "d":
                return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
            make = {"l": list, "t": tuple, "s": set, "f": frozenset}.get(tag)
            if make is not None:
                return make(decode(item, depth + 1) for item in body)
    except (TypeError, ValueError) as error:  # unhashable keys, bad hex, pairs that are not pairs
        raise ChannelError(f"a malformed {_quote(tag[:20])} value ({error})") from None
    raise ChannelError(f"an unknown value tag {_quote(tag[:20])}")


# ---------------------------------------------------------------------------------------------- frames
def send(fd: int, message) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"a message of {len(data)} bytes (at most {MAX_FRAME})")
    data = _HEADER.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 2**20))
        if not chunk:
            raise ChannelError("the channel was closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int) -> dict:
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    if size > MAX_FRAME:
        raise ChannelError(f"a frame of {size} bytes (at most {MAX_FRAME})")
    try:
        message = json.loads(_read_exactly(fd, size))
    except (ValueError, RecursionError) as error:
        raise ChannelError(f"a frame that is not JSON ({str(error)[:80]})") from None
    if type(message) is not dict:
        raise ChannelError("a frame that is not a JSON object")
    return message


def _words(error: BaseException) -> list[str]:
    """[type name, message] of an exception, for the other side."""
    try:
        return [type(error).__name__, str(error)[:1000]]
    except BaseException:  # noqa: BLE001 - a __str__ that raises
        return [type(error).__name__, ""]


def _said(error: BaseException) -> str:
    kind, message = _words(error)
    return f"{kind}: {message}" if message else kind


# ----------------------------------------------------------------------------------------- the candidate
def serve(requests: int, replies: int, program_path: str) -> None:
    """Run the program as `__main__`, report its names, answer calls until the channel closes (untrusted side)."""
    write_reply, read_request, leave = send, receive, os._exit
    ready_without_names = _HEADER.pack(12) + b'{"ready":{}}'
    main = type(sys)("__main__")
    main.__file__ = program_path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [program_path]
    try:
        with open(program_path, encoding="utf-8") as source:
            code = compile(source.read(), program_path, "exec")
        exec(code, main.__dict__)
    except BaseException as error:  # noqa: BLE001 - SystemExit and KeyboardInterrupt end the program early too
        write_reply(replies, {"failed": _words(error)})
        leave(0)
    try:
        write_reply(replies, {"ready": _manifest(main.__dict__)})
    except MemoryError:  # a program that holds all its memory: its names cannot be listed
        os.write(replies, ready_without_names)
    namespace = main.__dict__
    while True:
        try:
            request = read_request(requests)
        except ChannelError:
            leave(0)
        reply = {"id": request.get("id")}
        try:
            function = namespace[request["call"]]
            args = decode(request["args"])
            kwargs = decode(request["kwargs"])
        except BaseException as error:  # noqa: BLE001
            reply["unsendable"] = f"the request could not be read ({_said(error)})"
        else:
            try:
                result = function(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - the program's own exception, passed on to the tests
                reply["raised"] = _words(error)
            except BaseException as error:  # noqa: BLE001 - exit calls and the like end the run
                reply["exited"] = _words(error)
            else:
                try:
                    reply["value"] = encode(result)
                except (ValueError, RecursionError) as error:
                    reply["unsendable"] = f"it returned {error}"
        try:
            write_reply(replies, reply)
        except ValueError as error:
            write_reply(replies, {"id": request.get("id"), "unsendable": f"it returned {error}"})


def _manifest(namespace: dict) -> dict:
    """What the program defined, by name: "callable", "module:<name>", ["value", data] (plain data, 1 MiB in all)
    or "other"."""
    stdlib, budget, names = getattr(sys, "stdlib_module_names", ()), 2**20, {}
    for name, value in list(namespace.items()):
        if name.startswith("__") or type(name) is not str:
            continue
        if type(value) is type(sys):
            names[name] = f"module:{getattr(value, '__name__', '')}" if name in stdlib else "other"
        elif callable(value):
            names[name] = "callable"
        else:
            size = _size(value, budget)
            try:
                names[name] = ["value", encode(value)] if size <= budget else "other"
                budget -= size
            except (ValueError, RecursionError):
                names[name] = "other"
    return names


def _size(value, limit: int) -> int:
    """About how many bytes `value` encodes to, counted up to just past `limit` (so a large value costs nothing)."""
    total, stack = 0, [iter((value,))]
    while stack and total <= limit:
        item = next(stack[-1], stack)
        if item is stack:  # that container is done
            stack.pop()
            continue
        kind = type(item)
        total += 2 * len(item) + 4 if kind in (str, bytes) else 8
        if len(stack) > MAX_DEPTH:
            return limit + 1
        if kind in (list, tuple, set, frozenset):
            stack.append(iter(item))
        elif kind is dict:
            stack.append(itertools.chain.from_iterable(item.items()))
    return total


# --------------------------------------------------------------------------------------------- the judge
class _Channel:
    """The judge's end: one call at a time, each reply checked; the first failure is kept (`forfeited`)."""

    def __init__(self, requests: int, replies: int, pid: int):
        self.requests, self.replies, self.pid, self.next_id = requests, replies, pid, 0
        self.forfeited: str | None = None

    def forfeit(self, reason: str) -> Forfeit:
        self.forfeited = self.forfeited or reason
        return Forfeit(self.forfeited)

    def ended(self) -> str:
        """How the candidate's process ended (reaped if it has, within 0.2 s), for a reason."""
        for _ in range(20):
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return "its process had ended"
            if pid != 0:
                break
            time.sleep(0.01)
        else:
            return "its process is still running"
        if os.WIFSIGNALED(status):
            return f"its process was killed by signal {os.WTERMSIG(status)}"
        return f"its process exited with status {os.waitstatus_to_exitcode(status)}"

    def call(self, name: str, args: tuple, kwargs: dict):
        if self.forfeited:
            raise Forfeit(self.forfeited)
        self.next_id += 1
        try:
            request = {"id": self.next_id, "call": name, "args": encode(args), "kwargs": encode(kwargs)}
        except (ValueError, RecursionError) as error:
            raise self.forfeit(f"the tests pass {error} to `{name}`: it cannot be sent to the program") from None
        try:
            send(self.requests, request)
            reply = receive(self.replies)
            if reply.get("id") != self.next_id or len(reply) != 2:
                raise ChannelError(f"a reply that does not answer call {self.next_id}")
            if "value" in reply:
                return decode(reply["value"])
            if "raised" in reply:
                error = _program_exception(reply["raised"], name)
            elif "exited" in reply:
                kind, message = _pair(reply["exited"])
                raise self.forfeit(f"`{name}` raised {_quote(kind)} (an exit, not an exception): {_quote(message)}")
            elif "unsendable" in reply and type(reply["unsendable"]) is str:
                raise self.forfeit(f"`{name}` cannot be checked: {_quote(reply['unsendable'])}")
            else:
                raise ChannelError("a reply of an unknown kind")
        except Forfeit:
            raise
        except (ChannelError, OSError) as error:
            raise self.forfeit(f"the program did not answer a call to `{name}` ({error}; {self.ended()})") from None
        except BaseException as error:  # noqa: BLE001 - MemoryError, RecursionError...: never for the tests to catch
            raise self.forfeit(f"a call to `{name}` could not be checked ({_said(error)})") from None
        raise error  # the program's own exception, for the tests to expect or not


def _pair(words) -> tuple[str, str]:
    if type(words) is not list or len(words) != 2 or not all(type(w) is str for w in words):
        raise ChannelError("a malformed exception report")
    return words[0][:100], words[1][:1000]


def _program_exception(words, name: str) -> Exception:
    """The program's exception as the tests see it: the builtin exception of that name, else ProgramError; but a
    StopIteration or StopAsyncIteration becomes a RuntimeError naming it (as PEP 479 does for generators): raised
    out of a call inside `map()`, `filter()`, `zip()` or a generator expression in the tests, it would end their
    iteration quietly, and `assert all(map(...))` would pass a wrong answer."""
    kind, message = _pair(words)
    error_type = getattr(builtins, kind, None)
    error: Exception | None = None
    if isinstance(error_type, type) and issubclass(error_type, (StopIteration, StopAsyncIteration)):
        error = RuntimeError(f"`{name}` raised {kind}" + (f": {message}" if message else ""))
    elif isinstance(error_type, type) and issubclass(error_type, Exception):
        for base in error_type.__mro__:  # UnicodeDecodeError and the like take more than a message
            try:
                error = base(message)
                break
            except TypeError:
                continue
    if error is None:
        error = ProgramError(f"{kind}: {message}")
    error.raised_by = name
    return error


def _proxy(channel: _Channel, name: str):
    def proxy(*args, **kwargs):
        return channel.call(name, args, kwargs)

    proxy.__name__ = proxy.__qualname__ = name
    return proxy


def _namespace(channel: _Channel, manifest) -> dict:
    """The tests' globals: the program's names as proxies, values and standard modules; never a builtin's name."""
    if type(manifest) is not dict:
        raise ChannelError("a malformed list of names")
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    for name, kind in manifest.items():
        if not name.isidentifier() or name.startswith("__") or hasattr(builtins, name):
            continue
        if kind == "callable":
            namespace[name] = _proxy(channel, name)
        elif type(kind) is list and len(kind) == 2 and kind[0] == "value":
            namespace[name] = decode(kind[1])
        elif type(kind) is str and kind == f"module:{name}" and name in TESTS_MAY_USE_MODULES:
            namespace[name] = __import__(name)
    return namespace


def _quote(text: str, limit: int = 300) -> str:
    """Text from the program or its tests' exception, one line, in quotes: reported, never the verdict's words."""
    return json.dumps(" ".join(str(text).split())[:limit], ensure_ascii=False)


def _tests_failure(error: BaseException, tests_lines: list[str]) -> str:
    line = None
    trace = error.__traceback__
    while trace is not None:
        if trace.tb_frame.f_code.co_filename == TESTS_FILE:
            line = trace.tb_lineno
        trace = trace.tb_next
    where = f" at line {line}" if line else ""
    if line and 0 < line <= len(tests_lines):
        where += f" ({_quote(tests_lines[line - 1].strip(), 200)})"
    said = _said(error)
    source = f", raised by the program's `{error.raised_by}`" if hasattr(error, "raised_by") else ""
    return f"the tests failed{where}: {_quote(said)}{source}"


def _protect_self() -> None:
    """Make this process non-dumpable, or refuse: its memory holds the nonce and the tests."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_dumpable, pr_get_dumpable = 4, 3
    if libc.prctl(pr_set_dumpable, 0, 0, 0, 0) != 0 or libc.prctl(pr_get_dumpable, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def judge(nonce_fd: int, verdict_fd: int, tests_fd: int | None, program_path: str) -> None:
    """Run the tests against the candidate and write the verdict (trusted side); see the module docstring."""
    requests_in, requests_out = os.pipe()
    replies_in, replies_out = os.pipe()
    pid = os.fork()  # before this process reads a secret: the candidate starts with none, and costs no interpreter
    if pid == 0:
        _candidate(requests_in, replies_out, program_path)
    os.close(requests_in)
    os.close(replies_out)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the candidate may signal it; KeyboardInterrupt would reach the tests
    nonce = b""
    while chunk := os.read(nonce_fd, 64):  # the candidate is waiting for the start: it has run no program code
        nonce += chunk
    try:
        _protect_self()
        tests = None
        if tests_fd is not None:
            with os.fdopen(tests_fd, "rb", closefd=False) as source:
                tests = source.read().decode("utf-8", errors="replace")
        channel = _Channel(requests_out, replies_in, pid)
        send(requests_out, {"start": True})  # the candidate runs the program only now, this process protected
        passed, detail = _verdict(channel, tests)
    except Exception as error:  # noqa: BLE001 - no verdict but a failure
        passed, detail = False, f"the checker could not run the tests ({_said(error)})"
    record = {"nonce": nonce.decode(), "passed": passed, "detail": detail}
    data = json.dumps(record).encode()
    while data:
        data = data[os.write(verdict_fd, data) :]
    os._exit(0)


def _candidate(requests: int, replies: int, program_path: str) -> None:
    """The forked child: keep only stdin, stdout, stderr and its two channel ends, wait for the judge's start."""
    try:
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd > 2 and fd not in (requests, replies):
                try:
                    os.close(fd)
                except OSError:
                    pass
        if receive(requests) == {"start": True}:
            serve(requests, replies, program_path)
    finally:
        os._exit(1)


def _verdict(channel: _Channel, tests: str | None) -> tuple[bool, str]:
    try:
        code = None if tests is None else compile(tests, TESTS_FILE, "exec")
    except SyntaxError as error:
        return False, f"the tests do not compile: {_quote(error)}"
    replies_in = channel.replies
    try:
        first = receive(replies_in)
        if "failed" in first:
            kind, message = _pair(first["failed"])
            return False, f"the program raised {_quote(f'{kind}: {message}' if message else kind)} before its end"
        namespace = _namespace(channel, first.get("ready"))
    except ChannelError as error:
        return False, f"no valid report that the program reached its end ({error}; {channel.ended()})"
    if code is None:
        return True, ""
    try:
        exec(code, namespace)
    except Forfeit:
        pass
    except BaseException as error:  # noqa: BLE001 - an exit call in the tests ends them early: a failure too
        if not channel.forfeited:
            return False, _tests_failure(error, tests.splitlines())
    if channel.forfeited:
        return False, f"not checkable: {channel.forfeited}"
    return True, ""


if __name__ == "__main__" and sys.argv[1] == "judge":  # judge NONCE_FD VERDICT_FD TESTS_FD|- PROGRAM
    judge(int(sys.argv[2]), int(sys.argv[3]), None if sys.argv[4] == "-" else int(sys.argv[4]), sys.argv[5])
