"""Where a benchmark's results go: a JSON file (for the README's numbers and later comparisons) and stdout."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(results: dict, out: str | Path) -> Path:
    """Write `results` as indented JSON to `out` (creating its folder), print it, and return the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2) + "\n"
    path.write_text(text)
    print(text, end="")
    return path
