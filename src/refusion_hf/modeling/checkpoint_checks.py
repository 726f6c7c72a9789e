"""Checks of a checkpoint folder and its tokenizer before anything loads, each refused as an `InputError` naming the
flag (or argument) that gave it: a folder's config.json is validated (`RefusionConfig`'s own validation, and its
parameters against the machine's memory) before any layer is built; a folder must carry tokenizer files, and the
tokenizer must cover the embedding matrix. The commands and `loading.load_model_and_tokenizer` run them;
transformers' `from_pretrained` does the loading itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import InputError, first_line
from .configuration_refusion import SIZE_FIELDS, RefusionConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_checkpoint_folder(source: str | Path, flag: str, dtype: str | None = None) -> None:
    """A local checkpoint folder must exist and hold a readable config.json (without one, transformers builds the
    class's default config: for Qwen3 an 8B-parameter model) that `RefusionConfig` validates, describing a network
    whose parameters fit in memory in `dtype` (a name; None or "auto": the checkpoint's), and a readable
    generation_config.json if it has one. Hub ids are checked when they load."""
    path = Path(source)
    if not path.exists():
        if not str(source).startswith(("/", ".", "~")) and str(source).count("/") <= 1:
            return  # a Hub id: checked when it loads
        raise InputError(f"{flag} {source}: no such folder; pass a checkpoint folder or a Hub id.")
    if not path.is_dir():
        raise InputError(f"{flag} {source}: not a folder; pass the checkpoint's folder (config.json, weights).")
    config = path / "config.json"
    if not config.is_file():
        raise InputError(f"{flag} {source}: no config.json in the folder; pass a checkpoint folder.")
    try:
        loaded = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise InputError(f"{flag} {source}: config.json is not readable JSON ({first_line(error)}).") from None
    if not isinstance(loaded, dict):
        raise InputError(f"{flag} {source}: config.json is not a JSON object.")
    check_fits_in_memory(loaded, dtype, f"{flag} {source}")
    from huggingface_hub.errors import StrictDataclassError

    try:  # RefusionConfig's own validation, which every load runs: sizes, types
        RefusionConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, StrictDataclassError) as error:
        reason = first_line(error)
        raise InputError(f"{flag} {source}: config.json is not a valid configuration ({reason}).") from None
    generation_config = path / "generation_config.json"
    if generation_config.exists():  # transformers ignores an unreadable one silently: the decoding defaults would go
        try:
            if not isinstance(json.loads(generation_config.read_text()), dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise InputError(
                f"{flag} {source}: generation_config.json is not readable JSON ({first_line(error)}); fix or delete it."
            ) from None


def estimated_parameters(config: dict) -> int:
    """The number of parameters of the Qwen3 network a config.json describes (its values, Qwen3Config's defaults
    for those it leaves out), by arithmetic: nothing is built. `model.num_parameters()` once built."""
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

    sizes = [config.get(name) for name in SIZE_FIELDS]
    if any(value is not None and (type(value) is not int or value < 1) for value in sizes):
        return
    if dtype in (None, "auto"):
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    itemsize = getattr(torch, str(dtype).removeprefix("torch."), torch.float32).itemsize
    parameters = estimated_parameters(config)
    needed, memory = parameters * itemsize, machine_memory_bytes()
    if needed > memory:
        raise InputError(
            f"{what}: config.json describes {parameters:.3g} parameters, {needed / 2**30:.4g} GiB in {dtype}, more "
            f"than this machine's {memory / 2**30:.1f} GiB of memory; check its sizes (vocab_size, hidden_size, "
            "intermediate_size, num_hidden_layers)."
        )


def check_tokenizer_files(source: str | Path, flag: str) -> None:
    """A local folder must carry tokenizer files: without them transformers builds a near-empty tokenizer."""
    path = Path(source)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(
            f"{flag} {source}: the folder has no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the tokenizer "
            "next to the weights (`tokenizer.save_pretrained(folder)`)."
        )


def check_tokenizer_fits(tokenizer, vocab_size: int, flag: str) -> None:
    """The tokenizer must cover the embedding matrix (a tokenizer of another model, or an empty one, does not)."""
    if len(tokenizer) < 2 or len(tokenizer) * 2 < vocab_size:
        raise InputError(
            f"{flag}: the tokenizer has {len(tokenizer)} tokens for an embedding matrix of {vocab_size} rows; pass "
            "the model's own tokenizer."
        )
