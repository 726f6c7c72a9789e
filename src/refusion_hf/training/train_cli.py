"""`refusion train`: fine-tune a ReFusion model (full or LoRA) on a JSON / JSONL file with the stock `Trainer`.

    refusion train --model DIR --data FILE --output-dir DIR [--lora] [--slot-sizes 4,8,16,32] [--packing-length 128] \\
        [any TrainingArguments flag: --max-steps 100 --learning-rate 1e-5 --logging-steps 10 --seed 0 \\
         --gradient-checkpointing --bf16 --resume-from-checkpoint DIR|last ...]

Multi-process: `accelerate launch --multi_gpu --num_processes N -m refusion_hf.cli train ...` (DDP; on a
machine without GPUs add the TrainingArguments flag `--use-cpu`: DDP over gloo), `torchrun`, or any other launcher
`accelerate` / `Trainer` support. (`accelerate launch --cpu --num_processes N` starts N processes only through
`mpirun` with `--mpirun_hostfile`; without it, accelerate 1.x starts a single process.)

The output directory receives the model with its remote code (or, with `--lora`, the adapter), the tokenizer and
`trainer_state.json`; checkpoints follow `--save-steps` / `--save-strategy` as usual.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoTokenizer, TrainingArguments, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..command_inputs import SEED_LIMIT, CommandError, require_extra
from ..errors import first_line
from ..modeling import RefusionForCausalLM
from ..modeling.checkpoint_checks import check_checkpoint_folder, check_tokenizer_files, check_tokenizer_fits
from ..outputs import check_output_folder, move_into_place
from .arguments import RefusionModelArguments, RefusionTrainingArguments, TrainArgumentParser
from .data import load_sft_dataset
from .engines import deepspeed_requested, engine_checkpoint_problem, holds_engine_checkpoint, torch_save_problem

FINAL_SAVE_STAGING = ".final-save.partial"  # in --output-dir, while the trained model is saved


def register(subparsers) -> None:
    # Only the command's name here: every flag (and --help) goes to `TrainArgumentParser`, the one parser of the
    # options declared in arguments.py.
    subparsers.add_parser(
        "train",
        help="fine-tune a ReFusion model (full or LoRA) with the Hugging Face Trainer",
        add_help=False,
    ).set_defaults(func=run, accepts_extra_args=True)


def resolve_checkpoint(value: str | None, output_dir: str, needs_optimizer: bool = True) -> str | None:
    """The checkpoint to resume from. `last` is the newest *complete* checkpoint-* folder of `output_dir` (a run
    killed while saving leaves a newer, half-written one: it is skipped, and a note says why)."""
    if value is None or value.lower() in ("", "false", "none"):
        return None
    if value.lower() in ("last", "latest", "true"):
        candidates = sorted(
            (path for path in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*") if path.is_dir()),
            key=lambda path: int(path.name.rsplit("-", 1)[1]) if path.name.rsplit("-", 1)[1].isdigit() else -1,
            reverse=True,
        )
        skipped = []
        for candidate in candidates:
            problem = checkpoint_problem(candidate, needs_optimizer)
            if problem is None:
                if skipped:
                    print(
                        f"[refusion train] resuming from {candidate.name}; skipped newer incomplete "
                        + "; ".join(f"{name} ({why})" for name, why in skipped),
                        file=sys.stderr,
                    )
                return str(candidate)
            skipped.append((candidate.name, problem))
        found = f" ({'; '.join(f'{name}: {why}' for name, why in skipped)})" if skipped else ""
        raise CommandError(
            f"--resume-from-checkpoint {value}: {output_dir} holds no complete checkpoint-* folder{found}; pass a "
            "checkpoint path, or start without --resume-from-checkpoint."
        )
    if not os.path.isdir(value):
        raise CommandError(
            f"--resume-from-checkpoint: {value!r} is not a folder; pass a checkpoint-* folder or 'last'."
        )
    problem = checkpoint_problem(Path(value), needs_optimizer)
    if problem is not None:
        raise CommandError(f"--resume-from-checkpoint {value}: incomplete checkpoint ({problem}).")
    return value


def checkpoint_problem(folder: Path, needs_optimizer: bool = True) -> str | None:
    """Why `folder` is not a complete Trainer checkpoint (None when it is): the files a save writes, each whole."""
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME

    state = folder / TRAINER_STATE_NAME
    try:
        json.loads(state.read_text())
    except (OSError, ValueError):
        return f"{TRAINER_STATE_NAME} missing or unreadable"
    weights = [folder / name for name in ("model.safetensors", "adapter_model.safetensors") if (folder / name).exists()]
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weights += [folder / name for name in set(json.loads(index.read_text())["weight_map"].values())]
        except (OSError, ValueError, KeyError):
            return f"{index.name} unreadable"
    engine = holds_engine_checkpoint(folder)  # FSDP's or DeepSpeed's own format: model and optimizer in it
    if not weights and not engine:
        return "no weights"
    for path in weights:
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # noqa: BLE001 - a truncated or missing shard, whatever safetensors raises
            return f"{path.name} incomplete ({first_line(error)})"
    problem = engine_checkpoint_problem(folder, needs_optimizer) if engine else None
    if problem:
        return problem
    pickled = [OPTIMIZER_NAME, SCHEDULER_NAME] if needs_optimizer else []
    if engine:  # the engine saved the optimizer (DeepSpeed also the scheduler) in its format, checked above
        pickled = [] if (folder / "latest").is_file() else pickled[1:]
    for path in [folder / name for name in pickled] + sorted(folder.glob("rng_state*.pth")):
        problem = torch_save_problem(path)
        if problem:
            return problem
    return None


def load_model(model_args: RefusionModelArguments, training_args: TrainingArguments):
    model_path = model_args.model
    check_checkpoint_folder(model_path, "--model", "float32")  # Trainer trains in float32 (--bf16: autocast)
    check_tokenizer_files(model_path, "--model")
    try:
        model = RefusionForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    except (OSError, ValueError, SafetensorError) as error:
        raise CommandError(f"--model {model_path}: the checkpoint does not load ({first_line(error)}).") from None
    try:
        model.config.require_mask_token_id("ReFusion training")
    except ValueError as error:
        raise CommandError(f"--model {model_path}: {error}") from None
    if not model_args.lora:
        return model
    from peft import get_peft_model

    # peft matches each name against the end of the modules' names, and ignores a name that matches none
    modules = dict(model.named_modules())
    unmatched = [
        target
        for target in model_args.target_modules()
        if not any(name == target or name.endswith(f".{target}") for name in modules)
    ]
    if unmatched:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in modules.items() if isinstance(m, torch.nn.Linear)})
        raise CommandError(
            f"--lora-target-modules: {', '.join(unmatched)} names no module of the model; its linear layers are "
            f"{', '.join(linear)}."
        )
    if training_args.gradient_checkpointing:
        model.enable_input_require_grads()  # frozen embeddings: let checkpointed blocks see a grad-requiring input
    return get_peft_model(model, model_args.lora_config())


def parse_arguments(argv: list[str]) -> tuple[RefusionModelArguments, RefusionTrainingArguments]:
    try:
        model_args, training_args = TrainArgumentParser(__doc__).parse(argv)
    except ValueError as error:
        raise CommandError(first_line(error)) from None
    for name in ("seed", "data_seed"):  # transformers' set_seed raises on a seed numpy does not take, mid-run
        value = getattr(training_args, name)
        if value is not None and not 0 <= value < SEED_LIMIT:
            flag = f"--{name.replace('_', '-')}"
            raise CommandError(f"{flag} must be an integer from 0 to {SEED_LIMIT - 1}, got {value}.")
    return model_args, training_args


def save_final_model(trainer, output_dir: Path) -> None:
    """`trainer.save_model` into a staging folder of `output_dir`, whose files move up into `output_dir` once the
    save is complete: a failed save (a full disk) leaves no partial model there. (The Trainer's checkpoints are its
    own; resuming skips an incomplete one.) Every process takes part in the save: FSDP and DeepSpeed gather the
    weights."""
    staging = output_dir / FINAL_SAVE_STAGING
    try:
        trainer.save_model(str(staging))
        trainer.accelerator.wait_for_everyone()
        if trainer.is_world_process_zero():
            move_into_place(staging, output_dir)
    except (OSError, SafetensorError) as error:  # safetensors raises its own error for ENOSPC
        raise CommandError(
            f"--output-dir {output_dir}: saving the trained model failed ({first_line(error)}); nothing of it was "
            "written there (the Trainer's checkpoints are kept: --resume-from-checkpoint last)."
        ) from None
    finally:
        if trainer.is_world_process_zero():
            shutil.rmtree(staging, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    if deepspeed_requested(getattr(args, "extra_args", [])):  # else transformers fails parsing, with a traceback
        require_extra("deepspeed", "deepspeed")
    require_extra("train", "accelerate")  # else TrainingArguments fails parsing, with a traceback
    model_args, training_args = parse_arguments(getattr(args, "extra_args", []))
    if model_args.lora:
        require_extra("train", "peft")
    from .trainer import CheckpointWriteError, RefusionTrainer

    output_dir = training_args.output_dir
    resume = resolve_checkpoint(
        training_args.resume_from_checkpoint, output_dir, needs_optimizer=not training_args.save_only_model
    )
    set_seed(training_args.seed)

    check_output_folder(output_dir, "--output-dir")
    model = load_model(model_args, training_args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise CommandError(f"--model {model_args.model}: the tokenizer does not load ({first_line(error)}).") from None
    check_tokenizer_fits(tokenizer, model.get_input_embeddings().weight.shape[0], f"--model {model_args.model}")
    mask_token_id = model.config.mask_token_id
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id != mask_token_id:
        raise CommandError(
            f"--model: the config's mask_token_id is {mask_token_id} but the tokenizer's mask token "
            f"{tokenizer.mask_token!r} has id {tokenizer.mask_token_id}; fix one of them."
        )
    try:
        dataset = load_sft_dataset(model_args.data, tokenizer, max_length=training_args.max_length)
    except (OSError, ValueError) as error:
        raise CommandError(f"--data {model_args.data}: {first_line(error)}") from None
    slot_sizes = training_args.slot_size_values
    try:
        trainer = RefusionTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer)
    except ValueError as error:  # arguments the Trainer or the launch's engine refuse
        raise CommandError(first_line(error)) from None
    if trainer.is_world_process_zero():
        stats = dataset.stats
        print(
            f"[refusion train] {stats.kept} examples from {model_args.data} ({stats.skipped_too_long} skipped as "
            f"longer than {training_args.max_length} tokens); slot sizes {list(slot_sizes)}; "
            f"{f'{training_args.ar_fraction:.0%} plain autoregressive examples; ' if training_args.ar_fraction else ''}"
            f"{f'LoRA r={model_args.lora_r}' if model_args.lora else 'full fine-tuning'}; "
            f"{training_args.world_size} process(es)"
        )
    try:
        trainer.train(resume_from_checkpoint=resume)
    except CheckpointWriteError as error:  # the trainer removed the partial checkpoint
        advice = "free space" if error.disk_full else "check the disk (a full one fails so)"
        raise CommandError(
            f"--output-dir {output_dir}: {error}; {advice} and resume with --resume-from-checkpoint last."
        ) from None
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise CommandError(
            f"--output-dir {output_dir}: the disk is full ({first_line(error)}); free space and resume with "
            "--resume-from-checkpoint last (an incomplete checkpoint is skipped)."
        ) from None
    save_final_model(trainer, Path(output_dir))
    trainer.save_state()
    if trainer.is_world_process_zero():
        hub_base = None if Path(model_args.model).exists() else model_args.model  # a Hub id names the base
        if model_args.lora and hub_base is None:
            print(
                "[refusion train] the adapter keeps PEFT's stub card: its base is a local folder; `refusion publish "
                f"--model {output_dir} --out PUBLISH_DIR --base-model NAMESPACE/NAME` writes the ReFusion card.",
                file=sys.stderr,
            )
        else:
            trainer.create_model_card(finetuned_from=hub_base)
    trainer.accelerator.wait_for_everyone()  # no process leaves while another still writes or communicates
    return 0
