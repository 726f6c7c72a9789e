"""CPU TEST SCAFFOLDING: a pure-torch stand-in for sgl-kernel's CPU build, for running SGLang's CPU engine in tests.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports two ops from sgl-kernel's CPU build at import time
(``sglang/srt/mem_cache/allocation.py``, ``sglang/kernels/ops/kvcache/cache_move.py``); that build is not on the
package registry. Only :func:`assign_req_to_token_pool_cpu` is called on the paths this project uses (plain
prefill, decode and the diffusion extend); it is written here in plain torch. Every other name resolves to a function
that raises ``NotImplementedError``, so a path that needs a real kernel fails loudly instead of computing something.

``make sglang`` puts this directory on ``.venv-sglang``'s path only when ``import sgl_kernel`` fails there, so the
real kernel always wins where it is installed. Nothing in ``src/`` imports it.
"""

import torch

__version__ = "0.0.0+refusion-cpu-test-scaffold"
IS_REFUSION_CPU_TEST_SCAFFOLD = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_len: int,
) -> None:
    """Write request ``i``'s new cache locations into ``req_to_token[req_pool_indices[i], start:end]``.

    ``out_cache_loc`` holds the requests' new locations back to back, in request order (what sgl-kernel's CPU op
    and SGLang's Triton kernel ``assign_req_to_token_pool`` do).
    """
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        if end > max_len:
            raise ValueError(f"request row {row}: end offset {end} is past req_to_token's width {max_len}")
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + length].to(req_to_token.dtype)
        offset += length


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: sgl-kernel's CPU build is not installed; the CPU test scaffold "
            "(tests/sglang_cpu_scaffold) implements only assign_req_to_token_pool_cpu"
        )

    missing.__name__ = name
    return missing
