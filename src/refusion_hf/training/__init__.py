"""ReFusion training: the slot-permutation data collator (optionally packing examples into rows), a packing
collator for stock causal LMs (the AR baseline), SFT data loading, a `Trainer` that logs both loss parts,
and checkpoint conversion. The loss itself lives with the model (`modeling/refusion_loss.py`) so that exported
remote-code models train too.

`RefusionTrainer` / `RefusionEpochCallback` / `RefusionSFTTrainer` (TRL) / `RefusionTrainingArguments` are imported
on first use (importing `transformers.Trainer` costs time that `import refusion_hf` for inference should not pay)."""

from .collator import RefusionDataCollator
from .data import DataFormatError, RefusionSFTDataset, load_sft_dataset
from .packing import PackedCausalLMCollator

_LAZY = {
    "CheckpointWriteError": "trainer",
    "RefusionTrainer": "trainer",
    "RefusionEpochCallback": "trainer",
    "RefusionSFTTrainer": "sft",
    "RefusionSFTCollator": "sft",
    "RefusionTrainingArguments": "arguments",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointWriteError",
    "DataFormatError",
    "PackedCausalLMCollator",
    "RefusionDataCollator",
    "RefusionEpochCallback",
    "RefusionSFTCollator",
    "RefusionSFTDataset",
    "RefusionSFTTrainer",
    "RefusionTrainer",
    "RefusionTrainingArguments",
    "load_sft_dataset",
]
