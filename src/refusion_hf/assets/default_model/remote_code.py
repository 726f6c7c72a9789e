# Generated from refusion_hf.modeling.remote_code by refusion_hf.modeling.remote_code (save_pretrained writes it; `make embedded-bundle` refreshes the embedded model's copy): edit the source, not this file.
"""Export of the package's modelling code as a flat, self-contained remote-code bundle.

`transformers`' dynamic-module loader (what `trust_remote_code=True` runs) copies a model folder's `.py` files
into one flat package and follows only `from .sibling import name` imports. Our source tree is layered
(`modeling/`, `generation/`), so the bundle is produced from the *real import graph* of the exported classes:
starting at their modules, every relative import is followed, each reached module is written under its own
file name, and its relative imports are rewritten to the flat `from .module import name` form. Nothing is
maintained twice: the bundle is always exactly the code the package runs.

Rules the exported modules follow (checked here, with an error naming the offending file):
* imports of other package modules are relative, `from .mod import x` or `from ..subpackage.mod import x`;
* no `from . import mod` and no absolute `refusion_hf` import (the bundle must load where the package is
  not installed);
* module file names are unique across subpackages.

`write_custom_generate` exports ReFusion decoding the same way for stock models: `custom_generate/generate.py`
(transformers' "custom generation method" layout, loaded by `generate(custom_generate=DIR_OR_REPO,
trust_remote_code=True)`), with its flat siblings beside it in `custom_generate/`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

_RELATIVE_FROM = re.compile(r"^(?P<indent>[ \t]*)from[ \t]+(?P<dots>\.+)(?P<path>[\w.]*)[ \t]+import\b", re.M)
_ABSOLUTE_PACKAGE = re.compile(r"^[ \t]*(from|import)[ \t]+refusion_hf\b", re.M)


class RemoteCodeExportError(RuntimeError):
    """A module reachable from the exported classes cannot be written as flat remote code."""


def _resolve(module, dots: str, path: str) -> str:
    package = module.__package__ or module.__name__.rpartition(".")[0]
    return importlib.util.resolve_name(dots + path, package)


CUSTOM_GENERATE_DIR = "custom_generate"
CUSTOM_GENERATE_REQUIREMENTS = "torch\ntransformers>=5.24,<6\n"


def collect_bundle_modules(*roots) -> dict[str, object]:
    """All modules reachable through relative imports from the modules defining `roots` (classes or functions),
    by flat file name."""
    pending = [sys.modules[root.__module__] for root in roots]
    by_file: dict[str, object] = {}
    while pending:
        module = pending.pop()
        source_file = Path(inspect.getsourcefile(module))
        flat_name = source_file.name
        seen = by_file.get(flat_name)
        if seen is module:
            continue
        if seen is not None:
            raise RemoteCodeExportError(
                f"Two bundle modules share the file name {flat_name!r} ({seen.__name__}, {module.__name__}); "
                "remote code is flat, so rename one of them."
            )
        by_file[flat_name] = module
        source = source_file.read_text()
        if _ABSOLUTE_PACKAGE.search(source):
            raise RemoteCodeExportError(
                f"{source_file} imports `refusion_hf` absolutely; bundle modules must use relative imports so "
                "that the exported code loads where the package is not installed."
            )
        for match in _RELATIVE_FROM.finditer(source):
            if not match["path"]:
                raise RemoteCodeExportError(
                    f"{source_file} uses `from {match['dots']} import ...`, which transformers' remote-code loader "
                    "cannot follow; import names from a module instead (`from .module import name`)."
                )
            pending.append(importlib.import_module(_resolve(module, match["dots"], match["path"])))
    return by_file


def flatten_source(source: str) -> str:
    """Rewrite every relative import to the sibling form the remote-code loader follows."""

    def to_sibling(match: re.Match) -> str:
        return f"{match['indent']}from .{match['path'].rpartition('.')[2]} import"

    return _RELATIVE_FROM.sub(to_sibling, source)


def generated_header(module) -> str:
    """The first line of every exported file: which source it was generated from and how to regenerate it."""
    return (
        f"# Generated from {module.__name__} by refusion_hf.modeling.remote_code (save_pretrained writes it; "
        "`make embedded-bundle` refreshes the embedded model's copy): edit the source, not this file.\n"
    )


def write_remote_code(save_directory: str | Path, *roots, entry_name: str | None = None) -> list[str]:
    """Write the flat bundle for `roots` into `save_directory`; returns the file names written. With
    `entry_name`, the module of the first root is written under that name."""
    save_directory = Path(save_directory)
    save_directory.mkdir(parents=True, exist_ok=True)
    modules = collect_bundle_modules(*roots)
    entry = sys.modules[roots[0].__module__]
    written = []
    for flat_name, module in sorted(modules.items()):
        source = Path(inspect.getsourcefile(module)).read_text()
        name = entry_name if entry_name is not None and module is entry else flat_name
        (save_directory / name).write_text(generated_header(module) + flatten_source(source))
        written.append(name)
    return sorted(written)


def write_custom_generate(save_directory: str | Path) -> list[str]:
    """Write `custom_generate/` (generate.py, its flat siblings, requirements.txt) into `save_directory`; returns
    the paths written, relative to it."""
    from .custom_generate import generate

    folder = Path(save_directory) / CUSTOM_GENERATE_DIR
    written = write_remote_code(folder, generate, entry_name="generate.py")
    (folder / "requirements.txt").write_text(CUSTOM_GENERATE_REQUIREMENTS)
    return [f"{CUSTOM_GENERATE_DIR}/{name}" for name in [*written, "requirements.txt"]]


def auto_map_for(config_class: type, model_class: type) -> dict[str, str]:
    """`auto_map` entries pointing the Auto classes at the flat bundle."""

    def reference(cls: type) -> str:
        return f"{Path(inspect.getsourcefile(sys.modules[cls.__module__])).stem}.{cls.__name__}"

    return {
        "AutoConfig": reference(config_class),
        "AutoModel": reference(model_class),
        "AutoModelForCausalLM": reference(model_class),
    }


def write_model_bundle(save_directory: str | Path, config_class: type | None = None, model_class: type | None = None):
    """Everything `save_pretrained` writes besides weights, configs and tokenizer: the flat remote code of the
    classes (default: `RefusionConfig`, `RefusionForCausalLM`) and `custom_generate/`; returns the paths written.
    Also how the embedded model folder is refreshed (`make embedded-bundle`)."""
    if config_class is None or model_class is None:
        from .configuration_refusion import RefusionConfig
        from .modeling_refusion import RefusionForCausalLM

        config_class, model_class = config_class or RefusionConfig, model_class or RefusionForCausalLM
    return [*write_remote_code(save_directory, config_class, model_class), *write_custom_generate(save_directory)]
