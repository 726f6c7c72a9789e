"""The embedded model as evidence: ReFusion decoding of the ReFusion model beside autoregressive decoding of the
controlled AR baseline (trained from the same AR model on the same data for the same steps), on seeds of the
synthetic test split, batch 1, with `refusion eval --baseline-model` (both decodings batch by batch in one process).
Optionally a previous ReFusion model's accuracy on the same seeds (ReFusion decoding alone).

The targets (benchmarks/README.md, "The embedded default model"): ReFusion within 3 points of the baseline at >= 2x
its tokens/s on every seed; ReFusion at least as accurate as the previous embedded model.

    # the evidence: seeds outside benchmarks/decision_seeds.json (refused there), 500 problems, a paired 95% interval
    .venv/bin/python benchmarks/heldout_comparison.py --model src/refusion_hf/assets/default_model \\
        --baseline-model benchmarks/models/ar_baseline --suite synthetic-hard --seeds 540202 --limit 500 \\
        --decision-seeds benchmarks/decision_seeds.json --out benchmarks/results/evidence_installed_hard.json
    # tuning seeds only (decoding defaults, variants), with decoding flags for refusion eval after --
    .venv/bin/python benchmarks/heldout_comparison.py --model out/default_model/refusion_k4-8_ar0_steps2000 \\
        --baseline-model out/default_model/ar_continued_steps2000 --seeds 7,100 --out /tmp/tuning.json -- --slot-size 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from results_file import write_results

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT_SEEDS = (3, 5, 11, 21, 44, 2026, 31337)  # the old "held-out" seeds: decision seeds now (decision_seeds.json)
TUNING_SEEDS = (7, 100)  # decoding choices (defaults, variants, thresholds) are made on these only
POINTS, RATIO = 3.0, 2.0  # the targets


def seeds_argument(text: str) -> list[int]:
    """argparse type: comma-separated seeds."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def summarize_rows(rows: list[dict]) -> dict:
    """`side_by_side` rows of one setting over a group of seeds: mean accuracies and points behind, speed ratios
    (min and median over the seeds), tokens per forward."""
    return {
        "seeds": [r["seed"] for r in rows],
        "mean_accuracy": round(statistics.fmean(r["refusion_accuracy"] for r in rows), 9),  # no float-noise ties
        "mean_baseline_accuracy": statistics.fmean(r["baseline_accuracy"] for r in rows),
        "mean_points_behind": round(statistics.fmean(r["points_behind"] for r in rows), 2),
        "min_speedup": min(r["speedup"] for r in rows),
        "median_speedup": statistics.median(r["speedup"] for r in rows),
        "mean_tokens_per_forward": statistics.fmean(r["refusion_tokens_per_forward"] for r in rows),
    }


def evaluate(arguments: list[str]) -> dict:
    from refusion_hf.cli import main as refusion_cli  # here: importing this module stays cheap (remasking.py's tests)

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "results.json"
        code = refusion_cli(["eval", *arguments, "--json", str(out)])
        if code:
            raise SystemExit(f"refusion eval {' '.join(arguments)} failed with status {code}")
        return json.loads(out.read_text())


def eval_flags(limit: int, num_threads: int, suite: str = "synthetic") -> list[str]:
    """The `refusion eval` flags every run of these comparisons shares."""
    return ["--suite", suite, "--limit", str(limit), "--num-threads", str(num_threads)]


def side_by_side(model: str, baseline_model: str, seed: int, flags: list[str]) -> tuple[dict, dict]:
    """ReFusion decoding of `model` beside autoregressive decoding of `baseline_model` on `seed`'s problems, in one
    `refusion eval` run (`flags`: its other flags). Returns the comparison row and the full eval results."""
    both = evaluate(["--model", model, "--baseline-model", baseline_model, "--seed", str(seed), *flags])
    refusion, baseline = both["refusion"], both["autoregressive"]
    row = {
        "seed": seed,
        "refusion_accuracy": refusion["accuracy"],
        "baseline_accuracy": baseline["accuracy"],
        "points_behind": round(100 * (baseline["accuracy"] - refusion["accuracy"]), 2),
        "refusion_tokens_per_second": refusion["tokens_per_second"],
        "baseline_tokens_per_second": baseline["tokens_per_second"],
        "speedup": both["speedup"],
        "refusion_tokens_per_forward": refusion["tokens_per_forward"],
        "refusion_decoding": both["settings"]["refusion_decoding"],
    }
    interval = both.get("accuracy_difference_interval")
    if interval:  # the paired 95% interval on ReFusion's accuracy minus the baseline's, in points
        row["difference_interval_points"] = [round(100 * interval["low"], 2), round(100 * interval["high"], 2)]
        row["num_problems"] = interval["num_problems"]
    return row, both


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the ReFusion model")
    parser.add_argument("--baseline-model", required=True, help="the controlled AR baseline")
    parser.add_argument("--previous-model", default=None, help="a previous ReFusion model to compare accuracy with")
    parser.add_argument("--seeds", default=",".join(map(str, HELD_OUT_SEEDS)))
    parser.add_argument("--suite", default="synthetic", help="refusion eval's suite (synthetic or synthetic-hard)")
    parser.add_argument(
        "--decision-seeds",
        default=None,
        help="refusion eval's --decision-seeds: a seed this list names is refused (evidence comes from other seeds); "
        "the full eval results (per-problem answers, settings, the interval) are kept in the JSON's 'evaluations'",
    )
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "heldout_comparison.json"))
    args, decoding_flags = parser.parse_known_args()
    decoding_flags = [flag for flag in decoding_flags if flag != "--"]
    common = eval_flags(args.limit, args.num_threads, args.suite)
    checked = ["--decision-seeds", args.decision_seeds] if args.decision_seeds else []
    seeds = [int(seed) for seed in args.seeds.split(",")]
    rows, evaluations = [], []
    for seed in seeds:
        row, both = side_by_side(args.model, args.baseline_model, seed, [*common, *checked, *decoding_flags])
        if args.decision_seeds:
            evaluations.append(both)
        if args.previous_model:
            previous = evaluate(
                ["--model", args.previous_model, "--decodings", "refusion", "--seed", str(seed), *common]
                + ["--timing-repeats", "1"]
            )
            row["previous_accuracy"] = previous["refusion"]["accuracy"]
            row["previous_tokens_per_second"] = previous["refusion"]["tokens_per_second"]  # another process
        row["meets_targets"] = row["points_behind"] <= POINTS and row["speedup"] >= RATIO
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    summary = {
        "mean_points_behind": round(statistics.mean(r["points_behind"] for r in rows), 2),
        "worst_points_behind": max(r["points_behind"] for r in rows),
        "min_speedup": min(r["speedup"] for r in rows),
        "median_speedup": statistics.median(r["speedup"] for r in rows),
        "seeds_meeting_targets": sum(r["meets_targets"] for r in rows),
    }
    if args.previous_model:
        at_least = sum(r["refusion_accuracy"] >= r["previous_accuracy"] for r in rows)
        summary["seeds_at_least_previous_accuracy"] = at_least
    write_results(
        {
            "command": " ".join(sys.argv),
            "model": args.model,
            "baseline_model": args.baseline_model,
            "previous_model": args.previous_model,
            "targets": {"points_behind_at_most": POINTS, "speedup_at_least": RATIO},
            "suite": args.suite,
            "seeds": rows,
            "summary": summary,
            **({"evaluations": evaluations} if args.decision_seeds else {}),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
