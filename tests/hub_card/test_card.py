"""The model card: metadata and model-index through huggingface_hub's own parser, the body's sections, the eval
and trainer-state readers, and adapter cards (PEFT conventions, and the adapter folder working)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil

import peft
import pytest
import torch
import yaml
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.repocard_data import model_index_to_eval_results

from refusion_hf.hub_card import CardInputError, CardSourceError, load_eval_report, load_training_summary, publish

from .conftest import EXAMPLE_PROMPT, FIXTURE, HUMANEVAL_EVAL, REPO_ID, SYNTHETIC_EVAL, write_json

REQUIRED_TAGS = {"refusion", "diffusion", "masked-diffusion", "custom_code"}


def usage_snippet(card_text: str) -> str:
    usage = card_text.split("## Usage", 1)[1]
    return re.search(r"```python\n(.*?)```", usage, re.S).group(1)


def front_matter(path) -> dict:
    return yaml.safe_load(path.read_text().split("---")[1])


def test_card_metadata_parses_and_validates(published):
    readme = published.folder / "README.md"
    card = ModelCard.load(readme)  # raises on invalid metadata / model-index
    data = card.data
    assert data.library_name == "transformers"
    assert data.pipeline_tag == "text-generation"
    assert data.license == "apache-2.0"
    assert data.base_model == "test-org/tiny-qwen3-ar"
    assert data.datasets == ["test-org/toy-sft"]
    assert REQUIRED_TAGS <= set(data.tags)
    assert "arxiv:2512.13586" in data.tags
    assert data.model_name == "tiny-refusion"

    # The model-index holds the ReFusion-decoding results of both reports, values exactly as in the eval JSON.
    results = {(result.dataset_type, result.metric_type): result for result in data.eval_results}
    assert set(results) == {
        ("synthetic", "accuracy"),
        ("synthetic", "tokens_per_second"),
        ("synthetic", "tokens_per_forward"),
        ("openai/openai_humaneval", "pass@1"),
        ("openai/openai_humaneval", "tokens_per_second"),
        ("openai/openai_humaneval", "tokens_per_forward"),
    }
    assert results[("synthetic", "accuracy")].metric_value == SYNTHETIC_EVAL["refusion"]["accuracy"]
    assert results[("synthetic", "tokens_per_second")].metric_value == SYNTHETIC_EVAL["refusion"]["tokens_per_second"]
    assert results[("openai/openai_humaneval", "pass@1")].metric_value == HUMANEVAL_EVAL["refusion"]["accuracy"]
    synthetic = results[("synthetic", "accuracy")]
    assert synthetic.dataset_config == "seed-1234" and synthetic.task_type == "text-generation"
    assert synthetic.metric_args == {
        "slot_size": 8,
        "slot_threshold": 0.9,
        "token_threshold": 0.5,
        "max_new_tokens": 128,
        "seed": 1234,
        "limit": 60,
        "split": "test",
        "families": "arithmetic,listing",
        "num_problems": 60,
        "batch_size": 1,
        "dtype": "float32",
    }
    assert synthetic.metric_name == "accuracy (ReFusion decoding, 60 problems drawn with seed 1234)"
    assert results[("openai/openai_humaneval", "pass@1")].metric_name == "pass@1 (ReFusion decoding)"

    # The raw YAML is a model-index the Hub's format parser accepts, and it re-serialises unchanged.
    raw = front_matter(readme)
    name, parsed = model_index_to_eval_results(raw["model-index"])
    assert name == "tiny-refusion" and len(parsed) == 6
    assert ModelCardData(**raw).to_dict()["model-index"] == raw["model-index"]
    assert ModelCard(str(card)).data.to_dict() == data.to_dict()


def test_card_body_usage_knobs_eval_training_limitations_citation(published):
    text = (published.folder / "README.md").read_text()
    snippet = usage_snippet(text)
    # Loads through remote code, decodes with the defaults saved in generation_config.json (not package defaults).
    assert 'model_id = "test-org/tiny-refusion"' in snippet
    assert "AutoModelForCausalLM.from_pretrained(model_id, trust_remote_code=True" in snippet
    for argument in (
        "max_new_tokens=48,",
        "slot_size=8,",
        "block_size=32,",
        "slot_threshold=0.9,",
        "token_threshold=0.5,",
    ):
        assert argument in snippet
    assert f"tokenizer({json.dumps(EXAMPLE_PROMPT)}" in snippet and 'decoding="autoregressive"' in snippet
    compile(snippet, "snippet", "exec")
    # Batched use names trust_remote_code for the tokenizer too (AutoTokenizer reads config.json's auto_map).
    assert 'AutoTokenizer.from_pretrained(model_id, trust_remote_code=True, padding_side="left")' in text

    saved = json.loads((published.folder / "generation_config.json").read_text())
    assert (saved["slot_size"], saved["block_size"], saved["token_threshold"], saved["max_new_tokens"]) == (
        8,
        32,
        0.5,
        48,
    )
    assert "| `slot_size` | `8` |" in text and "| `token_threshold` | `0.5` |" in text
    assert "| `plan_ahead` | `True` |" in text
    assert "| `mask_token_id` | `3` |" in text and "| `max_new_tokens` | `48` |" in text

    evaluation = text.split("## Evaluation", 1)[1].split("\n## ", 1)[0]
    assert "| refusion_hf synthetic suite (seed-1234) | ReFusion | 0.55 | 120.5 | 2.75 | 310 |" in evaluation
    assert "| refusion_hf synthetic suite (seed-1234) | autoregressive | 0.5 | 40.0 | 1.00 | 850 |" in evaluation
    assert "| HumanEval | ReFusion | 0.25 | 88.0 | 2.00 | 90 |" in evaluation
    assert "3.01x the tokens/s of autoregressive decoding" in evaluation  # 120.5 / 40
    assert "60 problems drawn with seed 1234" in evaluation and "first 60" not in evaluation

    training = text.split("## Training details", 1)[1].split("\n## ", 1)[0]
    assert "Optimizer steps: 40 of 40" in training and "Batch size per device: 4" in training
    assert "Last logged training loss: 2" in training and "Mean training loss over the run: 3.1" in training
    assert "| Step | Epoch | loss | ar_loss | mdm_loss | Learning rate |" in training
    steps = [int(step) for step in re.findall(r"^\| (\d+) \|", training, re.M)]
    assert len(steps) == 10 and steps[0] == 2 and steps[-1] == 40  # subsampled, first and last logged steps kept

    limitations = text.split("## Limitations", 1)[1].split("\n## ", 1)[0]
    assert "Written slots are final" in limitations and "never revised" in limitations
    citation = text.split("## Citation", 1)[1]
    assert "arXiv:2512.13586" in citation
    for author in ("Li, Jia-Nan", "Guan, Jian", "Wu, Wei", "Li, Chongxuan"):
        assert author in citation
    assert "ReFusion: A Diffusion Large Language Model with Parallel Autoregressive Decoding" in citation
    assert "| Parameters | 82.30K (82,304) |" in text  # counted from the safetensors headers
    assert "| Mask token | `<\\|mask\\|>` (id 3) |" in text  # pipes escaped: the table keeps its two columns


def test_eval_report_reader_tolerates_extras_and_names_missing_keys(tmp_path):
    report = load_eval_report(write_json(tmp_path / "ok.json", SYNTHETIC_EVAL))
    assert report.suite == "synthetic" and report.refusion["num_forward_passes"] == 310
    assert "wall_seconds" not in report.refusion  # extra keys are tolerated, not carried into the card

    on_train = {**SYNTHETIC_EVAL, "settings": {**SYNTHETIC_EVAL["settings"], "split": "train"}}
    assert {
        result.dataset_split for result in load_eval_report(write_json(tmp_path / "t.json", on_train)).eval_results()
    } == {"train"}

    no_baseline = {key: value for key, value in SYNTHETIC_EVAL.items() if key != "autoregressive"}
    report = load_eval_report(write_json(tmp_path / "no_ar.json", no_baseline))
    assert report.autoregressive is None and report.speedup is None

    broken = [
        ({**SYNTHETIC_EVAL, "settings": {"seed": 1}}, "'settings.suite'"),
        ({**SYNTHETIC_EVAL, "refusion": {**SYNTHETIC_EVAL["refusion"], "accuracy": "high"}}, "'refusion.accuracy'"),
        ({k: v for k, v in SYNTHETIC_EVAL.items() if k != "refusion"}, "'refusion'"),
        ({**SYNTHETIC_EVAL, "autoregressive": {"accuracy": 0.5}}, "'autoregressive.tokens_per_second'"),
        ([1, 2], "expected a JSON object"),
    ]
    for index, (data, expected) in enumerate(broken):
        with pytest.raises(CardSourceError, match=re.escape(expected)) as error:
            load_eval_report(write_json(tmp_path / f"bad{index}.json", data))
        assert "--eval" in str(error.value) and "refusion eval --json" in str(error.value)
    ar_only = {
        "settings": {**SYNTHETIC_EVAL["settings"], "decodings": ["autoregressive"]},
        "autoregressive": SYNTHETIC_EVAL["autoregressive"],
    }
    with pytest.raises(CardSourceError, match="autoregressive results only .*both\\s+decodings"):
        load_eval_report(write_json(tmp_path / "ar_only.json", ar_only))
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(CardSourceError, match="not valid JSON"):
        load_eval_report(tmp_path / "garbage.json")
    with pytest.raises(CardSourceError, match="no such file"):
        load_eval_report(tmp_path / "missing.json")


def test_training_summary_reader(tmp_path):
    state = {"log_history": [{"step": 1, "loss": 2.5, "learning_rate": 1e-4}, {"step": 2, "loss": 0.0}]}
    summary = load_training_summary(write_json(tmp_path / "state.json", state))
    assert summary.facts == ["Last logged training loss: 0"]  # a zero loss is a loss; no step count recorded
    assert summary.columns == ["Step", "Epoch", "loss", "Learning rate"]
    assert summary.rows == [["1", "–", "2.5", "1.00e-04"], ["2", "–", "0", "–"]]
    with pytest.raises(CardSourceError, match="--trainer-state .*log_history"):
        load_training_summary(write_json(tmp_path / "bad.json", {"global_step": 3}))


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """A LoRA adapter (non-zero, so it changes the outputs) saved by PEFT on the tiny fixture, with its tokenizer;
    its adapter_config records the fixture's *local* path as base model, as a local training run does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from refusion_hf import RefusionForCausalLM

    torch.manual_seed(0)
    base = RefusionForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    folder = tmp_path_factory.mktemp("lora") / "adapter"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(FIXTURE).save_pretrained(folder)
    return folder, model


def test_adapter_card_follows_peft_conventions_and_folder_works(lora_dir, tmp_path):
    from peft import PeftModel

    from refusion_hf import RefusionForCausalLM

    adapter, trained = lora_dir
    # A local base path cannot go on the Hub: the error says which argument fixes it.
    with pytest.raises(CardInputError, match="--base-model"):
        publish(adapter, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()

    result = publish(adapter, tmp_path / "published", base_model=REPO_ID, example_prompt=EXAMPLE_PROMPT)
    assert result.kind == "adapter"
    assert set(result.files) >= {"README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer.json"}
    assert json.loads((result.folder / "adapter_config.json").read_text())["base_model_name_or_path"] == REPO_ID

    card = ModelCard.load(result.folder / "README.md")
    assert card.data.library_name == "peft" and card.data.base_model == REPO_ID
    assert card.data.pipeline_tag == "text-generation"
    assert {"lora", "transformers", f"base_model:adapter:{REPO_ID}", "refusion"} <= set(card.data.tags)
    assert f"- PEFT {peft.__version__}" in card.text
    # Decoding defaults of the base (read from the local base the adapter recorded): package defaults here.
    assert "| `slot_size` | `32` |" in card.text

    # The published adapter is the trained one: the card's snippet, pointed at local folders, prints what the
    # trained PEFT model generates (and the adapter does change the base model's output).
    snippet = usage_snippet(card.text)
    max_new_tokens = int(re.search(r"max_new_tokens=(\d+),", snippet).group(1))
    snippet = re.sub(r"^base_id = .*$", f"base_id = {json.dumps(str(FIXTURE))}", snippet, flags=re.M)
    snippet = re.sub(r"^adapter_id = .*$", f"adapter_id = {json.dumps(str(result.folder))}", snippet, flags=re.M)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet, "adapter_card_snippet", "exec"), {})
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = trained.generate(input_ids=ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    lines = printed.getvalue().splitlines()
    assert lines[0] == tokenizer.decode(expected.sequences[0, 4:], skip_special_tokens=True)
    assert lines[1].startswith(f"{expected.num_forward_passes} forward passes")

    reloaded = PeftModel.from_pretrained(RefusionForCausalLM.from_pretrained(FIXTURE), result.folder).eval()
    with torch.no_grad():
        adapted = reloaded(ids).logits
        with reloaded.disable_adapter():
            plain = reloaded(ids).logits
    assert torch.equal(adapted, trained(ids).logits.detach()) and not torch.allclose(adapted, plain)


def test_adapter_bin_weights_are_converted_to_safetensors(lora_dir, tmp_path):
    from safetensors.torch import load_file

    adapter, _ = lora_dir
    legacy = tmp_path / "legacy"
    shutil.copytree(adapter, legacy)
    state = load_file(legacy / "adapter_model.safetensors")
    torch.save(state, legacy / "adapter_model.bin")
    (legacy / "adapter_model.safetensors").unlink()
    result = publish(legacy, tmp_path / "out", base_model=REPO_ID)
    converted = load_file(result.folder / "adapter_model.safetensors")
    assert converted.keys() == state.keys() and all(torch.equal(converted[k], state[k]) for k in state)
    assert "adapter_model.bin" not in result.files


def test_chat_model_snippet_applies_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from refusion_hf import RefusionForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    tokenizer.chat_template = (
        "{% for m in messages %}t4 {{ m['content'] }} t60 {% endfor %}{% if add_generation_prompt %}t61 {% endif %}"
    )
    tokenizer.save_pretrained(tmp_path / "chat-tokenizer")
    result = publish(
        FIXTURE,
        tmp_path / "out",
        tokenizer=tmp_path / "chat-tokenizer",
        example_prompt="t7 t8 t9",
        decoding_defaults={"max_new_tokens": 1000},  # more than fits: the snippet lowers it
    )
    text = (result.folder / "README.md").read_text()
    assert "| Chat template | yes |" in text
    snippet = usage_snippet(text)
    assert "apply_chat_template" in snippet and 'model_id = "<your-namespace>/out"' in snippet

    printed = io.StringIO()
    code = re.sub(r"^model_id = .*$", f"model_id = {json.dumps(str(result.folder))}", snippet, flags=re.M)
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "chat_card_snippet", "exec"), {})
    ids = torch.tensor([[4, 7, 8, 9, 60, 61]])  # the template around the prompt
    max_new_tokens = int(re.search(r"max_new_tokens=(\d+),", snippet).group(1))
    assert max_new_tokens == (512 - ids.shape[1]) // 32 * 32  # lowered so that prompt + canvas fit the context
    assert "the default 1000 does not fit the context" in snippet and "| `max_new_tokens` | `1000` |" in text
    model = RefusionForCausalLM.from_pretrained(FIXTURE)
    expected = model.generate(ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True)
    lines = printed.getvalue().splitlines()
    assert lines[0] == tokenizer.decode(expected.sequences[0, ids.shape[1] :], skip_special_tokens=True)
    assert lines[1].startswith(f"{expected.num_forward_passes} forward passes")


def test_eval_report_names_the_problems_its_numbers_cover(tmp_path):
    """The synthetic suite draws problems by seed; the public suites take the first N; no limit, all problems."""
    for settings, expected in (
        ({**SYNTHETIC_EVAL["settings"], "limit": 60, "seed": 7}, "60 problems drawn with seed 7"),
        (
            {**SYNTHETIC_EVAL["settings"], "suite": "synthetic-hard", "limit": 500, "seed": 9},
            "500 problems drawn with seed 9",
        ),
        ({**HUMANEVAL_EVAL["settings"], "limit": 20}, "the first 20 problems only"),
        (HUMANEVAL_EVAL["settings"], None),
    ):
        report = load_eval_report(write_json(tmp_path / "eval.json", {**SYNTHETIC_EVAL, "settings": settings}))
        assert report.subset == expected
        if settings.get("suite") == "synthetic-hard":  # the hard tier is its own dataset, its seed the config
            assert report.label == "refusion_hf synthetic suite, hard tier (seed-9)"
