"""Accuracy against tokens per forward: a sweep of ReFusion decoding settings on the trained default model,
against token-level parallel decoding on the same weights (slot size 1), autoregressive decoding of the same
weights, and the controlled AR baseline model of `train_default_model.py` (benchmarks/models/ar_baseline: the same
converged AR model trained autoregressively for as many steps as the ReFusion fine-tuning took). All on the
synthetic test split, one process; writes JSON and a PNG plot.

    .venv/bin/python benchmarks/accuracy_frontier.py --seed 7 --limit 60
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from results_file import write_results
from transformers import AutoTokenizer

from refusion_hf import RefusionForCausalLM
from refusion_hf.evaluation.harness import EvalSettings, evaluate_decodings
from refusion_hf.evaluation.tasks import load_task
from refusion_hf.modeling.loading import default_model_path

ROOT = Path(__file__).resolve().parents[1]
SLOT_SIZES = (1, 4, 8)
THRESHOLDS = ((0.9, 0.6), (0.6, 0.3), (0.3, 0.1), (0.0, 0.0))  # (slot_threshold, token_threshold)
# Curves: (slot size, plan_ahead). Planning ahead changes forward passes only; slot 8 is also run without it.
CURVES = tuple((slot_size, True) for slot_size in SLOT_SIZES) + ((8, False),)


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
    parser.add_argument(
        "--ar-baseline",
        default=str(ROOT / "benchmarks" / "models" / "ar_baseline"),
        help="the controlled AR baseline model (train_default_model.py --install puts it there); 'none' to leave "
        "it out",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "accuracy_frontier.json"))
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG of --out's JSON")
    args = parser.parse_args()
    if args.replot:
        return replot(Path(args.out))
    torch.set_num_threads(1)
    os.environ["HF_ALLOW_CODE_EVAL"] = "1"  # all three families; the code runs sandboxed
    metadata = {"seed": args.seed, "num_problems": args.limit, "families": ["arithmetic", "code", "listing"]}
    task = load_task("refusion_synthetic", metadata=metadata)
    results: dict = {"seed": args.seed, "problems": args.limit, "runs": []}

    model_dir = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = RefusionForCausalLM.from_pretrained(model_dir).eval()  # the checkpoint's dtype
    results["dtype"] = str(model.dtype).removeprefix("torch.")
    if args.ar_baseline != "none":
        results["ar_baseline_model"] = evaluate_ar_baseline(Path(args.ar_baseline), task, args, model.dtype)
        print(json.dumps({"ar_baseline_model": results["ar_baseline_model"]}), flush=True)
    for slot_size, plan_ahead in CURVES:
        for slot_threshold, token_threshold in THRESHOLDS:
            settings = EvalSettings(
                max_new_tokens=args.max_new_tokens,
                knobs=dict(
                    slot_size=slot_size,
                    block_size=args.block_size,
                    slot_threshold=slot_threshold,
                    token_threshold=token_threshold,
                    plan_ahead=plan_ahead,
                ),
                seed=args.seed,
            )
            result = evaluate_decodings(model, tokenizer, task, settings)
            run = {
                "slot_size": slot_size,
                "slot_threshold": slot_threshold,
                "token_threshold": token_threshold,
                "plan_ahead": plan_ahead,
                "refusion": summary(result, "refusion"),
                "speedup_over_autoregressive_same_weights": result["speedup"],
            }
            results["runs"].append(run)
            results["autoregressive_same_weights"] = summary(result, "autoregressive")
            print(json.dumps(run), flush=True)

    out = write_results(results, args.out)
    plot(results, out.with_suffix(".png"))


def replot(json_path: Path) -> None:
    """Redraw the PNG from a results JSON (`--replot`), without decoding anything."""
    plot(json.loads(json_path.read_text()), json_path.with_suffix(".png"))


def evaluate_ar_baseline(folder: Path, task, args, dtype: torch.dtype) -> dict:
    if not (folder / "model.safetensors").exists():
        raise SystemExit(
            f"no AR baseline model in {folder}: run benchmarks/train_default_model.py --install (its ar_continued "
            "stage) or pass --ar-baseline none"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # A plain Qwen3 checkpoint loads as is; same dtype as the ReFusion model.
    model = RefusionForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    settings = EvalSettings(max_new_tokens=args.max_new_tokens, seed=args.seed)
    result = evaluate_decodings(model, tokenizer, task, settings, decodings=("autoregressive",))
    return {"model": str(folder), **summary(result, "autoregressive")}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4))
    for slot_size, plan_ahead in CURVES:
        runs = [r for r in results["runs"] if (r["slot_size"], r["plan_ahead"]) == (slot_size, plan_ahead)]
        label = "token-level parallel (slot 1)" if slot_size == 1 else f"ReFusion, slot {slot_size}"
        axes.plot(
            [r["refusion"]["tokens_per_forward"] for r in runs],
            [r["refusion"]["accuracy"] for r in runs],
            marker="o",
            linestyle="-" if plan_ahead else "--",
            label=label if plan_ahead else f"{label}, without planning ahead",
        )
    same = results["autoregressive_same_weights"]
    axes.scatter([1.0], [same["accuracy"]], marker="s", color="black", label="AR decoding, same weights", zorder=3)
    baseline = results.get("ar_baseline_model")
    if baseline is not None:
        axes.scatter([1.0], [baseline["accuracy"]], marker="D", color="tab:purple", label="AR baseline model", zorder=3)
    axes.set_xlabel("tokens per forward")
    axes.set_ylabel("accuracy (synthetic test split)")
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
