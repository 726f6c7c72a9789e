"""Evaluation on lm-evaluation-harness: the seeded synthetic task suite (shipped as the lm-eval tasks
`refusion_synthetic` and, its held-out hard tier, `refusion_synthetic_hard`), the registered lm-eval model
`refusion`, lm-eval's code metric run in the bubblewrap sandbox, `refusion eval` (ReFusion vs autoregressive
decoding of the same weights, side by side, with a paired interval on the accuracy difference) and
`refusion lm-eval`.

Only the standard-library parts are imported here; the harness (torch, lm-eval) loads on use.
"""

from .synthetic_tasks import (
    FAMILIES,
    SPLITS,
    TIERS,
    SyntheticProblem,
    generate_problem,
    generate_problems,
    write_jsonl,
)

__all__ = ["FAMILIES", "SPLITS", "TIERS", "SyntheticProblem", "generate_problem", "generate_problems", "write_jsonl"]
