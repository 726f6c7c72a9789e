"""The build backend writes the embedded model's remote code and custom_generate/ (git holds no copy: setup.py).

setuptools' own PEP 517 hooks (`build_wheel`, what `pip install .` runs; `build_editable`, what `pip install -e .`
and `make install` run) build a copy of the project made the way a fresh clone has it (no generated file), in a
subprocess that cannot import torch, transformers or refusion_hf, as in pip's isolated build environment. The
wheel's embedded folder, installed from it, then loads with `trust_remote_code=True` where refusion_hf is not
importable and decodes as the package does.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from refusion_hf import RefusionForCausalLM
from refusion_hf.modeling import remote_code
from refusion_hf.modeling.loading import default_model_path
from tests.bare_env import run_bare

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = f"refusion_hf/{remote_code.EMBEDDED_MODEL_RESOURCE}"

BUILD = """
import importlib.abc, json, os, sys

class _NotInTheBuildEnvironment(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "refusion_hf"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: build environment)")
        return None

sys.meta_path.insert(0, _NotInTheBuildEnvironment())
sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("/src")]

# pip's build environment holds setuptools and wheel only: the plugins other installed packages register for
# setuptools (e.g. `kernels`' egg_info writer, which imports torch) are not there either
import importlib.metadata as metadata
_entry_points = metadata.entry_points

def _build_environment_entry_points(**selection):
    found = _entry_points(**selection)
    return metadata.EntryPoints(
        point for point in found if point.dist is None or point.dist.name.lower() in ("setuptools", "wheel")
    )

metadata.entry_points = _build_environment_entry_points
from setuptools import build_meta

out = sys.argv[1]
print(json.dumps({"wheel": build_meta.build_wheel(out), "editable": build_meta.build_editable(out)}))
"""


def _is_generated(relative: str) -> bool:
    return relative.startswith(remote_code.EMBEDDED_MODEL_RESOURCE + "/") and any(
        Path(relative.removeprefix(remote_code.EMBEDDED_MODEL_RESOURCE + "/")).match(pattern)
        for pattern in remote_code.EMBEDDED_GENERATED_PATTERNS
    )


def _project_copy(destination: Path) -> Path:
    """The files a build reads, as a fresh clone has them: no generated file, no build output."""
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, destination / name)
    package = ROOT / "src" / "refusion_hf"

    def ignore(directory, names):
        relative = Path(directory).relative_to(package)
        return [
            name
            for name in names
            if name == "__pycache__" or name.endswith(".egg-info") or _is_generated((relative / name).as_posix())
        ]

    shutil.copytree(package, destination / "src" / "refusion_hf", ignore=ignore)
    return destination


def _bundle_files(folder: Path) -> dict[str, bytes]:
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in folder.rglob("*")
        if path.is_file() and _is_generated(f"{remote_code.EMBEDDED_MODEL_RESOURCE}/{path.relative_to(folder)}")
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(project copy, wheel path, editable wheel path) of one build of each kind."""
    project = _project_copy(tmp_path_factory.mktemp("project"))
    assert not _bundle_files(project / "src" / EMBEDDED), "the copy is not a fresh clone's"
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(BUILD), str(out)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, f"the build failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    names = json.loads(result.stdout.strip().splitlines()[-1])
    return project, out / names["wheel"], out / names["editable"]


@pytest.fixture(scope="module")
def expected_bundle(tmp_path_factory):
    """What save_pretrained writes besides weights, configs and tokenizer."""
    folder = tmp_path_factory.mktemp("saved")
    remote_code.write_model_bundle(folder)
    return _bundle_files(folder)


def test_wheel_carries_the_embedded_bundle(built, expected_bundle):
    _, wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        prefix = f"{EMBEDDED}/"
        shipped = {
            name.removeprefix(prefix): archive.read(name)
            for name in archive.namelist()
            if name.startswith(prefix) and _is_generated(name.removeprefix("refusion_hf/"))
        }
        data = {name.removeprefix(prefix) for name in archive.namelist() if name.startswith(prefix)} - set(shipped)
    assert len(expected_bundle) > 20
    assert sorted(shipped) == sorted(expected_bundle)
    assert [name for name in shipped if shipped[name] != expected_bundle[name]] == []
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= data


def test_editable_install_writes_the_bundle_where_the_package_is_imported_from(built, expected_bundle):
    """setuptools' editable wheel for this src layout is a .pth adding src/: the bundle is written there."""
    project, _, editable = built
    with zipfile.ZipFile(editable) as archive:
        paths = [archive.read(name).decode().strip() for name in archive.namelist() if name.endswith(".pth")]
    assert paths == [str((project / "src").resolve())]
    written = _bundle_files(project / "src" / EMBEDDED)
    assert sorted(written) == sorted(expected_bundle)
    assert [name for name in written if written[name] != expected_bundle[name]] == []


def test_embedded_model_installed_from_the_wheel_loads_anywhere(built, tmp_path):
    _, wheel, _ = built
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    installed = site / EMBEDDED
    model = RefusionForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = [[1, 372, 285, 44, 300, 10]]  # token ids of the embedded vocabulary (770 tokens)
    expected = model.generate(torch.tensor(ids), max_new_tokens=16).tolist()
    result = run_bare(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(installed)!r}, trust_remote_code=True, dtype=torch.float32)
        assert type(model).__module__.startswith("transformers_modules")
        print(json.dumps(model.eval().generate(torch.tensor({ids}), max_new_tokens=16).tolist()))
        """,
        tmp_path,
    )
    assert result == expected
