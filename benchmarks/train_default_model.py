"""Train the embedded default ReFusion model: the paper's recipe at small scale, on 2 CPU cores.

Stages (each writes a folder under --work-dir and is skipped when that folder is complete, so the recipe can be
resumed or partly re-run):

1. data       train / held-out JSONL from the seeded synthetic suite (`refusion_hf.evaluation.synthetic_tasks`).
2. tokenizer  a byte-level BPE trained here on the training text (one token per digit, so arithmetic is
              learnable), with a chat template; special tokens <|endoftext|> (pad), <|im_start|>, <|im_end|> (EOS).
3. ar_base    a small Qwen3 trained from scratch as an ordinary causal LM with the stock `Trainer` (loss on the
              answer + EOS only, the prompt is context).
4. converted  `refusion convert` (adds <|mask|> and <|beginoftext|>, mean-initialised rows, our config + code).
5. refusion   `refusion train`: ReFusion fine-tuning (slot-permutation collator, AR + MDM loss) for N steps.
6. ar_continued  the controlled baseline: the same ar_base trained autoregressively for the same N extra steps.

Every training stage packs each batch's 32 examples into rows of --packing-length tokens (`PackedCausalLMCollator`,
`refusion train --packing-length`) instead of padding them to the longest: the same examples and losses per step,
steps about 1.2x faster (`benchmarks/packing_speed.py`). `--packing-length 0` pads instead.

Step counts: 1,400 AR steps, then 1,400 + 2,900 ReFusion steps (and as many AR baseline steps): about 60 minutes
on 2 cores (59.7 as run). ReFusion decoding accuracy grows steeply with fine-tuning steps (0.28 to 0.37 after the
first segment, 0.57 to 0.73 at the end, on two test seeds), so the budget goes to fine-tuning rather than to a
longer AR pretraining (README: "The embedded default model").

Each stage's wall time goes to `<work-dir>/timings.json`.

Then the ReFusion model is copied (with tuned decoding defaults in its generation_config.json) into the package
at src/refusion_hf/assets/default_model when --install is given.

    .venv/bin/python benchmarks/train_default_model.py --work-dir out/default_model --install
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Trainer,
    TrainingArguments,
)

from refusion_hf import RefusionForCausalLM
from refusion_hf.cli import main as refusion_cli
from refusion_hf.evaluation.synthetic_tasks import write_jsonl
from refusion_hf.training import PackedCausalLMCollator
from refusion_hf.training.data import load_sft_dataset

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_MODEL = ROOT / "src" / "refusion_hf" / "assets" / "default_model"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAIN_SEED = 1234
SEGMENT_SEEDS = (TRAIN_SEED, 4321)  # seeds of the ReFusion fine-tuning segments


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class StageTimings:
    """Wall time of each stage run by this invocation, written to a JSON file after every stage (a resumed run
    keeps the times of the stages it reused from the file)."""

    def __init__(self, path: Path, **settings):
        self.path = path
        previous = json.loads(path.read_text()) if path.exists() else {}
        self.minutes = previous.get("minutes", {})
        # The settings of the run that trained the reused stages stay (a resumed `--install` run changes none).
        self.settings = previous.get("settings") or {**settings, "torch_threads": torch.get_num_threads()}

    def run(self, name: str, stage, *args):
        start = time.time()
        result = stage(*args)
        elapsed = (time.time() - start) / 60
        if elapsed > 0.05 or name not in self.minutes:  # a reused stage returns at once
            self.minutes[name] = round(elapsed, 2)
        total = sum(self.minutes.values())
        report = {"minutes": self.minutes, "total_minutes": round(total, 2), "settings": self.settings}
        self.path.write_text(json.dumps(report, indent=2) + "\n")
        log(f"{name} done ({elapsed:.1f} min; {total:.1f} min for all stages so far)")
        return result


def stage_data(work: Path, train_examples: int) -> Path:
    data = work / "data"
    if (data / "train.jsonl").exists():
        return data
    data.mkdir(parents=True, exist_ok=True)
    write_jsonl(data / "train.jsonl", "train", train_examples, seed=TRAIN_SEED)
    log(f"data: {train_examples} training problems")
    return data


def stage_tokenizer(work: Path, data: Path, vocab_size: int) -> Path:
    folder = work / "tokenizer"
    if (folder / "tokenizer.json").exists():
        return folder
    texts = []
    for line in (data / "train.jsonl").read_text().splitlines():
        record = json.loads(line)
        texts.extend(message["content"] for message in record["messages"])
    tokenizer = Tokenizer(models.BPE())
    # One token per digit (a leading space stays with the first digit), then byte-level BPE.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r" ?\d"), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(folder)
    log(f"tokenizer: {len(wrapped)} tokens")
    return folder


def training_arguments(output_dir: Path, steps: int, learning_rate: float, batch_size: int, **extra):
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=min(200, steps // 10),
        weight_decay=0.01,
        logging_steps=50,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=TRAIN_SEED,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **extra,
    )


def causal_lm_features(data_file: Path, tokenizer) -> list[dict]:
    """Prompt + answer + EOS, loss on the answer and EOS only."""
    dataset = load_sft_dataset(data_file, tokenizer, max_length=tokenizer.model_max_length)
    return [
        {"input_ids": f["input_ids"], "labels": [-100] * f["prompt_length"] + f["input_ids"][f["prompt_length"] :]}
        for f in dataset.features
    ]


def causal_lm_collator(tokenizer, packing_length: int):
    """Examples packed into rows of `packing_length` tokens, or (0) each batch padded to its longest example."""
    if packing_length:
        return PackedCausalLMCollator(tokenizer, packing_length=packing_length)
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)


def train_causal_lm(model, tokenizer, features, output_dir: Path, steps: int, learning_rate: float, args):
    trainer = Trainer(
        model=model,
        args=training_arguments(output_dir, steps, learning_rate, args.batch_size),
        train_dataset=features,
        data_collator=causal_lm_collator(tokenizer, args.packing_length),
    )
    trainer.train()
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    trainer.state.save_to_json(str(output_dir / "trainer_state.json"))


def stage_ar_base(work: Path, data: Path, tokenizer_dir: Path, args) -> Path:
    folder = work / "ar_base"
    if (folder / "model.safetensors").exists():
        return folder
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=max(1, args.hidden_size // 128),
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(TRAIN_SEED)
    model = Qwen3ForCausalLM(config)
    log(f"ar_base: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {args.ar_steps} steps")
    features = causal_lm_features(data / "train.jsonl", tokenizer)
    train_causal_lm(model, tokenizer, features, folder, args.ar_steps, args.ar_learning_rate, args)
    return folder


def stage_convert(work: Path, ar_base: Path) -> Path:
    folder = work / "converted"
    if not (folder / "model.safetensors").exists():
        refusion_cli(["convert", "--base", str(ar_base), "--out", str(folder)])
    return folder


def stage_refusion(work: Path, data: Path, converted: Path, args) -> Path:
    """ReFusion fine-tuning in segments (each a fresh cosine schedule continuing from the previous weights)."""
    source = converted
    for index, steps in enumerate(args.finetune_steps):
        folder = work / ("refusion" if index == 0 else f"refusion{index + 1}")
        if not (folder / "model.safetensors").exists():
            log(f"{folder.name}: {steps} steps")
            refusion_cli(
                [
                    "train",
                    "--model",
                    str(source),
                    "--data",
                    str(data / "train.jsonl"),
                    "--output-dir",
                    str(folder),
                    "--slot-sizes",
                    args.slot_sizes,
                    *(["--packing-length", str(args.packing_length)] if args.packing_length else []),
                    "--max-steps",
                    str(steps),
                    "--learning-rate",
                    str(args.finetune_learning_rate),
                    "--per-device-train-batch-size",
                    str(args.batch_size),
                    "--lr-scheduler-type",
                    "cosine",
                    "--warmup-steps",
                    "50",
                    "--logging-steps",
                    "100",
                    "--save-strategy",
                    "no",
                    "--report-to",
                    "none",
                    "--use-cpu",
                    "--seed",
                    str(SEGMENT_SEEDS[index % len(SEGMENT_SEEDS)]),
                    "--disable-tqdm",
                    "true",
                ]
            )
        source = folder
    return source


def stage_ar_continued(work: Path, data: Path, ar_base: Path, args) -> Path:
    folder = work / "ar_continued"
    if (folder / "model.safetensors").exists():
        return folder
    tokenizer = PreTrainedTokenizerFast.from_pretrained(ar_base)
    model = Qwen3ForCausalLM.from_pretrained(ar_base)
    steps = sum(args.finetune_steps)
    log(f"ar_continued: {steps} more autoregressive steps")
    features = causal_lm_features(data / "train.jsonl", tokenizer)
    train_causal_lm(model, tokenizer, features, folder, steps, args.finetune_learning_rate, args)
    return folder


def install(refusion_dir: Path, decoding: dict) -> None:
    """Copy the trained ReFusion model into the package, stored in bfloat16 (the dtype it runs in by default:
    `from_pretrained` loads a checkpoint's own dtype), with tuned decoding defaults."""
    if PACKAGE_MODEL.exists():
        shutil.rmtree(PACKAGE_MODEL)
    shutil.copytree(
        refusion_dir, PACKAGE_MODEL, ignore=shutil.ignore_patterns("checkpoint-*", "*.py", "runs", "training_args.bin")
    )
    with tempfile.TemporaryDirectory() as staging:
        RefusionForCausalLM.from_pretrained(refusion_dir, dtype=torch.bfloat16).save_pretrained(staging)
        for name in ("model.safetensors", "config.json"):
            shutil.copyfile(Path(staging) / name, PACKAGE_MODEL / name)
            (PACKAGE_MODEL / name).chmod(0o644)
    config_path = PACKAGE_MODEL / "generation_config.json"
    config = json.loads(config_path.read_text())
    config.update(decoding)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    size = sum(p.stat().st_size for p in PACKAGE_MODEL.rglob("*") if p.is_file())
    log(f"installed into {PACKAGE_MODEL} ({size / 1e6:.1f} MB)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=str(ROOT / "out" / "default_model"))
    parser.add_argument("--train-examples", type=int, default=60000)
    parser.add_argument("--vocab-size", type=int, default=768)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--packing-length",
        type=int,
        default=192,
        help="pack each batch's examples into rows of this many tokens (0: pad each batch to its longest example)",
    )
    parser.add_argument("--ar-steps", type=int, default=1400)
    parser.add_argument("--ar-learning-rate", type=float, default=2e-3)
    parser.add_argument(
        "--finetune-steps",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1400, 2900],
        help="ReFusion fine-tuning segments, comma-separated step counts",
    )
    parser.add_argument("--finetune-learning-rate", type=float, default=1e-3)
    parser.add_argument("--slot-sizes", default="4,8")
    parser.add_argument("--stop-after", choices=["data", "tokenizer", "ar_base", "converted", "refusion"])
    parser.add_argument("--install", action="store_true", help="copy the ReFusion model into the package")
    parser.add_argument(
        "--decoding",
        default=json.dumps(
            {"max_new_tokens": 64, "slot_size": 8, "block_size": 16, "slot_threshold": 0.6, "token_threshold": 0.3}
        ),
        help="JSON of decoding defaults written into the installed model",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    timings = StageTimings(work / "timings.json", arguments=vars(args))
    data = timings.run("data", stage_data, work, args.train_examples)
    tokenizer = timings.run("tokenizer", stage_tokenizer, work, data, args.vocab_size)
    if args.stop_after in ("data", "tokenizer"):
        return
    ar_base = timings.run("ar_base", stage_ar_base, work, data, tokenizer, args)
    if args.stop_after == "ar_base":
        return
    converted = timings.run("converted", stage_convert, work, ar_base)
    if args.stop_after == "converted":
        return
    refusion = timings.run("refusion", stage_refusion, work, data, converted, args)
    if args.stop_after == "refusion":
        return
    timings.run("ar_continued", stage_ar_continued, work, data, ar_base, args)
    if args.install:
        install(refusion, json.loads(args.decoding))


if __name__ == "__main__":
    sys.exit(main())
