"""The one writer of `benchmarks/results/`: every benchmark's JSON goes through `write_results`, which puts in front
of the figures where they came from (`provenance`): the command as run, the commit and whether the tree was clean,
the machine (CPU and its vector instruction sets, GPU, cores, load, library versions) and the date (UTC).
tests/test_benchmarks.py holds every committed JSON to it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROVENANCE_KEYS = ("command", "commit", "tree_clean", "machine", "date")


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _command(argv: list[str]) -> str:
    """`python benchmarks/NAME.py FLAGS...` as run, paths inside the checkout relative to its root."""
    script = Path(argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *argv[1:]])


def machine() -> dict:
    """The machine: CPU model, its vector instruction sets (numerics differ between AVX2 and AVX-512/AMX kernels),
    cores, load average, GPU if any, OS, Python / torch / transformers versions."""
    model, flags = platform.processor() or "unknown", []
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
        model = found.group(1).strip() if found else model
        first = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
        flags = sorted(f for f in (first.group(1).split() if first else []) if re.match(r"avx2$|avx512|amx", f))
    except OSError:
        pass
    described = {
        "cpu": model,
        "cpu_vector_flags": flags,
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "os": platform.platform(),
        "python": platform.python_version(),
    }
    for library in ("torch", "transformers"):
        module = sys.modules.get(library)
        described[library] = getattr(module, "__version__", None) if module else None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        described["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return described


def provenance(argv: list[str] | None = None) -> dict:
    """Where a result comes from: command, commit, tree_clean (no uncommitted change to tracked files, nor an
    untracked file outside benchmarks/results/), machine, date."""
    status = _git("status", "--porcelain", "--untracked-files=all")
    changed = [line for line in status.splitlines() if not line[3:].startswith("benchmarks/results/")]
    return {
        "command": _command(list(sys.argv if argv is None else argv)),
        "commit": _git("rev-parse", "HEAD"),
        "tree_clean": not changed,
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_results(results: dict, out: str | Path) -> Path:
    """Write `results` as indented JSON to `out` (creating its folder), `provenance` first, print it, and return the
    path. A `provenance` key of `results` itself is refused: it is this function's to write."""
    if "provenance" in results:
        raise ValueError("results carry their own 'provenance'; write_results records it")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"provenance": provenance(), **results}, indent=2) + "\n"
    path.write_text(text)
    print(text, end="")
    return path


def provenance_problems(data: object) -> list[str]:
    """What a results JSON lacks of its provenance (empty when it has it all)."""
    record = data.get("provenance") if isinstance(data, dict) else None
    if not isinstance(record, dict):
        return ["no 'provenance' object"]
    problems = [f"no {key!r}" for key in PROVENANCE_KEYS if key not in record]
    if not str(record.get("command", "")).startswith("python benchmarks/"):
        problems.append("'command' is not `python benchmarks/SCRIPT ...`")
    if not re.fullmatch(r"[0-9a-f]{40}", str(record.get("commit", ""))):
        problems.append("'commit' is not a full commit hash")
    if not isinstance(record.get("tree_clean"), bool):
        problems.append("'tree_clean' is not true or false")
    described = record.get("machine")
    if not isinstance(described, dict) or not described.get("cpu"):
        problems.append("'machine' does not name the CPU")
    try:
        datetime.datetime.fromisoformat(str(record.get("date")))
    except ValueError:
        problems.append("'date' is not an ISO date")
    return problems
