"""lm-evaluation-harness's own `hf` model runs ReFusion decoding on a folder we ship: the real `lm_eval` CLI on a
local generate_until task (task YAML and JSONL written here, offline), its answers identical at batch sizes 1 and
3 (float32) and equal to `generate()`'s on the same prompts, cut at the task's `until` strings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refusion_hf.evaluation.synthetic_tasks import generate_problems
from refusion_hf.modeling.loading import default_model_path, load_model_and_tokenizer

UNTIL = ["\n\n", "####", "Question:"]
MAX_GEN_TOKS = 24


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_task")
    problems = generate_problems("test", 6, seed=404, families=("arithmetic",))
    data = folder / "toy.jsonl"
    data.write_text("".join(json.dumps({"question": p.prompt, "answer": str(p.answer)}) + "\n" for p in problems))
    (folder / "refusion_toy.yaml").write_text(
        f"""task: refusion_toy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {json.dumps(UNTIL)}
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
metric_list:
  - metric: exact_match
"""
    )
    return folder


def run_lm_eval(task_dir: Path, out: Path, batch_size: int) -> list[dict]:
    model_args = f"pretrained={default_model_path()},trust_remote_code=True,dtype=float32"
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", model_args, "--tasks",
               "refusion_toy", "--include_path", str(task_dir), "--batch_size", str(batch_size), "--log_samples",
               "--output_path", str(out), "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    (samples,) = out.rglob("samples_refusion_toy_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def test_lm_eval_hf_model_runs_refusion_decoding(task_dir, tmp_path):
    alone = run_lm_eval(task_dir, tmp_path / "b1", 1)
    batched = run_lm_eval(task_dir, tmp_path / "b3", 3)
    answers = {s["doc_id"]: s["resps"][0][0] for s in alone}
    assert answers == {s["doc_id"]: s["resps"][0][0] for s in batched}, "batch size does not change an answer"

    model, tokenizer = load_model_and_tokenizer(str(default_model_path()), "float32")
    for sample in alone:
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        ids = tokenizer(context, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            full = model.generate(ids, max_new_tokens=MAX_GEN_TOKS)[0, ids.shape[1] :]
        text = tokenizer.decode(full, skip_special_tokens=False)
        for stop in [*UNTIL, tokenizer.decode([model.generation_config.eos_token_id])]:
            text = text.split(stop)[0]
        assert answers[sample["doc_id"]] == text, sample["doc_id"]


def test_refusion_lm_eval_with_a_preset_writes_speed_into_the_results(task_dir, tmp_path, capsys):
    """`refusion lm-eval` is lm-eval's CLI with the `refusion` model: its answers are `generate()`'s with the preset's
    knobs, and the results JSON carries tokens/s, tokens per forward and forward passes per task."""
    from refusion_hf.cli import main

    out = tmp_path / "out"
    model_args = f"pretrained={default_model_path()},dtype=float32,preset=arc_challenge_chat"
    argv = ["lm-eval", "--model", "refusion", "--model_args", model_args, "--tasks", "refusion_toy",
            "--include_path", str(task_dir), "--batch_size", "2", "--log_samples", "--output_path", str(out),
            "--limit", "4"]  # fmt: skip
    assert main(argv) == 0
    assert "[refusion] refusion_toy:" in capsys.readouterr().out
    (results,) = out.rglob("results_*.json")
    report = json.loads(results.read_text())["refusion_decoding"]
    assert report["preset"] == "arc_challenge_chat" and report["settings"]["slot_size"] == 8
    stats = report["tasks"]["refusion_toy"]
    assert stats["requests"] == 4 and stats["forward_passes"] > 0
    # (not > 1 here: these raw, untemplated prompts are outside the embedded model's training, and sub-slot revision
    # re-decodes much of what it writes for them)
    assert stats["tokens_per_forward"] == stats["tokens"] / stats["forward_passes"] > 0
    assert stats["tokens_per_second"] > 0

    model, tokenizer = load_model_and_tokenizer(str(default_model_path()), "float32")
    (samples,) = out.rglob("samples_refusion_toy_*.jsonl")
    for sample in map(json.loads, samples.read_text().splitlines()):
        ids = tokenizer(sample["arguments"]["gen_args_0"]["arg_0"], add_special_tokens=False, return_tensors="pt")
        full = model.generate(ids.input_ids, preset="arc_challenge_chat", max_new_tokens=MAX_GEN_TOKS)
        text = tokenizer.decode(full[0, ids.input_ids.shape[1] :])
        for stop in [*UNTIL, tokenizer.decode([model.generation_config.eos_token_id])]:
            text = text.split(stop)[0]
        assert sample["resps"][0][0] == text


@pytest.mark.parametrize(("task", "tier"), [("refusion_synthetic", "standard"), ("refusion_synthetic_hard", "hard")])
def test_the_synthetic_suite_ships_as_an_lm_eval_task(tmp_path, capsys, task, tier):
    """`refusion lm-eval --tasks refusion_synthetic` (and its hard tier, `refusion_synthetic_hard`) scores the
    problems `refusion eval --suite synthetic` (`synthetic-hard`) draws, with the same checks: the same answers and
    verdicts as `generate()` on the chat-templated prompts."""
    from refusion_hf.cli import main
    from refusion_hf.evaluation.lm_eval_tasks.synthetic_suite import is_correct, load
    from refusion_hf.generation.cli import encode_prompt

    out = tmp_path / "out"
    argv = ["lm-eval", "--model", "refusion", "--model_args", f"pretrained={default_model_path()},dtype=float32",
            "--tasks", task, "--metadata", '{"seed": 7, "num_problems": 5}', "--apply_chat_template",
            "--batch_size", "2", "--log_samples", "--output_path", str(out)]  # fmt: skip
    assert main(argv) == 0
    (samples,) = out.rglob(f"samples_{task}_*.jsonl")
    samples = {s["doc_id"]: s for s in map(json.loads, samples.read_text().splitlines())}
    docs = load(seed=7, num_problems=5, tier=tier)["test"]
    assert len(samples) == 5
    assert [samples[index]["doc"]["id"] for index in range(5)] == docs["id"]
    assert docs["id"][0].startswith("synthetic/" if tier == "standard" else "synthetic-hard/")
    model, tokenizer = load_model_and_tokenizer(str(default_model_path()), "float32")
    for index, doc in enumerate(docs):
        ids = encode_prompt(tokenizer, doc["prompt"])
        answer = tokenizer.decode(model.generate(ids, max_new_tokens=64)[0, ids.shape[1] :], skip_special_tokens=True)
        assert samples[index]["resps"][0][0] == answer
        assert samples[index]["exact_match"] == float(is_correct(doc["family"], answer, doc["target"]))


def test_continuous_batching_gives_the_same_answers_and_counts_the_forwards(task_dir, tmp_path):
    """`--model_args ...,continuous_batching=True`: the task's requests go through `generate_batch` (2 rows at once
    here), the answers are HFLM's fixed-batch answers, and the speed figures are still reported."""
    from refusion_hf.cli import main
    from refusion_hf.evaluation import lm_eval_model

    answers, reports = [], []
    for continuous in (False, True):
        out = tmp_path / f"continuous_{continuous}"
        model_args = f"pretrained={default_model_path()},dtype=float32,continuous_batching={continuous}"
        argv = ["lm-eval", "--model", "refusion", "--model_args", model_args, "--tasks", "refusion_toy",
                "--include_path", str(task_dir), "--batch_size", "2", "--log_samples", "--output_path", str(out),
                "--limit", "5"]  # fmt: skip
        assert main(argv) == 0
        (samples,) = out.rglob("samples_refusion_toy_*.jsonl")
        answers.append({s["doc_id"]: s["resps"][0][0] for s in map(json.loads, samples.read_text().splitlines())})
        (results,) = out.rglob("results_*.json")
        reports.append(json.loads(results.read_text())["refusion_decoding"]["tasks"]["refusion_toy"])
    assert answers[0] == answers[1] and len(answers[0]) == 5
    assert reports[1]["requests"] == 5 and reports[1]["forward_passes"] > 0 and reports[1]["tokens"] > 0
    assert not lm_eval_model.INSTANCES
