"""`refusion train`'s options, declared once as dataclasses that transformers' `HfArgumentParser` turns into flags:
`RefusionTrainingArguments` is `TrainingArguments` plus ReFusion's data options (what trl's `SFTConfig` is to
supervised fine-tuning), `RefusionModelArguments` the model, the data file and the LoRA adapter (as trl's
`ModelConfig`, under this project's flag names).

transformers parses (dashes or underscores), documents and validates its own fields; peft builds the adapter from
`RefusionModelArguments.lora_config()`. Added here: the checks of ReFusion's fields, each a ValueError naming its
flag, and `TrainArgumentParser`, whose errors are the one line every `refusion` command prints.
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass, field

from transformers import HfArgumentParser, TrainingArguments

from .collator import DEFAULT_EPS, DEFAULT_SLOT_SIZES, RefusionDataCollator
from .data import DEFAULT_MAX_LENGTH

DEFAULT_LORA_TARGET_MODULES = "q_proj,k_proj,v_proj,o_proj"


@dataclass
class RefusionModelArguments:
    """What to train, on what, and whether as a LoRA adapter."""

    model: str = field(metadata={"help": "ReFusion checkpoint folder or Hub id (see `refusion convert`)"})
    data: str = field(metadata={"help": 'JSON / JSONL of {"query", "response"} or {"messages"} records'})
    lora: bool = field(default=False, metadata={"help": "train a LoRA adapter (PEFT) instead of all weights"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_alpha: float = field(default=16, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout"})
    lora_target_modules: str = field(
        default=DEFAULT_LORA_TARGET_MODULES, metadata={"help": "comma-separated module names the adapter wraps"}
    )

    def __post_init__(self):
        if self.lora and not self.target_modules():
            raise ValueError("--lora-target-modules is empty; name modules like 'q_proj,k_proj,v_proj,o_proj'.")
        if self.lora and self.lora_r < 1:
            raise ValueError(f"--lora-r must be a positive integer, got {self.lora_r}.")

    def target_modules(self) -> list[str]:
        return [name.strip() for name in self.lora_target_modules.split(",") if name.strip()]

    def lora_config(self):
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=self.target_modules(),
            task_type="CAUSAL_LM",
        )


@dataclass
class RefusionTrainingArguments(TrainingArguments):
    """`TrainingArguments` with ReFusion's data options (the collator's slot sizes, masking floor, share of plain
    autoregressive examples, packing) and the length filter."""

    output_dir: str | None = field(
        default=None, metadata={"help": "where the model (or adapter), tokenizer and state go", "required": True}
    )
    slot_sizes: str = field(
        default=",".join(map(str, DEFAULT_SLOT_SIZES)),
        metadata={"help": "comma-separated slot sizes; each example draws one"},
    )
    packing_length: int | None = field(
        default=None,
        metadata={
            "help": "pack each batch's examples into rows of this many tokens (each example still attends only to "
            "itself, so the loss is unchanged) instead of padding every example to the longest"
        },
    )
    eps: float = field(default=DEFAULT_EPS, metadata={"help": "p_mask = (1 - eps) t + eps"})
    ar_fraction: float = field(
        default=0.0,
        metadata={
            "help": "share of examples trained as plain autoregressive ones, so predictions across slot boundaries "
            "keep being trained (0: the paper's recipe)"
        },
    )
    max_length: int = field(default=DEFAULT_MAX_LENGTH, metadata={"help": "skip longer examples (tokens)"})

    def __post_init__(self):
        self.slot_size_values  # noqa: B018 - raises for a malformed list
        if self.packing_length is not None and self.packing_length < 1:
            raise ValueError(f"--packing-length must be a positive number of tokens, got {self.packing_length}.")
        if not 0.0 <= self.ar_fraction <= 1.0:
            raise ValueError(f"--ar-fraction must lie in [0, 1], got {self.ar_fraction}.")
        if not 0.0 < self.eps <= 1.0:
            raise ValueError(f"--eps must lie in (0, 1], got {self.eps}.")
        super().__post_init__()

    @property
    def slot_size_values(self) -> tuple[int, ...]:
        try:
            sizes = tuple(int(part) for part in self.slot_sizes.split(","))
        except ValueError:
            sizes = ()
        if not sizes or any(size < 1 for size in sizes):
            raise ValueError(
                f"--slot-sizes must be comma-separated positive integers like '4,8,16,32', got {self.slot_sizes!r}."
            )
        return sizes

    DATA_OPTIONS = ("slot_sizes", "eps", "ar_fraction", "packing_length")

    def data_collator(self, tokenizer=None, mask_token_id: int | None = None) -> RefusionDataCollator:
        """The collator these options describe, seeded with `data_seed` (else `seed`); `RefusionTrainer` builds it
        when it is given no collator."""
        return RefusionDataCollator(
            tokenizer,
            mask_token_id=mask_token_id,
            slot_sizes=self.slot_size_values,
            eps=self.eps,
            ar_fraction=self.ar_fraction,
            seed=self.data_seed if self.data_seed is not None else self.seed,
            packing_length=self.packing_length,
        )


class TrainArgumentParser(HfArgumentParser):
    """`HfArgumentParser` over both dataclasses; its errors are one line (`refusion train: error: ...`, status 2)."""

    def __init__(self, description: str | None = None):
        super().__init__(
            (RefusionModelArguments, RefusionTrainingArguments),
            prog="refusion train",
            usage="refusion train --model DIR --data FILE --output-dir DIR [ReFusion, LoRA, TrainingArguments flags]",
            description=description,
            formatter_class=functools.partial(argparse.RawDescriptionHelpFormatter, width=120),
            allow_abbrev=False,
        )
        # The ReFusion loss keeps every parameter in the graph, so DDP need not search for unused ones.
        self.set_defaults(label_names=["labels"], ddp_find_unused_parameters=False)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse(self, argv: list[str]) -> tuple[RefusionModelArguments, RefusionTrainingArguments]:
        """Both dataclasses from `argv`; ValueError (naming the flag) for a bad value or a launch without a
        distributed setup."""
        model_args, training_args, unknown = self.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
        if unknown:
            raise ValueError(
                f"unrecognized arguments: {' '.join(unknown)} (the flags are ReFusion's, the model's and "
                "TrainingArguments' fields: see `refusion train --help`)"
            )
        launched_processes = int(os.environ.get("WORLD_SIZE", "1"))
        if launched_processes > 1 and training_args.world_size == 1:
            raise ValueError(
                f"{launched_processes} processes were launched (WORLD_SIZE) but TrainingArguments sees no distributed "
                "setup, so each would train alone. Without GPUs, add `--use-cpu` (DDP over gloo), e.g. "
                "`accelerate launch --multi_gpu --num_processes 2 -m refusion_hf.cli train ... --use-cpu`."
            )
        return model_args, training_args


__all__ = ["RefusionModelArguments", "RefusionTrainingArguments", "TrainArgumentParser"]
