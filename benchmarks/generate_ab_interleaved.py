"""ReFusion `generate()` of this checkout's decoder against a baseline commit's, in ONE process, call by call: the
A/B for a decoder change when the machine's speed drifts faster than `generate_ab.py`'s fresh processes alternate.

Both sides' `refusion_hf/generation/` (the baseline's by `git archive`, this checkout's from `src/`) are imported
side by side as two packages under other names (the decoder's modules import only torch, transformers and each
other: they are the remote-code bundle). One model (the embedded model, loaded by this checkout, in `--dtype`)
serves both, so the model class and its forward are the same on both sides and only the generation code differs
(`generate_ab.py` also runs each side's model class). Each batch is decoded by both sides back to back, which
one first alternating, `--repeats` times after a warm-up, each side through its own `refusion_generate(model,
...)` (what `model.generate()` calls) under `torch.no_grad()`; a batch counts at its fastest call. Tokens and
forward passes must be identical (else it exits with status 1). Reports current over baseline wall time against
issue 28's goals (at most 0.95 at batch 1, 1.02 at batch 4 and 16).

`--model overhead` swaps the embedded model for a random one of its architecture and vocabulary shrunk until a
forward is mostly Python (`OVERHEAD_SHAPE`: 2 layers, 32 wide; seeded, built by this checkout): the decoder's own
Python per call and per forward then makes up most of the wall time instead of a small share of it, so a difference
in it shows above the machine's drift. Random weights accept no draft beyond each round's first token: many small
forwards per call, a workload unlike the embedded model's (its ratios say where the decoders' Python differs, not
what a user's call costs).

    nice -n 0 .venv/bin/python benchmarks/generate_ab_interleaved.py --baseline e2b8e4c \\
        --out benchmarks/results/generate_ab_interleaved.json
"""

from __future__ import annotations

import importlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from generate_ab import GOALS, comparison_arguments, extract_baseline, git, tokens_digest
from generate_ab_worker import left_pad
from results_file import write_results

from refusion_hf.evaluation.synthetic_tasks import generate_problems
from refusion_hf.modeling.loading import default_model_path, load_model_and_tokenizer, prompt_ids

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("baseline", "current")
NOT_DECODER = ("__init__.py", "cli.py", "trace_view.py")  # the package's CLI glue, not the bundle


def generation_package(name: str, source: Path, folder: Path):
    """`source` (a `refusion_hf/generation/` folder) imported as `name.generation`, beside a copy of its sibling
    `_compat/` (the seams to other libraries' private names, since issue 40) as `name._compat` when it has one."""
    top = folder / name
    package = top / "generation"
    package.mkdir(parents=True)
    (top / "__init__.py").write_text("")
    for module in source.glob("*.py"):
        if module.name not in NOT_DECODER:
            shutil.copy(module, package / module.name)
    (package / "__init__.py").write_text("")
    seams = source.parent / "_compat"
    if seams.is_dir():
        shutil.copytree(seams, top / "_compat", ignore=shutil.ignore_patterns("__pycache__"))
    return importlib.import_module(f"{name}.generation.refusion_generate")


# The embedded model's architecture and vocabulary at a size where a forward is mostly Python (`--model overhead`)
OVERHEAD_SHAPE = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "head_dim": 16}


def overhead_bound_model(embedded):
    """A random model of `embedded`'s class, config and generation config, in its dtype, shrunk to
    `OVERHEAD_SHAPE` (seeded: the same weights on every run)."""
    config = type(embedded.config)(**{**embedded.config.to_dict(), **OVERHEAD_SHAPE, "layer_types": None})
    torch.manual_seed(0)
    model = type(embedded)(config).to(embedded.dtype).eval()
    model.generation_config = embedded.generation_config
    return model


def main() -> None:
    parser = comparison_arguments(__doc__, "generate_ab_interleaved.json", 6, "timed calls per side and batch")
    parser.add_argument(
        "--model", choices=("embedded", "overhead"), default="embedded",
        help="the embedded model, or a random one of its architecture small enough that a forward is mostly Python",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    head = git("rev-parse", "--short", "HEAD")
    rows = []
    forwards = [0]  # model forwards of the current call

    def count_forward(module, inputs) -> None:
        forwards[0] += 1

    with tempfile.TemporaryDirectory() as folder:
        sys.path.insert(0, folder)
        generate = {
            "baseline": generation_package("ab_baseline_generation",
                                           extract_baseline(args.baseline, Path(folder)) / "refusion_hf" / "generation",
                                           Path(folder)).refusion_generate,
            "current": generation_package("ab_current_generation", ROOT / "src" / "refusion_hf" / "generation",
                                          Path(folder)).refusion_generate,
        }  # fmt: skip
        for dtype, batch_sizes in args.runs:
            model, tokenizer = load_model_and_tokenizer(str(default_model_path()), dtype=dtype)
            if args.model == "overhead":
                model = overhead_bound_model(model)
            model.register_forward_pre_hook(count_forward)
            problems = generate_problems("test", args.prompts, 0, families=["arithmetic", "listing"])
            prompts = [prompt_ids(tokenizer, problem.prompt) for problem in problems]
            pad = model.generation_config.pad_token_id or 0
            for batch_size in [int(size) for size in batch_sizes.split(",")]:
                batches = [left_pad(prompts[i : i + batch_size], pad) for i in range(0, len(prompts), batch_size)]
                best = {side: [float("inf")] * len(batches) for side in SIDES}
                seen = {side: [] for side in SIDES}  # warm-up: tokens and forward passes per batch
                for run in range(1 + args.repeats):
                    for index, (ids, mask) in enumerate(batches):
                        for side in SIDES if (run + index) % 2 == 0 else SIDES[::-1]:
                            forwards[0] = 0
                            start = time.perf_counter()
                            with torch.no_grad():
                                output = generate[side](
                                    model, ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                    **args.generate_kwargs,
                                )  # fmt: skip
                            seconds = time.perf_counter() - start
                            if run == 0:
                                seen[side].append((output.tolist(), forwards[0]))
                            else:
                                best[side][index] = min(best[side][index], seconds)
                if seen["current"] != seen["baseline"]:
                    raise SystemExit(f"{dtype} batch {batch_size}: tokens or forward passes differ from the baseline's")
                seconds = {side: sum(best[side]) for side in SIDES}
                ratio = seconds["current"] / seconds["baseline"]
                goal = GOALS.get(batch_size)
                rows.append(
                    {
                        "dtype": dtype,
                        "batch_size": batch_size,
                        "seconds_each_batch_at_its_best": seconds,
                        "current_over_baseline_wall_time": ratio,
                        "goal_at_most": goal,
                        "meets_goal": None if goal is None else ratio <= goal,
                        "forward_passes": sum(count for _, count in seen["current"]),
                        "model_parameters": sum(parameter.numel() for parameter in model.parameters()),
                        "same_tokens_and_forward_passes": True,
                        "tokens_sha256": tokens_digest([{"tokens": [tokens for tokens, _ in seen["current"]]}]),
                    }
                )
                print(f"{dtype} batch {batch_size}: {ratio:.3f}", file=sys.stderr)
    write_results(
        {
            "baseline": args.baseline,
            "current": head,
            "current_src_has_uncommitted_changes": bool(git("status", "--porcelain", "--", "src")),
            "model": "embedded" if args.model == "embedded" else {"shape": OVERHEAD_SHAPE, "weights": "random, seed 0"},
            "torch_threads": args.threads,
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "generate_kwargs": args.generate_kwargs,
            "rows": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
