"""GPU readiness: ReFusion decoding of a Qwen3-8B-shaped model (random bfloat16 weights), in one short run.

The 8B checkpoint cannot be downloaded here, so the weights are random: the shapes, kernels and cache sizes are
the real model's, the drafts are noise. What is measured, side by side in one process:

(a) forward latency of every query shape the decoder issues (1 to 128 tokens, under the decoder's additive float
    4D masks) on a cache of 256 to 4096 entries, against a stock autoregressive step (1 token, no 4D mask);
(b) end-to-end tokens/s of ReFusion `generate()` and of HF greedy `generate()` (same weights), batch 1 and 8.
    Random weights accept nothing useful, so acceptance is *forced*, as two bounds: thresholds 0 / 0 (every
    draft accepted: a plan and a verification per block, the fastest ReFusion can be) and 1.01 / 1.01 (one slot
    per step, one token per infill round, the slowest); real decoding lies between them. EOS is suppressed in
    both decodings so every row generates the full length;
(c) device-to-host syncs (`aten::_local_scalar_dense` and `aten::item` in torch.profiler) and the share of time
    outside the model forward, for one ReFusion call;
(d) long prompts (issue 38), batch 1, 4k to 32k tokens: the device memory a call allocates above what is held before
    it (the weights; `torch.cuda.max_memory_allocated`), the time to its first committed token and its whole time,
    ReFusion (slot 8, block 32) against HF greedy on the same weights, the median of `--repeats` // 2 calls after
    a short warm-up call each. ReFusion runs twice: at its default thresholds (random weights accept no draft beyond
    a round's first token, so its first slot is written token by token: the slow bound) and with acceptance forced
    (thresholds 0: its first commit follows the prefill, one plan and one verification: the fast bound). The first
    token is timed as `long_context.py` times it (`FirstTokenClock`), with the device synchronised before the clock
    is read.

(e) `--sections sglang_engines` (not in the default: it needs SGLang, `pip install -e ".[sglang,serving]"` in a CUDA
    torch environment): the same model saved as a ReFusion folder (with the embedded model's tokenizer: ids under the
    vocabulary) and `engine_throughput.measure_engines` on it, TP 1: ReFusion on SGLang (`refusion serve --engine
    sglang`, the folder's own decoding settings: the package's defaults), the same weights as a stock Qwen3 on SGLang
    (autoregressive), and `generate()`, at 1, 4 and 16 concurrent requests (16 requests each, `--sglang-max-tokens` new
    tokens; random weights almost never emit EOS, so every answer runs to the limit). The model leaves the GPU first
    (the servers need its memory). TP 2 needs two GPUs and `--sglang-tp-size 2` (SGLang's `--tp-size`: each server
    shards the weights over both; `generate()` stays on one GPU). Not yet run on a GPU (no device lent since it was
    written).

    python benchmarks/gpu_readiness.py     # CUDA, 8B shape: all four sections took over 7.5 minutes on one H200
    python benchmarks/gpu_readiness.py --sections sglang_engines   # 8B shape, one GPU; SGLang installed
    python benchmarks/gpu_readiness.py --repeats 2 --sections forward_latency,long_prompts   # 50 s there (2 ways)
    python benchmarks/gpu_readiness.py --shape tiny --device cpu   # the smoke test the suite runs
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import torch
from results_file import write_results

from refusion_hf import RefusionConfig, RefusionForCausalLM

SHAPES = {
    "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096),
}  # fmt: skip
CACHE_LENGTHS = {"8b": (256, 1024, 4096), "tiny": (64, 256)}
LONG_PROMPTS = {"8b": (4096, 16384, 32768), "tiny": (256, 1024)}
SECTIONS = ("forward_latency", "end_to_end", "overhead", "long_prompts")
OPTIONAL_SECTIONS = ("sglang_engines",)  # named in --sections only (SGLang installed); run after the others
QUERY_LENGTHS = (1, 8, 16, 32, 64, 128)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int) -> float:
    """Median wall seconds of `fn()` over `repeats` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_model(shape: str, device, dtype) -> RefusionForCausalLM:
    config = RefusionConfig(**SHAPES[shape], mask_token_id=SHAPES[shape]["vocab_size"] - 1, eos_token_id=0,
                            pad_token_id=1, bos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = RefusionForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _query(model, cache, ids, positions, mask, keep: int) -> None:
    """One forward on top of `cache`, then the cache is cut back (the next timing sees the same cache)."""
    model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=keep)
    cache.crop(-ids.shape[1])


@torch.no_grad()
def forward_latency(model, device, cache_lengths, repeats: int) -> list[dict]:
    from transformers import DynamicCache

    rows = []
    vocab = model.config.vocab_size
    for cache_length in cache_lengths:
        cache = DynamicCache(config=model.config)
        prompt = torch.randint(3, vocab - 1, (1, cache_length), device=device)
        model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
        position = torch.tensor([[cache_length]], device=device)
        step = functools.partial(_query, model, cache, prompt[:, :1], position, None, 1)
        rows.append({"cache": cache_length, "query": 1, "kind": "autoregressive step",
                     "ms": 1000 * timed(step, device, repeats)})  # fmt: skip
        for q in QUERY_LENGTHS:
            ids = torch.randint(3, vocab - 1, (1, q), device=device)
            positions = torch.arange(cache_length, cache_length + q, device=device)[None]
            mask = torch.zeros(1, 1, q, cache_length + q, dtype=model.dtype, device=device)
            mask[..., cache_length:] = torch.full((q, q), torch.finfo(model.dtype).min, device=device).triu(1)
            query = functools.partial(_query, model, cache, ids, positions, mask, q)
            rows.append({"cache": cache_length, "query": q, "kind": "ReFusion query (4D float mask, all logits)",
                         "ms": 1000 * timed(query, device, repeats)})  # fmt: skip
    return rows


@torch.no_grad()
def end_to_end(model, device, batch_sizes, prompt_length: int, new_tokens: int, repeats: int) -> list[dict]:
    rows = []
    vocab = model.config.vocab_size
    knobs = dict(max_new_tokens=new_tokens, slot_size=32, block_size=128, suppress_tokens=[0], do_sample=False)
    for batch in batch_sizes:
        ids = torch.randint(3, vocab - 1, (batch, prompt_length), device=device)
        generated = batch * new_tokens
        ar = timed(functools.partial(model.generate, ids, decoding="autoregressive", **knobs), device, repeats)
        rows.append({"batch": batch, "decoding": "HF greedy", "tokens_per_second": generated / ar})
        for name, thresholds in (("forced: all accepted", 0.0), ("forced: minimal acceptance", 1.01)):
            settings = dict(knobs, slot_threshold=thresholds, token_threshold=thresholds, return_dict_in_generate=True)
            out = model.generate(ids, **settings)
            seconds = timed(functools.partial(model.generate, ids, **settings), device, repeats)
            rows.append({"batch": batch, "decoding": f"ReFusion, {name}", "tokens_per_second": generated / seconds,
                         "forward_passes": out.num_forward_passes, "ratio_to_ar": ar / seconds})  # fmt: skip
    return rows


@torch.no_grad()
def overhead(model, device, prompt_length: int, new_tokens: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(3, model.config.vocab_size - 1, (1, prompt_length), device=device)
    knobs = dict(max_new_tokens=new_tokens, slot_size=32, block_size=128, slot_threshold=0.9, token_threshold=0.4,
                 suppress_tokens=[0], return_dict_in_generate=True)  # fmt: skip
    forward_seconds = []
    original = model.forward

    def timed_forward(*args, **kwargs):
        sync(device)
        start = time.perf_counter()
        result = original(*args, **kwargs)
        sync(device)
        forward_seconds.append(time.perf_counter() - start)
        return result

    model.generate(ids, **knobs)  # warm-up
    model.forward = timed_forward
    try:
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, **knobs)
        sync(device)
        total = time.perf_counter() - start
    finally:
        del model.forward
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        model.generate(ids, **knobs)
    syncs = sum(e.count for e in prof.key_averages() if e.key in ("aten::_local_scalar_dense", "aten::item"))
    return {
        "forward_passes": out.num_forward_passes,
        "share_outside_forward": 1 - sum(forward_seconds) / total,
        "host_syncs": syncs,
        "host_syncs_per_forward": syncs / out.num_forward_passes,
        "note": "real thresholds (0.9 / 0.4) on random weights: the step mix is not real decoding's",
    }


@torch.no_grad()
def long_prompts(model, device, lengths, new_tokens: int, repeats: int) -> list[dict]:
    from long_context import FirstTokenClock

    rows = []
    vocab = model.config.vocab_size
    refusion = dict(slot_size=8, block_size=32)
    ways = {
        "HF greedy": ("stock", dict(decoding="autoregressive")),
        "ReFusion": ("refusion", refusion),
        "ReFusion, forced: all accepted": ("refusion", dict(refusion, slot_threshold=0.0, token_threshold=0.0)),
    }
    for length in lengths:
        ids = torch.randint(3, vocab - 1, (1, length), device=device)
        by_way = {}
        for decoding, (way, knobs) in ways.items():
            clock = FirstTokenClock(way, functools.partial(sync, device))
            settings = dict(max_new_tokens=new_tokens, do_sample=False, suppress_tokens=[0], **knobs)
            model.generate(ids[:, :16], **settings)  # warm-up: lazy allocations
            calls = []
            for _ in range(repeats):
                clock.at = None
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    held = torch.cuda.memory_allocated(device)
                sync(device)
                start = time.perf_counter()
                out = model.generate(ids, stopping_criteria=clock.criteria(), return_dict_in_generate=True, **settings)
                sync(device)
                seconds = time.perf_counter() - start
                grown = torch.cuda.max_memory_allocated(device) - held if device.type == "cuda" else None
                calls.append({"peak_growth_mib": grown / 2**20 if grown is not None else None,
                              "seconds_to_first_token": clock.at - start, "seconds": seconds,
                              "forward_passes": getattr(out, "num_forward_passes", None) or new_tokens})  # fmt: skip
            by_way[decoding] = {key: None if calls[0][key] is None else statistics.median(call[key] for call in calls)
                                for key in calls[0]}  # fmt: skip
            rows.append({"prompt": length, "decoding": decoding, **by_way[decoding], "calls": calls})
        stock = by_way["HF greedy"]
        for decoding in ways:
            if decoding != "HF greedy":
                refusion = by_way[decoding]
                memory = refusion["peak_growth_mib"] / stock["peak_growth_mib"] if stock["peak_growth_mib"] else None
                first = refusion["seconds_to_first_token"] / stock["seconds_to_first_token"]
                rows.append({"prompt": length, "decoding": f"ratio {decoding} / HF greedy", "peak_growth": memory,
                             "first_token": first})  # fmt: skip
    return rows


def sglang_engines(model, device, max_tokens: int, tp_size: int) -> dict:
    """(e): `model` saved as a ReFusion folder, then `engine_throughput.measure_engines` on it (the docstring)."""
    import tempfile
    from types import SimpleNamespace

    import engine_throughput
    from transformers import AutoTokenizer

    from refusion_hf.modeling.loading import default_model_path

    with tempfile.TemporaryDirectory(prefix="gpu-readiness-sglang-") as scratch:
        folder = Path(scratch) / "refusion"
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(folder)
        dtype = str(model.dtype).removeprefix("torch.")
        model.to("cpu")  # the servers take the GPU's memory
        if device.type == "cuda":
            torch.cuda.empty_cache()
        settings = SimpleNamespace(engines=list(engine_throughput.ENGINES), concurrency=[1, 4, 16], requests=16,
                                   max_tokens=max_tokens, dtype=dtype, device=device.type, tp_size=tp_size,
                                   decoding="installed")  # fmt: skip
        return engine_throughput.measure_engines(str(folder), settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/gpu_readiness_<shape>_<device>.json")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, in this order: {', '.join(SECTIONS + OPTIONAL_SECTIONS)} (default: "
                        f"{', '.join(SECTIONS)})")  # fmt: skip
    parser.add_argument("--sglang-max-tokens", type=int, default=64, help="sglang_engines: new tokens per request")
    parser.add_argument("--sglang-tp-size", type=int, default=1, help="sglang_engines: SGLang's --tp-size (GPUs)")
    args = parser.parse_args()
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    known = SECTIONS + OPTIONAL_SECTIONS
    unknown = sorted(set(sections) - set(known))
    if not sections:
        parser.error(f"--sections: name at least one of {', '.join(known)}")
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.shape, device, dtype)
    tiny = args.shape == "tiny"
    prompt_length, new_tokens = (32, 32) if tiny else (256, 256)
    results = {
        "command": f"benchmarks/gpu_readiness.py --shape {args.shape} --device {args.device} --repeats {args.repeats}"
        f" --sections {args.sections}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "shape": SHAPES[args.shape],
        "weights": "random (the checkpoint cannot be downloaded here); acceptance forced, see the docstring",
    }
    run = {
        "forward_latency": lambda: forward_latency(model, device, CACHE_LENGTHS[args.shape], args.repeats),
        "end_to_end": lambda: end_to_end(model, device, (1, 8), prompt_length, new_tokens, max(1, args.repeats // 2)),
        "overhead": lambda: overhead(model, device, prompt_length, new_tokens),
        "long_prompts": lambda: long_prompts(model, device, LONG_PROMPTS[args.shape], 32, max(1, args.repeats // 2)),
        "sglang_engines": lambda: sglang_engines(model, device, args.sglang_max_tokens, args.sglang_tp_size),
    }
    out = args.out or Path(__file__).parent / "results" / f"gpu_readiness_{args.shape}_{args.device}.json"
    for section in known:  # each section's results are written as soon as it ends: a run cut short keeps them
        if section in sections:
            start = time.perf_counter()
            results[section] = run[section]()
            results.setdefault("section_seconds", {})[section] = time.perf_counter() - start
            write_results(results, out)


if __name__ == "__main__":
    main()
