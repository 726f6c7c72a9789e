"""Two ReFusion models' decoding speed side by side, in one process: the synthetic test problems of each seed
(arithmetic and listing, through the chat template), batch 1, each model with its own decoding defaults
(generation_config.json), every problem decoded `--repeats` times per model, interleaved (which model goes first
alternates), its fastest run timed. Reports per seed tokens/s, tokens per forward and their ratio (first / second).
What `heldout_comparison.py --previous-model` cannot give: that one times the previous model in another process.

    .venv/bin/python benchmarks/model_speed_comparison.py --models src/refusion_hf/assets/default_model \\
        out/previous_model --out benchmarks/results/model_speed_comparison.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from heldout_comparison import HELD_OUT_SEEDS
from results_file import write_results

from refusion_hf.evaluation.synthetic_tasks import generate_problems
from refusion_hf.modeling.loading import load_model_and_tokenizer, prompt_ids

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs=2, required=True, metavar=("FIRST", "SECOND"))
    parser.add_argument("--seeds", default=",".join(map(str, HELD_OUT_SEEDS)))
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "model_speed_comparison.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = [load_model_and_tokenizer(path) for path in args.models]
    rows = []
    for seed in [int(seed) for seed in args.seeds.split(",")]:
        problems = generate_problems("test", args.limit, seed, families=["arithmetic", "listing"])
        totals = [{"seconds": 0.0, "tokens": 0, "forwards": 0} for _ in loaded]
        for index, problem in enumerate(problems):
            order = [0, 1] if index % 2 == 0 else [1, 0]
            best = [float("inf"), float("inf")]
            outputs = [None, None]
            for _ in range(args.repeats):
                for which in order:
                    model, tokenizer = loaded[which]
                    ids = torch.tensor([prompt_ids(tokenizer, problem.prompt)])
                    start = time.perf_counter()
                    with torch.no_grad():
                        outputs[which] = model.generate(ids, return_dict_in_generate=True)
                    best[which] = min(best[which], time.perf_counter() - start)
            for which, output in enumerate(outputs):
                totals[which]["seconds"] += best[which]
                totals[which]["tokens"] += int(output.answer_lengths.sum())
                totals[which]["forwards"] += int(output.num_forward_passes)
        speeds = [t["tokens"] / t["seconds"] for t in totals]
        row = {"seed": seed}
        for name, total, speed in zip(("first", "second"), totals, speeds):
            row[name] = {**total, "tokens_per_second": speed, "tokens_per_forward": total["tokens"] / total["forwards"]}
        row["first_over_second_tokens_per_second"] = speeds[0] / speeds[1]
        rows.append(row)
        print(seed, round(row["first_over_second_tokens_per_second"], 3), file=sys.stderr)
    ratios = [row["first_over_second_tokens_per_second"] for row in rows]
    write_results(
        {
            "command": " ".join(sys.argv),
            "models": args.models,
            "threads": args.threads,
            "repeats": args.repeats,
            "seeds": rows,
            "summary": {"min_ratio": min(ratios), "median_ratio": statistics.median(ratios), "max_ratio": max(ratios)},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
