"""The `refusion` commands' convention for user errors, and the checks of their inputs and outputs.

A user error (a bad path or flag value, an unreadable or corrupt checkpoint, a folder without a tokenizer, bad
data, an output that cannot be written) is a `CommandError`: `refusion_hf.cli.main` prints it as the one line
`refusion <command>: error: <message>` and exits with status 2, without a traceback. Anything else is an internal
error and keeps its traceback. Outputs are checked before any long work starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class CommandError(ValueError):
    """A user error of a `refusion` command; its message names the input and what to do instead."""


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0 (NaN refused), named in argparse's one-line error otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_decoding_arguments(parser, title: str | None = None) -> None:
    """One flag per ReFusion decoding knob (`DECODING_KNOBS`), typed and explained by `RefusionGenerationConfig`'s
    own field documentation: `--slot-size N`, `--token-threshold X`, `--plan-ahead / --no-plan-ahead`... Each
    defaults to None: the model's generation config decides."""
    from .generation.refusion_generation_config import DECODING_KNOBS, documented_fields

    group = parser.add_argument_group(title) if title else parser
    docs = documented_fields()
    argument_types = {"int": positive_int, "float": non_negative_float}  # every int knob counts, every float is >= 0
    for name in DECODING_KNOBS:
        doc = docs[name]
        flag = f"--{name.replace('_', '-')}"
        help_text = doc.text.split(". ")[0].rstrip(".") + " (default: the model's generation config)"
        if doc.type == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(flag, type=argument_types[doc.type], default=None, metavar=name.upper(), help=help_text)


def require_extra(extra: str, *modules: str) -> None:
    """The packages a command needs beyond the core install must be there, else one line naming the extra."""
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise CommandError(
            f"this needs the `{extra}` extra ({', '.join(missing)} not installed): pip install 'refusion_hf[{extra}]'."
        )


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_checkpoint_folder(source: str | Path, flag: str) -> None:
    """A local checkpoint folder must exist and hold a readable config.json (without one, transformers builds the
    class's default config: for Qwen3 an 8B-parameter model). Hub ids are checked when they load."""
    path = Path(source)
    if not path.exists():
        if not str(source).startswith(("/", ".", "~")) and str(source).count("/") <= 1:
            return  # a Hub id: checked when it loads
        raise CommandError(f"{flag} {source}: no such folder; pass a checkpoint folder or a Hub id.")
    if not path.is_dir():
        raise CommandError(f"{flag} {source}: not a folder; pass the checkpoint's folder (config.json, weights).")
    config = path / "config.json"
    if not config.is_file():
        raise CommandError(f"{flag} {source}: no config.json in the folder; pass a checkpoint folder.")
    try:
        loaded = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CommandError(f"{flag} {source}: config.json is not readable JSON ({first_line(error)}).") from None
    if not isinstance(loaded, dict):
        raise CommandError(f"{flag} {source}: config.json is not a JSON object.")


def check_tokenizer_files(source: str | Path, flag: str) -> None:
    """A local folder must carry tokenizer files: without them transformers builds a near-empty tokenizer."""
    path = Path(source)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CommandError(
            f"{flag} {source}: the folder has no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the tokenizer "
            "next to the weights (`tokenizer.save_pretrained(folder)`)."
        )


def check_tokenizer_fits(tokenizer, vocab_size: int, flag: str) -> None:
    """The tokenizer must cover the embedding matrix (a tokenizer of another model, or an empty one, does not)."""
    if len(tokenizer) < 2 or len(tokenizer) * 2 < vocab_size:
        raise CommandError(
            f"{flag}: the tokenizer has {len(tokenizer)} tokens for an embedding matrix of {vocab_size} rows; pass "
            "the model's own tokenizer."
        )


def check_output_file(path: str | Path, flag: str) -> Path:
    """`path` can be written (its folder is created if missing); checked before any long work."""
    path = Path(path)
    if path.is_dir():
        raise CommandError(f"{flag} {path}: is a folder; pass a file path.")
    _check_writable_folder(path.parent, flag, path)
    return path


def check_output_folder(path: str | Path, flag: str) -> Path:
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CommandError(f"{flag} {path}: is a file; pass a folder (it is created if missing).")
    _check_writable_folder(path, flag, path)
    return path


def _check_writable_folder(folder: Path, flag: str, shown: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise CommandError(f"{flag} {shown}: cannot be written ({first_line(error)}); choose another path.") from None
