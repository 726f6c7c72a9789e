"""The authors' golden decoding vectors (tests/data/oracle_cases.jsonl) and how we compare with them
(docs/design.md, "Faithfulness"): on a case without a hole, the new tokens up to the reference's first EOS (within
max_new_tokens) are the reference's, padding follows, and no more forward passes are used; on a case where the
reference's EOS-in-infill defect left a hole, ours has none."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "tiny-qwen3-refusion"
CASES_FILE = DATA / "oracle_cases.jsonl"
EOS, PAD, MASK = 1, 0, 3


def load_cases() -> list[dict]:
    return [json.loads(line) for line in CASES_FILE.read_text().splitlines() if line.strip()]


def generate_kwargs(case: dict) -> dict:
    """The case's decoder arguments in `generate()` terms."""
    return dict(
        max_new_tokens=case["gen_length"],
        slot_size=case["slot_size"],
        block_size=case["block_length"],
        slot_threshold=case["slot_threshold"],
        token_threshold=case["token_threshold"],
    )


@dataclass
class Expected:
    tokens: list[int]  # reference tokens at positions 0 .. cut-1
    cut: int
    hole_free: bool


def expected(case: dict) -> Expected:
    by_position = dict(zip(case["output_positions"], case["output_ids"]))
    ordered = [by_position[p] for p in sorted(by_position)]
    positions = sorted(by_position)
    cut = case["gen_length"]
    for position, token in zip(positions, ordered):
        if token == EOS:
            cut = min(cut, position + 1)
            break
    hole_free = all(p in by_position for p in range(cut))
    return Expected([by_position.get(p, -1) for p in range(cut)], cut, hole_free)


def mismatch(case: dict, generated: list[int], forward_passes: int) -> str | None:
    """None when `generated` (the new tokens of a batch-1 call: exactly the answer, as wide as stock generate
    makes it) satisfies that comparison (module docstring)."""
    exp = expected(case)
    if exp.hole_free and len(generated) != exp.cut:
        return f"expected an answer of {exp.cut} new tokens, got {len(generated)}"
    if len(generated) > case["gen_length"]:
        return f"expected at most {case['gen_length']} new tokens, got {len(generated)}"
    generated = generated + [PAD] * (case["gen_length"] - len(generated))
    if exp.hole_free:
        if generated[: exp.cut] != exp.tokens:
            return f"tokens differ: expected {exp.tokens}, got {generated[: exp.cut]}"
        if any(t != PAD for t in generated[exp.cut :]):
            return f"expected padding after position {exp.cut}, got {generated[exp.cut :]}"
        if forward_passes > case["forward_calls"]:
            return f"{forward_passes} forward passes, more than the reference's {case['forward_calls']}"
        return None
    # A case where the reference left a hole: ours must have none (no mask, everything up to the EOS decoded).
    if MASK in generated:
        return "output contains a mask token (a hole)"
    if EOS in generated:
        end = generated.index(EOS) + 1
        if any(t != PAD for t in generated[end:]):
            return "tokens after the EOS are not padding"
    return None
