"""Whole `generate()` of this checkout against a baseline commit's, in fresh processes alternating: the A/B for any
change to generation (preparation, decoder, draft policy, output), each side importing only its own package.

The baseline's `src/` is extracted with `git archive` into a temporary folder; `generate_ab_worker.py` runs once per
side, round and dtype as a fresh `python` process with `PYTHONPATH` pointing at that side's `src/` (each worker
reports the `refusion_hf.__file__` it imported, checked here and written to the JSON). A worker loads the embedded
model with its side's own class (`--weights current`, the default: this checkout's weights on both sides, since the
decoders compare only on the same weights and the embedded model was retrained after some baselines; `own`: each
side its own commit's), warms up, times `--repeats` passes of `generate()` over `--prompts` synthetic prompts per
batch size (each batch by its fastest call) and the per-call setup around the decoding loop's forwards. Which side
runs first alternates from round to round; per batch size, each batch's fastest call in any round counts (the sum of
those is `seconds_each_batch_at_its_best`; the best round's total is reported too). Tokens and forward passes must
be identical on both sides in every round (else it exits with status 1). Reports the current wall time over the
baseline's (below 1: this checkout is faster) against the goals of issue 28 (at most 0.95 at batch 1, 1.02 at batch
4 and 16), and both sides' per-call setup in milliseconds: around the forwards (everything before the first and
after the last) and, apart from the decoder's, `generate()`'s own before and after its decoding loop.

    nice -n 0 .venv/bin/python benchmarks/generate_ab.py --baseline e2b8e4c --out benchmarks/results/generate_ab.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from results_file import write_results

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().with_name("generate_ab_worker.py")
CURRENT_WEIGHTS = ROOT / "src" / "refusion_hf" / "assets" / "default_model"  # this checkout's embedded model
GOALS = {1: 0.95, 4: 1.02, 16: 1.02}  # issue 28: current wall time over the baseline's, at most
SIDES = ("baseline", "current")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def generate_kwargs(text: str) -> dict:
    """An argparse type: a JSON object of keyword arguments for `generate()` (e.g. '{"remask_threshold": null}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object of generate() keyword arguments")
    return value


def run_config(text: str) -> tuple[str, str]:
    """An argparse type: `DTYPE:B1,B2,...`, e.g. `bfloat16:1,4,16`."""
    dtype, _, sizes = text.partition(":")
    if dtype not in ("bfloat16", "float32", "float16") or not sizes:
        raise argparse.ArgumentTypeError(f"{text!r} is not DTYPE:BATCH_SIZES (e.g. bfloat16:1,4,16)")
    return dtype, ",".join(str(positive_int(size)) for size in sizes.split(","))


def extract_baseline(commit: str, folder: Path) -> Path:
    """The baseline's `src/` (git archive of `commit`) under `folder`."""
    archive = subprocess.run(["git", "archive", "--format=tar", commit, "src"], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        reason = (archive.stderr.decode().strip().splitlines() or ["git archive failed"])[0]
        raise SystemExit(f"--baseline {commit}: {reason}")
    archive_path = folder / "baseline.tar"
    archive_path.write_bytes(archive.stdout)
    with tarfile.open(archive_path) as tar:
        tar.extractall(folder / "baseline", filter="data")
    return folder / "baseline" / "src"


def run_worker(src: Path, dtype: str, batch_sizes: str, args) -> dict:
    command = [sys.executable, str(WORKER), "--dtype", dtype, "--batch-sizes", batch_sizes, "--prompts",
               str(args.prompts), "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
               "--threads", str(args.threads), "--generate-kwargs", json.dumps(args.generate_kwargs)]  # fmt: skip
    if args.weights == "current":
        command += ["--model-path", str(CURRENT_WEIGHTS)]
    env = {**os.environ, "PYTHONPATH": str(src)}
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"the worker on {src} failed:\n{completed.stderr[-3000:]}")
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    if not Path(result["package"]).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"the worker meant for {src} imported refusion_hf from {result['package']}")
    return result


def tokens_digest(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps([row["tokens"] for row in rows]).encode()).hexdigest()[:16]


def git(*arguments: str) -> str:
    return subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def comparison_arguments(description: str, out_name: str, repeats: int, repeats_help: str) -> argparse.ArgumentParser:
    """The arguments of an A/B against a baseline commit (this script's and `generate_ab_interleaved.py`'s)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a commit (anything `git archive` takes)")
    parser.add_argument(
        "--runs", type=run_config, nargs="+", default=[("bfloat16", "1,4,16"), ("float32", "1")],
        help="DTYPE:BATCH_SIZES (default: bfloat16:1,4,16 float32:1)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=positive_int, default=repeats, help=repeats_help)
    parser.add_argument("--prompts", type=positive_int, default=32)
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument(
        "--generate-kwargs", type=generate_kwargs, default={},
        help="a JSON object of keyword arguments both sides' generate() calls get, e.g. a decoding both sides know "
        "(the embedded model's own generation config otherwise)",
    )  # fmt: skip
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / out_name))
    return parser


def main() -> None:
    parser = comparison_arguments(__doc__, "generate_ab.json", 3, "timed passes per worker (after a warm-up)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="fresh workers per side and DTYPE:BATCH_SIZES")
    parser.add_argument(
        "--weights", choices=("current", "own"), default="current",
        help="the embedded model both sides decode: this checkout's, or each side its own commit's",
    )  # fmt: skip
    args = parser.parse_args()
    load_before, head_before = os.getloadavg(), git("rev-parse", "--short", "HEAD")
    with tempfile.TemporaryDirectory() as folder:
        sources = {"baseline": extract_baseline(args.baseline, Path(folder)), "current": ROOT / "src"}
        results = {}  # (dtype, batch size) -> side -> list of the rounds' rows
        packages, models = {}, {}  # side -> the package it imported, the model folder it loaded
        for round_index in range(args.rounds):
            for run_index, (dtype, batch_sizes) in enumerate(args.runs):
                order = SIDES if (round_index + run_index) % 2 == 0 else SIDES[::-1]
                for side in order:
                    result = run_worker(sources[side], dtype, batch_sizes, args)
                    packages[side], models[side] = result["package"], result["model_path"]
                    for row in result["rows"]:
                        results.setdefault((dtype, row["batch_size"]), {}).setdefault(side, []).append(row)
                    print(f"round {round_index + 1} {dtype} {side}: "
                          + ", ".join(f"B{row['batch_size']} {row['seconds']:.3f} s" for row in result["rows"]),
                          file=sys.stderr)  # fmt: skip
    rows = []
    for (dtype, batch_size), sides in results.items():
        reference = sides["baseline"][0]
        for side, rounds in sides.items():
            for row in rounds:
                if row["tokens"] != reference["tokens"] or row["forward_passes"] != reference["forward_passes"]:
                    raise SystemExit(
                        f"{dtype} batch {batch_size}: {side}'s tokens or forward passes differ from the baseline's"
                    )
        best = {side: min(row["seconds"] for row in rounds) for side, rounds in sides.items()}
        # Each batch by its fastest call in any round (a burst of other load slows some batches of one round):
        per_batch = {
            side: sum(map(min, zip(*(row["batch_seconds"] for row in rounds)))) for side, rounds in sides.items()
        }
        ratio = per_batch["current"] / per_batch["baseline"]
        goal = GOALS.get(batch_size)
        rows.append(
            {
                "dtype": dtype,
                "batch_size": batch_size,
                "seconds_each_batch_at_its_best": per_batch,
                "seconds_best_of_rounds": best,
                "seconds_every_round": {side: [row["seconds"] for row in rounds] for side, rounds in sides.items()},
                "current_over_baseline_wall_time": ratio,
                "goal_at_most": goal,
                "meets_goal": None if goal is None else ratio <= goal,
                "setup_ms_per_call_best_of_rounds": {
                    side: {
                        part: min(row["setup_ms_per_call"][part] for row in rounds)
                        for part in ("before_first_forward", "after_last_forward")
                    }
                    for side, rounds in sides.items()
                },
                "generate_setup_ms_per_call_best_of_rounds": {
                    side: {
                        part: min(row["generate_setup_ms_per_call"][part] for row in rounds)
                        for part in ("before_decode_batch", "after_decode_batch")
                        if all(row.get("generate_setup_ms_per_call", {}).get(part) is not None for row in rounds)
                    }
                    for side, rounds in sides.items()
                },
                "forward_passes": reference["forward_passes"],
                "same_tokens_and_forward_passes": True,
                "tokens_sha256": tokens_digest([reference]),
            }
        )
    write_results(
        {
            "baseline": args.baseline,
            "current": head_before,
            "current_head_at_the_end": git("rev-parse", "--short", "HEAD"),
            "current_src_has_uncommitted_changes": bool(git("status", "--porcelain", "--", "src")),
            "packages": packages,
            "torch_threads": args.threads,
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "repeats_per_worker": args.repeats,
            "generate_kwargs": args.generate_kwargs,
            "rounds": args.rounds,
            "weights": args.weights,
            "model_paths": models,
            "load_average_before_after": [load_before[0], os.getloadavg()[0]],
            "rows": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
