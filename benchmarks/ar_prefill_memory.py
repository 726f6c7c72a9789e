"""Peak memory of an autoregressive prefill at Qwen3's vocabulary: does `generate` keep one row of logits?

Stock `generate` passes `logits_to_keep=1` to models whose `forward` declares it, so the prefill of a long prompt
computes the logits of its last position only. Before `RefusionForCausalLM.forward` declared it (main e2b8e4c),
`decoding="autoregressive"` computed `prompt_length x vocab_size` float32 logits at prefill. This script builds a
one-layer Qwen3 at the official checkpoint's vocabulary (151,671 ids, random weights: memory does not depend on
them), and measures `generate(prompt, max_new_tokens=1)` (the prefill and one token) three ways, each in a fresh
process, as the peak resident memory of the call above the memory held just before it:

* `stock`: transformers' `Qwen3ForCausalLM` with the same weights;
* `refusion_autoregressive`: `RefusionForCausalLM.generate(..., decoding="autoregressive")` of this checkout;
* `refusion_autoregressive_all_rows`: the same with `_supports_logits_to_keep()` answering False, which is what
  stock `generate` saw before (it then passes no `logits_to_keep`, and every prompt position gets its logits).

The three must return the same tokens (checked). On CPU (this machine) the measure is the process's peak RSS.

    .venv/bin/python benchmarks/ar_prefill_memory.py --out benchmarks/results/ar_prefill_memory.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

VOCAB_SIZE = 151_671  # the official ReFusion checkpoint's (Qwen3's vocabulary plus the mask token)
WAYS = ("stock", "refusion_autoregressive", "refusion_autoregressive_all_rows")


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure_one(way: str, prompt_length: int) -> dict:
    """Runs in its own process: build the model, then one `generate` call; returns its memory and tokens."""
    import torch
    from transformers import Qwen3ForCausalLM

    from refusion_hf import RefusionConfig, RefusionForCausalLM

    torch.manual_seed(0)
    config = RefusionConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=prompt_length + 8, mask_token_id=VOCAB_SIZE - 1,
        eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    model = (Qwen3ForCausalLM if way == "stock" else RefusionForCausalLM)(config).eval()
    if way == "refusion_autoregressive_all_rows":
        model._supports_logits_to_keep = lambda: False
    extra = {} if way == "stock" else {"decoding": "autoregressive"}
    prompt = torch.randint(1, VOCAB_SIZE - 1, (1, prompt_length), generator=torch.Generator().manual_seed(1))
    model.generate(prompt[:, :8], max_new_tokens=1, do_sample=False, **extra)  # warm-up: lazy allocations
    before = current_rss_bytes()
    peak_before = peak_rss_bytes()
    start = time.perf_counter()
    tokens = model.generate(prompt, max_new_tokens=1, do_sample=False, **extra)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    return {
        "peak_above_start_mib": round((max(peak, peak_before) - before) / 2**20, 1),
        "call_raised_peak": peak > peak_before,
        "seconds": round(seconds, 3),
        "new_token": int(tokens[0, -1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-length", type=int, default=4096)
    parser.add_argument("--out", default="benchmarks/results/ar_prefill_memory.json")
    parser.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)  # internal: measure one way in this process
    args = parser.parse_args()
    if args.prompt_length < 1:
        parser.error(f"--prompt-length must be a positive number of tokens, got {args.prompt_length}")
    if args.one:
        print(json.dumps(measure_one(args.one, args.prompt_length)))
        return
    from results_file import write_results

    import refusion_hf

    ways = {}
    for way in WAYS:
        command = [sys.executable, __file__, "--one", way, "--prompt-length", str(args.prompt_length)]
        ways[way] = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    tokens = {result["new_token"] for result in ways.values()}
    if len(tokens) != 1:
        raise SystemExit(f"the three ways generated different tokens: {ways}")
    full_logits_mib = args.prompt_length * VOCAB_SIZE * 4 / 2**20
    write_results(
        {
            "prompt_length": args.prompt_length,
            "vocab_size": VOCAB_SIZE,
            "float32_logits_of_every_prompt_position_mib": round(full_logits_mib, 1),
            "ways": ways,
            "refusion_hf": str(Path(refusion_hf.__file__).parent),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
