"""Sub-slot remasking (issue #31) measured on the embedded model: accuracy and tokens/s of ReFusion decoding with
revision off and at several `remask_threshold` values, each run side by side with the controlled AR baseline
(`refusion eval --baseline-model`, so every speed figure is a ratio taken in one process), on the tuning seeds and
on the held-out seeds of `heldout_comparison.py`; the installed slot setting (the model's generation config) and
multi-slot settings (several slots per block, where the paper's parallelism lives).

`refusion eval` (lm-eval's scoring, the side-by-side timing) does the measuring; `heldout_comparison.py` runs it.
Added here: the grid, the revision figures, and the choice. Per run: tokens revised per answer (the eval's
`num_revised_tokens`, from `generate`'s output; null where the decoder does not report it) and extra forward passes
per answer against revision off (same seed, same slot setting). The threshold is chosen on the tuning seeds only:
`recommended_remask_threshold` is the most accurate one there (ties: the faster) among those more accurate than
revision off at >= 2x the baseline's tokens/s on every tuning seed, or null if none is; the held-out seeds then say
whether it helps (`install`: more accurate than revision off at >= 2x on every held-out seed) and how much of
ReFusion's gap to the baseline it closes (`goal_met`: at least half of the installed setting's gap with revision
off, at >= 2x). Multi-slot settings are chosen and judged the same way, so they compare with the installed one.

    .venv/bin/python benchmarks/remasking.py --thresholds none,0.1,0.2,0.3,0.5 --slot-settings installed,8x16
    # -> benchmarks/results/remasking.json; extra `refusion eval` flags after --, e.g. -- --timing-repeats 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from heldout_comparison import (
    HELD_OUT_SEEDS,
    RATIO,
    ROOT,
    TUNING_SEEDS,
    eval_flags,
    seeds_argument,
    side_by_side,
    summarize_rows,
)
from results_file import write_results

INSTALLED = "installed"  # the slot setting of the model's generation config
GOAL_GAP_CLOSED = 0.5  # the goal: revision closes at least half of the gap to the AR baseline


@dataclass(frozen=True)
class Setting:
    """One ReFusion decoding of the grid: a slot setting (`installed`, or slot size and block size) and a remask
    threshold (None: revision off)."""

    slots: str
    threshold: float | None

    def flags(self) -> list[str]:
        flags = []
        if self.slots != INSTALLED:
            slot_size, block_size = self.slots.split("x")
            flags += ["--slot-size", slot_size, "--block-size", block_size]
        if self.threshold is not None:
            flags += ["--remask-threshold", str(self.threshold)]
        return flags


def revision_available() -> bool:
    """Whether this checkout's decoder has the `remask_threshold` knob."""
    from refusion_hf.generation.refusion_generation_config import RefusionGenerationConfig

    return hasattr(RefusionGenerationConfig(), "remask_threshold")


def _thresholds(text: str) -> list[float | None]:
    values: list[float | None] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part == "none":
            values.append(None)
            continue
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected 'none' or numbers in (0, 1], got {part!r}") from None
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"a remask threshold lies in (0, 1], got {value}")
        values.append(value)
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct values, 'none' for revision off, got {text!r}")
    return values


def _slot_settings(text: str) -> list[str]:
    settings = [part.strip() for part in text.split(",") if part.strip()]
    for setting in settings:
        if setting == INSTALLED:
            continue
        slot_size, _, block_size = setting.partition("x")
        if not (slot_size.isdigit() and block_size.isdigit() and int(slot_size) > 0 and int(block_size) > 0):
            raise argparse.ArgumentTypeError(f"expected '{INSTALLED}' or SLOTxBLOCK (e.g. 8x16), got {setting!r}")
        if int(block_size) % int(slot_size):
            raise argparse.ArgumentTypeError(f"{setting}: the block size must be a multiple of the slot size")
    if not settings or len(set(settings)) != len(settings):
        raise argparse.ArgumentTypeError(f"expected distinct slot settings, got {text!r}")
    return settings


def measure(args, setting: Setting, group: str, seed: int, flags: list[str]) -> dict:
    """One side-by-side run: the comparison row plus the revision figures and the run's wall time."""
    start = time.perf_counter()
    row, both = side_by_side(args.model, args.baseline_model, seed, [*flags, *setting.flags()])
    refusion = both["refusion"]
    answers = refusion["num_sequences"]
    revised = refusion.get("num_revised_tokens")  # reported by a decoder that revises
    row.update(
        group=group,
        slots=setting.slots,
        remask_threshold=setting.threshold,
        answers=answers,
        refusion_forward_passes=refusion["num_forward_passes"],
        refusion_tokens=refusion["num_tokens"],
        revised_tokens=revised,
        revised_tokens_per_answer=None if revised is None else revised / answers,
        wall_seconds=round(time.perf_counter() - start, 1),
    )
    return row


def add_extra_forwards(rows: list[dict]) -> None:
    """Each row's forward passes per answer beyond those of revision off on the same seed and slot setting."""
    off = {(r["seed"], r["slots"]): r for r in rows if r["remask_threshold"] is None}
    for row in rows:
        base = off.get((row["seed"], row["slots"]))
        extra = None if base is None else row["refusion_forward_passes"] - base["refusion_forward_passes"]
        row["extra_forwards_per_answer"] = None if extra is None else extra / row["answers"]


def summarize(rows: list[dict]) -> dict:
    """One group of seeds at one setting: mean accuracies, speed ratios, revision figures."""
    return {
        **summarize_rows(rows),
        "revised_tokens_per_answer": _pooled(rows, "revised_tokens"),
        "extra_forwards_per_answer": _pooled_extra(rows),
    }


def _pooled(rows: list[dict], key: str) -> float | None:
    if any(r[key] is None for r in rows):
        return None
    return sum(r[key] for r in rows) / sum(r["answers"] for r in rows)


def _pooled_extra(rows: list[dict]) -> float | None:
    if any(r["extra_forwards_per_answer"] is None for r in rows):
        return None
    return sum(r["extra_forwards_per_answer"] * r["answers"] for r in rows) / sum(r["answers"] for r in rows)


def gap_closed(rows: list[dict], off_rows: list[dict]) -> float | None:
    """(accuracy gained over revision off) / (revision off's gap to the baseline), pooled over the seeds."""
    off = {r["seed"]: r for r in off_rows}
    if not off or any(r["seed"] not in off for r in rows):
        return None
    gap = sum(off[r["seed"]]["baseline_accuracy"] - off[r["seed"]]["refusion_accuracy"] for r in rows)
    gained = sum(r["refusion_accuracy"] - off[r["seed"]]["refusion_accuracy"] for r in rows)
    return gained / gap if gap > 0 else None


def more_accurate(a: float, b: float) -> bool:
    """`a` above `b` by more than float noise (means of per-seed accuracies: equal counts may differ in the last
    bit)."""
    return round(a, 9) > round(b, 9)


def recommend(summaries: dict[str | None, dict]) -> float | None:
    """The threshold to recommend from one slot setting's tuning-seed summaries (keyed by threshold, None = off):
    the most accurate (ties: the higher median speedup) of those more accurate than revision off at >= RATIO times
    the baseline's tokens/s on every seed; None if no threshold is (or revision off was not run)."""
    off = summaries.get(None)
    if off is None:
        return None
    helping = [
        (round(s["mean_accuracy"], 9), s["median_speedup"], threshold)
        for threshold, s in summaries.items()
        if threshold is not None
        and more_accurate(s["mean_accuracy"], off["mean_accuracy"])
        and s["min_speedup"] >= RATIO
    ]
    return max(helping)[2] if helping else None


def _key(threshold: float | None) -> str:
    return "off" if threshold is None else str(threshold)


def markdown(summary: dict) -> str:
    """The summary as the README's table (group, slot setting, threshold per line)."""
    lines = [
        "| seeds | slots | remask threshold | accuracy | AR baseline | points behind | ratio (min / median) | "
        "tokens/forward | revised tokens / answer | extra forwards / answer | gap closed (own off / installed off) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for group, by_slots in summary.items():
        for slots, by_threshold in by_slots.items():
            for threshold, s in by_threshold.items():
                revised, extra = s["revised_tokens_per_answer"], s["extra_forwards_per_answer"]
                closed = " / ".join(
                    "-" if v is None else f"{v:.2f}" for v in (s["gap_closed"], s["gap_closed_vs_installed_off"])
                )
                lines.append(
                    f"| {group} | {slots} | {threshold} | {s['mean_accuracy']:.3f} | "
                    f"{s['mean_baseline_accuracy']:.3f} | {s['mean_points_behind']:.1f} | "
                    f"{s['min_speedup']:.2f}x / {s['median_speedup']:.2f}x | {s['mean_tokens_per_forward']:.2f} | "
                    f"{'-' if revised is None else f'{revised:.2f}'} | {'-' if extra is None else f'{extra:.2f}'} | "
                    f"{closed} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "src" / "refusion_hf" / "assets" / "default_model"))
    parser.add_argument("--baseline-model", default=str(ROOT / "benchmarks" / "models" / "ar_baseline"))
    parser.add_argument("--thresholds", type=_thresholds, default=_thresholds("none,0.1,0.2,0.3,0.5"),
                        help="comma-separated remask thresholds in (0, 1]; 'none' is revision off (default: "
                        "none,0.1,0.2,0.3,0.5)")  # fmt: skip
    parser.add_argument("--slot-settings", type=_slot_settings, default=_slot_settings(f"{INSTALLED},8x16"),
                        help=f"'{INSTALLED}' (the model's generation config) and SLOTxBLOCK multi-slot settings "
                        f"(default: {INSTALLED},8x16)")  # fmt: skip
    parser.add_argument("--tuning-seeds", type=seeds_argument, default=list(TUNING_SEEDS))
    parser.add_argument("--heldout-seeds", type=seeds_argument, default=list(HELD_OUT_SEEDS))
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "remasking.json"))
    parser.add_argument("--from-runs", help="a results JSON of this script: summarize and choose again from its runs "
                        "(the grid flags must name what it ran), measuring nothing")  # fmt: skip
    args, extra_flags = parser.parse_known_args()
    extra_flags = [flag for flag in extra_flags if flag != "--"]
    if any(t is not None for t in args.thresholds) and not revision_available():
        parser.error("this checkout's decoder has no remask_threshold knob yet (issue #31): pass --thresholds none")
    overlap = set(args.tuning_seeds) & set(args.heldout_seeds)
    if overlap:
        parser.error(f"seeds {sorted(overlap)} are both tuning and held-out seeds: a seed is one or the other")
    groups = {"tuning": args.tuning_seeds, "held_out": args.heldout_seeds}
    if not any(groups.values()):
        parser.error("no seeds: pass --tuning-seeds and/or --heldout-seeds")
    flags = [*eval_flags(args.limit, args.num_threads), *extra_flags]
    settings = [Setting(slots, threshold) for slots in args.slot_settings for threshold in args.thresholds]

    start = time.perf_counter()
    rows, measured = [], {}
    if args.from_runs:  # the measured runs (with their extra forwards) of an earlier invocation
        earlier = json.loads(Path(args.from_runs).read_text())
        rows = earlier["runs"]
        measured = {"measured_by": earlier["command"], "measured_wall_seconds": earlier["wall_seconds"]}
        settings, groups = [], {g: s for g, s in groups.items() if any(r["group"] == g for r in rows)}
    for group, seeds in groups.items():
        for seed in seeds:
            for setting in settings:
                rows.append(measure(args, setting, group, seed, flags))
                print({k: rows[-1][k] for k in ("group", "seed", "slots", "remask_threshold", "refusion_accuracy",
                                                "baseline_accuracy", "speedup")}, file=sys.stderr)  # fmt: skip
    if not args.from_runs:
        add_extra_forwards(rows)

    summary: dict = {}
    for group, seeds in groups.items():
        if not seeds:
            continue
        for slots in args.slot_settings:
            runs = [r for r in rows if r["group"] == group and r["slots"] == slots]
            off_rows = [r for r in runs if r["remask_threshold"] is None]
            installed_off = [r for r in rows if r["group"] == group and r["slots"] == INSTALLED
                             and r["remask_threshold"] is None]  # fmt: skip
            for threshold in args.thresholds:
                chosen = [r for r in runs if r["remask_threshold"] == threshold]
                entry = summarize(chosen)
                entry["gap_closed"] = None if threshold is None else gap_closed(chosen, off_rows)
                entry["gap_closed_vs_installed_off"] = gap_closed(chosen, installed_off)
                summary.setdefault(group, {}).setdefault(slots, {})[threshold] = entry

    choice: dict = {}
    for slots in args.slot_settings:
        best = recommend(summary["tuning"][slots]) if "tuning" in summary else None
        verdict: dict = {"best_threshold_on_tuning_seeds": best}
        if "tuning" in summary:  # to compare slot settings on the tuning seeds, each at its own choice
            verdict["tuning_accuracy_at_choice"] = summary["tuning"][slots].get(best, {}).get("mean_accuracy")
        held_out = summary.get("held_out", {}).get(slots, {})
        if best is not None and best in held_out and None in held_out:
            chosen, off = held_out[best], held_out[None]
            fast = chosen["min_speedup"] >= RATIO
            verdict["held_out"] = chosen
            verdict["helps_on_held_out"] = more_accurate(chosen["mean_accuracy"], off["mean_accuracy"]) and fast
            verdict["goal_met"] = fast and (chosen["gap_closed_vs_installed_off"] or 0.0) >= GOAL_GAP_CLOSED
        choice[slots] = verdict
    installed = choice.get(INSTALLED, {})
    summary = {g: {s: {_key(t): v for t, v in by.items()} for s, by in d.items()} for g, d in summary.items()}
    write_results(
        {
            "command": " ".join(sys.argv),
            "model": args.model,
            "baseline_model": args.baseline_model,
            "revision_available": revision_available(),
            "tuning_seeds": args.tuning_seeds,
            "heldout_seeds": args.heldout_seeds,
            "limit": args.limit,
            "eval_flags": flags,
            "targets": {"speedup_at_least": RATIO, "gap_closed_at_least": GOAL_GAP_CLOSED},
            "recommended_remask_threshold": installed.get("best_threshold_on_tuning_seeds"),
            "install": installed.get("helps_on_held_out", False),
            "choice_by_slot_setting": choice,
            "summary": summary,
            "runs": rows,
            "wall_seconds": round(time.perf_counter() - start, 1),
            **measured,
        },
        args.out,
    )
    print(markdown(summary), file=sys.stderr)


if __name__ == "__main__":
    main()
