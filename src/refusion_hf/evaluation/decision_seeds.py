"""The decision-seeds list: seeds of the synthetic suite that informed a choice (training data, tuning, judging
attempts), read from a JSON file such as benchmarks/decision_seeds.json, so that `refusion eval --decision-seeds`
refuses to report a figure from one of them. Held-out evidence is only held out while nothing was chosen on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError, first_line


def read_decision_seeds(path: str | Path) -> set[int]:
    """The seeds a decision-seeds file lists: a JSON object whose "seeds" is a list of objects with an integer
    "seed" (and what it was used for) or of integers. One clear error for anything else."""
    try:
        loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise InputError(f"--decision-seeds {path}: not a readable JSON file ({first_line(error)}).") from None
    entries = loaded.get("seeds") if isinstance(loaded, dict) else None
    if not isinstance(entries, list):
        raise InputError(f'--decision-seeds {path}: expected a JSON object with a "seeds" list.')
    seeds = set()
    for entry in entries:
        value = entry.get("seed") if isinstance(entry, dict) else entry
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f'--decision-seeds {path}: {entry!r} is not an integer seed or {{"seed": N, ...}}.')
        seeds.add(value)
    return seeds
