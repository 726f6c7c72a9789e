"""Supervised fine-tuning data for ReFusion: JSON / JSONL files of prompt-answer pairs, tokenised into the
features `RefusionDataCollator` takes (`input_ids` = prompt + answer + EOS, `prompt_length`).

Accepted records (one per line in JSONL; a JSON file may also hold one array of records):

* `{"query": "...", "response": "..."}`: the authors' format;
* `{"messages": [{"role": ..., "content": ...}, ...]}`: the last message is the assistant's answer, the ones
  before it are the prompt.

The prompt goes through the tokenizer's chat template (with the generation prompt) when the tokenizer has one, and
is tokenised as plain text otherwise (then `messages` records are rejected: they need a template). The answer is
tokenised without special tokens and EOS is appended. Examples longer than `max_length` are skipped and counted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from ..modeling.loading import prompt_ids

logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 4096


class DataFormatError(ValueError):
    """A training record is malformed; the message names the file and the line (or array item)."""


@dataclass
class LoadStats:
    """What `load_sft_dataset` kept and skipped."""

    total: int = 0
    kept: int = 0
    skipped_too_long: int = 0
    longest_kept: int = 0
    skipped_at: list[str] = field(default_factory=list)  # where ("line N" / "item N") the over-long ones are


class RefusionSFTDataset(Dataset):
    """A list of `{"input_ids": [...], "prompt_length": int}` features, with the loading statistics."""

    def __init__(self, features: list[dict[str, Any]], stats: LoadStats | None = None):
        self.features = features
        self.stats = stats or LoadStats(total=len(features), kept=len(features))

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.features[index]


def read_records(path: str | Path) -> list[tuple[str, dict]]:
    """`(where, record)` pairs from a JSONL file or a JSON array file; `where` is "line N" or "item N" (1-based)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training data file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            array = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataFormatError(f"{path}: line {error.lineno}: invalid JSON ({error.msg})") from error
        return [(f"item {index}", record) for index, record in enumerate(array, start=1)]
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as error:
            raise DataFormatError(f"{path}: line {number}: invalid JSON ({error.msg})") from error
    return records


def _check_text(value: Any, path: Path, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise DataFormatError(f"{path}: {where}: {what} must be a string, got {type(value).__name__}")
    return value


def split_record(record: Any, path: Path, where: str) -> tuple[list[dict[str, str]] | str, str]:
    """The prompt (a string, or a list of chat messages) and the answer text of one record."""
    if not isinstance(record, dict):
        raise DataFormatError(f"{path}: {where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or len(messages) < 2:
            raise DataFormatError(
                f"{path}: {where}: 'messages' must be a list of at least two messages (the prompt, then the "
                "assistant's answer)"
            )
        for number, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise DataFormatError(f"{path}: {where}: message {number} must be an object with 'role' and 'content'")
            _check_text(message["content"], path, where, f"message {number} 'content'")
        if messages[-1]["role"] != "assistant":
            raise DataFormatError(
                f"{path}: {where}: the last message must be the assistant's answer (role 'assistant'), got role "
                f"{messages[-1]['role']!r}"
            )
        prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
        return prompt, messages[-1]["content"]
    if "query" in record and "response" in record:
        query = _check_text(record["query"], path, where, "'query'")
        return query, _check_text(record["response"], path, where, "'response'")
    raise DataFormatError(
        f"{path}: {where}: a record needs either 'query' and 'response' or 'messages'; got keys {sorted(record)}"
    )


def encode_prompt(tokenizer, prompt: list[dict[str, str]] | str, path: Path, where: str) -> list[int]:
    try:
        return prompt_ids(tokenizer, prompt)
    except ValueError:
        raise DataFormatError(
            f"{path}: {where}: 'messages' records need a chat template, but the tokenizer has none; set "
            "`tokenizer.chat_template` or write the data as {'query', 'response'} records"
        ) from None


def load_sft_dataset(path: str | Path, tokenizer, max_length: int = DEFAULT_MAX_LENGTH) -> RefusionSFTDataset:
    """Tokenise a JSON / JSONL training file into collator features; over-long examples are skipped and counted."""
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (one prompt token and EOS), got {max_length}.")
    eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        raise ValueError("The tokenizer has no EOS token; set `tokenizer.eos_token` (answers end with EOS).")
    path = Path(path)
    stats = LoadStats()
    features = []
    for where, record in read_records(path):
        prompt, answer = split_record(record, path, where)
        prompt_ids = encode_prompt(tokenizer, prompt, path, where)
        answer_ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"]) + [eos_token_id]
        stats.total += 1
        if len(prompt_ids) + len(answer_ids) > max_length:
            stats.skipped_too_long += 1
            stats.skipped_at.append(where)
            continue
        stats.kept += 1
        stats.longest_kept = max(stats.longest_kept, len(prompt_ids) + len(answer_ids))
        features.append({"input_ids": prompt_ids + answer_ids, "prompt_length": len(prompt_ids)})
    if stats.skipped_too_long:
        logger.warning(
            "%s: skipped %d of %d examples longer than max_length=%d tokens (first at %s)",
            path,
            stats.skipped_too_long,
            stats.total,
            max_length,
            stats.skipped_at[0],
        )
    if not features:
        raise ValueError(
            f"{path}: no usable example ({stats.total} read, {stats.skipped_too_long} longer than "
            f"max_length={max_length}); raise max_length (`--max-length`) or check the file."
        )
    logger.info("%s: %d training examples (%d skipped as too long)", path, stats.kept, stats.skipped_too_long)
    return RefusionSFTDataset(features, stats)


__all__ = ["DataFormatError", "LoadStats", "RefusionSFTDataset", "load_sft_dataset", "read_records"]
