"""The decoder's masked attention rows with grouped key/value heads, three ways, side by side in one process: the
choice `split_attention._scored_attention` makes by device and cache length (`PACK_FROM`, `GROUPED_SDPA_DEVICES`).

- repeated: transformers' `sdpa_attention_forward` as it runs with a mask, copying every cached key and value once
  per query head of a group (`repeat_kv`);
- grouped: torch's SDPA on the key/value heads as cached (`enable_gqa`; `split_attention._grouped_sdpa`);
- packed: the query heads of a group as rows of one head, the mask's rows repeated (`SplitMask.scored_packed`).

Each is the real code path of `split_attention` (its module constants set per way), on random queries, a cache of
K entries (views of a buffer with room, as `InPlaceLayer` hands them out) and an additive mask. The three ways add
the same products in different orders (other kernels, other blockings, chosen by the CPU's instruction set: AVX2 or
AVX-512/AMX), so their outputs agree to within torch.testing's default tolerance for the dtype (float32: 1e-5 absolute
plus 1.3e-6 relative; up to 9.5e-7 apart measured on an AVX-512/AMX CPU, bit for bit on some AVX2 ones), not bit for
bit: each row records the largest absolute difference from repeated, and a way outside the tolerance exits with
status 1. Times are each way's fastest of `--repeats` loops,
the ways interleaved; ratios are against repeated.

    .venv/bin/python benchmarks/grouped_attention.py --out benchmarks/results/grouped_attention.json
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from generate_ab import positive_int
from results_file import write_results

from refusion_hf.generation import split_attention
from refusion_hf.generation.split_attention import SplitMask

ROOT = Path(__file__).resolve().parents[1]
# (name, query heads, key/value heads, head size): the embedded model's attention, and Qwen3-8B's
HEADS = (("embedded", 4, 2, 64), ("qwen3-8b", 32, 8, 128))
WAYS = {  # way -> (PACK_FROM, GROUPED_SDPA_DEVICES)
    "repeated": (2**62, ()),
    "grouped": (2**62, ("cpu",)),
    "packed": (0, ()),
}


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1, e.g. `8,32`."""
    return [positive_int(part) for part in text.split(",")]


def dtype_names(text: str) -> list[str]:
    """An argparse type: comma-separated floating dtypes SDPA runs on CPU, e.g. `float32,bfloat16`."""
    names = text.split(",")
    unknown = [name for name in names if name not in ("float32", "bfloat16", "float16")]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not float32, bfloat16 or float16")
    return names


@dataclass(frozen=True)
class AttentionModule:
    """What the sdpa backend reads of a Qwen3 attention module."""

    num_key_value_groups: int
    training: bool = False
    is_causal: bool = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=positive_ints, default=[8, 32], help="scored rows S per forward, e.g. 8,32")
    parser.add_argument("--cache", type=positive_ints, default=[75, 300, 1100, 4096], help="cached entries K")
    parser.add_argument("--dtypes", type=dtype_names, default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed loops per way (fastest counts)")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grouped_attention.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    defaults = {"pack_from": split_attention.PACK_FROM, "grouped_sdpa_devices": split_attention.GROUPED_SDPA_DEVICES}
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for name, heads, kv_heads, head_size in HEADS:
            module = AttentionModule(heads // kv_heads)
            for s in args.queries:
                for k in args.cache:
                    query = torch.randn(1, heads, s, head_size, generator=generator).to(dtype)
                    room = torch.randn(2, 1, kv_heads, k + 256, head_size, generator=generator).to(dtype)
                    key, value = room[0, :, :, :k], room[1, :, :, :k]  # views with room after them
                    blocked = torch.rand(1, 1, s, k, generator=generator) < 0.2
                    blocked[..., -1] = False  # no row fully blocked
                    mask = torch.zeros(1, 1, s, k, dtype=dtype).masked_fill_(blocked, torch.finfo(dtype).min)
                    scaling = head_size**-0.5
                    # about 20 ms of work per loop on this machine's slowest setting
                    loops = max(5, int(2e7 / (heads * s * k * head_size)))
                    outputs, seconds = {}, {way: float("inf") for way in WAYS}
                    for repeat in range(1 + args.repeats):
                        for way in WAYS if repeat % 2 == 0 else list(WAYS)[::-1]:
                            split_attention.PACK_FROM, split_attention.GROUPED_SDPA_DEVICES = WAYS[way]
                            split = SplitMask(0, None, mask)
                            start = time.perf_counter()
                            for _ in range(loops):
                                out = split_attention._scored_attention(
                                    "sdpa", module, query, key, value, split, scaling=scaling
                                )
                            if repeat:
                                seconds[way] = min(seconds[way], (time.perf_counter() - start) / loops)
                            outputs[way] = out
                    for way, out in outputs.items():
                        try:
                            torch.testing.assert_close(out, outputs["repeated"])
                        except AssertionError as error:
                            raise SystemExit(
                                f"{name} {dtype_name} S={s} K={k}: {way} differs from repeated: {error}"
                            ) from None
                    rows.append(
                        {
                            "dtype": dtype_name,
                            "heads": name,
                            "query_heads": heads,
                            "key_value_heads": kv_heads,
                            "head_size": head_size,
                            "scored_rows": s,
                            "cached_entries": k,
                            "microseconds": {way: round(t * 1e6, 2) for way, t in seconds.items()},
                            "over_repeated": {way: round(t / seconds["repeated"], 3) for way, t in seconds.items()},
                            "copied_entries_per_tensor_when_repeated": heads * k * head_size,
                            "max_abs_difference_from_repeated": {
                                way: float((out.float() - outputs["repeated"].float()).abs().max())
                                for way, out in outputs.items()
                            },
                            "outputs_within_tolerance": True,  # torch.testing.assert_close's default for the dtype
                        }
                    )
                    print(f"{dtype_name} {name} S={s} K={k}: {rows[-1]['over_repeated']}", file=sys.stderr)
    split_attention.PACK_FROM, split_attention.GROUPED_SDPA_DEVICES = defaults.values()
    write_results(
        {
            "torch": torch.__version__,
            "threads": args.threads,
            "repeats": args.repeats,
            "split_attention_defaults": defaults,  # what decoding uses: the way each row's setting takes
            "rows": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
