"""Train the embedded default ReFusion model and its controlled AR baseline: the paper's comparison (Table 2: one
AR initialisation, the same data, the same steps) at small scale, on 2 CPU cores.

Stages (each writes a folder under --work-dir and is skipped when complete; a stage that was interrupted resumes
from its last checkpoint, so the recipe can be stopped and rerun at any point):

1. data          train JSONL from the seeded synthetic suite (`refusion_hf.evaluation.synthetic_tasks`).
2. tokenizer     a byte-level BPE trained here on the training text (one token per digit, so arithmetic is
                 learnable), with a chat template; special tokens <|endoftext|> (pad), <|im_start|>, <|im_end|> (EOS).
3. ar_base       a small Qwen3 trained from scratch as an ordinary causal LM with the stock `Trainer` (loss on the
                 answer + EOS only) at a constant learning rate until it has converged: every --ar-eval-every steps
                 its greedy autoregressive accuracy on held-out problems (test split, --validation-seed, a seed used
                 for nothing else) is measured, and training stops after --ar-patience evaluations without a gain
                 of more than --ar-min-gain (`validation.json` keeps the curve).
4. converted     `refusion convert` (adds <|mask|> and <|beginoftext|>, mean-initialised rows, our config + code).
5. refusion_*    `refusion train` from the converted model: ReFusion fine-tuning (slot-permutation collator, AR +
                 MDM loss), --finetune-steps with a cosine schedule; --slot-sizes and --ar-fraction (the share of
                 plain autoregressive examples mixed in) and the steps name the variant's folder.
6. ar_continued_steps<N>
                 the controlled baseline: the same ar_base trained autoregressively on the same data for the same
                 steps (N) with the same schedule.
7. with --more-steps M, a second phase of both branches alike (a warm restart): each branch's model as --install
   stores it (bfloat16, folder `<branch>_bf16`) is trained M more steps on the same data with a new cosine schedule
   from --more-learning-rate (folders `<branch>_then<M>`); --install then installs these. --more-steps M1,M2,...
   chains phases: each starts from the previous phase's model rounded to bfloat16 as phase 2 starts from phase 1's,
   with a new cosine schedule from --more-learning-rate (folders `<branch>_then<M1>_then<M2>`).

--from-installed takes phase 1 of each branch from the installed models (the package's default model and the AR
baseline, checked against --finetune-steps) instead of training it, so a second phase needs no retraining of
ar_base: phase 2 starts from the same (bfloat16) weights either way. Stages 3 and 4 run only when a branch of
phase 1 still has to be trained. The models installed now are phase 3's (their last phase trained 2,000 steps),
so --from-installed refuses them; it served when phase 1's were installed (the commands below, as run).

Every training stage packs each batch's 32 examples into rows of --packing-length tokens (`PackedCausalLMCollator`,
`refusion train --packing-length`) instead of padding them to the longest: the same examples and losses per step,
steps about 1.2x faster (`benchmarks/packing_speed.py`). `--packing-length 0` pads instead.

Each stage's wall time goes to `<work-dir>/timings.json`. With --install, the ReFusion model is copied (with the
decoding defaults of --decoding in its generation_config.json) into the package at
src/refusion_hf/assets/default_model, and the AR baseline to benchmarks/models/ar_baseline (both bfloat16).
The installed models (phase 1 of 4,300 steps, then two phases of 2,000; --decoding's default is their installed
decoding), in one resumable command at low priority:

    nice -n 19 .venv/bin/python benchmarks/train_default_model.py --work-dir out/default_model --more-steps 2000,2000 \
        --install

As run: phases 2 and 3 on top of the phase-1 models installed then (commit 30ac818), both branches side by side (one
thread each) once the shared stages existed (two processes must not write them at once), then the install (every
stage reused):

    .venv/bin/python benchmarks/train_default_model.py --stop-after tokenizer
    nice -n 19 .venv/bin/python benchmarks/train_default_model.py --from-installed --more-steps 2000,2000 \
        --branch refusion --threads 1 &
    nice -n 19 .venv/bin/python benchmarks/train_default_model.py --from-installed --more-steps 2000,2000 \
        --branch ar --threads 1
    .venv/bin/python benchmarks/train_default_model.py --from-installed --more-steps 2000,2000 --install

A variant of the ReFusion branch reuses every earlier stage:

    nice -n 19 .venv/bin/python benchmarks/train_default_model.py --work-dir out/default_model --ar-fraction 0.25 \
        --stop-after refusion
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_file import write_results
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from refusion_hf import RefusionForCausalLM
from refusion_hf.cli import main as refusion_cli
from refusion_hf.evaluation.lm_eval_tasks.synthetic_suite import DEFAULT_FAMILIES, is_correct
from refusion_hf.evaluation.synthetic_tasks import generate_problems, write_jsonl
from refusion_hf.modeling.loading import prompt_ids
from refusion_hf.modeling.remote_code import write_folder_bundle
from refusion_hf.training import PackedCausalLMCollator
from refusion_hf.training.data import load_sft_dataset
from refusion_hf.training.train_cli import resolve_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_MODEL = ROOT / "src" / "refusion_hf" / "assets" / "default_model"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAIN_SEED = 1234
AR_BASELINE = ROOT / "benchmarks" / "models" / "ar_baseline"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class StageTimings:
    """Wall time of each stage run by this invocation, merged into a JSON file after every stage, with the
    arguments of the invocation that ran it (a resumed run keeps the times of the stages it reused; two processes
    training the branches side by side each add theirs: the merge holds an exclusive lock on `<path>.lock`, so
    neither drops the other's entry, and the file is replaced whole, never left half-written)."""

    def __init__(self, path: Path, **settings):
        self.path = path
        self.settings = {**settings, "torch_threads": torch.get_num_threads()}

    def _read(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def run(self, name: str, stage, *args):
        start = time.time()
        result = stage(*args)
        elapsed = (time.time() - start) / 60
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            report = self._read()
            minutes, runs = report.get("minutes", {}), report.get("stage_settings", {})
            if elapsed > 0.05 or name not in minutes:  # a reused stage returns at once
                minutes[name] = round(elapsed, 2)
                runs[name] = self.settings
            total = sum(minutes.values())
            report.update(minutes=minutes, total_minutes=round(total, 2), stage_settings=runs)
            written = self.path.with_name(self.path.name + ".tmp")
            written.write_text(json.dumps(report, indent=2) + "\n")
            os.replace(written, self.path)
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
    """The stages' shared arguments: a checkpoint every `save_steps` (the last two kept) so that a killed stage
    resumes where it stopped."""
    settings = {
        "lr_scheduler_type": "cosine",
        "warmup_steps": min(200, steps // 10),
        "save_strategy": "steps",
        "save_steps": 500,
        "save_total_limit": 2,
        **extra,
    }
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        weight_decay=0.01,
        logging_steps=50,
        report_to="none",
        use_cpu=True,
        seed=TRAIN_SEED,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **settings,
    )


def last_checkpoint(folder: Path) -> str | None:
    """The newest complete checkpoint of an interrupted stage (None when it never saved one)."""
    if not any(folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*")):
        return None
    return resolve_checkpoint("last", str(folder))


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


def train_causal_lm(model, tokenizer, features, output_dir: Path, arguments: TrainingArguments, args, callbacks=()):
    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=features,
        data_collator=causal_lm_collator(tokenizer, args.packing_length),
        callbacks=list(callbacks),
    )
    resume = last_checkpoint(output_dir)
    if resume:
        log(f"{output_dir.name}: resuming from {Path(resume).name}")
    trainer.train(resume_from_checkpoint=resume)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    trainer.state.save_to_json(str(output_dir / "trainer_state.json"))
    remove_checkpoints(output_dir)


def remove_checkpoints(folder: Path) -> None:
    """A complete stage keeps its final model only."""
    for checkpoint in folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        shutil.rmtree(checkpoint)


# -- convergence of the autoregressive pretraining ---------------------------------------------------------------


def validation_problems(seed: int, n: int):
    """Held-out problems (the test split, a seed used for nothing else) that decide when pretraining has
    converged; arithmetic and listing, the families `refusion eval` scores without executing code."""
    return generate_problems("test", n, seed=seed, families=list(DEFAULT_FAMILIES))


@torch.no_grad()
def autoregressive_accuracy(model, tokenizer, problems, max_new_tokens: int = 64, batch_size: int = 100) -> float:
    """Greedy autoregressive accuracy of a causal LM on synthetic problems (stock `generate`, left padding)."""
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    correct = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        batch = tokenizer.pad([{"input_ids": prompt_ids(tokenizer, p.prompt)} for p in chunk], return_tensors="pt")
        output = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        texts = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(is_correct(p.family, text, p.target) for p, text in zip(chunk, texts))
    model.train(was_training)
    return correct / len(problems)


class PlateauStopping(TrainerCallback):
    """Every `every` steps: autoregressive accuracy on the validation problems; training stops once `patience`
    evaluations in a row have not beaten the best before them by more than `min_gain` (a measured plateau), or
    at `max_steps`. The history is kept in `history_path` (a resumed run drops what came after its checkpoint)."""

    def __init__(self, tokenizer, problems, every: int, patience: int, min_gain: float, history_path: Path):
        self.tokenizer, self.problems = tokenizer, problems
        self.every, self.patience, self.min_gain = every, patience, min_gain
        self.history_path = history_path
        self.history = json.loads(history_path.read_text()) if history_path.exists() else []

    def on_train_begin(self, args, state, control, **kwargs):
        self.history = [entry for entry in self.history if entry["step"] <= state.global_step]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every:
            return
        accuracy = autoregressive_accuracy(model, self.tokenizer, self.problems)
        loss = next((entry["loss"] for entry in reversed(state.log_history) if "loss" in entry), None)
        self.history.append({"step": state.global_step, "accuracy": accuracy, "loss": loss})
        self.history_path.write_text(json.dumps(self.history, indent=2) + "\n")
        log(f"step {state.global_step}: validation accuracy {accuracy:.3f} (loss {loss})")
        if self.plateaued():
            log(f"plateau: no gain above {self.min_gain} in the last {self.patience} evaluations; stopping")
            control.should_training_stop = True
            control.should_save = True

    def plateaued(self) -> bool:
        if len(self.history) <= self.patience:
            return False
        accuracies = [entry["accuracy"] for entry in self.history]
        best_before = max(accuracies[: -self.patience])
        return best_before >= 1.0 or max(accuracies[-self.patience :]) <= best_before + self.min_gain


def stage_ar_base(work: Path, data: Path, tokenizer_dir: Path, args) -> Path:
    """Autoregressive pretraining from scratch at a constant learning rate (after warm-up) until the validation
    accuracy plateaus: the converged AR model both branches start from."""
    folder = work / "ar_base"
    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
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
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    log(f"ar_base: {parameters:.2f}M parameters, at most {args.ar_max_steps} steps")
    features = causal_lm_features(data / "train.jsonl", tokenizer)
    plateau = PlateauStopping(
        tokenizer,
        validation_problems(args.validation_seed, args.validation_problems),
        every=args.ar_eval_every,
        patience=args.ar_patience,
        min_gain=args.ar_min_gain,
        history_path=folder / "validation.json",
    )
    arguments = training_arguments(
        folder,
        args.ar_max_steps,
        args.ar_learning_rate,
        args.batch_size,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=200,
        save_steps=args.ar_eval_every,
    )
    train_causal_lm(model, tokenizer, features, folder, arguments, args, callbacks=[plateau])
    return folder


def run_refusion_cli(argv: list[str]) -> None:
    """A `refusion` command in this process; its failure stops the recipe (a stage is complete only on success)."""
    status = refusion_cli(argv)
    if status:
        raise SystemExit(f"`refusion {argv[0]}` failed (exit status {status}): the stage is not complete")


def stage_convert(work: Path, ar_base: Path) -> Path:
    folder = work / "converted"
    if not (folder / "model.safetensors").exists():
        run_refusion_cli(["convert", "--base", str(ar_base), "--out", str(folder)])
    return folder


def variant_name(args) -> str:
    """The ReFusion branch's folder: its slot sizes, the share of plain autoregressive examples and its steps."""
    return f"refusion_k{args.slot_sizes.replace(',', '-')}_ar{args.ar_fraction:g}_steps{args.finetune_steps}"


def baseline_name(args) -> str:
    """The controlled baseline's folder: as many steps as the ReFusion branch it is compared with."""
    return f"ar_continued_steps{args.finetune_steps}"


def complete(folder: Path) -> bool:
    return (folder / "model.safetensors").exists()


def stage_refusion(work: Path, data: Path, start: Path, args, name: str, steps: int, learning_rate: float) -> Path:
    """ReFusion fine-tuning (`refusion train`) of `start` (the converted AR model, or in a later phase the previous
    phase's model) for `steps` with a cosine schedule from `learning_rate`, resumable from its checkpoints."""
    folder = work / name
    if complete(folder):
        return folder
    log(f"{folder.name}: {steps} steps from {start.name}")
    resume = last_checkpoint(folder)
    run_refusion_cli(
        [
            "train",
            "--model",
            str(start),
            "--data",
            str(data / "train.jsonl"),
            "--output-dir",
            str(folder),
            "--slot-sizes",
            args.slot_sizes,
            "--ar-fraction",
            str(args.ar_fraction),
            *(["--packing-length", str(args.packing_length)] if args.packing_length else []),
            "--max-steps",
            str(steps),
            "--learning-rate",
            str(learning_rate),
            "--per-device-train-batch-size",
            str(args.batch_size),
            "--lr-scheduler-type",
            "cosine",
            "--warmup-steps",
            "50",
            "--logging-steps",
            "100",
            "--save-strategy",
            "steps",
            "--save-steps",
            "500",
            "--save-total-limit",
            "2",
            "--report-to",
            "none",
            "--use-cpu",
            "--seed",
            str(TRAIN_SEED),
            "--disable-tqdm",
            "true",
            *(["--resume-from-checkpoint", resume] if resume else []),
        ]
    )
    remove_checkpoints(folder)
    return folder


def stage_ar_continued(work: Path, data: Path, start: Path, args, name: str, steps: int, learning_rate: float) -> Path:
    """The controlled baseline: the same converged AR model (in phase 2, the phase-1 baseline), trained
    autoregressively on the same data for as many steps, with the same schedule, as the ReFusion branch."""
    folder = work / name
    if complete(folder):
        return folder
    tokenizer = PreTrainedTokenizerFast.from_pretrained(start)
    model = Qwen3ForCausalLM.from_pretrained(start, dtype=torch.float32)
    log(f"{folder.name}: {steps} more autoregressive steps from {start.name}")
    features = causal_lm_features(data / "train.jsonl", tokenizer)
    arguments = training_arguments(folder, steps, learning_rate, args.batch_size, warmup_steps=50)
    train_causal_lm(model, tokenizer, features, folder, arguments, args)
    return folder


def stage_installed_form(work: Path, trained: Path, model_class) -> Path:
    """A phase's model as --install stores it (rounded to bfloat16), saved in float32 with its tokenizer: where the
    next phase starts, so that a run from scratch and a run seeded from the installed models continue alike."""
    folder = work / f"{trained.name}_bf16"
    if complete(folder):
        return folder
    rounded = model_class.from_pretrained(trained, dtype=torch.bfloat16).to(torch.float32)
    rounded.save_pretrained(folder)
    PreTrainedTokenizerFast.from_pretrained(trained).save_pretrained(folder)
    return folder


def seed_from_installed(installed: Path, folder: Path, steps: int) -> None:
    """Phase 1 of a branch taken from its installed model (--from-installed), after checking that it was trained
    for the steps this run names."""
    if complete(folder):
        return
    state = json.loads((installed / "trainer_state.json").read_text())
    if state["global_step"] != steps:
        raise SystemExit(
            f"--from-installed: {installed} was trained {state['global_step']} steps, not --finetune-steps {steps} "
            "(installed models of a later phase are not phase 1: run without --from-installed to train phase 1)"
        )
    shutil.copytree(installed, folder, ignore=shutil.ignore_patterns("*.py", "custom_generate", "__pycache__"))
    (folder / "SEEDED_FROM_INSTALLED").write_text(f"{installed}\n")
    log(f"{folder.name}: phase 1 taken from {installed}")


def install(refusion_dir: Path, decoding: dict) -> None:
    """Copy the trained ReFusion model into the package, stored in bfloat16 (the dtype it runs in by default:
    `from_pretrained` loads a checkpoint's own dtype), with tuned decoding defaults."""
    if PACKAGE_MODEL.exists():
        shutil.rmtree(PACKAGE_MODEL)
    shutil.copytree(
        refusion_dir,
        PACKAGE_MODEL,
        ignore=shutil.ignore_patterns("checkpoint-*", "*.py", "runs", "training_args.bin", "README.md"),
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
    # The folder's remote code and custom_generate/ (git-ignored, written at build time) went with the old folder:
    # written again from the current sources, as `make embedded-bundle` writes them.
    write_folder_bundle(PACKAGE_MODEL)
    log(f"installed into {PACKAGE_MODEL} ({size / 1e6:.1f} MB of weights, config and tokenizer; remote code rewritten)")


def install_baseline(ar_dir: Path) -> None:
    """The controlled AR baseline next to the benchmarks (bfloat16, model + tokenizer + trainer state), so the
    comparison can be rerun without training."""
    if AR_BASELINE.exists():
        shutil.rmtree(AR_BASELINE)
    Qwen3ForCausalLM.from_pretrained(ar_dir, dtype=torch.bfloat16).save_pretrained(AR_BASELINE)
    PreTrainedTokenizerFast.from_pretrained(ar_dir).save_pretrained(AR_BASELINE)
    shutil.copyfile(ar_dir / "trainer_state.json", AR_BASELINE / "trainer_state.json")
    log(f"installed the AR baseline into {AR_BASELINE}")


def phase_steps(text: str) -> list[int]:
    """--more-steps: "0" (no later phase) or positive step counts, comma-separated (one phase each)."""
    try:
        steps = [int(part) for part in text.split(",")]
    except ValueError:
        steps = None
    if steps == [0]:
        return []
    if not steps or any(step < 1 for step in steps):
        raise argparse.ArgumentTypeError(f"{text!r}: 0, or positive numbers of steps, comma-separated (one phase each)")
    return steps


def hidden_size(text: str) -> int:
    value = int(text)
    if value < 64 or value % 64:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive multiple of 64 (the model's heads are 64 wide)")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=str(ROOT / "out" / "default_model"))
    parser.add_argument("--train-examples", type=int, default=60000)
    parser.add_argument("--vocab-size", type=int, default=768)
    parser.add_argument("--hidden-size", type=hidden_size, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--packing-length",
        type=int,
        default=192,
        help="pack each batch's examples into rows of this many tokens (0: pad each batch to its longest example)",
    )
    parser.add_argument("--ar-max-steps", type=int, default=8000, help="pretraining stops here at the latest")
    parser.add_argument("--ar-learning-rate", type=float, default=1e-3)
    parser.add_argument("--ar-eval-every", type=int, default=500, help="validation (and checkpoint) interval")
    parser.add_argument("--ar-patience", type=int, default=3, help="evaluations without gain before stopping")
    parser.add_argument("--ar-min-gain", type=float, default=0.01, help="accuracy gain that counts as progress")
    parser.add_argument("--validation-seed", type=int, default=500, help="test-split seed deciding convergence")
    parser.add_argument("--validation-problems", type=int, default=200)
    parser.add_argument("--finetune-steps", type=int, default=4300, help="steps of each branch")
    parser.add_argument("--finetune-learning-rate", type=float, default=1e-3)
    parser.add_argument("--slot-sizes", default="4,8", help="ReFusion branch: slot sizes drawn per example")
    parser.add_argument(
        "--ar-fraction", type=float, default=0.0, help="ReFusion branch: share of plain autoregressive examples"
    )
    parser.add_argument("--stop-after", choices=["data", "tokenizer", "ar_base", "converted", "refusion"])
    parser.add_argument(
        "--branch",
        choices=["both", "refusion", "ar"],
        default="both",
        help="which fine-tuning branch to run (two processes can train the branches side by side)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 per process when running two)")
    parser.add_argument("--more-steps", type=phase_steps, default=[],
                        help="later phases: each branch trained this many more steps, comma-separated for a chain "
                        "of phases (0: none)")  # fmt: skip
    parser.add_argument("--more-learning-rate", type=float, default=5e-4,
                        help="the second phase's peak learning rate (cosine, 50 warm-up steps)")  # fmt: skip
    parser.add_argument("--from-installed", action="store_true",
                        help="phase 1 of each branch: the installed models, not trained here")  # fmt: skip
    parser.add_argument(
        "--install",
        action="store_true",
        help="copy the ReFusion model into the package and the AR baseline to benchmarks/models/ar_baseline, and "
        "write the stage times to --results",
    )
    parser.add_argument("--results", default=None, help="with --install (default: benchmarks/results/recipe_run.json)")
    parser.add_argument(
        "--decoding",
        default=json.dumps(
            {
                "decoding": "refusion",
                "max_new_tokens": 64,
                "slot_size": 8,
                "block_size": 16,
                "slot_threshold": 0.9,
                "token_threshold": 0.7,
                "remask_threshold": 0.1,
                "plan_ahead": True,
            }
        ),
        help="JSON of decoding defaults written into the installed model",
    )
    args = parser.parse_args(argv)
    args.results = str(ROOT / "benchmarks" / "results" / "recipe_run.json") if args.results is None else args.results
    if args.stop_after and args.more_steps:  # the second phase comes after every first-phase stage
        parser.error(
            f"--stop-after {args.stop_after} stops before the second phase that --more-steps asks for: drop one "
            "(a second phase of one branch alone: --branch refusion or --branch ar with --more-steps)"
        )
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    timings = StageTimings(work / "timings.json", arguments=vars(args))
    data = timings.run("data", stage_data, work, args.train_examples)
    tokenizer = timings.run("tokenizer", stage_tokenizer, work, data, args.vocab_size)
    if args.stop_after in ("data", "tokenizer"):
        return
    branches = ("refusion", "ar") if args.branch == "both" else (args.branch,)
    phase1 = {"refusion": work / variant_name(args), "ar": work / baseline_name(args)}
    if args.from_installed:
        installed = {"refusion": PACKAGE_MODEL, "ar": AR_BASELINE}
        for branch in branches:
            seed_from_installed(installed[branch], phase1[branch], args.finetune_steps)
    to_train = [branch for branch in branches if not complete(phase1[branch])]  # phase 1 still to be trained
    ar_base = None
    if to_train or args.stop_after in ("ar_base", "converted"):
        ar_base = timings.run("ar_base", stage_ar_base, work, data, tokenizer, args)
        if args.stop_after == "ar_base":
            return
    steps, rate = args.finetune_steps, args.finetune_learning_rate
    trained = {}
    if "refusion" in branches:
        converted = None
        if "refusion" in to_train or args.stop_after == "converted":
            converted = timings.run("converted", stage_convert, work, ar_base)
            if args.stop_after == "converted":
                return
        name = variant_name(args)
        trained["refusion"] = timings.run(name, stage_refusion, work, data, converted, args, name, steps, rate)
    if "ar" in branches and args.stop_after != "refusion":
        name = baseline_name(args)
        trained["ar"] = timings.run(name, stage_ar_continued, work, data, ar_base, args, name, steps, rate)
    stages = {"refusion": (stage_refusion, RefusionForCausalLM), "ar": (stage_ar_continued, Qwen3ForCausalLM)}
    for more in args.more_steps:  # phases 2, 3, ...: both branches alike, each from its last model as installed
        for branch, previous in trained.items():
            stage, model_class = stages[branch]
            start = timings.run(f"{previous.name}_bf16", stage_installed_form, work, previous, model_class)
            name = f"{previous.name}_then{more}"
            trained[branch] = timings.run(name, stage, work, data, start, args, name, more, args.more_learning_rate)
    if args.stop_after == "refusion":
        return
    if args.install:
        if args.branch != "both":
            raise SystemExit("--install needs both branches: run without --branch (finished stages are reused)")
        install(trained["refusion"], json.loads(args.decoding))
        install_baseline(trained["ar"])
        report = json.loads((work / "timings.json").read_text())  # every stage's time, reused ones included
        stages = [{"stage": name, "minutes": minutes} for name, minutes in report["minutes"].items()]
        command = [__file__, *(sys.argv[1:] if argv is None else argv)]
        write_results({"total_minutes": report["total_minutes"], "stages": stages, **report}, args.results, command)


if __name__ == "__main__":
    sys.exit(main())
