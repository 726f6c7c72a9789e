"""The build's one step beyond setup.cfg (setuptools does the rest): the embedded model folder's remote code and
custom_generate/ are generated from the sources when the package is built, instead of being kept in git.

`build_py` runs for `pip install .` / `pip wheel` (it writes them into the build directory, so the wheel carries
them) and for `pip install -e .` (setuptools' editable mode imports the package from src/, so they are written
into src/, where .gitignore keeps them out of git; `make embedded-bundle` refreshes them after a source change).
The writer is `refusion_hf/modeling/remote_code.py`, loaded here on its own: the build environment has no torch or
transformers, and it reads the sources without importing them.
"""

import importlib.util
import logging
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCES = Path(__file__).resolve().parent / "src"


def _remote_code():
    spec = importlib.util.spec_from_file_location(
        "_refusion_hf_remote_code", SOURCES / "refusion_hf" / "modeling" / "remote_code.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithEmbeddedBundle(build_py):
    """setuptools' build_py, then the embedded model's bundle written beside the package it builds."""

    def run(self):
        super().run()
        written = _remote_code().write_embedded_bundle(SOURCES if self.editable_mode else self.build_lib)
        self.announce(f"wrote the embedded model's remote code ({len(written)} files)", level=logging.INFO)


setup(cmdclass={"build_py": BuildPyWithEmbeddedBundle})
