"""Accuracy and speed of ReFusion decoding beside the autoregressive baseline, on the seeded suites: the one tool
for the evidence, the frontier of decoding settings and the decoding choice.

Each run is one `refusion eval --baseline-model` (harness.py; lm-eval scores): ReFusion decoding of `--model` beside
autoregressive decoding of `--baseline-model` (the controlled AR baseline of train_default_model.py by default;
`same` for AR decoding of the model's own weights), batch by batch in one process, on `--limit` problems of one seed
of one suite. Per run: both accuracies, points behind with the paired 95% interval, the tokens/s ratio (both
decodings timed side by side), tokens per forward, revised tokens per answer.

* The grid: decoding settings over the model's generation config, each checked against it before anything runs.
  `--setting installed` is the config as it is; `--setting block_size=8,token_threshold=0.9` changes knobs
  (generate()'s names); `--grid KNOB=V1,V2,...` axes add the product of their values (`--grid slot_size=4,8
  --grid plan_ahead=true,false`). Default: `installed` alone.
* Every setting runs on every `--seeds` seed of every `--suite`; per suite and setting, the mean points behind and
  the min / median speed ratio, and the frontier: the settings that no other is both nearer the baseline and faster
  than (mean points behind against min ratio).
* `--choose-on SEEDS`: the grid runs on these seeds instead; the choice rule picks the most accurate setting at
  >= `--target-ratio` times the baseline's tokens/s on every one of them (ties: the higher median ratio; none if
  none is that fast), and only the choice then runs on `--seeds`, whose summary is the verdict (`goal_met`: within
  `--target-points` on average at >= `--target-ratio` on every seed).
* `--decision-seeds FILE` (benchmarks/decision_seeds.json: every seed that informed a choice): a `--seeds` seed it
  lists is refused (evidence comes from problems nothing was chosen on; `refusion eval` checks each run again) and
  a `--choose-on` seed it does not list is refused (a seed is listed before a choice is made on it). The full eval
  results of every `--seeds` run (per-problem answers, settings, the interval) are then kept under "evaluations".

The AR baseline decodes again beside every setting: `refusion eval` takes its speed ratio from both decodings timed
batch by batch in one process, and it has no way to reuse an earlier process's AR run (whose times were taken at
another moment of a shared machine). Its accuracy is the same each time (greedy, same problems): rows record it.
More `refusion eval` flags go after `--` (not the ones this tool sets: the decoding knobs, seed, suite, limit...).

    # the evidence: the installed decoding on a seed nothing was chosen on, 500 problems
    python benchmarks/accuracy_speed.py --model src/refusion_hf/assets/default_model \\
        --baseline-model benchmarks/models/ar_baseline --suite synthetic-hard --seeds 540202 --limit 500 \\
        --num-threads 1 --decision-seeds benchmarks/decision_seeds.json \\
        --out benchmarks/results/evidence_installed_hard.json -- --timing-repeats 1
    # the frontier: the installed decoding and stricter / narrower ones, both tiers, fresh seeds
    python benchmarks/accuracy_speed.py --suite synthetic,synthetic-hard --seeds 540203,540204 --limit 500 \\
        --setting installed --setting token_threshold=0.9 --setting block_size=8 \\
        --decision-seeds benchmarks/decision_seeds.json --out benchmarks/results/evidence_frontier.json
    # a choice: the grid on decision seeds, the choice judged on a fresh one
    python benchmarks/accuracy_speed.py --grid slot_size=4,8 --grid token_threshold=0.5,0.7,0.9 \\
        --choose-on 7,100 --seeds 540205 --decision-seeds benchmarks/decision_seeds.json --out /tmp/choice.json
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

from results_file import write_results

ROOT = Path(__file__).resolve().parents[1]
MODEL = "src/refusion_hf/assets/default_model"
BASELINE = "benchmarks/models/ar_baseline"
SAME = "same"  # --baseline-model: AR decoding of the model's own weights
INSTALLED = "installed"  # --setting: the model's generation config as it is
# `refusion eval` flags this tool sets itself (after `--` they would override it without a word); the decoding
# knobs' flags are added from their declaration.
OWNED_FLAGS = ("--model", "--baseline-model", "--suite", "--seed", "--limit", "--num-threads", "--decision-seeds",
               "--json", "--decodings", "--preset")  # fmt: skip


def _knobs() -> dict:
    from refusion_hf.generation.refusion_generation_config import declared_knobs

    return {knob.name: knob for knob in declared_knobs(tunable=True)}


def knob_value(name: str, text: str):
    """A decoding knob's value from text, typed and ranged by its declaration."""
    knobs = _knobs()
    if name not in knobs:
        raise argparse.ArgumentTypeError(f"unknown decoding knob {name!r}; choose from {', '.join(knobs)}")
    knob = knobs[name]
    if knob.type is bool:
        if text.lower() not in ("true", "false"):
            raise argparse.ArgumentTypeError(f"{name}: expected true or false, got {text!r}")
        return text.lower() == "true"
    if knob.choices is not None:
        if text not in knob.choices:
            raise argparse.ArgumentTypeError(f"{name}: expected one of {', '.join(knob.choices)}, got {text!r}")
        return text
    from refusion_hf.command_inputs import knob_argument_type

    try:
        return knob_argument_type(knob)(text)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{name}: {error}") from None


def setting_argument(text: str) -> dict:
    """argparse type of --setting: `installed`, or KNOB=VALUE pairs, comma-separated."""
    if text.strip() == INSTALLED:
        return {}
    setting = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, equals, value = part.partition("=")
        if not equals:
            raise argparse.ArgumentTypeError(f"expected '{INSTALLED}' or KNOB=VALUE pairs, got {part!r}")
        if name in setting:
            raise argparse.ArgumentTypeError(f"{name} is set twice in {text!r}")
        setting[name] = knob_value(name, value)
    if not setting:
        raise argparse.ArgumentTypeError(f"expected '{INSTALLED}' or KNOB=VALUE pairs, got {text!r}")
    return setting


def grid_axis(text: str) -> tuple[str, list]:
    """argparse type of --grid: KNOB=V1,V2,..."""
    name, equals, values = text.partition("=")
    parsed = [knob_value(name.strip(), value.strip()) for value in values.split(",") if value.strip()] if equals else []
    if not parsed or len(set(parsed)) != len(parsed):
        raise argparse.ArgumentTypeError(f"expected KNOB=V1,V2,... with distinct values, got {text!r}")
    return name.strip(), parsed


def seeds_argument(text: str) -> list[int]:
    """argparse type: distinct comma-separated seeds."""
    from refusion_hf.command_inputs import seed

    seeds = [seed(part.strip()) for part in text.split(",") if part.strip()]
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated seeds, got {text!r}")
    return seeds


def suites_argument(text: str) -> list[str]:
    from refusion_hf.evaluation.tasks import SYNTHETIC_TIERS

    suites = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [suite for suite in suites if suite not in SYNTHETIC_TIERS]
    if not suites or unknown or len(set(suites)) != len(suites):
        raise argparse.ArgumentTypeError(f"expected distinct seeded suites from {', '.join(SYNTHETIC_TIERS)}")
    return suites


def setting_name(setting: dict) -> str:
    return ",".join(f"{name}={value}" for name, value in setting.items()) or INSTALLED


def grid(settings: list[dict], axes: list[tuple[str, list]]) -> list[dict]:
    """The explicit settings, then the product of the axes; `installed` alone when neither is given."""
    names = [name for name, _ in axes]
    if len(set(names)) != len(names):
        raise ValueError(f"--grid names a knob twice: {names}")
    product = [dict(zip(names, values)) for values in itertools.product(*(v for _, v in axes))] if axes else []
    combined = [*settings, *product] or [{}]
    seen = [sorted(s.items()) for s in combined]  # the same knobs in another order are the same setting
    repeated = sorted({setting_name(s) for s, key in zip(combined, seen) if seen.count(key) > 1})
    if repeated:
        raise ValueError(f"settings listed twice: {', '.join(repeated)}")
    return combined


def check_settings(model: str, settings: list[dict]) -> None:
    """Each setting over the model's generation config is a valid config (a block size that is a multiple of the
    slot size, ...): a ValueError naming the setting otherwise, before any evaluation runs."""
    from transformers import GenerationConfig

    from refusion_hf.generation.refusion_generation_config import RefusionGenerationConfig

    installed = RefusionGenerationConfig.from_generation_config(GenerationConfig.from_pretrained(model))
    for setting in settings:
        config = copy.deepcopy(installed)
        for name, value in setting.items():
            setattr(config, name, value)
        try:
            config.validate()
        except ValueError as error:
            raise ValueError(f"setting {setting_name(setting)}: {error}") from None


def knob_flags(setting: dict) -> list[str]:
    """`refusion eval`'s flags for a setting."""
    flags = []
    for name, value in setting.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def owned_flags() -> set[str]:
    knobs = {"--" + name.replace("_", "-") for name in _knobs()}
    return {*OWNED_FLAGS, *knobs, *("--no-" + flag[2:] for flag in knobs)}


def evaluate(arguments: list[str]) -> dict:
    """One `refusion eval` (in this process) with `arguments`: its full results."""
    from refusion_hf.cli import main as refusion_cli

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "results.json"
        code = refusion_cli(["eval", *arguments, "--json", str(out)])
        if code:
            raise SystemExit(f"refusion eval {' '.join(arguments)} failed with status {code}")
        return json.loads(out.read_text())


def side_by_side(args, suite: str, seed: int, setting: dict, checked: bool) -> tuple[dict, dict]:
    """One run: ReFusion decoding at `setting` beside the AR baseline on `seed`'s problems of `suite`. Returns the
    comparison row and the full eval results."""
    arguments = ["--model", args.model, "--suite", suite, "--seed", str(seed), "--limit", str(args.limit)]
    arguments += ["--num-threads", str(args.num_threads)]
    if args.baseline_model != SAME:
        arguments += ["--baseline-model", args.baseline_model]
    if checked and args.decision_seeds:
        arguments += ["--decision-seeds", args.decision_seeds]
    both = evaluate([*arguments, *knob_flags(setting), *args.eval_flags])
    refusion, baseline = both["refusion"], both["autoregressive"]
    row = {
        "suite": suite,
        "setting": setting_name(setting),
        "seed": seed,
        "refusion_accuracy": refusion["accuracy"],
        "baseline_accuracy": baseline["accuracy"],
        "points_behind": round(100 * (baseline["accuracy"] - refusion["accuracy"]), 2),
        "refusion_tokens_per_second": refusion["tokens_per_second"],
        "baseline_tokens_per_second": baseline["tokens_per_second"],
        "speedup": both["speedup"],
        "refusion_tokens_per_forward": refusion["tokens_per_forward"],
        "revised_tokens_per_answer": None
        if refusion.get("num_revised_tokens") is None
        else refusion["num_revised_tokens"] / refusion["num_sequences"],
        "refusion_decoding": both["settings"]["refusion_decoding"],
    }
    interval = both.get("accuracy_difference_interval")
    if interval:  # the paired 95% interval on ReFusion's accuracy minus the baseline's, in points
        row["difference_interval_points"] = [round(100 * interval["low"], 2), round(100 * interval["high"], 2)]
        row["num_problems"] = interval["num_problems"]
    row["meets_targets"] = row["points_behind"] <= args.target_points and row["speedup"] >= args.target_ratio
    return row, both


def summarize(rows: list[dict]) -> dict:
    """One setting's runs over a group of seeds: mean accuracies and points behind, speed ratios (min and median),
    tokens per forward."""
    return {
        "seeds": [r["seed"] for r in rows],
        "mean_accuracy": round(statistics.fmean(r["refusion_accuracy"] for r in rows), 9),  # no float-noise ties
        "mean_baseline_accuracy": statistics.fmean(r["baseline_accuracy"] for r in rows),
        "mean_points_behind": round(statistics.fmean(r["points_behind"] for r in rows), 2),
        "min_speedup": min(r["speedup"] for r in rows),
        "median_speedup": statistics.median(r["speedup"] for r in rows),
        "mean_tokens_per_forward": statistics.fmean(r["refusion_tokens_per_forward"] for r in rows),
        "seeds_meeting_targets": sum(r["meets_targets"] for r in rows),
    }


def meets(summary: dict, points: float, ratio: float) -> bool:
    return summary["mean_points_behind"] <= points and summary["min_speedup"] >= ratio


def choose(summaries: dict[str, dict], ratio: float) -> str | None:
    """The most accurate setting at >= `ratio` times the baseline's tokens/s on every seed (ties: the higher median
    ratio); None if none is that fast."""
    fast = {name: s for name, s in summaries.items() if s["min_speedup"] >= ratio}
    return max(fast, key=lambda name: (fast[name]["mean_accuracy"], fast[name]["median_speedup"])) if fast else None


def frontier(summaries: dict[str, dict]) -> list[str]:
    """The settings no other is both nearer the baseline (mean points behind) and faster (min ratio) than, fastest
    first."""

    def dominated(s: dict) -> bool:
        return any(
            o["mean_points_behind"] <= s["mean_points_behind"]
            and o["min_speedup"] >= s["min_speedup"]
            and (o["mean_points_behind"], o["min_speedup"]) != (s["mean_points_behind"], s["min_speedup"])
            for o in summaries.values()
        )

    kept = [name for name, s in summaries.items() if not dominated(s)]
    return sorted(kept, key=lambda name: -summaries[name]["min_speedup"])


def build_parser() -> argparse.ArgumentParser:
    from refusion_hf.command_inputs import positive_int

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", default=MODEL, help=f"the ReFusion model (default {MODEL})")
    parser.add_argument(
        "--baseline-model",
        default=BASELINE,
        help=f"the AR baseline (default {BASELINE}); '{SAME}': AR decoding of --model",
    )
    parser.add_argument(
        "--suite",
        type=suites_argument,
        default=["synthetic"],
        help="seeded suites, comma-separated: synthetic, synthetic-hard (default synthetic)",
    )
    parser.add_argument("--seeds", type=seeds_argument, required=True, help="the seeds every run reports on")
    parser.add_argument(
        "--choose-on",
        type=seeds_argument,
        default=[],
        help="seeds to choose a setting of the grid on (then judged on --seeds)",
    )
    parser.add_argument(
        "--decision-seeds",
        default=None,
        metavar="FILE",
        help="refuse --seeds it lists and --choose-on seeds it does not; keep full eval results",
    )
    parser.add_argument(
        "--setting",
        type=setting_argument,
        action="append",
        default=[],
        help=f"'{INSTALLED}' or KNOB=VALUE,... over the model's generation config (repeatable)",
    )
    parser.add_argument(
        "--grid",
        type=grid_axis,
        action="append",
        default=[],
        help="KNOB=V1,V2,...: an axis; the product of the axes is added (repeatable)",
    )
    parser.add_argument("--limit", type=positive_int, default=60, help="problems per seed (default 60)")
    parser.add_argument("--num-threads", type=positive_int, default=2)
    parser.add_argument("--target-points", type=float, default=3.0, help="the goal: at most this many points behind")
    parser.add_argument("--target-ratio", type=float, default=2.0, help="the goal: at least this speed ratio")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "accuracy_speed.json"))
    return parser


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[dict]]:
    """The arguments and the grid's settings, every refusal made here, before any evaluation runs."""
    parser = build_parser()
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])  # before `--`: this tool's flags only
    args.eval_flags = argv[split + 1 :]
    taken = sorted({flag.split("=")[0] for flag in args.eval_flags} & owned_flags())
    if taken:
        parser.error(f"{', '.join(taken)} after --: this tool sets it (use its own flags, --setting or --grid)")
    try:
        settings = grid(args.setting, args.grid)
        check_settings(args.model, settings)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if set(args.choose_on) & set(args.seeds):
        parser.error(f"seeds {sorted(set(args.choose_on) & set(args.seeds))} are in both --choose-on and --seeds")
    if args.decision_seeds:
        from refusion_hf.evaluation.decision_seeds import read_decision_seeds

        try:
            listed = read_decision_seeds(args.decision_seeds)
        except ValueError as error:
            parser.error(str(error))
        if set(args.seeds) & listed:
            parser.error(f"--seeds {sorted(set(args.seeds) & listed)}: listed in {args.decision_seeds} (they "
                         "informed a choice); report on seeds it does not list")  # fmt: skip
        if set(args.choose_on) - listed:
            parser.error(f"--choose-on {sorted(set(args.choose_on) - listed)}: not listed in {args.decision_seeds}; "
                         "list a seed there before choosing on it")  # fmt: skip
    return args, settings


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args, settings = parse(argv)
    rows, evaluations = [], []

    def run_group(group: str, seeds: list[int], chosen_from: list[dict]) -> dict:
        summary: dict = {}
        for suite in args.suite:
            for setting in chosen_from:
                measured = []
                for seed in seeds:
                    row, both = side_by_side(args, suite, seed, setting, checked=group == "reported")
                    rows.append({"group": group, **row})
                    measured.append(row)
                    if group == "reported" and args.decision_seeds:
                        evaluations.append(both)
                    print(json.dumps({k: row[k] for k in ("suite", "setting", "seed", "points_behind", "speedup")}),
                          file=sys.stderr)  # fmt: skip
                summary.setdefault(suite, {})[setting_name(setting)] = summarize(measured)
        return summary

    def pooled() -> dict[str, dict]:
        """Each setting's choice runs over every suite as one group (the choice is made over all of them)."""
        names = [setting_name(s) for s in settings]
        return {name: summarize([r for r in rows if r["group"] == "choice" and r["setting"] == name]) for name in names}

    results: dict = {}
    if args.choose_on:
        choice_summary = run_group("choice", args.choose_on, settings)
        chosen = choose(pooled(), args.target_ratio)
        chosen_setting = next((s for s in settings if setting_name(s) == chosen), None)
        reported = run_group("reported", args.seeds, [chosen_setting]) if chosen_setting is not None else {}
        verdict = [s for per_suite in reported.values() for s in per_suite.values()]
        results["choice"] = {
            "setting": chosen,
            "knobs": chosen_setting,
            "meets_targets_on_choice_seeds": chosen is not None
            and meets(pooled()[chosen], args.target_points, args.target_ratio),
            "goal_met": bool(verdict) and all(meets(s, args.target_points, args.target_ratio) for s in verdict),
        }
        results["summary"] = {"choice": choice_summary, "reported": reported}
        results["frontier"] = {suite: frontier(by) for suite, by in choice_summary.items()}
    else:
        reported = run_group("reported", args.seeds, settings)
        results["summary"] = {"reported": reported}
        results["frontier"] = {suite: frontier(by) for suite, by in reported.items()}
    write_results(
        {
            "model": args.model,
            "baseline_model": args.baseline_model,
            "targets": {"points_behind_at_most": args.target_points, "speedup_at_least": args.target_ratio},
            "suites": args.suite,
            "settings": {setting_name(s): s for s in settings},
            "limit": args.limit,
            "eval_flags": args.eval_flags,
            **results,
            "seeds": rows,  # one row per run: a seed of a suite at a setting
            **({"evaluations": evaluations} if args.decision_seeds else {}),
        },
        args.out,
        argv=[__file__, *argv],
    )


if __name__ == "__main__":
    main()
