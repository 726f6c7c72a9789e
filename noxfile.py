"""`make test-matrix`: the release subset of the suite under the oldest and the newest supported dependency sets
(setup.cfg's ranges), each in a fresh virtual environment of its own that nox builds with uv.

* `oldest`: every library with a lower bound in setup.cfg at that bound (`OLDEST`, checked against setup.cfg by
  tests/test_noxfile.py), the rest as uv resolves them;
* `newest`: `.[train,eval,serving]` as uv resolves it today: the newest release each range allows.

Both install torch 2.13.0 from the CPU wheel pip is configured to use (this machine's find-links: `pip install
--dry-run` tells which file; uv reads no pip configuration and would fetch the CUDA build from the index), then the
package from this clone (a wheel, not editable: the tests import what a user installs) with the `train`, `eval` and
`serving` extras, pytest and hypothesis, and run `SUBSET`. `nox -s oldest` runs one end; `nox -R` reuses the
environments. tests/README.md gives the subset's time. The serving extra's libraries (FastAPI, uvicorn, pydantic,
openai) are as uv resolves them at both ends: their lower bounds are not pinned in `oldest`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["oldest", "newest"]
nox.options.error_on_missing_interpreters = True

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
TORCH = "2.13.0"

# The lower bound of every library setup.cfg bounds below (install_requires, train, eval): the oldest set.
OLDEST = {
    "torch": TORCH,
    "transformers": "5.19.0",
    "huggingface_hub": "1.31.0",
    "accelerate": "1.15.0",
    "peft": "0.18.0",
    "trl": "1.15.0",
    "evaluate": "0.4.6",
    "lm-eval": "0.4.13",
}

# What each end runs: modeling (save/load, remote code in a bare environment), the oracle, generate()'s contract,
# custom_generate on a stock Qwen3, a training step (Trainer, TRL, LoRA), and each release difference's seam test.
SUBSET = [
    # every seam's declarations and release differences (the coverage checks import every module, serving/ too)
    "tests/_compat",
    "tests/modeling",
    # the 300 golden cases (make test also decodes each without planning ahead: the same forwards, so no release
    # difference, and as long again)
    "tests/generation/test_oracle.py::test_matches_authors_decoder",
    "tests/generation/test_generate_contract.py",
    "tests/generation/test_custom_generate.py",
    "tests/training/test_trainer.py",
    "tests/training/test_trl.py",
    # refusion serve on public APIs: the openai client over 127.0.0.1, the same tokens as generate()
    "tests/serving/test_serve.py",
]


def torch_cpu_wheel() -> str:
    """The local CPU wheel of torch `TORCH` that this machine's pip would install (its configured find-links)."""
    report = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--no-deps",
         "--report", "-", f"torch=={TORCH}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    url = json.loads(report)["install"][0]["download_info"]["url"]
    path = unquote(urlparse(url).path)
    if not url.startswith("file://") or "+cpu" not in path:
        raise SystemExit(
            f"pip's torch=={TORCH} is {url}, not a local CPU wheel: set TORCH_WHEEL to the path of a CPU wheel of "
            f"torch {TORCH} (a CUDA build is several GB)."
        )
    return path


def install_and_test(session: nox.Session, pins: list[str]) -> None:
    wheel = os.environ.get("TORCH_WHEEL") or torch_cpu_wheel()
    session.install(wheel)
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text(f"torch=={TORCH}\n" + "".join(f"{pin}\n" for pin in pins))
    session.install("-c", str(constraints), ".[train,eval,serving]", "pytest", "hypothesis")
    session.run("uv", "pip", "list", "--python", session.virtualenv.location, external=True)  # the set, in the log
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", *SUBSET, *session.posargs)


@nox.session(python=PYTHON)
def oldest(session: nox.Session) -> None:
    install_and_test(session, [f"{name}=={release}" for name, release in OLDEST.items() if name != "torch"])


@nox.session(python=PYTHON)
def newest(session: nox.Session) -> None:
    install_and_test(session, [])
