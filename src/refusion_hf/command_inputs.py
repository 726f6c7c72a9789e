"""The `refusion` commands' convention for user errors, and the checks of their inputs and outputs.

A user error (a bad path or flag value, an unreadable or corrupt checkpoint, a folder without a tokenizer, bad
data, an output that cannot be written) is a `CommandError`: `refusion_hf.cli.main` prints it as the one line
`refusion <command>: error: <message>` and exits with status 2, without a traceback. Anything else is an internal
error and keeps its traceback. Outputs are checked before any long work starts, and written to a staging path
moved into place only when complete (`staged_output`), so a failed write (a full disk) leaves no partial output.
A checkpoint folder's config.json is validated (`RefusionConfig`'s own validation, and its parameters against the
machine's memory) before any layer is built.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
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


SEED_LIMIT = 2**32  # transformers' `set_seed` (Trainer, lm-eval) also seeds numpy, whose seeds are 32-bit


def seed(text: str) -> int:
    """An argparse type: a random seed, an integer in [0, 2**32)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {SEED_LIMIT - 1}, got {text!r}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {SEED_LIMIT - 1}, got {value}")
    return value


def knob_argument_type(knob):
    """An argparse type for a number-valued decoding knob (a `DecodingKnob`): its declared type and range, named in
    argparse's one-line error otherwise ("expected an integer >= 1, got 0"). A multiple of another knob is checked
    when the config is validated."""
    range_text = knob.range_text()
    expected = range_text or ("an integer" if knob.type is int else "a number")

    def parse(text: str):
        try:
            value = knob.type(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value != value or (range_text is not None and not knob.in_range(value)):  # NaN, or out of range
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


def add_decoding_arguments(parser, title: str | None = None) -> None:
    """One flag per tunable ReFusion decoding knob, typed, ranged and explained (its help's first sentence) by the
    knob's declaration (`refusion_generation_config.KNOBS`): `--slot-size N`, `--token-threshold X`,
    `--plan-ahead / --no-plan-ahead`... Each defaults to None: the model's generation config decides."""
    from .generation.refusion_generation_config import declared_knobs

    group = parser.add_argument_group(title) if title else parser
    for knob in declared_knobs(tunable=True):
        flag = f"--{knob.name.replace('_', '-')}"
        help_text = knob.help.split(". ")[0].rstrip(".") + " (default: the model's generation config)"
        if knob.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif knob.choices is not None:
            group.add_argument(flag, choices=knob.choices, default=None, help=help_text)
        else:
            argument_type = knob_argument_type(knob)
            group.add_argument(flag, type=argument_type, default=None, metavar=knob.name.upper(), help=help_text)


def require_extra(extra: str, *modules: str) -> None:
    """The packages a command needs beyond the core install must be there, else one line naming the extra."""
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise CommandError(
            f"this needs the `{extra}` extra ({', '.join(missing)} not installed): pip install 'refusion_hf[{extra}]'."
        )


def first_line(error: BaseException) -> str:
    """The first line of an error's message; for a strict config's validation error (`@strict`, whose own first
    line only names the validator), the message of the error it wraps."""
    from huggingface_hub.errors import StrictDataclassError

    if isinstance(error, StrictDataclassError) and error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_checkpoint_folder(source: str | Path, flag: str, dtype: str | None = None) -> None:
    """A local checkpoint folder must exist and hold a readable config.json (without one, transformers builds the
    class's default config: for Qwen3 an 8B-parameter model) that `RefusionConfig` validates, describing a network
    whose parameters fit in memory in `dtype` (a name; None or "auto": the checkpoint's), and a readable
    generation_config.json if it has one. Hub ids are checked when they load."""
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
    check_fits_in_memory(loaded, dtype, f"{flag} {source}")
    from huggingface_hub.errors import StrictDataclassError

    from .modeling import RefusionConfig

    try:  # RefusionConfig's own validation, which every load runs: sizes, types
        RefusionConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, StrictDataclassError) as error:
        reason = first_line(error)
        raise CommandError(f"{flag} {source}: config.json is not a valid configuration ({reason}).") from None
    generation_config = path / "generation_config.json"
    if generation_config.exists():  # transformers ignores an unreadable one silently: the decoding defaults would go
        try:
            if not isinstance(json.loads(generation_config.read_text()), dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise CommandError(
                f"{flag} {source}: generation_config.json is not readable JSON ({first_line(error)}); fix or delete it."
            ) from None


def estimated_parameters(config: dict) -> int:
    """The number of parameters of the Qwen3 network a config.json describes (its values, Qwen3Config's defaults
    for those it leaves out), by arithmetic: nothing is built. `model.num_parameters()` once built."""
    from .modeling import RefusionConfig

    defaults = {name: field.default for name, field in RefusionConfig.__dataclass_fields__.items()}

    def size(name):
        value = config.get(name)
        return defaults[name] if value is None else value

    hidden, heads, head_dim = size("hidden_size"), size("num_attention_heads"), size("head_dim")
    kv_heads = size("num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
    bias = bool(config.get("attention_bias", defaults["attention_bias"]))
    attention = (
        hidden * (heads + 2 * kv_heads) * head_dim  # q, k, v
        + heads * head_dim * hidden  # o
        + (((heads + 2 * kv_heads) * head_dim + hidden) if bias else 0)
        + 2 * head_dim  # q_norm, k_norm
    )
    layer = attention + 3 * hidden * size("intermediate_size") + 2 * hidden
    embeddings = size("vocab_size") * hidden
    tied = config.get("tie_word_embeddings", defaults["tie_word_embeddings"])
    return embeddings * (1 if tied else 2) + size("num_hidden_layers") * layer + hidden


def machine_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits_in_memory(config: dict, dtype: str | None, what: str) -> None:
    """The parameters a config.json describes must fit in this machine's memory in the dtype they load in (`dtype`,
    else the config's own, else float32): checked before any layer is built, which for a config of a million
    layers takes minutes. A config whose sizes are not integers >= 1 is left to the config's own validation."""
    import torch

    from .modeling.configuration_refusion import SIZE_FIELDS

    sizes = [config.get(name) for name in SIZE_FIELDS]
    if any(value is not None and (type(value) is not int or value < 1) for value in sizes):
        return
    if dtype in (None, "auto"):
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    itemsize = getattr(torch, str(dtype).removeprefix("torch."), torch.float32).itemsize
    parameters = estimated_parameters(config)
    needed, memory = parameters * itemsize, machine_memory_bytes()
    if needed > memory:
        raise CommandError(
            f"{what}: config.json describes {parameters:.3g} parameters, {needed / 2**30:.4g} GiB in {dtype}, more "
            f"than this machine's {memory / 2**30:.1f} GiB of memory; check its sizes (vocab_size, hidden_size, "
            "intermediate_size, num_hidden_layers)."
        )


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
    """`path` is a folder that can be written, or one that can be created in a writable folder (created if
    missing; `path` itself is created by the writing, so a run refused later leaves no empty folder behind)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CommandError(f"{flag} {path}: is a file; pass a folder (it is created if missing).")
    _check_writable_folder(path if path.is_dir() else path.parent, flag, path)
    return path


def _check_writable_folder(folder: Path, flag: str, shown: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise CommandError(f"{flag} {shown}: cannot be written ({first_line(error)}); choose another path.") from None


@contextlib.contextmanager
def staged_output(target: str | Path, flag: str) -> Iterator[Path]:
    """A path to write an output (a file, or a folder the caller creates) into, next to `target`; when the block
    completes, the output is moved onto `target` (`move_into_place`), so a failed or interrupted write (a full disk)
    never leaves a partial output there. On an error the staged output is deleted, and an OSError (or safetensors'
    error for one) becomes a `CommandError` naming `flag`."""
    shown, target = target, Path(target).resolve()  # `.` has a parent
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as error:
        raise CommandError(f"{flag} {shown}: cannot be written ({first_line(error)}); choose another path.") from None
    staged = staging / target.name
    try:
        yield staged
        move_into_place(staged, target)
    except Exception as error:
        from safetensors import SafetensorError  # what safetensors raises for an I/O error (ENOSPC) while writing

        if not isinstance(error, (OSError, SafetensorError)):
            raise
        reason = first_line(error)
        raise CommandError(f"{flag} {shown}: writing it failed ({reason}); nothing was written there.") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def move_into_place(staged: Path, target: Path) -> None:
    """Move a complete output (a file or a folder) onto `target`, by renames. A folder's entries replace the
    same-named ones of an existing `target` folder, which stays (it may be the working directory); its other files
    are kept."""
    if staged.is_dir() and target.is_dir():
        for entry in staged.iterdir():
            existing = target / entry.name
            if existing.is_dir() and not existing.is_symlink():
                shutil.rmtree(existing)
            os.replace(entry, existing)
    else:
        os.replace(staged, target)
