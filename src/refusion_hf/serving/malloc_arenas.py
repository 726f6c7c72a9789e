"""One glibc malloc arena for `refusion serve`, so a long prompt costs the server about what it costs `generate()`.

uvicorn's event loop, the template renderer and the decoding worker are separate threads, and glibc gives each
thread that allocates concurrently its own malloc arena. Memory a long prompt's forward frees in one arena is not
reused by another: with glibc's default arenas the server's long request grew its peak resident memory by 1.58x /
1.37x what the same 16k / 32k-token prompt costs stock `generate()`, with one arena by 1.50x / 1.09x
(`benchmarks/long_context.py --through serve`, both ways side by side in one run). Large tensors are `mmap`ed by glibc
whatever the arena count, so sharing one arena costs the server little: it serialises only small allocations. The
limit is set before the model is loaded: once torch's worker threads have made arenas of their own, a thread that
starts later reuses one of them whatever the limit.

glibc reads the operator's `MALLOC_ARENA_MAX` at start-up; when it is set we leave it alone. On other C libraries
(musl, macOS) there is no such setting and this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_ARENA_MAX = -8  # glibc's malloc.h: mallopt(M_ARENA_MAX, n)


def use_one_malloc_arena() -> bool:
    """Limit glibc malloc to one arena (call before the server starts its threads); True if it was set."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, 1))
