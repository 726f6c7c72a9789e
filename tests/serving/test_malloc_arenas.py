"""`refusion serve` keeps glibc malloc to one arena (serving/malloc_arenas.py), observed from glibc's own report."""

import subprocess
import sys
import textwrap

import pytest

from refusion_hf.serving.malloc_arenas import use_one_malloc_arena

GLIBC = sys.platform == "linux" and "glibc" in " ".join(__import__("platform").libc_ver())

# Threads allocating small blocks at once, then glibc's `malloc_info` (XML, one <heap nr=...> per arena) counted.
ARENAS = textwrap.dedent(
    """
    import ctypes, ctypes.util, sys, tempfile, threading
    from refusion_hf.serving.malloc_arenas import use_one_malloc_arena
    print(use_one_malloc_arena() if sys.argv[1] == "limit" else None)
    start = threading.Barrier(8)
    def churn():
        start.wait()
        kept = [bytearray(64) for _ in range(20000)]
        del kept
    threads = [threading.Thread(target=churn) for _ in range(8)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.fopen.restype = ctypes.c_void_p
    with tempfile.NamedTemporaryFile() as report:
        stream = libc.fopen(report.name.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        print(open(report.name).read().count("<heap nr="))
    """
)


def arenas(mode: str, **env) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", ARENAS, mode], capture_output=True, text=True, check=True, env={**env, "PATH": ""}
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc arenas")
def test_threads_share_one_arena():
    assert arenas("free")[1] > 1, "without the limit, concurrent threads get arenas of their own"
    assert arenas("limit") == ("True", 1)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc arenas")
def test_an_operators_malloc_arena_max_is_left_alone(monkeypatch):
    assert arenas("limit", MALLOC_ARENA_MAX="4")[0] == "False"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert use_one_malloc_arena() is False


class _Loaded(Exception):
    pass


def test_refusion_serve_limits_the_arenas_before_it_loads_the_model(fixture_path, monkeypatch):
    """The limit holds only if set before torch's threads make arenas of their own: `refusion serve` sets it
    before `build_app` loads the model."""
    from refusion_hf.cli import main
    from refusion_hf.serving import app, malloc_arenas

    calls = []
    monkeypatch.setattr(malloc_arenas, "use_one_malloc_arena", lambda: calls.append("limit") or True)

    def build_app(*args, **kwargs):
        calls.append("load")
        raise _Loaded

    monkeypatch.setattr(app, "build_app", build_app)
    with pytest.raises(_Loaded):
        main(["serve", str(fixture_path)])
    assert calls == ["limit", "load"]
