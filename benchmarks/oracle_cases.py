"""The golden decoding vectors of the authors' decoder that the test suite replays (tests/data), read as data: the
benchmarks use the cases and the tiny checkpoint they were made with, not the tests' code."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
FIXTURE = DATA / "tiny-qwen3-refusion"  # the tiny official-format checkpoint of the cases


def load_cases() -> list[dict]:
    return [json.loads(line) for line in (DATA / "oracle_cases.jsonl").read_text().splitlines() if line.strip()]


def generate_kwargs(case: dict) -> dict:
    """A case's decoder settings (the authors' names) as `generate()` arguments."""
    names = {"gen_length": "max_new_tokens", "slot_size": "slot_size", "block_length": "block_size"}
    names.update(slot_threshold="slot_threshold", token_threshold="token_threshold")
    return {ours: case[theirs] for theirs, ours in names.items()}
