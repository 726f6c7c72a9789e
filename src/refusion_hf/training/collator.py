"""`RefusionDataCollator`: ReFusion's slot permutation and masking, done in the data pipeline (docs/design.md §2).

The authors permute and mask inside the model's `forward`; doing it here keeps the model a plain causal LM, so the
stock `Trainer`, `accelerate` launches, PEFT and gradient checkpointing work unchanged.

Randomness. With `seed=None` the draws come from torch's global generator (seed it with `torch.manual_seed`, as
`transformers.set_seed` does). With a `seed`, the collator holds no generator state at all: each example's draws
come from a generator seeded by a hash of (seed, epoch, the batch's token ids, the example's row in the batch). So
a seeded run is reproducible; examples draw independently (two copies of one example in a batch draw differently);
and the same batch collated again gives the same output whichever process or dataloader worker collates it, or
whether it is collated after a resume from a checkpoint (the stock `Trainer` skips the batches already trained
without collating them, and pre-fetches batches before checkpoints are written, so a stateful generator could not
be restored exactly). The epoch is set by `set_epoch` (`RefusionTrainer` does it through `RefusionEpochCallback`).
The one consequence to know: within one epoch, two batches with identical contents in identical order draw the
same slots and masks (with the Trainer's shuffling this does not happen in practice).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.data.data_collator import DataCollatorMixin

from ..modeling.refusion_loss import IGNORE_INDEX
from .packing import block_causal_mask, padded_width, plan_packed_rows

DEFAULT_SLOT_SIZES = (4, 8, 16, 32)
DEFAULT_EPS = 1e-3


def _as_int_list(value: Any, what: str) -> list[int]:
    """Token ids from a list, tuple, torch tensor or numpy array (1-D)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{what} must be a sequence of token ids, got {type(value).__name__}.")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{what} must hold integer token ids (one flat sequence per feature).")
    return list(value)


@dataclass
class RefusionDataCollator(DataCollatorMixin):
    """
    Builds ReFusion training batches: `[prompt] + [clean slots, permuted] + [masked slots, in order] + [padding]`.

    Args:
        tokenizer (`PreTrainedTokenizerBase`, *optional*): source of the default `mask_token_id` and
            `pad_token_id`.
        mask_token_id (`int`, *optional*): id of `<|mask|>`; defaults to `tokenizer.mask_token_id`.
        slot_sizes (`Sequence[int]`, defaults to `(4, 8, 16, 32)`): each example draws its slot size k uniformly
            from these.
        eps (`float`, defaults to 1e-3): `p_mask = (1 - eps) * t + eps` with `t ~ U(0, 1)`.
        ar_fraction (`float`, defaults to 0): the probability that an example is collated as a plain
            autoregressive one instead (no permutation, no masks, every answer token labelled with the next one,
            the last prompt token with the first answer token), so that the prediction across slot boundaries,
            which ReFusion examples never label, keeps being trained. 0 draws exactly what the collator without
            it draws.
        seed (`int`, *optional*): makes the draws a pure function of (seed, epoch, batch); see the module docstring.
            `None` uses torch's global generator.
        pad_token_id (`int`, *optional*): defaults to the tokenizer's pad token, else its EOS, else the mask id. Padding
            is never attended to by real tokens (right padding, causal attention) and never labelled.
        pad_to_multiple_of (`int`, *optional*): pad every batch to a multiple of this length.
        packing_length (`int`, *optional*): pack the batch's examples into rows of this many tokens (first-fit
            decreasing; a longer example gets a row of its own length) instead of one padded row per example. Each
            example keeps exactly its loss (it attends only to itself, through a 4D mask) while the step computes
            far less padding (see `training/packing.py`).
        return_tensors (`str`, defaults to `"pt"`): `"pt"` (torch tensors) or `"np"` (numpy arrays), as for the
            stock collators (`DataCollatorMixin`).

    Input features: dicts with `input_ids` (prompt + answer, the answer ending with EOS) and `prompt_length` (the
    number of prompt tokens; the answer must hold at least one token). Other keys are ignored.

    Output batch (tensors `[batch, length]`; `[rows, length]` when packing):
        * `input_ids`: the prompt untouched; then the answer cut into slots of k, the clean slots in a random
          permutation, then the masked slots in their original order with every token replaced by the mask id;
          then padding.
        * `position_ids`: every token keeps its original index; padding continues after the example's last one
          (when packing: padding counts from 0).
        * `attention_mask`: 1 for real tokens, 0 for padding (always explicit: with permuted positions and no mask,
          transformers would treat the row as packed sequences). When packing: bool `[rows, 1, length, length]`,
          True where a token may attend: causal in buffer order within its own example (padding attends to
          padding only).
        * `labels` (*not shifted*, -100 = none): in a clean slot, the next token of the same slot (the slot's last
          token has none); at a masked position, its own original token; prompt and padding have none. In a
          plain autoregressive example (`ar_fraction`): the next token, from the last prompt token on.
        * `mdm_weights` (float32): `1 / (p_mask * answer_length * num_examples)` at masked positions, 0
          elsewhere, where `num_examples` is the number of features collated together: the MDM loss is the sum
          of `mdm_weights * CE`, i.e. the authors' per-example normalisation averaged over the batch, whether or
          not the batch is packed.
    """

    tokenizer: Any = None
    mask_token_id: int | None = None
    slot_sizes: Sequence[int] = DEFAULT_SLOT_SIZES
    eps: float = DEFAULT_EPS
    ar_fraction: float = 0.0
    seed: int | None = None
    pad_token_id: int | None = None
    pad_to_multiple_of: int | None = None
    packing_length: int | None = None
    return_tensors: str = "pt"
    epoch: int = field(default=0, init=False)

    def __post_init__(self):
        if self.mask_token_id is None and self.tokenizer is not None:
            self.mask_token_id = self.tokenizer.mask_token_id
        if self.mask_token_id is None:
            raise ValueError(
                "mask_token_id: no mask token id was given and the tokenizer has no mask token. Pass "
                "`mask_token_id=model.config.mask_token_id`, or add `<|mask|>` to the checkpoint with "
                "`refusion convert`."
            )
        self.slot_sizes = tuple(self.slot_sizes)
        if not self.slot_sizes or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.slot_sizes):
            raise ValueError(f"slot_sizes must be a non-empty sequence of positive integers, got {self.slot_sizes!r}.")
        if not 0.0 < self.eps <= 1.0:
            raise ValueError(f"eps must lie in (0, 1] (p_mask = (1 - eps) * t + eps), got {self.eps!r}.")
        if isinstance(self.ar_fraction, bool) or not 0.0 <= self.ar_fraction <= 1.0:
            raise ValueError(
                f"ar_fraction must lie in [0, 1] (the share of plain autoregressive examples), got "
                f"{self.ar_fraction!r}."
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}.")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive integer or None, got {self.pad_to_multiple_of!r}.")
        length = self.packing_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise ValueError(f"packing_length must be a positive number of tokens or None, got {length!r}.")
        if self.return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt' or 'np', got {self.return_tensors!r}.")
        tokenizer = self.tokenizer
        if self.pad_token_id is None and tokenizer is not None:
            self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.mask_token_id = int(self.mask_token_id)
        self.pad_token_id = int(self.pad_token_id) if self.pad_token_id is not None else self.mask_token_id
        self.eps = float(self.eps)
        self.ar_fraction = float(self.ar_fraction)

    def set_epoch(self, epoch: int) -> None:
        """Make the (seeded) draws of this epoch differ from those of every other epoch."""
        self.epoch = int(epoch)

    def numpy_call(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        return {name: tensor.numpy() for name, tensor in self.torch_call(features).items()}

    def torch_call(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("RefusionDataCollator got an empty batch.")
        examples = [self._read_feature(index, feature) for index, feature in enumerate(features)]
        batch_digest = self._batch_digest(examples) if self.seed is not None else None
        rows = []
        for index, (input_ids, prompt_length) in enumerate(examples):
            generator = self._example_generator(batch_digest, index) if batch_digest is not None else None
            rows.append(self._build_row(input_ids, prompt_length, generator, num_examples=len(examples)))
        return self._pack(rows) if self.packing_length else self._pad(rows)

    # -- inputs ---------------------------------------------------------------------------------------------------

    @staticmethod
    def _read_feature(index: int, feature: dict[str, Any]) -> tuple[list[int], int]:
        if not isinstance(feature, dict) or "input_ids" not in feature or "prompt_length" not in feature:
            keys = sorted(feature) if isinstance(feature, dict) else type(feature).__name__
            raise ValueError(
                f"feature {index}: RefusionDataCollator needs `input_ids` and `prompt_length`, got {keys}. With "
                "`Trainer`, keep the `prompt_length` column: use `RefusionTrainer` or set "
                "`remove_unused_columns=False` in `TrainingArguments`."
            )
        input_ids = _as_int_list(feature["input_ids"], f"feature {index}: input_ids")
        prompt_length = feature["prompt_length"]
        prompt_length = int(prompt_length.item() if isinstance(prompt_length, torch.Tensor) else prompt_length)
        if not 0 <= prompt_length < len(input_ids):
            raise ValueError(
                f"feature {index}: prompt_length is {prompt_length} but input_ids has {len(input_ids)} tokens; the "
                "prompt length must be >= 0 and leave at least one answer token (the EOS)."
            )
        return input_ids, prompt_length

    def _batch_digest(self, examples: list[tuple[list[int], int]]) -> bytes:
        digest = hashlib.sha256(f"refusion-collator:{self.seed}:{self.epoch}".encode())
        for input_ids, prompt_length in examples:
            digest.update(f"|{prompt_length}:{len(input_ids)}:".encode())
            digest.update(torch.tensor(input_ids, dtype=torch.int64).numpy().tobytes())
        return digest.digest()

    @staticmethod
    def _example_generator(batch_digest: bytes, index: int) -> torch.Generator:
        seed = int.from_bytes(hashlib.sha256(batch_digest + index.to_bytes(8, "little")).digest()[:8], "little")
        return torch.Generator().manual_seed(seed & ((1 << 63) - 1))

    # -- one example ----------------------------------------------------------------------------------------------

    def _build_row(
        self, input_ids: list[int], prompt_length: int, generator: torch.Generator | None, num_examples: int
    ) -> dict:
        ids = torch.tensor(input_ids, dtype=torch.long)
        if self.ar_fraction and float(torch.rand((), generator=generator)) < self.ar_fraction:
            return self._autoregressive_row(ids, prompt_length)
        answer_length = len(input_ids) - prompt_length
        k = self.slot_sizes[int(torch.randint(len(self.slot_sizes), (1,), generator=generator))]
        t = float(torch.rand((), generator=generator))
        p_mask = (1.0 - self.eps) * t + self.eps
        num_slots = math.ceil(answer_length / k)
        slot_masked = torch.rand(num_slots, generator=generator) < p_mask
        clean_slots = torch.nonzero(~slot_masked).flatten()
        clean_slots = clean_slots[torch.randperm(len(clean_slots), generator=generator)]
        masked_slots = torch.nonzero(slot_masked).flatten()  # ascending: original order
        slot_order = torch.cat([clean_slots, masked_slots])

        # Answer tokens sorted by (rank of their slot in the new order, original index).
        answer_index = torch.arange(answer_length)
        token_slot = answer_index // k
        slot_rank = torch.empty(num_slots, dtype=torch.long)
        slot_rank[slot_order] = torch.arange(num_slots)
        answer_order = torch.argsort(slot_rank[token_slot] * answer_length + answer_index)
        positions = torch.cat([torch.arange(prompt_length), prompt_length + answer_order])

        is_masked = torch.zeros(len(input_ids), dtype=torch.bool)
        is_masked[prompt_length:] = slot_masked[token_slot]
        slot_end = torch.clamp((token_slot + 1) * k, max=answer_length)  # exclusive end, answer coordinates
        has_next_in_slot = torch.zeros(len(input_ids), dtype=torch.bool)
        has_next_in_slot[prompt_length:] = answer_index + 1 < slot_end

        # Targets in original order, then gathered into buffer order.
        next_token = torch.cat([ids[1:], ids.new_full((1,), IGNORE_INDEX)])
        targets = torch.full_like(ids, IGNORE_INDEX)
        clean_labelled = ~is_masked & has_next_in_slot
        targets[clean_labelled] = next_token[clean_labelled]
        targets[is_masked] = ids[is_masked]
        weights = torch.zeros(len(input_ids), dtype=torch.float32)
        weights[is_masked] = 1.0 / (p_mask * answer_length * num_examples)
        tokens = torch.where(is_masked, torch.full_like(ids, self.mask_token_id), ids)
        return {
            "input_ids": tokens[positions],
            "position_ids": positions,
            "labels": targets[positions],
            "mdm_weights": weights[positions],
        }

    @staticmethod
    def _autoregressive_row(ids: torch.Tensor, prompt_length: int) -> dict:
        """A plain causal-LM example in ReFusion's label convention (unshifted: the target at each position)."""
        targets = torch.full_like(ids, IGNORE_INDEX)
        targets[max(prompt_length - 1, 0) : -1] = ids[max(prompt_length, 1) :]
        return {
            "input_ids": ids,
            "position_ids": torch.arange(len(ids)),
            "labels": targets,
            "mdm_weights": torch.zeros(len(ids), dtype=torch.float32),
        }

    # -- batch ----------------------------------------------------------------------------------------------------

    def _pad(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        length = max(len(row["input_ids"]) for row in rows)
        if self.pad_to_multiple_of:
            length = math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch_size = len(rows)
        batch = {
            "input_ids": torch.full((batch_size, length), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((batch_size, length), dtype=torch.long),
            "position_ids": torch.arange(length).repeat(batch_size, 1),
            "labels": torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long),
            "mdm_weights": torch.zeros((batch_size, length), dtype=torch.float32),
        }
        for b, row in enumerate(rows):
            n = len(row["input_ids"])
            batch["input_ids"][b, :n] = row["input_ids"]
            batch["attention_mask"][b, :n] = 1
            batch["position_ids"][b, :n] = row["position_ids"]  # padding keeps arange: continues after n - 1
            batch["labels"][b, :n] = row["labels"]
            batch["mdm_weights"][b, :n] = row["mdm_weights"]
        return batch

    def _pack(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        lengths = [len(row["input_ids"]) for row in rows]
        packed_rows = plan_packed_rows(lengths, self.packing_length)
        width = padded_width(packed_rows, lengths, self.pad_to_multiple_of)
        shape = (len(packed_rows), width)
        batch = {
            "input_ids": torch.full(shape, self.pad_token_id, dtype=torch.long),
            "position_ids": torch.zeros(shape, dtype=torch.long),
            "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
            "mdm_weights": torch.zeros(shape, dtype=torch.float32),
        }
        segments = torch.full(shape, -1, dtype=torch.long)  # example index per position; padding: -1
        for r, members in enumerate(packed_rows):
            start = 0
            for index in members:
                row, end = rows[index], start + lengths[index]
                for name in batch:
                    batch[name][r, start:end] = row[name]
                segments[r, start:end] = index
                start = end
            batch["position_ids"][r, start:] = torch.arange(width - start)
        batch["attention_mask"] = block_causal_mask(segments)  # [rows, 1, width, width]
        return batch


__all__ = ["DEFAULT_EPS", "DEFAULT_SLOT_SIZES", "RefusionDataCollator"]
