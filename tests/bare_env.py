"""Run Python code in a subprocess that cannot import `refusion_hf` (as on a machine with only torch and
transformers): `src/` is not on its path and an import hook refuses the package even though the development
install is in the venv. Used to check that saved folders load through their own remote code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_BLOCKER = """
import importlib.abc, sys
class _NoRefusionHF(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "refusion_hf" or name.startswith("refusion_hf."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: bare environment)")
        return None
sys.meta_path.insert(0, _NoRefusionHF())
sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("/src")]
try:
    import refusion_hf  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("bare environment is broken: refusion_hf is importable")
"""


def run_bare(code: str, tmp_path: Path, timeout: int = 300) -> dict:
    """Run `code` (which must print one JSON object on its last stdout line) without refusion_hf; return it."""
    script = tmp_path / "bare_script.py"
    script.write_text(_BLOCKER + textwrap.dedent(code))
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": "",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    result = subprocess.run(
        [sys.executable, str(script)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=tmp_path,
    )
    if result.returncode != 0:
        raise AssertionError(f"bare-environment script failed:\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])
