"""The identity of a checkpoint folder: a SHA-256 over its weight files, so a report can say which weights it
measured (`refusion eval` records it; `refusion publish --eval` checks it against the folder it publishes)."""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SKIPPED = ("optimizer", "scheduler", "rng_state", "training_args", "scaler")  # trainer state, not weights


def weights_sha256(folder: str | Path) -> str | None:
    """SHA-256 over the names and bytes of the folder's top-level weight files (model shards or an adapter), in name
    order; None when `folder` is not a local folder with weights (a Hub id)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    files = sorted(
        path
        for path in folder.iterdir()
        if path.is_file() and path.suffix in WEIGHT_SUFFIXES and not path.name.startswith(_SKIPPED)
    )
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
