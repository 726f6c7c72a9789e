"""Decoder measurements, side by side in one process; writes JSON.

1. Forward passes against the authors' decoder on the public oracle cases (float64, greedy): ours / theirs,
   with and without planning ahead.
2. Planning ahead on / off on the embedded default model over synthetic test problems: forward passes and wall
   time (identical tokens checked), interleaved per problem.

    .venv/bin/python benchmarks/decoder_speed.py --out benchmarks/results/decoder_speed.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from oracle_cases import FIXTURE, generate_kwargs, load_cases
from results_file import write_results

from refusion_hf import RefusionForCausalLM

ROOT = Path(__file__).resolve().parents[1]


def plan_ahead_on_embedded_model(rounds: int, limit: int = 60, seed: int = 2026) -> dict:
    """The embedded model with its own decoding defaults, on synthetic test problems (arithmetic + listing),
    batch 1: planning ahead on / off, interleaved per problem; rounds repeat the whole set. In float32, where both
    give identical tokens exactly (in its stored bfloat16 the differently shaped forwards round differently and
    can flip a near-tie)."""
    from transformers import AutoTokenizer

    from refusion_hf.evaluation.synthetic_tasks import generate_problems
    from refusion_hf.modeling.loading import default_model_path, prompt_ids

    path = default_model_path()
    model = RefusionForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    problems = generate_problems("test", limit, seed, families=["arithmetic", "listing"])
    prompts = [torch.tensor([prompt_ids(tokenizer, problem.prompt)]) for problem in problems]
    seconds = {True: [], False: []}
    passes = {True: 0, False: 0}
    ratios = []
    for round_index in range(rounds + 1):  # round 0 warms up
        totals = {True: 0.0, False: 0.0}
        for index, ids in enumerate(prompts):
            outputs = {}
            order = (True, False) if index % 2 == 0 else (False, True)
            for plan_ahead in order:
                start = time.perf_counter()
                out = model.generate(ids, return_dict_in_generate=True, plan_ahead=plan_ahead)
                totals[plan_ahead] += time.perf_counter() - start
                outputs[plan_ahead] = out
                if round_index == 1:
                    passes[plan_ahead] += out.num_forward_passes
            assert torch.equal(outputs[True].sequences, outputs[False].sequences), "planning ahead changed tokens"
        if round_index > 0:
            for plan_ahead in (True, False):
                seconds[plan_ahead].append(totals[plan_ahead])
            ratios.append(totals[False] / totals[True])
    return {
        "problems": limit,
        "seed": seed,
        "dtype": "float32",
        "forward_passes_plan_ahead": passes[True],
        "forward_passes_without": passes[False],
        "forward_ratio_without_over_plan_ahead": passes[False] / passes[True],
        "median_seconds_plan_ahead": statistics.median(seconds[True]),
        "median_seconds_without": statistics.median(seconds[False]),
        "median_time_ratio_without_over_plan_ahead": statistics.median(ratios),
    }


def forward_pass_ratio(model64, plan_ahead: bool) -> dict:
    ours, theirs, per_case = 0, 0, []
    for case in load_cases():
        ids = torch.tensor([case["prompt_ids"]])
        out = model64.generate(ids, return_dict_in_generate=True, plan_ahead=plan_ahead, **generate_kwargs(case))
        ours += out.num_forward_passes
        theirs += case["forward_calls"]
        per_case.append((case["id"], out.num_forward_passes, case["forward_calls"]))
    return {
        "plan_ahead": plan_ahead,
        "cases": len(per_case),
        "total_ours": ours,
        "total_authors": theirs,
        "ratio_total": ours / theirs,
        "cases_fewer": sum(a < b for _, a, b in per_case),
        "cases_equal": sum(a == b for _, a, b in per_case),
        "cases_more": [c for c in per_case if c[1] > c[2]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decoder_speed.json"))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    results: dict = {"torch_threads": torch.get_num_threads()}

    model64 = RefusionForCausalLM.from_pretrained(FIXTURE, dtype=torch.float64).eval()
    results["forward_passes_vs_authors"] = [forward_pass_ratio(model64, plan_ahead) for plan_ahead in (False, True)]

    results["plan_ahead_embedded_model"] = plan_ahead_on_embedded_model(args.rounds)

    write_results(results, args.out)


if __name__ == "__main__":
    main()
