"""Where ReFusion decoding's time goes and how it scales with batch size, against autoregressive decoding of the
same weights; one process, interleaved, writes JSON.

For the embedded model (its decoding defaults, synthetic test prompts through the chat template) and a random
512-wide, 8-layer Qwen3 (`--wide-prompts` random 256-token prompts, 128 new tokens, slot 8, thresholds 0.0 / 0.5,
each batch timed once), per batch size:

* tokens/s of `generate()` with ReFusion and with `decoding="autoregressive"` (greedy, same prompts), and their
  ratio; each batch is decoded `--repeats` times per decoding, interleaved, and timed by its fastest run;
* forward passes; the share of wall time spent outside the model forward (forward hooks time every call);
* host reads per forward: the profiler's `aten::_local_scalar_dense` (`item()`, `int()`, `bool()` of a tensor) and
  `aten::nonzero` events plus `Tensor.tolist()` calls (counted by a wrapper), i.e. what would be a device-to-host
  sync on a GPU;
* from `decode_batch` with a counting `forward`: the padding share of the batched query tensor, rows active per
  forward, and query tokens fed per committed answer token;
* continuous batching (`generate_batch`, at most B requests at once, finished rows replaced at once) over
  `--stream` prompts against fixed batches of B (`generate()` per batch), both ReFusion, same prompts.

    .venv/bin/python benchmarks/decoder_profile.py --out benchmarks/results/decoder_profile.json

`--counts-only` counts without timing (so it may run beside other work): per batch size, the host reads of one
`generate()` call on the first batch, its forward passes, the reads of `decode_batch` alone (the decoding loop,
without `generate()`'s setup and output) per forward, and the query-shape figures above (padding share, rows
active, query tokens per committed token) over all prompts; for the 512-wide model, the query-shape figures at
batch 1 and 4 (float32).

    .venv/bin/python benchmarks/decoder_profile.py --counts-only --out benchmarks/results/decoder_host_reads.json
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch
from results_file import write_results

from refusion_hf import RefusionConfig, RefusionForCausalLM
from refusion_hf.command_inputs import positive_int
from refusion_hf.evaluation.synthetic_tasks import generate_problems
from refusion_hf.generation import batch_scheduler, ragged_kv_cache
from refusion_hf.generation.refusion_generate import (
    answer_lengths,
    decoding_settings,
    eos_token_ids,
    merge_generation_config,
)
from refusion_hf.modeling.loading import default_model_path, prompt_ids

ROOT = Path(__file__).resolve().parents[1]


class ForwardTimer:
    """Times every call of the model's forward (hooks on the top-level module)."""

    def __init__(self, model):
        self.seconds, self.calls, self._start = 0.0, 0, None
        self.handles = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after),
        ]

    def _before(self, module, args):
        self._start = time.perf_counter()

    def _after(self, module, args, output):
        self.seconds += time.perf_counter() - self._start
        self.calls += 1

    def reset(self):
        self.seconds, self.calls = 0.0, 0

    def remove(self):
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def counting_tolist(counter: list[int]):
    real = torch.Tensor.tolist

    def tolist(self):
        counter[0] += 1
        return real(self)

    torch.Tensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.tolist = real


def host_reads(fn) -> int:
    """Host reads of tensor values while `fn` runs (see the module docstring)."""
    calls = [0]
    with counting_tolist(calls), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = ("aten::_local_scalar_dense", "aten::nonzero")
    return calls[0] + sum(event.count for event in prof.key_averages() if event.key in names)


def host_read_counts(model, prompts: list[torch.Tensor], batch_sizes: list[int], kwargs: dict) -> dict:
    """Host reads of one ReFusion `generate()` call per batch size (first batch), in all and inside the decoding
    loop (`decode_batch`), per forward pass."""
    counts = {}
    for batch_size in batch_sizes:
        ids, mask = left_pad(prompts[:batch_size], model.generation_config.pad_token_id)
        output = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
        total = host_reads(
            lambda ids=ids, mask=mask: model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
        )
        loop = decoding_loop_reads(model, ids, mask, kwargs)
        forwards = int(output.num_forward_passes)
        counts[batch_size] = {
            "forward_passes": forwards,
            "host_reads": total,
            "host_reads_in_decoding_loop": loop,
            "loop_reads_per_forward": loop / forwards,
        }
    return counts


def decoding_loop_reads(model, ids, mask, kwargs: dict) -> int:
    """Host reads while `decode_batch` runs inside one `generate()` call."""
    from refusion_hf.generation import refusion_generate

    real, reads = refusion_generate.decode_batch, []

    def counted(*args, **kw):
        result = []
        reads.append(host_reads(lambda: result.append(real(*args, **kw))))
        return result[0]

    refusion_generate.decode_batch = counted
    try:
        model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
    finally:
        refusion_generate.decode_batch = real
    return sum(reads)


def left_pad(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(row.numel() for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - row.numel() :], mask[i, width - row.numel() :] = row, 1
    return ids, mask


def query_shape_stats(
    model, prompts: list[torch.Tensor], batch_size: int, kwargs: dict, continuous: bool = False
) -> dict:
    """Padding share, rows active per forward and query tokens per committed token, from `decode_batch` (fixed
    batches of `batch_size`, or one continuous stream of at most `batch_size` rows)."""
    totals = {"slots": 0, "real": 0, "rows": 0, "forwards": 0, "scored": 0, "committed": 0}

    def forward(model_, kv, queries, pad_token_id):
        width = max(q.num_context for q in queries) + max(q.num_scored for q in queries)
        totals["slots"] += width * len(queries)
        totals["real"] += sum(q.tokens.shape[0] for q in queries)
        totals["scored"] += sum(q.num_scored for q in queries)
        totals["rows"] += len(queries)
        totals["forwards"] += 1
        return ragged_kv_cache.forward_queries(model_, kv, queries, pad_token_id)

    pad = model.generation_config.pad_token_id or 0
    groups = [prompts] if continuous else [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    for batch in groups:
        ids, _ = left_pad(batch, pad)
        config, _ = merge_generation_config(model, None, kwargs)
        config.max_length = ids.shape[1] + config.max_new_tokens
        settings = decoding_settings(model, config, ids.shape[1], max(p.numel() for p in batch))
        rows = batch_size if continuous else None
        result = batch_scheduler.decode_batch(model, batch, settings, pad, forward=forward, max_rows=rows)
        totals["committed"] += sum(result.answer_lengths)
    return {
        "padding_share": 1 - totals["real"] / totals["slots"],
        "rows_active_per_forward": totals["rows"] / totals["forwards"],
        "query_tokens_per_committed_token": totals["scored"] / totals["committed"],
    }


def measure(model, prompts: list[torch.Tensor], batch_size: int, kwargs: dict, repeats: int) -> dict:
    pad = model.generation_config.pad_token_id or 0
    batches = [left_pad(prompts[i : i + batch_size], pad) for i in range(0, len(prompts), batch_size)]
    timer = ForwardTimer(model)
    runs = {
        "refusion": lambda ids, mask: model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs),
        "autoregressive": lambda ids, mask: model.generate(
            ids, attention_mask=mask, decoding="autoregressive", max_new_tokens=kwargs["max_new_tokens"]
        ),
    }
    stats = {name: {"seconds": 0.0, "forward_seconds": 0.0, "forwards": 0, "tokens": 0} for name in runs}
    eos = set(eos_token_ids(model.generation_config))
    for index, (ids, mask) in enumerate(batches):
        order = list(runs) if index % 2 == 0 else list(runs)[::-1]
        best = {}
        for _ in range(repeats):
            for name in order:
                timer.reset()
                start = time.perf_counter()
                output = runs[name](ids, mask)
                seconds = time.perf_counter() - start
                if name not in best or seconds < best[name][0]:
                    best[name] = (seconds, timer.seconds, timer.calls, output)
        for name, (seconds, forward_seconds, calls, output) in best.items():
            sequences = output.sequences if hasattr(output, "sequences") else output
            tokens = sum(answer_lengths(sequences[:, ids.shape[1] :], eos))
            entry = stats[name]
            entry["seconds"] += seconds
            entry["forward_seconds"] += forward_seconds
            entry["forwards"] += calls
            entry["tokens"] += tokens
    timer.remove()
    ids, mask = batches[0]
    reads = host_reads(lambda: runs["refusion"](ids, mask))
    first_forwards = runs["refusion"](ids, mask).num_forward_passes
    report = {}
    for name, entry in stats.items():
        report[name] = {
            "tokens_per_second": entry["tokens"] / entry["seconds"],
            "forward_passes": entry["forwards"],
            "tokens": entry["tokens"],
            "outside_forward_share": 1 - entry["forward_seconds"] / entry["seconds"],
        }
    report["refusion_over_autoregressive_tokens_per_second"] = (
        report["refusion"]["tokens_per_second"] / report["autoregressive"]["tokens_per_second"]
    )
    report["refusion"]["host_reads_per_forward"] = reads / first_forwards
    report["refusion"].update(query_shape_stats(model, prompts, batch_size, kwargs))
    return report


def continuous_vs_fixed(model, prompts: list[torch.Tensor], batch_size: int, kwargs: dict, repeats: int) -> dict:
    """ReFusion tokens/s over a stream of prompts: `generate_batch` (continuous, at most `batch_size` rows) against
    `generate()` on fixed batches of `batch_size`, interleaved, fastest of `repeats`; same tokens checked."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pad = model.generation_config.pad_token_id or 0
    config = ContinuousBatchingConfig(max_requests_per_batch=batch_size)
    lists = [p.tolist() for p in prompts]
    best = {"continuous": float("inf"), "fixed": float("inf")}
    for _ in range(repeats):
        start = time.perf_counter()
        stream = model.generate_batch(lists, continuous_batching_config=config, **kwargs)
        best["continuous"] = min(best["continuous"], time.perf_counter() - start)
        start = time.perf_counter()
        fixed = []
        for i in range(0, len(prompts), batch_size):
            ids, mask = left_pad(prompts[i : i + batch_size], pad)
            out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
            fixed += [
                row[ids.shape[1] : ids.shape[1] + n].tolist() for row, n in zip(out.sequences, out.answer_lengths)
            ]
        best["fixed"] = min(best["fixed"], time.perf_counter() - start)
    answers = [stream[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    tokens = sum(len(a) for a in answers)
    report = {
        "prompts": len(prompts),
        "same_answers": sum(a == b for a, b in zip(answers, fixed)),
        "continuous_tokens_per_second": tokens / best["continuous"],
        "fixed_tokens_per_second": sum(len(a) for a in fixed) / best["fixed"],
        "continuous": query_shape_stats(model, prompts, batch_size, kwargs, continuous=True),
        "fixed": query_shape_stats(model, prompts, batch_size, kwargs),
    }
    report["continuous_over_fixed"] = report["continuous_tokens_per_second"] / report["fixed_tokens_per_second"]
    return report


def embedded_prompts(tokenizer, n: int, seed: int) -> list[torch.Tensor]:
    problems = generate_problems("test", n, seed, families=["arithmetic", "listing"])
    return [torch.tensor(prompt_ids(tokenizer, p.prompt)) for p in problems]


def wide_model_and_prompts(n: int = 4):
    """The random 512-wide, 8-layer Qwen3 (float32), `n` random 256-token prompts and its decoding knobs."""
    torch.manual_seed(0)
    config = RefusionConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        mask_token_id=3,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = RefusionForCausalLM(config).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    prompts = [torch.randint(4, 4096, (256,)) for _ in range(n)]
    kwargs = dict(max_new_tokens=128, slot_size=8, block_size=64, slot_threshold=0.0, token_threshold=0.5)
    return model, prompts, kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decoder_profile.json"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32, help="embedded model: prompts per batch size")
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    parser.add_argument("--stream", type=int, default=64, help="embedded model: prompts of the continuous stream")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-wide", action="store_true", help="leave out the 512-wide random model")
    parser.add_argument("--wide-prompts", type=positive_int, default=16, help="512-wide model: prompts per batch size")
    parser.add_argument("--counts-only", action="store_true", help="count host reads and query shapes (no timing)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results: dict = {"torch_threads": args.threads, "repeats": args.repeats, "embedded": {}, "wide_512x8": {}}
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = embedded_prompts(tokenizer, args.prompts, seed=2026)
    if args.counts_only:
        model = RefusionForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        kwargs = {"max_new_tokens": 64}
        with torch.no_grad():
            counts = host_read_counts(model, prompts, batch_sizes, kwargs)
            shapes = {b: query_shape_stats(model, prompts, b, kwargs) for b in batch_sizes}
            wide = {}
            if not args.skip_wide:
                model, wide_prompts, kwargs = wide_model_and_prompts()
                wide = {b: query_shape_stats(model, wide_prompts, b, kwargs) for b in (1, 4)}
        results = {"model": "embedded", "dtype": "bfloat16", "host_reads": counts, "query_shapes": shapes}
        write_results({**results, "wide_512x8_float32_query_shapes": wide}, args.out)
        return
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):
            model = RefusionForCausalLM.from_pretrained(path, dtype=dtype).eval()
            name = str(dtype).removeprefix("torch.")
            kwargs = {"max_new_tokens": 64}
            results["embedded"][name] = {b: measure(model, prompts, b, kwargs, args.repeats) for b in batch_sizes}
            print(name, results["embedded"][name], flush=True)
            stream = embedded_prompts(tokenizer, args.stream, seed=4242)
            results.setdefault("continuous_batching", {})[name] = {
                b: continuous_vs_fixed(model, stream, b, kwargs, args.repeats) for b in batch_sizes if b > 1
            }
            print(name, results["continuous_batching"][name], flush=True)
        if not args.skip_wide:
            model, wide_prompts, kwargs = wide_model_and_prompts(args.wide_prompts)
            wide_batches = [b for b in batch_sizes if b <= args.wide_prompts]
            for dtype in (torch.bfloat16, torch.float32):
                model = model.to(dtype)
                name = str(dtype).removeprefix("torch.")
                results["wide_512x8"][name] = {b: measure(model, wide_prompts, b, kwargs, 1) for b in wide_batches}
                print(name, results["wide_512x8"][name], flush=True)
    write_results(results, args.out)


if __name__ == "__main__":
    main()
