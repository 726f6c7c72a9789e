"""A toy training set over the fixture's vocabulary (t4 ... t63): prompt = 4 consecutive tokens, answer = the
tokens that follow (3 to 19 of them), so both the AR and the MDM parts of the loss have something to learn."""

from __future__ import annotations

import json
import random
from pathlib import Path


def toy_records(count: int = 32, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        start = rng.randint(4, 40)
        query = " ".join(f"t{start + j}" for j in range(4))
        length = rng.randint(3, 19)
        response = " ".join(f"t{start + 4 + j}" for j in range(length) if start + 4 + j < 64)
        records.append({"query": query, "response": response})
    return records


def write_toy_jsonl(path: Path, count: int = 32, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in toy_records(count, seed)))
    return path


def train_args(model, data, output_dir, *extra: str) -> list[str]:
    return ["train", "--model", str(model), "--data", str(data), "--output-dir", str(output_dir), *extra]
