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
import json
import os
import sys
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoTokenizer, HfArgumentParser, TrainingArguments, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..command_inputs import (
    CommandError,
    check_checkpoint_folder,
    check_output_folder,
    check_tokenizer_files,
    check_tokenizer_fits,
    first_line,
    require_extra,
)
from ..modeling import RefusionForCausalLM
from .collator import DEFAULT_EPS, DEFAULT_SLOT_SIZES, RefusionDataCollator
from .data import DEFAULT_MAX_LENGTH, load_sft_dataset

DEFAULT_LORA_TARGET_MODULES = "q_proj,k_proj,v_proj,o_proj"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="fine-tune a ReFusion model (full or LoRA) with the Hugging Face Trainer",
        description=__doc__.split("\n\n")[0],
        epilog="Every other flag is a TrainingArguments field, dashes or underscores "
        "(e.g. --max-steps, --learning-rate, --per-device-train-batch-size, --gradient-accumulation-steps, "
        "--logging-steps, --save-steps, --seed, --gradient-checkpointing, --bf16, --resume-from-checkpoint).",
        allow_abbrev=False,
    )
    parser.add_argument("--model", required=True, help="ReFusion checkpoint folder or Hub id (see `refusion convert`)")
    parser.add_argument("--data", required=True, help='JSON / JSONL of {"query", "response"} or {"messages"} records')
    parser.add_argument("--output-dir", required=True, help="where the model (or adapter), tokenizer and state go")
    parser.add_argument(
        "--slot-sizes",
        default=",".join(map(str, DEFAULT_SLOT_SIZES)),
        help="comma-separated slot sizes; each example draws one (default %(default)s)",
    )
    parser.add_argument(
        "--packing-length",
        type=int,
        help="pack each batch's examples into rows of this many tokens (each example still attends only to itself, "
        "so the loss is unchanged) instead of padding every example to the longest; saves the compute of padding",
    )
    parser.add_argument("--eps", type=float, default=DEFAULT_EPS, help="p_mask = (1 - eps) t + eps (default 1e-3)")
    parser.add_argument(
        "--ar-fraction",
        type=float,
        default=0.0,
        help="share of examples trained as plain autoregressive ones, so predictions across slot boundaries keep "
        "being trained (default 0: the paper's recipe)",
    )
    parser.add_argument(
        "--max-length", type=int, default=DEFAULT_MAX_LENGTH, help="skip longer examples (default %(default)s tokens)"
    )
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (PEFT) instead of all weights")
    parser.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--lora-alpha", type=float, default=16, help="LoRA alpha (default 16)")
    parser.add_argument("--lora-dropout", type=float, default=0.05, help="LoRA dropout (default 0.05)")
    parser.add_argument(
        "--lora-target-modules", default=DEFAULT_LORA_TARGET_MODULES, help="comma-separated (default %(default)s)"
    )
    parser.set_defaults(func=run, accepts_extra_args=True)


def parse_slot_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(size < 1 for size in sizes):
        raise CommandError(f"--slot-sizes must be comma-separated positive integers like '4,8,16,32', got {text!r}.")
    return sizes


def parse_training_arguments(output_dir: str, extra_args: list[str]) -> TrainingArguments:
    """`TrainingArguments` from the command line's remaining flags (HfArgumentParser), for `output_dir`."""
    parser = HfArgumentParser(TrainingArguments)
    # The ReFusion loss keeps every parameter in the graph, so DDP need not search for unused ones.
    parser.set_defaults(label_names=["labels"], ddp_find_unused_parameters=False)
    try:
        (training_args,) = parser.parse_args_into_dataclasses(args=[*extra_args, "--output_dir", output_dir])
    except ValueError as error:
        raise CommandError(f"{error}. `refusion train` passes unknown flags to TrainingArguments.") from None
    launched_processes = int(os.environ.get("WORLD_SIZE", "1"))
    if launched_processes > 1 and training_args.world_size == 1:
        raise CommandError(
            f"{launched_processes} processes were launched (WORLD_SIZE) but TrainingArguments sees no distributed "
            "setup, so each would train alone. Without GPUs, add `--use-cpu` (DDP over gloo), e.g. "
            "`accelerate launch --multi_gpu --num_processes 2 -m refusion_hf.cli train ... --use-cpu`."
        )
    return training_args


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
    if not weights:
        return "no weights"
    for path in weights:
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # noqa: BLE001 - a truncated or missing shard, whatever safetensors raises
            return f"{path.name} incomplete ({first_line(error)})"
    pickled = [OPTIMIZER_NAME, SCHEDULER_NAME] if needs_optimizer else []
    for name in pickled + [p.name for p in folder.glob("rng_state*.pth")]:
        try:
            zipfile.ZipFile(folder / name).close()  # torch.save writes a zip: a cut file has no central directory
        except (OSError, zipfile.BadZipFile):
            return f"{name} missing or incomplete"
    return None


def load_model(model_path: str, training_args: TrainingArguments, args: argparse.Namespace):
    check_checkpoint_folder(model_path, "--model")
    check_tokenizer_files(model_path, "--model")
    try:
        model = RefusionForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    except (OSError, ValueError, SafetensorError) as error:
        raise CommandError(f"--model {model_path}: the checkpoint does not load ({first_line(error)}).") from None
    try:
        model.config.require_mask_token_id("ReFusion training")
    except ValueError as error:
        raise CommandError(f"--model {model_path}: {error}") from None
    if not args.lora:
        return model
    from peft import LoraConfig, get_peft_model

    targets = [name.strip() for name in args.lora_target_modules.split(",") if name.strip()]
    if not targets:
        raise CommandError("--lora-target-modules is empty; name modules like 'q_proj,k_proj,v_proj,o_proj'.")
    if args.lora_r < 1:
        raise CommandError(f"--lora-r must be a positive integer, got {args.lora_r}.")
    if training_args.gradient_checkpointing:
        model.enable_input_require_grads()  # frozen embeddings: let checkpointed blocks see a grad-requiring input
    lora_config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora_config)


def run(args: argparse.Namespace) -> int:
    require_extra("train", "accelerate", *(["peft"] if args.lora else []))
    from .trainer import RefusionTrainer

    slot_sizes = parse_slot_sizes(args.slot_sizes)
    if not 0.0 <= args.ar_fraction <= 1.0:
        raise CommandError(f"--ar-fraction must lie in [0, 1], got {args.ar_fraction}.")
    if args.packing_length is not None and args.packing_length < 1:
        raise CommandError(f"--packing-length must be a positive number of tokens, got {args.packing_length}.")
    training_args = parse_training_arguments(args.output_dir, getattr(args, "extra_args", []))
    resume = resolve_checkpoint(
        training_args.resume_from_checkpoint, args.output_dir, needs_optimizer=not training_args.save_only_model
    )
    set_seed(training_args.seed)

    check_output_folder(args.output_dir, "--output-dir")
    model = load_model(args.model, training_args, args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as error:
        raise CommandError(f"--model {args.model}: the tokenizer does not load ({first_line(error)}).") from None
    check_tokenizer_fits(tokenizer, model.get_input_embeddings().weight.shape[0], f"--model {args.model}")
    mask_token_id = model.config.mask_token_id
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id != mask_token_id:
        raise CommandError(
            f"--model: the config's mask_token_id is {mask_token_id} but the tokenizer's mask token "
            f"{tokenizer.mask_token!r} has id {tokenizer.mask_token_id}; fix one of them."
        )
    try:
        dataset = load_sft_dataset(args.data, tokenizer, max_length=args.max_length)
    except (OSError, ValueError) as error:
        raise CommandError(f"--data {args.data}: {first_line(error)}") from None
    collator = RefusionDataCollator(
        tokenizer,
        mask_token_id=mask_token_id,
        slot_sizes=slot_sizes,
        eps=args.eps,
        ar_fraction=args.ar_fraction,
        seed=training_args.data_seed if training_args.data_seed is not None else training_args.seed,
        packing_length=args.packing_length,
    )
    trainer = RefusionTrainer(
        model=model,
        args=training_args,
        data_collator=collator,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    if trainer.is_world_process_zero():
        stats = dataset.stats
        print(
            f"[refusion train] {stats.kept} examples from {args.data} ({stats.skipped_too_long} skipped as longer "
            f"than {args.max_length} tokens); slot sizes {list(slot_sizes)}; "
            f"{f'{args.ar_fraction:.0%} plain autoregressive examples; ' if args.ar_fraction else ''}"
            f"{f'LoRA r={args.lora_r}' if args.lora else 'full fine-tuning'}; "
            f"{training_args.world_size} process(es)"
        )
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(args.output_dir)
    trainer.save_state()
    trainer.accelerator.wait_for_everyone()  # no process leaves while another still writes or communicates
    return 0
