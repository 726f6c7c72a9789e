"""`RefusionTrainer`: the stock `Trainer` with the few things ReFusion training needs.

What it adds, and nothing else (the training loop, `accelerate`, PEFT, gradient checkpointing, checkpointing and
resuming are the stock ones):

* the two parts of the loss (`ar_loss`, `mdm_loss`, averaged like `loss` over the micro-batches since the last
  log, and over processes) are logged next to `loss`, so they reach the progress display, every reporting
  integration and `trainer_state.json`. A subclass is needed for that: callbacks never see the model's outputs,
  and by the time `on_log` runs the log line is already in `log_history`;
* the loss is a per-micro-batch mean (the authors' normalisation): `num_items_in_batch` is never passed to the
  model and the Trainer divides by the gradient-accumulation steps itself (`loss_is_scaled_for_ga = False`);
* `prompt_length` is kept when `remove_unused_columns` prunes dataset columns (the collator needs it);
* the collator's epoch follows the training loop (`RefusionEpochCallback`), so seeded draws differ per epoch and a
  resumed run draws exactly what the uninterrupted run drew;
* `data_collator` defaults to a `RefusionDataCollator` over `processing_class` and the model's mask token, seeded
  with `args.data_seed` (or `args.seed`), with the data options of `args` when they are `RefusionTrainingArguments`
  (an explicit collator that disagrees with them is refused);
* accelerate's engines (training/engines.py): FSDP asked for in a CPU run runs as FSDP2 (accelerate would run plain
  DDP), DeepSpeed there is refused; a model you save under FSDP is one full state dict (a from_pretrained folder),
  checkpoints keep the engine's sharded format;
* label smoothing and `compute_loss_func` are refused (either would replace the ReFusion loss; the label
  smoother also assumes shifted causal-LM labels);
* `create_model_card` writes the ReFusion card (`hub_card`, the one `refusion publish` writes) from the live
  training state into `output_dir`, as trl's trainers do; `push_to_hub` calls it too. `save_model()` and every
  checkpoint write the card of what they saved (README.md, the training details up to that step);
* a checkpoint whose save fails (a full disk: safetensors, `torch.save` and the JSON writes each fail their own way)
  is removed, so no half-written `checkpoint-N` is left beside the complete ones, and the failure is raised as one
  `CheckpointWriteError` naming the folder (`refusion train` prints it as one line). A run killed mid-save can still
  leave one: `refusion train --resume-from-checkpoint last` skips it.

The stock `Trainer` also trains a ReFusion model correctly with `RefusionDataCollator` (set
`remove_unused_columns=False`, add `RefusionEpochCallback`); it just does not log the two parts.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from .._compat.transformers import add_signature_columns, output_dir, save_stock_checkpoint
from ..errors import first_line
from .arguments import RefusionTrainingArguments
from .collator import RefusionDataCollator
from .engines import full_state_dict, holds_engine_checkpoint, use_requested_engine_on_cpu

logger = logging.get_logger(__name__)

LOSS_PARTS = ("ar_loss", "mdm_loss")
COLLATOR_COLUMNS = ("input_ids", "prompt_length")


DISK_FULL_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (an I/O error: a full disk...); its partial folder has been removed."""

    def __init__(self, folder: Path, cause: BaseException, free_bytes: int | None):
        self.folder, self.cause, self.free_bytes = folder, cause, free_bytes
        self.disk_full = getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
            text in str(cause) for text in DISK_FULL_TEXTS
        )
        free = "" if free_bytes is None else f"; {free_bytes / 2**20:.1f} MiB were free there when it failed"
        super().__init__(
            f"{'the disk is full: ' if self.disk_full else ''}writing the checkpoint {folder.name} failed "
            f"({type(cause).__name__}: {first_line(cause)}{free}); the partial {folder.name} was removed"
        )


def is_write_failure(error: BaseException) -> bool:
    """Whether `error` is how a file write fails: an `OSError`, safetensors' own error, or the `RuntimeError` of
    torch's serializer (`torch.save` on a full disk: "unexpected pos ...", "file write failed")."""
    if isinstance(error, (OSError, SafetensorError)):
        return True
    return isinstance(error, RuntimeError) and any(
        text in str(error) for text in ("inline_container", "PytorchStreamWriter", "file write failed")
    )


class RefusionEpochCallback(TrainerCallback):
    """Tells a collator with `set_epoch` which epoch the training loop is starting (also after a resume)."""

    def __init__(self, collator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        # `state.epoch` is `epoch + fraction done`; at the start of an epoch (fresh, or resumed mid-epoch from a
        # checkpoint) its integer part is the epoch the loop is entering.
        self.collator.set_epoch(math.floor(state.epoch or 0))


class RefusionTrainer(Trainer):
    """A `Trainer` that logs ReFusion's `ar_loss` and `mdm_loss` (see the module docstring for everything it adds)."""

    loss_is_scaled_for_ga = False

    def __init__(self, model=None, args=None, data_collator=None, *positional, **kwargs):
        super().__init__(model, args, data_collator, *positional, **kwargs)
        if self.args.label_smoothing_factor:
            raise ValueError(
                f"label_smoothing_factor is {self.args.label_smoothing_factor}, but the Trainer's label smoother "
                "assumes shifted causal-LM labels and would replace the ReFusion loss; set it to 0."
            )
        if self.compute_loss_func is not None:
            raise ValueError(
                "compute_loss_func would replace the ReFusion loss (ar_loss + mdm_loss, which the model computes from "
                "the collator's mdm_weights); drop it, or train another loss with transformers.Trainer."
            )
        if data_collator is None:
            self.data_collator = self._default_collator()
        else:
            self._check_collator_matches_args(data_collator)
        if hasattr(self.data_collator, "set_epoch"):
            self.add_callback(RefusionEpochCallback(self.data_collator))
        self._loss_part_sums = None
        self._loss_part_count = 0
        self._card_problems: set[str] = set()  # why a save got no card, each said once

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        use_requested_engine_on_cpu(self)  # FSDP / DeepSpeed asked for on CPU: run it or refuse (engines.py)

    def _default_collator(self) -> RefusionDataCollator:
        config = getattr(self.model, "config", None)
        mask_token_id = getattr(config, "mask_token_id", None)
        if isinstance(self.args, RefusionTrainingArguments):
            return self.args.data_collator(self.processing_class, mask_token_id)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return RefusionDataCollator(self.processing_class, mask_token_id=mask_token_id, seed=seed)

    def _check_collator_matches_args(self, collator) -> None:
        if not isinstance(self.args, RefusionTrainingArguments) or not isinstance(collator, RefusionDataCollator):
            return
        wanted = self.args.data_collator(mask_token_id=collator.mask_token_id)
        differing = [name for name in self.args.DATA_OPTIONS if getattr(collator, name) != getattr(wanted, name)]
        if differing:
            raise ValueError(
                f"args sets {', '.join(differing)} differently from the data_collator given; set them in one place "
                "(pass no data_collator to use the arguments', or leave the arguments at their defaults)."
            )

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        add_signature_columns(self, COLLATOR_COLUMNS)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # `Trainer.compute_loss` by name: the model's own loss, also in `RefusionSFTTrainer`, where `super()` would be
        # TRL's token-level loss (which shifts the collator's unshifted targets).
        loss, outputs = Trainer.compute_loss(self, model, inputs, return_outputs=True, num_items_in_batch=None)
        parts = [outputs.get(name) if isinstance(outputs, dict) else None for name in LOSS_PARTS]
        if "mdm_weights" in inputs and any(part is None for part in parts):
            raise ValueError(
                f"The model ({type(model).__name__}) ignored `mdm_weights` and returned no `ar_loss` / `mdm_loss`: "
                "train a `RefusionForCausalLM` (convert an autoregressive checkpoint with `refusion convert`)."
            )
        if model.training and all(part is not None for part in parts):
            values = torch.stack([part.detach().float() for part in parts])
            self._loss_part_sums = values if self._loss_part_sums is None else self._loss_part_sums + values
            self._loss_part_count += 1
        return (loss, outputs) if return_outputs else loss

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """Write the ReFusion model card of the saved model (or adapter) in `output_dir`, with this run's training
        details. `model_name` titles it, `license`, `finetuned_from` (a Hub id: the base model) and `dataset` /
        `dataset_tags` (Hub dataset ids) go into its metadata. The card sets its own tags and task, so `language`,
        `tags`, `tasks` and `dataset_args` are refused. An adapter's card needs `finetuned_from` unless the adapter
        records a Hub id as its base."""
        if not self.is_world_process_zero():
            return
        refused = [name for name, value in (("language", language), ("tags", tags), ("tasks", tasks),
                                            ("dataset_args", dataset_args)) if value]  # fmt: skip
        if refused:
            raise ValueError(
                f"create_model_card: {', '.join(refused)} cannot go on the ReFusion card (it sets its own tags and "
                "task); drop them, or edit the README.md it writes."
            )
        datasets = []
        for names in (dataset_tags, dataset):
            datasets += [names] if isinstance(names, str) else list(names or [])
        folder = Path(self.args.output_dir)
        card = self._model_card(folder, model_name=model_name, finetuned_from=finetuned_from, license=license,
                                datasets=list(dict.fromkeys(datasets)) or None)  # fmt: skip
        card.save(folder / "README.md")

    def _model_card(self, folder: Path, *, model_name=None, finetuned_from=None, license=None, datasets=None):
        """The ReFusion card of the model or adapter saved in `folder`, with the training state so far."""
        from ..hub_card import build_adapter_card, build_model_card
        from ..hub_card.card import check_hub_id
        from ..hub_card.sources import training_summary

        common = {
            "training": training_summary(dataclasses.asdict(self.state)),
            "datasets": datasets,
            "name": model_name,
            **({"license": license} if license else {}),
        }
        if (folder / "adapter_config.json").exists():
            recorded = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
            base = finetuned_from or recorded
            if not base:
                raise ValueError(
                    "create_model_card: the adapter records no base model; pass finetuned_from='namespace/base-model' "
                    "(the card tells users which model to load it on)."
                )
            check_hub_id(base, "create_model_card: the adapter's base model (pass finetuned_from)", "namespace/base")
            return build_adapter_card(folder, base_model=base, **common)
        return build_model_card(folder, base_model=finetuned_from, **common)

    def _save_checkpoint(self, model, trial) -> None:
        """The stock checkpoint, then its ReFusion card (training details up to this step), so that every checkpoint
        is a complete folder to publish (except under FSDP / DeepSpeed, whose checkpoints hold the engine's shards,
        not a from_pretrained folder: no card). `Trainer._save_checkpoint` by name: TRL's (in `RefusionSFTTrainer`)
        writes its own card into `output_dir` first, before any model is saved there.

        A save that fails removes the checkpoint folder (see the module docstring); a write failure is raised as
        `CheckpointWriteError`."""
        folder = Path(output_dir(self, trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        try:
            save_stock_checkpoint(self, model, trial)
            self._write_card(folder)
        except Exception as error:
            try:  # before the removal frees the partial files' space
                free = shutil.disk_usage(folder.parent).free
            except OSError:
                free = None
            shutil.rmtree(folder, ignore_errors=True)
            if is_write_failure(error):
                raise CheckpointWriteError(folder, error, free) from error
            raise

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The stock save; a save you ask for (not a checkpoint's or `push_to_hub`'s) is a normal `from_pretrained`
        folder also under FSDP with a sharded state dict (checkpoints keep the engine's format, which resuming reads),
        and gets the ReFusion card next to the model."""
        if _internal_call:
            super().save_model(output_dir, _internal_call)
            return
        with full_state_dict(self):
            super().save_model(output_dir, _internal_call)
        self._write_card(Path(output_dir or self.args.output_dir))

    def _write_card(self, folder: Path) -> None:
        """The ReFusion card of the model just saved in `folder`, when it can be built; else a warning says why (once
        per reason: it is the same at every save)."""
        if not self.is_world_process_zero():
            return
        if (folder / "tokenizer_config.json").is_file():
            hub_id = self.args.hub_model_id
            name = hub_id.rsplit("/", 1)[-1] if hub_id else Path(self.args.output_dir).resolve().name
            try:
                card = self._model_card(folder, model_name=name)
            except ValueError as error:  # e.g. an adapter of a local base model: the card needs its Hub id
                reason = f"{error} Call trainer.create_model_card(...) after saving."
            else:
                card.save(folder / "README.md")
                return
        elif holds_engine_checkpoint(folder):  # FSDP / DeepSpeed shards: no from_pretrained folder to describe
            return
        else:
            reason = "no tokenizer was saved with it (pass processing_class=)."
        if reason not in self._card_problems:
            self._card_problems.add(reason)
            logger.warning("No model card in %s (nor in later saves, for the same reason): %s", folder, reason)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._loss_part_count:
            means = self._loss_part_sums / self._loss_part_count
            means = self.accelerator.gather(means.unsqueeze(0)).mean(dim=0)
            self._loss_part_sums, self._loss_part_count = None, 0
            ordered = {}
            for key, value in logs.items():
                ordered[key] = value
                if key == "loss":
                    ordered.update(zip(LOSS_PARTS, means.tolist()))
            logs = ordered
        super().log(logs, start_time)


__all__ = ["CheckpointWriteError", "RefusionEpochCallback", "RefusionTrainer"]
