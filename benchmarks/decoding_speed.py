"""Decoding speed against a baseline, side by side in one run (ratios, not absolute times): `--baseline` is

- a commit (anything `git archive` takes): this checkout's whole `generate()` against that commit's, each side in
  fresh processes importing only its own package (`git archive` of its `src/`, `PYTHONPATH`), alternating which side
  runs first from round to round. Both load this checkout's embedded model with their own class (`--weights own`:
  each side its own commit's). Tokens and forward passes must be identical on both sides (else exit status 1);
  reported: current over baseline wall time (each batch at its fastest call in any round) against issue 28's goals
  (at most 0.95 at batch 1, 1.02 at batch 4 and 16), and each side's per-call setup around the forwards;
- `autoregressive`: the same harness, the baseline side this checkout's `generate()` with
  `decoding="autoregressive"` (stock transformers' greedy loop on the same weights): ReFusion's wall time over
  autoregressive decoding's for the same prompts and `--max-new-tokens`, per batch size, and both forward counts;
- `authors`: forward passes against the authors' decoder on its golden cases (tests/data/oracle_cases.jsonl, the
  tiny checkpoint they were made with, float64, greedy), with and without planning ahead: counts, not times.

    python benchmarks/decoding_speed.py --baseline 7247c5f --out benchmarks/results/decoding_speed_vs_7247c5f.json
    python benchmarks/decoding_speed.py --baseline autoregressive --out benchmarks/results/decoding_speed_vs_ar.json
    python benchmarks/decoding_speed.py --baseline authors --out benchmarks/results/forward_passes_vs_authors.json

Each side of a timed comparison is this file run with `--worker` (its flags: `--dtype`, `--batch-sizes`,
`--prompts`, `--max-new-tokens`, `--repeats`, `--threads`, `--generate-kwargs`, `--model-path`): the embedded model
in `--dtype`, the synthetic test prompts through the chat template, left-padded into batches; per batch size one
warm-up pass, then `--repeats` passes, each batch timed by its fastest call; forward hooks time the setup before the
first forward and after the last, and, around `refusion_generate.decode_batch`, `generate()`'s own setup.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from results_file import write_results

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
CURRENT_WEIGHTS = ROOT / "src" / "refusion_hf" / "assets" / "default_model"  # this checkout's embedded model
ORACLE_DATA = ROOT / "tests" / "data"  # the authors' golden cases and the tiny checkpoint they were made with
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
    # the "data" extraction filter where this Python has it (3.11.4 and later; Debian 12's python3 is 3.11.2)
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(archive_path) as tar:
        tar.extractall(folder / "baseline", **safe)
    return folder / "baseline" / "src"


def run_worker(src: Path, dtype: str, batch_sizes: str, args, extra_kwargs: dict) -> dict:
    kwargs = json.dumps({**args.generate_kwargs, **extra_kwargs})
    command = [sys.executable, str(THIS), "--worker", "--dtype", dtype, "--batch-sizes", batch_sizes, "--prompts",
               str(args.prompts), "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
               "--threads", str(args.threads), "--generate-kwargs", kwargs]  # fmt: skip
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


class CallClock:
    """Forward pre- and post-hooks on the model: the start of the first forward and the end of the last one of a
    call, and the number of forwards. Where `refusion_generate` calls a module-level `decode_batch` (every version
    so far), also when the decoding loop is entered and left: `generate()`'s own setup, apart from the decoder's."""

    def __init__(self, model):
        self.reset()
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)
        self.module = importlib.import_module("refusion_hf.generation.refusion_generate")
        decode_batch = getattr(self.module, "decode_batch", None)
        if decode_batch is not None:

            def timed(*args, **kwargs):
                self.decode_start = time.perf_counter()
                result = decode_batch(*args, **kwargs)
                self.decode_end = time.perf_counter()
                return result

            self.module.decode_batch = timed

    def reset(self) -> None:
        self.first_start = self.last_end = self.decode_start = self.decode_end = None
        self.forwards = 0

    def _pre(self, module, args):
        if self.first_start is None:
            self.first_start = time.perf_counter()
        self.forwards += 1

    def _post(self, module, args, output):
        self.last_end = time.perf_counter()


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    return ids, mask


def worker(argv: list[str]) -> None:
    """One side of a `--baseline COMMIT` / `autoregressive` comparison, in its own process: times whole
    `model.generate()` calls of whichever `refusion_hf` this process imports (`PYTHONPATH` decides: the checkout's
    `src/` or a baseline commit's) and prints JSON to stdout. Only the package's public API is used (loading,
    synthetic tasks, `generate()`), so any commit of it runs."""
    import refusion_hf
    from refusion_hf.evaluation.synthetic_tasks import generate_problems
    from refusion_hf.modeling.loading import default_model_path, load_model_and_tokenizer, prompt_ids

    parser = argparse.ArgumentParser(prog="decoding_speed.py --worker")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,4,16", help="comma-separated")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--generate-kwargs", type=generate_kwargs, default={}, help="a JSON object, for generate()")
    parser.add_argument("--model-path", help="a model folder (default: the imported package's embedded model)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path = args.model_path or str(default_model_path())
    model, tokenizer = load_model_and_tokenizer(model_path, dtype=args.dtype)
    problems = generate_problems("test", args.prompts, 0, families=["arithmetic", "listing"])
    prompts = [prompt_ids(tokenizer, problem.prompt) for problem in problems]
    pad = model.generation_config.pad_token_id or 0
    clock = CallClock(model)
    rows = []
    for batch_size in [int(part) for part in args.batch_sizes.split(",")]:
        batches = [left_pad(prompts[i : i + batch_size], pad) for i in range(0, len(prompts), batch_size)]
        best = [float("inf")] * len(batches)
        before, after, tokens, forwards = [], [], [], []
        own_before, own_after = [], []  # generate() before / after its decoding loop
        for run in range(1 + args.repeats):  # run 0 warms up
            for index, (ids, mask) in enumerate(batches):
                clock.reset()
                start = time.perf_counter()
                output = model.generate(
                    ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, **args.generate_kwargs
                )
                end = time.perf_counter()
                if run == 0:
                    tokens.append(output.tolist())
                    forwards.append(clock.forwards)
                    continue
                if output.tolist() != tokens[index] or clock.forwards != forwards[index]:
                    raise SystemExit(f"batch {index} at batch size {batch_size}: a repeat decoded differently")
                best[index] = min(best[index], end - start)
                before.append(clock.first_start - start)
                after.append(end - clock.last_end)
                if clock.decode_start is not None:
                    own_before.append(clock.decode_start - start)
                    own_after.append(end - clock.decode_end)
        rows.append(
            {
                "batch_size": batch_size,
                "seconds": sum(best),
                "batch_seconds": best,
                "setup_ms_per_call": {
                    "before_first_forward": 1000 * statistics.median(before),
                    "after_last_forward": 1000 * statistics.median(after),
                },
                "generate_setup_ms_per_call": {
                    "before_decode_batch": 1000 * statistics.median(own_before) if own_before else None,
                    "after_decode_batch": 1000 * statistics.median(own_after) if own_after else None,
                },
                "forward_passes": sum(forwards),
                "tokens": tokens,
            }
        )
    print(json.dumps({"package": refusion_hf.__file__, "model_path": model_path, "dtype": args.dtype, "rows": rows}))


def against_generate(args) -> None:
    """`--baseline COMMIT` or `autoregressive`: whole `generate()` calls, fresh worker processes alternating."""
    load_before, head_before = os.getloadavg(), git("rev-parse", "--short", "HEAD")
    autoregressive = args.baseline == "autoregressive"
    side_kwargs = {"baseline": {"decoding": "autoregressive"} if autoregressive else {}, "current": {}}
    with tempfile.TemporaryDirectory() as folder:
        baseline_src = ROOT / "src" if autoregressive else extract_baseline(args.baseline, Path(folder))
        sources = {"baseline": baseline_src, "current": ROOT / "src"}
        results = {}  # (dtype, batch size) -> side -> list of the rounds' rows
        packages, models = {}, {}  # side -> the package it imported, the model folder it loaded
        for round_index in range(args.rounds):
            for run_index, (dtype, batch_sizes) in enumerate(args.runs):
                order = SIDES if (round_index + run_index) % 2 == 0 else SIDES[::-1]
                for side in order:
                    result = run_worker(sources[side], dtype, batch_sizes, args, side_kwargs[side])
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
                if autoregressive and side == "current":  # another decoding: its own tokens, its own forwards
                    if row["tokens"] != sides["current"][0]["tokens"]:
                        raise SystemExit(f"{dtype} batch {batch_size}: ReFusion decoded differently between rounds")
                elif row["tokens"] != reference["tokens"] or row["forward_passes"] != reference["forward_passes"]:
                    raise SystemExit(
                        f"{dtype} batch {batch_size}: {side}'s tokens or forward passes differ from the baseline's"
                    )
        best = {side: min(row["seconds"] for row in rounds) for side, rounds in sides.items()}
        # Each batch by its fastest call in any round (a burst of other load slows some batches of one round):
        per_batch = {
            side: sum(map(min, zip(*(row["batch_seconds"] for row in rounds)))) for side, rounds in sides.items()
        }
        ratio = per_batch["current"] / per_batch["baseline"]
        goal = None if autoregressive else GOALS.get(batch_size)
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
                "forward_passes": {side: rounds[0]["forward_passes"] for side, rounds in sides.items()},
                "same_tokens_and_forward_passes": not autoregressive,
                "tokens_sha256": {side: tokens_digest([rounds[0]]) for side, rounds in sides.items()},
            }
        )
    write_results(
        {
            "baseline": args.baseline,
            "baseline_generate_kwargs": side_kwargs["baseline"],
            "current": head_before,
            "current_head_at_the_end": git("rev-parse", "--short", "HEAD"),
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


def against_authors(args) -> None:
    """`--baseline authors`: our forward passes against the authors' decoder's on its golden cases."""
    from refusion_hf import RefusionForCausalLM

    cases = [json.loads(line) for line in (ORACLE_DATA / "oracle_cases.jsonl").read_text().splitlines() if line]
    cases = cases[: args.cases] if args.cases else cases
    model = RefusionForCausalLM.from_pretrained(ORACLE_DATA / "tiny-qwen3-refusion", dtype=torch.float64).eval()
    rows = []
    for plan_ahead in (False, True):
        per_case = []
        for case in cases:
            ids = torch.tensor([case["prompt_ids"]])
            knobs = dict(max_new_tokens=case["gen_length"], slot_size=case["slot_size"],
                         block_size=case["block_length"], slot_threshold=case["slot_threshold"],
                         token_threshold=case["token_threshold"])  # fmt: skip
            out = model.generate(ids, return_dict_in_generate=True, plan_ahead=plan_ahead, **knobs)
            per_case.append((case["id"], out.num_forward_passes, case["forward_calls"]))
        ours, theirs = sum(c[1] for c in per_case), sum(c[2] for c in per_case)
        rows.append(
            {
                "plan_ahead": plan_ahead,
                "cases": len(per_case),
                "forward_passes_ours": ours,
                "forward_passes_authors": theirs,
                "ours_over_authors": round(ours / theirs, 4),
                "cases_fewer": sum(a < b for _, a, b in per_case),
                "cases_equal": sum(a == b for _, a, b in per_case),
                "cases_more": [list(c) for c in per_case if c[1] > c[2]],
            }
        )
        print(f"plan_ahead={plan_ahead}: {ours} / {theirs} forward passes", file=sys.stderr)
    write_results({"baseline": "authors", "dtype": "float64", "rows": rows}, args.out)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a commit, `autoregressive` or `authors`")
    parser.add_argument(
        "--runs", type=run_config, nargs="+", default=[("bfloat16", "1,4,16"), ("float32", "1")],
        help="DTYPE:BATCH_SIZES (default: bfloat16:1,4,16 float32:1)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed passes per worker (after a warm-up)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="fresh workers per side and DTYPE:BATCH_SIZES")
    parser.add_argument("--prompts", type=positive_int, default=32)
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument(
        "--generate-kwargs", type=generate_kwargs, default={},
        help="a JSON object of keyword arguments both sides' generate() calls get, e.g. a decoding both sides know "
        "(the embedded model's own generation config otherwise)",
    )  # fmt: skip
    parser.add_argument(
        "--weights", choices=("current", "own"), default="current",
        help="the embedded model both sides decode: this checkout's, or each side its own commit's",
    )  # fmt: skip
    parser.add_argument("--cases", type=positive_int, help="--baseline authors: the first N golden cases (all: 300)")
    parser.add_argument("--out", required=True, help="the results JSON (benchmarks/results/NAME.json to commit it)")
    args = parser.parse_args()
    if args.baseline == "authors":
        return against_authors(args)
    if args.weights == "own" and args.baseline == "autoregressive":
        parser.error("--weights own: only against a commit")
    return against_generate(args)


if __name__ == "__main__":
    main()
