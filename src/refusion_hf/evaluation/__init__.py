"""Evaluation: the seeded synthetic task suite, local `evaluate` metrics (numeric match, sandboxed pass@1, listing
match, throughput) and the `refusion eval` command (ReFusion vs autoregressive decoding of the same weights).

Only the standard-library parts are imported here; the harness (torch) and metrics (evaluate) load on use.
"""

from .synthetic_tasks import FAMILIES, SPLITS, SyntheticProblem, generate_problem, generate_problems, write_jsonl

__all__ = ["FAMILIES", "SPLITS", "SyntheticProblem", "generate_problem", "generate_problems", "write_jsonl"]
