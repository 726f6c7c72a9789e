"""Training-step time with packed vs padded batches, side by side in one process; writes JSON.

The embedded default model (in float32, as the recipe trains it) takes full training steps (forward, backward,
AdamW) on real batches of synthetic training problems, collated in each way:

* ReFusion steps (`RefusionForCausalLM` + `RefusionDataCollator`): padded to the batch's longest example, and
  packed into rows of each `--packing-lengths` value;
* autoregressive steps (the same weights as a stock `Qwen3ForCausalLM`): `DataCollatorForSeq2Seq` padding, and
  `PackedCausalLMCollator` rows.

Each batch is collated in every way before timing; the ways take turns over `--repeats` rounds (this machine is
noisy) and each reports its median step time, the ratio to padding, and how many positions it computes per real
token. The losses of the first batch are checked to agree across ways (packing must not change them).

    .venv/bin/python benchmarks/packing_speed.py --out benchmarks/results/packing_speed.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from results_file import write_results
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Qwen3ForCausalLM

from refusion_hf import RefusionDataCollator, RefusionForCausalLM
from refusion_hf.evaluation.synthetic_tasks import write_jsonl
from refusion_hf.modeling.loading import default_model_path
from refusion_hf.training import PackedCausalLMCollator, load_sft_dataset

ROOT = Path(__file__).resolve().parents[1]


def time_steps(model, batches: list[dict], optimizer) -> float:
    start = time.perf_counter()
    for batch in batches:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / len(batches)


def first_loss(model, batch: dict) -> float:
    with torch.no_grad():
        return model(**batch).loss.item()


def positions_per_token(batches: list[dict], real_tokens: int) -> float:
    return sum(batch["input_ids"].numel() for batch in batches) / real_tokens


def measure(name: str, model, collators: dict, examples: list[list[dict]], repeats: int) -> dict:
    real_tokens = sum(len(feature["input_ids"]) for batch in examples for feature in batch)
    collated = {way: [collator(batch) for batch in examples] for way, collator in collators.items()}
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    losses = {way: first_loss(model, batches[0]) for way, batches in collated.items()}
    reference = losses["padded"]
    for way, loss in losses.items():
        if abs(loss - reference) > 1e-4 * abs(reference):
            raise AssertionError(f"{name}: the {way} batch's loss {loss} differs from the padded one {reference}")
    times = {way: [] for way in collated}
    for _ in range(repeats):
        for way, batches in collated.items():
            times[way].append(time_steps(model, batches, optimizer))
    padded = statistics.median(times["padded"])
    return {
        way: {
            "median_step_seconds": round(statistics.median(runs), 4),
            "ratio_to_padded": round(padded / statistics.median(runs), 3),
            "positions_per_real_token": round(positions_per_token(collated[way], real_tokens), 3),
            "rows_per_batch": statistics.mean(batch["input_ids"].shape[0] for batch in collated[way]),
        }
        for way, runs in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "packing_speed.json"))
    parser.add_argument("--packing-lengths", default="128,192,256,384")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    packing_lengths = [int(n) for n in args.packing_lengths.split(",")]

    model_dir = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as scratch:
        data = write_jsonl(Path(scratch) / "train.jsonl", "train", args.batch_size * args.batches, seed=1234)
        features = load_sft_dataset(data, tokenizer).features
    random.Random(0).shuffle(features)
    examples = [features[i : i + args.batch_size] for i in range(0, len(features), args.batch_size)]

    refusion = RefusionForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    refusion_collators = {"padded": RefusionDataCollator(tokenizer, slot_sizes=(4, 8), seed=0)}
    for n in packing_lengths:
        refusion_collators[f"packed_{n}"] = RefusionDataCollator(tokenizer, slot_sizes=(4, 8), seed=0, packing_length=n)

    causal_examples = [
        [
            {"input_ids": f["input_ids"], "labels": [-100] * f["prompt_length"] + f["input_ids"][f["prompt_length"] :]}
            for f in batch
        ]
        for batch in examples
    ]
    autoregressive = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    causal_collators = {"padded": DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)}
    for n in packing_lengths:
        causal_collators[f"packed_{n}"] = PackedCausalLMCollator(tokenizer, packing_length=n)

    results = {
        "settings": {
            **{name: value for name, value in vars(args).items() if name != "out"},
            "model": "embedded default model, float32",
        },
        "refusion": measure("refusion", refusion, refusion_collators, examples, args.repeats),
        "autoregressive": measure("autoregressive", autoregressive, causal_collators, causal_examples, args.repeats),
    }
    write_results(results, args.out)


if __name__ == "__main__":
    main()
