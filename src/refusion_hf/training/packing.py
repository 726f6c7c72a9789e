"""Packing a batch's examples into rows of a fixed length, so a training step computes little padding.

Padding a batch to its longest example wastes the compute of every padded position: on the synthetic suite
(batches of 32 examples of 69 tokens on average, 120 at most) a padded batch holds 1.40x the real tokens. Packing
the same examples into rows (first-fit decreasing) keeps each example's loss exactly (an example attends only to
itself and keeps its own position ids) and computes 1.23x / 1.15x / 1.09x the real tokens in rows of 128 / 192 /
256. Longer rows cost more attention per token; a training step of the default model is 1.21x (ReFusion) and
1.18x (autoregressive) faster than padded in rows of 192 (`benchmarks/packing_speed.py`, in git at 7247c5f).

* `plan_packed_rows`: which examples share a row.
* `PackedCausalLMCollator`: plain causal-LM batches for stock models (the AR baseline). It marks where each example
  starts by restarting `position_ids` at 0 and passes no `attention_mask`: transformers then builds the
  block-diagonal causal mask itself, for every attention implementation ("padding-free" training, as with the
  stock `DataCollatorWithFlattening`; that one packs the whole batch into ONE row, which suits flash-attention's
  variable-length kernels but makes sdpa attend densely over all of the batch's tokens).
* `RefusionDataCollator(packing_length=...)` packs ReFusion rows; their positions are permuted, so it passes an
  explicit 4D mask built by `block_causal_mask` instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
from transformers.data.data_collator import DataCollatorMixin

from ..modeling.refusion_loss import IGNORE_INDEX


def plan_packed_rows(lengths: Sequence[int], row_length: int) -> list[list[int]]:
    """Indices of the examples in each row: first-fit decreasing into rows of `max(row_length, longest)` tokens.

    Deterministic (ties keep the input order); each example appears in exactly one row, whole.
    """
    if row_length < 1:
        raise ValueError(f"packing_length must be a positive number of tokens, got {row_length!r}.")
    capacity = max([row_length, *lengths])
    rows: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for row, space in enumerate(free):
            if lengths[index] <= space:
                rows[row].append(index)
                free[row] -= lengths[index]
                break
        else:
            rows.append([index])
            free.append(capacity - lengths[index])
    return rows


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """segment_ids `[R, L]` (equal ids = one example) -> bool `[R, 1, L, L]`: True where query i may attend key j,
    i.e. j <= i in buffer order and both in the same segment. Every position attends at least to itself."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same_segment & causal)[:, None]


def padded_width(rows: list[list[int]], lengths: Sequence[int], pad_to_multiple_of: int | None) -> int:
    width = max(sum(lengths[i] for i in row) for row in rows)
    if pad_to_multiple_of:
        width = math.ceil(width / pad_to_multiple_of) * pad_to_multiple_of
    return width


@dataclass
class PackedCausalLMCollator(DataCollatorMixin):
    """
    Causal-LM batches with the examples packed into rows of `packing_length` tokens, for stock models.

    Args:
        tokenizer (`PreTrainedTokenizerBase`, *optional*): source of the default `pad_token_id`.
        packing_length (`int`): tokens per row; a longer example gets a row of its own length.
        pad_token_id (`int`, *optional*): defaults to the tokenizer's pad token, else its EOS token.
        pad_to_multiple_of (`int`, *optional*): pad the rows to a multiple of this length.
        return_tensors (`str`, defaults to `"pt"`): `"pt"` or `"np"`.

    Input features: `input_ids` and optionally `labels` (unshifted, as for `DataCollatorForSeq2Seq`; -100 = no
    loss; defaults to `input_ids`).

    Output batch (`[rows, width]`): `input_ids`, `labels` (the first token of every example gets -100, so no
    example is trained to predict the next one's start), `position_ids` (0, 1, ... per example; padding is a
    sequence of its own), and `use_cache=False`. No `attention_mask`: transformers derives the block-diagonal
    causal mask from the position restarts, but only when the forward has no cache, and a model whose config has
    `use_cache=True` (the default) creates one even in training: the packed examples would then silently attend
    to each other (measured with transformers 5.24), hence `use_cache=False` in every batch.
    This is for models that read position restarts this way: stock transformers models, and `RefusionForCausalLM`
    trained autoregressively (its batches without `mdm_weights` are read as stock); ReFusion batches are packed by
    `RefusionDataCollator(packing_length=...)`, whose permuted positions need its explicit mask.
    """

    tokenizer: Any = None
    _: KW_ONLY
    packing_length: int
    pad_token_id: int | None = None
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __post_init__(self):
        tokenizer = self.tokenizer
        if self.pad_token_id is None and tokenizer is not None:
            self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_token_id is None:
            raise ValueError("pad_token_id: give one, or a tokenizer with a pad or EOS token.")
        length = self.packing_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"packing_length must be a positive number of tokens, got {length!r}.")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive integer or None, got {self.pad_to_multiple_of!r}.")
        if self.return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt' or 'np', got {self.return_tensors!r}.")
        self.pad_token_id = int(self.pad_token_id)

    def numpy_call(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            name: value.numpy() if isinstance(value, torch.Tensor) else value
            for name, value in self.torch_call(features).items()
        }

    def torch_call(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if not features:
            raise ValueError("PackedCausalLMCollator got an empty batch.")
        examples = []
        for index, feature in enumerate(features):
            if not isinstance(feature, dict) or "input_ids" not in feature:
                raise ValueError(f"feature {index}: PackedCausalLMCollator needs `input_ids`.")
            input_ids = torch.as_tensor(feature["input_ids"], dtype=torch.long).flatten()
            labels = torch.as_tensor(feature.get("labels", input_ids), dtype=torch.long).flatten()
            if len(input_ids) == 0 or labels.shape != input_ids.shape:
                raise ValueError(
                    f"feature {index}: `input_ids` must be non-empty and `labels` as long as it, got "
                    f"{len(input_ids)} and {len(labels)} tokens."
                )
            labels = labels.clone()
            labels[0] = IGNORE_INDEX
            examples.append((input_ids, labels))
        lengths = [len(ids) for ids, _ in examples]
        rows = plan_packed_rows(lengths, self.packing_length)
        width = padded_width(rows, lengths, self.pad_to_multiple_of)
        batch = {
            "input_ids": torch.full((len(rows), width), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long),
            "position_ids": torch.zeros((len(rows), width), dtype=torch.long),
        }
        for r, row in enumerate(rows):
            start = 0
            for index in row:
                input_ids, labels = examples[index]
                end = start + len(input_ids)
                batch["input_ids"][r, start:end] = input_ids
                batch["labels"][r, start:end] = labels
                batch["position_ids"][r, start:end] = torch.arange(len(input_ids))
                start = end
            batch["position_ids"][r, start:] = torch.arange(width - start)  # padding: a sequence of its own
        batch["use_cache"] = False
        return batch


__all__ = ["PackedCausalLMCollator", "block_causal_mask", "plan_packed_rows"]
