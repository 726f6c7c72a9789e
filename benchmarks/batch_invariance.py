"""How often a row of a left-padded batch decodes differently from the same prompt alone, per dtype.

ReFusion decoding of a batch is exact row by row up to floating-point rounding: a batched forward pads every row
to the widest query, and a matmul of another shape may round differently, which can flip a near-tie (a draft's
argmax, a threshold comparison). This measures it on random batches of the tiny oracle checkpoint (2-5 prompts of
1-14 tokens, the decoding knobs of the oracle grid) and on the embedded model (batches of synthetic questions).

    .venv/bin/python benchmarks/batch_invariance.py [--batches 150]   # -> benchmarks/results/batch_invariance.json
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from results_file import write_results

from refusion_hf import RefusionForCausalLM
from refusion_hf.evaluation.synthetic_tasks import generate_problems
from refusion_hf.modeling.loading import default_model_path, load_model_and_tokenizer, prompt_ids

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-qwen3-refusion"
DTYPES = ("float64", "float32", "bfloat16")


def left_pad(prompts: list[list[int]], pad: int):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def differing_rows(model, prompts: list[list[int]], knobs: dict, pad: int) -> int:
    ids, mask = left_pad(prompts, pad)
    together = model.generate(ids, attention_mask=mask, **knobs)[:, ids.shape[1] :]
    differ = 0
    for row, prompt in enumerate(prompts):
        alone = model.generate(torch.tensor([prompt]), **knobs)[0, len(prompt) :]
        differ += not torch.equal(together[row, : alone.shape[0]], alone)
    return differ


def fixture_batches(count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        prompts = [[rng.randint(4, 63) for _ in range(rng.randint(1, 14))] for _ in range(rng.randint(2, 5))]
        slot = rng.choice([1, 2, 3, 4, 8])
        new = rng.randint(1, 40)
        canvas = -(-new // slot) * slot
        knobs = dict(
            max_new_tokens=new,
            slot_size=slot,
            block_size=slot * rng.randint(1, canvas // slot),
            slot_threshold=rng.choice([0.0, 0.3, 0.6, 0.9, 1.01]),
            token_threshold=rng.choice([0.0, 0.1, 0.3, 0.6, 0.9, 1.01]),
        )
        yield prompts, knobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "batch_invariance.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = {"command": "benchmarks/batch_invariance.py", "batches": args.batches, "models": {}}
    for dtype in DTYPES:
        model = RefusionForCausalLM.from_pretrained(FIXTURE, dtype=getattr(torch, dtype)).eval()
        rows = differ = 0
        for prompts, knobs in fixture_batches(args.batches, seed=0):
            rows += len(prompts)
            differ += differing_rows(model, prompts, knobs, pad=0)
        results["models"].setdefault("oracle fixture", {})[dtype] = {"rows": rows, "rows_differing": differ}
    questions = [p.prompt for p in generate_problems("test", 48, seed=99, families=("arithmetic", "listing"))]
    for dtype in DTYPES:
        model, tokenizer = load_model_and_tokenizer(str(default_model_path()), dtype)
        encoded = [prompt_ids(tokenizer, question) for question in questions]
        rows = differ = 0
        for start in range(0, len(encoded), 4):
            batch = encoded[start : start + 4]
            rows += len(batch)
            differ += differing_rows(model, batch, {"max_new_tokens": 64}, pad=tokenizer.pad_token_id)
        results["models"].setdefault("embedded model", {})[dtype] = {"rows": rows, "rows_differing": differ}
    write_results(results, args.out)


if __name__ == "__main__":
    main()
