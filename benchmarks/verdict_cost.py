"""The cost of a code verdict: the previous sandbox.py (one process: runner, program, tests) against this one (a judge
process and the program's process, calls over a pipe), loaded side by side in one process and called alternately
(order flipped every pair), so drifting load hits both alike. Writes benchmarks/results/verdict_cost.json.

    git show 54d7d0c:src/refusion_hf/evaluation/sandbox.py > /tmp/sandbox_before.py
    .venv/bin/python benchmarks/verdict_cost.py --before /tmp/sandbox_before.py --pairs 40
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = "def add(a, b):\n    return a + b\n"
TESTS = {
    "1 call": "def check(candidate):\n    assert candidate(2, 3) == 5\ncheck(add)\n",
    "1000 calls": "def check(candidate):\n    for i in range(1000):\n        assert candidate(i, 3) == i + 3\n"
    "check(add)\n",
}


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the previous sandbox.py (standalone module)")
    parser.add_argument("--pairs", type=int, default=40)
    args = parser.parse_args()
    sides = {
        "before": load("sandbox_before", args.before),
        "after": load("sandbox_after", ROOT / "src" / "refusion_hf" / "evaluation" / "sandbox.py"),
    }
    for module in sides.values():
        module._sandbox()  # the one-time setup (filter, probe) is not a verdict's cost
    load_before = os.getloadavg()
    results = {}
    for case, tests in TESTS.items():
        seconds = {"before": [], "after": []}
        for pair in range(args.pairs):
            for side in ("before", "after") if pair % 2 else ("after", "before"):
                start = time.perf_counter()
                result = sides[side].run_program(PROGRAM, tests=tests, allow_code_execution=True, timeout=30)
                seconds[side].append(time.perf_counter() - start)
                assert result.passed, (side, result)
        paired = [after - before for after, before in zip(seconds["after"], seconds["before"])]
        results[case] = {
            "before_median_s": round(statistics.median(seconds["before"]), 4),
            "after_median_s": round(statistics.median(seconds["after"]), 4),
            "before_min_s": round(min(seconds["before"]), 4),
            "after_min_s": round(min(seconds["after"]), 4),
            "paired_difference_median_s": round(statistics.median(paired), 4),
        }
        print(case, results[case], flush=True)
    report = {
        "pairs": args.pairs,
        "cpus": os.cpu_count(),
        "load_average_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cases": results,
    }
    out = ROOT / "benchmarks" / "results" / "verdict_cost.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
