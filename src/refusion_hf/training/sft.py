"""`RefusionSFTTrainer`: TRL's `SFTTrainer` training the ReFusion objective.

TRL does the rest: dataset preparation (its own tokenization and chat templating of prompt/completion and
conversational datasets, truncation), `SFTConfig`, PEFT through `peft_config`, logging, saving. What differs:

* a `messages` dataset is read the way `refusion train` reads it: the last message is the answer, the ones before
  it the prompt (it becomes a conversational prompt/completion dataset before TRL prepares it);
* batches come from `RefusionDataCollator` (slot permutation and masking, seeded), fed by `RefusionSFTCollator`,
  which reads each example's prompt length from TRL's labels (the prompt is the part before the last run of
  trainable tokens);
* the loss is the model's own ReFusion loss (`ar_loss + mdm_loss`, both logged, as `RefusionTrainer` does), not
  TRL's token-level causal-LM loss, which would shift the collator's unshifted targets.

`SFTConfig.pad_to_multiple_of` pads the batches. TRL's `packing`, `padding_free`, `loss_type="dft"` and
`completion_only_loss=False` are refused with the way to get what they do
(packing: `RefusionDataCollator(packing_length=N)`). Plain `SFTTrainer` with a ReFusion collator fails at the first
step with an error naming this class (the model refuses a ReFusion batch whose loss the trainer computes itself).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trl import SFTTrainer

from .._compat.transformers import add_signature_columns, stock_signature_columns
from ..modeling.refusion_loss import IGNORE_INDEX
from .collator import RefusionDataCollator
from .trainer import RefusionTrainer


@dataclass
class RefusionSFTCollator:
    """TRL's prepared features (`input_ids`, `labels` with -100 on the prompt) -> `RefusionDataCollator` batches."""

    collator: RefusionDataCollator

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        return self.collator([self.to_refusion_feature(feature) for feature in features])

    def set_epoch(self, epoch: int) -> None:
        self.collator.set_epoch(epoch)

    @staticmethod
    def to_refusion_feature(feature: dict[str, Any]) -> dict[str, Any]:
        input_ids = list(feature["input_ids"])
        labels = feature.get("labels")
        if labels is None:
            raise ValueError(
                "RefusionSFTTrainer needs to know where each answer starts: give a prompt/completion or messages "
                "dataset (TRL then marks the prompt with -100 labels), not plain text."
            )
        labels = list(labels)
        answer = 0
        while answer < len(labels) and labels[len(labels) - 1 - answer] != IGNORE_INDEX:
            answer += 1
        prompt_length = len(input_ids) - answer
        if answer == 0 or prompt_length == 0:
            raise ValueError("An example has no prompt or no answer after TRL's preparation; check the dataset.")
        return {"input_ids": input_ids, "prompt_length": prompt_length}


def _refuse_objective_changes(args) -> None:
    """TRL options that would change the ReFusion objective (rows of several examples, another loss, a trained
    prompt), refused by name."""
    packed = [name for name in ("packing", "eval_packing", "padding_free") if getattr(args, name, None)]
    if packed:
        raise ValueError(
            f"SFTConfig {', '.join(f'{name}=True' for name in packed)}: TRL would put several examples in one row, and "
            "the ReFusion collator needs each example's own prompt and answer. Leave them off; to pack, pass "
            "data_collator=refusion_hf.training.RefusionSFTCollator(RefusionDataCollator(tokenizer, mask_token_id=..., "
            "packing_length=N)) (examples packed under a block-diagonal attention mask)."
        )
    if getattr(args, "loss_type", "nll") not in ("nll", "chunked_nll"):
        raise ValueError(
            f"SFTConfig loss_type={args.loss_type!r}: RefusionSFTTrainer trains the model's own ReFusion loss "
            "(ar_loss + mdm_loss), not TRL's token losses; leave loss_type at 'nll'."
        )
    if getattr(args, "completion_only_loss", None) is False:
        raise ValueError(
            "SFTConfig completion_only_loss=False would train the prompt too; the ReFusion objective trains the "
            "answer, decoded after the prompt. Leave completion_only_loss at None (or True)."
        )


def _messages_as_prompt_completion(dataset):
    """A `messages` dataset as conversational prompt/completion (the last message is the answer)."""
    if dataset is None or "messages" not in dataset.column_names or "prompt" in dataset.column_names:
        return dataset
    return dataset.map(
        lambda example: {"prompt": example["messages"][:-1], "completion": example["messages"][-1:]},
        remove_columns=["messages"],
    )


class RefusionSFTTrainer(RefusionTrainer, SFTTrainer):
    """TRL's `SFTTrainer` with the ReFusion objective (see the module docstring). Arguments are `SFTTrainer`'s."""

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None, **kwargs):
        _refuse_objective_changes(args)
        train_dataset = _messages_as_prompt_completion(train_dataset)
        if isinstance(eval_dataset, dict):
            eval_dataset = {name: _messages_as_prompt_completion(data) for name, data in eval_dataset.items()}
        else:
            eval_dataset = _messages_as_prompt_completion(eval_dataset)
        super().__init__(model, args, data_collator, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)

    def _default_collator(self) -> RefusionSFTCollator:
        # SFTConfig's pad_to_multiple_of (resolved to an int or None) pads the batches, as in TRL's own collator.
        collator = super()._default_collator()
        collator = dataclasses.replace(collator, pad_to_multiple_of=getattr(self.args, "pad_to_multiple_of", None))
        return RefusionSFTCollator(collator)

    def _set_signature_columns_if_needed(self) -> None:
        stock_signature_columns(self)
        add_signature_columns(self, ("input_ids", "labels"))


__all__ = ["RefusionSFTCollator", "RefusionSFTTrainer"]
