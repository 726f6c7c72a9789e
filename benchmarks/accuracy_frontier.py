"""Accuracy against tokens per forward: a sweep of ReFusion decoding settings on the trained default model,
against token-level parallel decoding on the same weights (slot size 1), autoregressive decoding of the same
weights. All on the synthetic test split, one process; writes JSON and a PNG plot. (The controlled AR baseline
model of `train_default_model.py`, `ar_continued`, has no mask token, and `evaluate_decodings` always runs both
decodings, so it is not evaluated here yet.)

    .venv/bin/python benchmarks/accuracy_frontier.py --seed 7 --limit 60
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from refusion_hf import RefusionForCausalLM
from refusion_hf.evaluation.harness import EvalSettings, evaluate_decodings
from refusion_hf.evaluation.suites import synthetic_problems
from refusion_hf.generation.cli import default_model_path

ROOT = Path(__file__).resolve().parents[1]
SLOT_SIZES = (1, 4, 8)
THRESHOLDS = ((0.9, 0.6), (0.6, 0.3), (0.3, 0.1), (0.0, 0.0))  # (slot_threshold, token_threshold)


def summary(result: dict, decoding: str) -> dict:
    part = result[decoding]
    return {key: part[key] for key in ("accuracy", "tokens_per_forward", "tokens_per_second", "num_forward_passes")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="ReFusion model (default: the embedded one)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "accuracy_frontier.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    problems = synthetic_problems(seed=args.seed, limit=args.limit)  # all three families; code runs sandboxed
    results: dict = {"seed": args.seed, "problems": len(problems), "runs": []}

    model_dir = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = RefusionForCausalLM.from_pretrained(model_dir).eval()
    for slot_size in SLOT_SIZES:
        for slot_threshold, token_threshold in THRESHOLDS:
            settings = EvalSettings(
                max_new_tokens=args.max_new_tokens,
                slot_size=slot_size,
                block_size=args.block_size,
                slot_threshold=slot_threshold,
                token_threshold=token_threshold,
                seed=args.seed,
                allow_code_execution=True,
            )
            result = evaluate_decodings(model, tokenizer, problems, settings)
            run = {
                "slot_size": slot_size,
                "slot_threshold": slot_threshold,
                "token_threshold": token_threshold,
                "refusion": summary(result, "refusion"),
            }
            results["runs"].append(run)
            results["autoregressive_same_weights"] = summary(result, "autoregressive")
            print(json.dumps(run), flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(json.dumps(results, indent=2))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for slot_size in SLOT_SIZES:
        runs = [r for r in results["runs"] if r["slot_size"] == slot_size]
        label = "token-level parallel (slot 1)" if slot_size == 1 else f"ReFusion, slot {slot_size}"
        axes.plot(
            [r["refusion"]["tokens_per_forward"] for r in runs],
            [r["refusion"]["accuracy"] for r in runs],
            marker="o",
            label=label,
        )
    same = results["autoregressive_same_weights"]
    axes.scatter([1.0], [same["accuracy"]], marker="s", color="black", label="AR decoding, same weights", zorder=3)
    axes.set_xlabel("tokens per forward")
    axes.set_ylabel("accuracy (synthetic test split)")
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
