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
import os

import torch
from transformers import AutoTokenizer, HfArgumentParser, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from ..modeling import RefusionForCausalLM
from .collator import DEFAULT_EPS, DEFAULT_SLOT_SIZES, RefusionDataCollator
from .data import DEFAULT_MAX_LENGTH, load_sft_dataset
from .trainer import RefusionTrainer

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
        raise ValueError(f"--slot-sizes must be comma-separated positive integers like '4,8,16,32', got {text!r}.")
    return sizes


def parse_training_arguments(output_dir: str, extra_args: list[str]) -> TrainingArguments:
    """`TrainingArguments` from the command line's remaining flags (HfArgumentParser), for `output_dir`."""
    parser = HfArgumentParser(TrainingArguments)
    # The ReFusion loss keeps every parameter in the graph, so DDP need not search for unused ones.
    parser.set_defaults(label_names=["labels"], ddp_find_unused_parameters=False)
    try:
        (training_args,) = parser.parse_args_into_dataclasses(args=[*extra_args, "--output_dir", output_dir])
    except ValueError as error:
        raise ValueError(f"{error}. `refusion train` passes unknown flags to TrainingArguments.") from error
    launched_processes = int(os.environ.get("WORLD_SIZE", "1"))
    if launched_processes > 1 and training_args.world_size == 1:
        raise ValueError(
            f"{launched_processes} processes were launched (WORLD_SIZE) but TrainingArguments sees no distributed "
            "setup, so each would train alone. Without GPUs, add `--use-cpu` (DDP over gloo), e.g. "
            "`accelerate launch --multi_gpu --num_processes 2 -m refusion_hf.cli train ... --use-cpu`."
        )
    return training_args


def resolve_checkpoint(value: str | None, output_dir: str) -> str | None:
    if value is None or value.lower() in ("", "false", "none"):
        return None
    if value.lower() in ("last", "latest", "true"):
        checkpoint = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if checkpoint is None:
            raise ValueError(
                f"--resume-from-checkpoint {value}: {output_dir} holds no checkpoint-* folder; pass a checkpoint path."
            )
        return checkpoint
    if not os.path.isdir(value):
        raise ValueError(f"--resume-from-checkpoint: {value!r} is not a folder; pass a checkpoint-* folder or 'last'.")
    return value


def load_model(model_path: str, training_args: TrainingArguments, args: argparse.Namespace):
    model = RefusionForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config.require_mask_token_id("ReFusion training")
    if not args.lora:
        return model
    from peft import LoraConfig, get_peft_model

    targets = [name.strip() for name in args.lora_target_modules.split(",") if name.strip()]
    if not targets:
        raise ValueError("--lora-target-modules is empty; name modules like 'q_proj,k_proj,v_proj,o_proj'.")
    if args.lora_r < 1:
        raise ValueError(f"--lora-r must be a positive integer, got {args.lora_r}.")
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
    slot_sizes = parse_slot_sizes(args.slot_sizes)
    if args.packing_length is not None and args.packing_length < 1:
        raise ValueError(f"--packing-length must be a positive number of tokens, got {args.packing_length}.")
    training_args = parse_training_arguments(args.output_dir, getattr(args, "extra_args", []))
    resume = resolve_checkpoint(training_args.resume_from_checkpoint, args.output_dir)
    set_seed(training_args.seed)

    model = load_model(args.model, training_args, args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    mask_token_id = model.config.mask_token_id
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id != mask_token_id:
        raise ValueError(
            f"--model: the config's mask_token_id is {mask_token_id} but the tokenizer's mask token "
            f"{tokenizer.mask_token!r} has id {tokenizer.mask_token_id}; fix one of them."
        )
    dataset = load_sft_dataset(args.data, tokenizer, max_length=args.max_length)
    collator = RefusionDataCollator(
        tokenizer,
        mask_token_id=mask_token_id,
        slot_sizes=slot_sizes,
        eps=args.eps,
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
            f"{f'LoRA r={args.lora_r}' if args.lora else 'full fine-tuning'}; "
            f"{training_args.world_size} process(es)"
        )
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(args.output_dir)
    trainer.save_state()
    trainer.accelerator.wait_for_everyone()  # no process leaves while another still writes or communicates
    return 0
