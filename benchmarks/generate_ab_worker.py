"""One side of `generate_ab.py`: times whole `model.generate()` calls of whichever `refusion_hf` this process
imports (`PYTHONPATH` decides: the checkout's `src/` or a baseline commit's), and prints JSON to stdout.

The embedded model (`default_model_path()` of the imported package, or `--model-path`) in `--dtype`, loaded by the
imported package's own class, its decoding defaults, the synthetic test prompts through the chat template,
left-padded into batches of each `--batch-sizes`. Per batch size: one warm-up pass over all batches, then
`--repeats` passes, each batch timed by its fastest call. Forward hooks on the model time the per-call setup: from
the call to the first forward's start (config merge, checks, processors, criteria, draft policy, the decoder's own
preparation) and from the last forward's end to the return (the last step's decisions, output building); and,
through the module-level `decode_batch` that `refusion_generate` calls, `generate()`'s own setup before and after
the decoding loop. Otherwise only the public API of the package is used (loading, synthetic tasks, `generate()`), so
any commit of it runs.

    PYTHONPATH=src python benchmarks/generate_ab_worker.py --dtype bfloat16 --batch-sizes 1,4,16
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time

import torch
from generate_ab import generate_kwargs

import refusion_hf
from refusion_hf.evaluation.synthetic_tasks import generate_problems
from refusion_hf.modeling.loading import default_model_path, load_model_and_tokenizer, prompt_ids


class CallClock:
    """Forward pre- and post-hooks on the model: the start of the first forward and the end of the last one of a
    call, and the number of forwards. Where `refusion_generate` calls a module-level `decode_batch` (every version
    so far), also when the decoding loop is entered and left: `generate()`'s own setup, apart from the decoder's."""

    def __init__(self, model):
        self.reset()
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)
        self.module = importlib.import_module("refusion_hf.generation.refusion_generate")
        decode_batch = getattr(self.module, "decode_batch", None)
        if decode_batch is not None:

            def timed(*args, **kwargs):
                self.decode_start = time.perf_counter()
                result = decode_batch(*args, **kwargs)
                self.decode_end = time.perf_counter()
                return result

            self.module.decode_batch = timed

    def reset(self) -> None:
        self.first_start = self.last_end = self.decode_start = self.decode_end = None
        self.forwards = 0

    def _pre(self, module, args):
        if self.first_start is None:
            self.first_start = time.perf_counter()
        self.forwards += 1

    def _post(self, module, args, output):
        self.last_end = time.perf_counter()


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,4,16", help="comma-separated")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--generate-kwargs", type=generate_kwargs, default={}, help="a JSON object, for generate()")
    parser.add_argument("--model-path", help="a model folder (default: the imported package's embedded model)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_path = args.model_path or str(default_model_path())
    model, tokenizer = load_model_and_tokenizer(model_path, dtype=args.dtype)
    problems = generate_problems("test", args.prompts, 0, families=["arithmetic", "listing"])
    prompts = [prompt_ids(tokenizer, problem.prompt) for problem in problems]
    pad = model.generation_config.pad_token_id or 0
    clock = CallClock(model)
    rows = []
    for batch_size in [int(part) for part in args.batch_sizes.split(",")]:
        batches = [left_pad(prompts[i : i + batch_size], pad) for i in range(0, len(prompts), batch_size)]
        best = [float("inf")] * len(batches)
        before, after, tokens, forwards = [], [], [], []
        own_before, own_after = [], []  # generate() before / after its decoding loop
        for run in range(1 + args.repeats):  # run 0 warms up
            for index, (ids, mask) in enumerate(batches):
                clock.reset()
                start = time.perf_counter()
                output = model.generate(
                    ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, **args.generate_kwargs
                )
                end = time.perf_counter()
                if run == 0:
                    tokens.append(output.tolist())
                    forwards.append(clock.forwards)
                    continue
                if output.tolist() != tokens[index] or clock.forwards != forwards[index]:
                    raise SystemExit(f"batch {index} at batch size {batch_size}: a repeat decoded differently")
                best[index] = min(best[index], end - start)
                before.append(clock.first_start - start)
                after.append(end - clock.last_end)
                if clock.decode_start is not None:
                    own_before.append(clock.decode_start - start)
                    own_after.append(end - clock.decode_end)
        rows.append(
            {
                "batch_size": batch_size,
                "seconds": sum(best),
                "batch_seconds": best,
                "setup_ms_per_call": {
                    "before_first_forward": 1000 * statistics.median(before),
                    "after_last_forward": 1000 * statistics.median(after),
                },
                "generate_setup_ms_per_call": {
                    "before_decode_batch": 1000 * statistics.median(own_before) if own_before else None,
                    "after_decode_batch": 1000 * statistics.median(own_after) if own_after else None,
                },
                "forward_passes": sum(forwards),
                "tokens": tokens,
            }
        )
    print(json.dumps({"package": refusion_hf.__file__, "model_path": model_path, "dtype": args.dtype, "rows": rows}))


if __name__ == "__main__":
    main()
