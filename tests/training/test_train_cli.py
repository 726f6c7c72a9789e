"""`refusion train`, full and LoRA, on the tiny official-format fixture: the logged loss (and both of its parts)
goes down, the outputs are complete, the saved model trains through its remote code, and the adapter round-trips
through PEFT."""

import json
import re

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from refusion_hf import RefusionDataCollator, RefusionForCausalLM
from refusion_hf.cli import main
from refusion_hf.command_inputs import CommandError
from refusion_hf.training.train_cli import parse_arguments
from tests.bare_env import run_bare
from tests.cli_errors import user_error
from tests.training.toy import train_args, write_toy_jsonl

COMMON = ["--max-steps", "40", "--logging-steps", "10", "--per-device-train-batch-size", "8", "--seed", "0"]
COMMON += ["--save-strategy", "no", "--slot-sizes", "2,4,8", "--disable-tqdm", "true"]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return write_toy_jsonl(tmp_path_factory.mktemp("data") / "toy.jsonl")


@pytest.fixture(scope="module")
def full_run(fixture_path, toy_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    assert main(train_args(fixture_path, toy_data, out, *COMMON, "--learning-rate", "3e-3")) == 0
    return out


@pytest.fixture(scope="module")
def lora_run(fixture_path, toy_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    assert main(train_args(fixture_path, toy_data, out, *COMMON, "--learning-rate", "1e-2", "--lora")) == 0
    return out


def training_logs(out):
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry for entry in history if "loss" in entry]


def check_logs(out):
    logs = training_logs(out)
    assert [entry["step"] for entry in logs] == [10, 20, 30, 40]
    for entry in logs:
        assert entry["loss"] == pytest.approx(entry["ar_loss"] + entry["mdm_loss"], rel=1e-4)
    assert logs[-1]["loss"] <= 0.8 * logs[0]["loss"], logs
    assert logs[-1]["ar_loss"] < logs[0]["ar_loss"] and logs[-1]["mdm_loss"] < logs[0]["mdm_loss"], logs


def sample_batch(fixture_path):
    from transformers import AutoTokenizer

    collator = RefusionDataCollator(AutoTokenizer.from_pretrained(fixture_path), slot_sizes=(2, 4), seed=3)
    return collator(
        [
            {"input_ids": [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 1], "prompt_length": 4},
            {"input_ids": [40, 41, 42, 43, 44, 45, 46, 1], "prompt_length": 4},
        ]
    )


def test_full_training_lowers_the_loss_and_saves_everything(full_run, fixture_path):
    check_logs(full_run)
    config = json.loads((full_run / "config.json").read_text())
    assert config["model_type"] == "refusion" and config["mask_token_id"] == 3
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_refusion.RefusionForCausalLM"
    for name in ("model.safetensors", "refusion_loss.py", "tokenizer.json", "trainer_state.json"):
        assert (full_run / name).is_file(), name
    trained = AutoModelForCausalLM.from_pretrained(full_run).eval()
    base = RefusionForCausalLM.from_pretrained(fixture_path).eval()
    assert isinstance(trained, RefusionForCausalLM)
    assert not torch.equal(trained.lm_head.weight, base.lm_head.weight)
    batch = sample_batch(fixture_path)
    with torch.no_grad():
        assert trained(**batch).loss < base(**batch).loss
    out = trained.generate(torch.tensor([[20, 21, 22, 23]]), max_new_tokens=8, slot_size=4)
    assert 4 < out.shape[1] <= 12 and 3 not in out[0].tolist()  # up to 8 new tokens (fewer if EOS), no mask


def test_training_writes_the_model_card_from_the_live_run(full_run, lora_run, fixture_path, tmp_path):
    """The card `refusion publish` writes, written by the trainer at save time with this run's numbers; an adapter
    on a local base keeps PEFT's stub card (ours could not name its base)."""
    from huggingface_hub import ModelCard

    from refusion_hf.training import RefusionTrainer

    card = ModelCard.load(full_run / "README.md")
    assert card.data.library_name == "transformers" and "refusion" in card.data.tags
    state = json.loads((full_run / "trainer_state.json").read_text())
    last_loss = [entry["loss"] for entry in state["log_history"] if "loss" in entry][-1]
    training = card.text.split("## Training details", 1)[1]
    assert "Optimizer steps: 40 of 40" in training and f"Last logged training loss: {last_loss:.4g}" in training
    assert "| Step | Epoch | loss | ar_loss | mdm_loss | Learning rate |" in training
    assert "refusion" not in (ModelCard.load(lora_run / "README.md").data.tags or [])

    model = RefusionForCausalLM.from_pretrained(full_run)
    trainer = RefusionTrainer(model=model, args=TrainingArguments(output_dir=str(full_run), report_to="none"))
    with pytest.raises(ValueError, match="create_model_card: language, tags cannot go on the ReFusion card"):
        trainer.create_model_card(tags=["x"], language="en")
    adapter_trainer = RefusionTrainer(model=model, args=TrainingArguments(output_dir=str(lora_run), report_to="none"))
    local_base = r"the adapter's base model \(pass finetuned_from\) '.*' is a local path; it must be a Hub"
    with pytest.raises(ValueError, match=local_base):
        adapter_trainer.create_model_card()
    adapter_trainer.create_model_card(finetuned_from="test-org/base", model_name="my-adapter", dataset="test-org/d")
    adapter_card = ModelCard.load(lora_run / "README.md")
    assert adapter_card.data.library_name == "peft" and adapter_card.data.base_model == "test-org/base"
    assert adapter_card.data.datasets == ["test-org/d"] and adapter_card.text.lstrip().startswith("# my-adapter")


def test_saved_model_trains_through_its_remote_code(full_run, fixture_path, tmp_path):
    """The loss lives in the exported bundle: a machine without refusion_hf computes the same ReFusion loss."""
    batch = sample_batch(fixture_path)
    torch.save(batch, tmp_path / "batch.pt")
    with torch.no_grad():
        local = AutoModelForCausalLM.from_pretrained(full_run).eval()(**batch)
    remote = run_bare(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(full_run)!r}, trust_remote_code=True).eval()
        batch = torch.load({str(tmp_path / "batch.pt")!r})
        out = model(**batch)
        out.loss.backward()
        print(json.dumps({{"module": type(model).__module__, "loss": out.loss.item(), "ar": out.ar_loss.item(),
                          "mdm": out.mdm_loss.item(), "grad": model.lm_head.weight.grad is not None}}))
        """,
        tmp_path,
    )
    assert not remote["module"].startswith("refusion_hf") and remote["grad"]
    assert remote["loss"] == pytest.approx(local.loss.item(), rel=1e-6)
    assert remote["ar"] == pytest.approx(local.ar_loss.item(), rel=1e-6)
    assert remote["mdm"] == pytest.approx(local.mdm_loss.item(), rel=1e-6)


def test_lora_adapter_round_trip(lora_run, fixture_path):
    check_logs(lora_run)
    adapter_config = json.loads((lora_run / "adapter_config.json").read_text())
    assert adapter_config["r"] == 8 and adapter_config["lora_alpha"] == 16
    assert set(adapter_config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert (lora_run / "adapter_model.safetensors").is_file() and not (lora_run / "model.safetensors").exists()
    assert (lora_run / "tokenizer.json").is_file() and (lora_run / "trainer_state.json").is_file()

    base_logits_model = RefusionForCausalLM.from_pretrained(fixture_path).eval()
    peft_model = PeftModel.from_pretrained(RefusionForCausalLM.from_pretrained(fixture_path), lora_run).eval()
    batch = sample_batch(fixture_path)
    prompt = torch.tensor([[20, 21, 22, 23]])
    knobs = dict(max_new_tokens=12, slot_size=4, slot_threshold=0.5, token_threshold=0.3)
    with torch.no_grad():
        base_out = base_logits_model(**batch)
        adapted = peft_model(**batch)
        assert adapted.loss < base_out.loss, "the trained adapter fits the task better than the base"
        with peft_model.disable_adapter():
            torch.testing.assert_close(peft_model(**batch).logits, base_out.logits)
        through_adapter = peft_model.generate(input_ids=prompt, **knobs)
        merged = peft_model.merge_and_unload()
        assert isinstance(merged, RefusionForCausalLM)
        torch.testing.assert_close(merged(**batch).logits, adapted.logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(merged.generate(prompt, **knobs), through_adapter)


def test_packed_training_logs_the_losses_of_padded_training(full_run, fixture_path, toy_data, tmp_path):
    # Same seed, same batches, same draws: packing changes only which positions are computed, not the loss.
    assert (
        main(train_args(fixture_path, toy_data, tmp_path, *COMMON, "--learning-rate", "3e-3", "--packing-length", "64"))
        == 0
    )
    padded, packed = training_logs(full_run), training_logs(tmp_path)
    assert [entry["step"] for entry in packed] == [entry["step"] for entry in padded]
    for padded_entry, packed_entry in zip(padded, packed):
        for part in ("loss", "ar_loss", "mdm_loss"):
            assert packed_entry[part] == pytest.approx(padded_entry[part], rel=1e-3), (part, padded_entry, packed_entry)


def test_bad_arguments_raise_clear_errors(fixture_path, toy_data, tmp_path, monkeypatch, capsys):
    assert re.search(
        r"--packing-length must be a positive number of tokens, got 0",
        user_error(capsys, train_args(fixture_path, toy_data, tmp_path, "--packing-length", "0")),
    )
    assert re.search(
        r"--slot-sizes must be comma-separated positive integers.*'4,x'",
        user_error(capsys, train_args(fixture_path, toy_data, tmp_path, "--slot-sizes", "4,x")),
    )
    assert re.search(
        r"unrecognized arguments: --bogus-flag 1 .*TrainingArguments' fields: see `refusion train --help`",
        user_error(capsys, train_args(fixture_path, toy_data, tmp_path, "--bogus-flag", "1")),
    )
    assert re.search(
        r"--resume-from-checkpoint last: .* holds no complete checkpoint-\* folder",
        user_error(capsys, train_args(fixture_path, toy_data, tmp_path, "--resume-from-checkpoint", "last")),
    )
    assert re.search(
        r"--lora-target-modules is empty",
        user_error(capsys, train_args(fixture_path, toy_data, tmp_path, "--lora", "--lora-target-modules", ",")),
    )
    no_mask = tmp_path / "no_mask"
    RefusionForCausalLM.from_pretrained(fixture_path).save_pretrained(no_mask)
    AutoTokenizer.from_pretrained(fixture_path).save_pretrained(no_mask)
    config = json.loads((no_mask / "config.json").read_text())
    del config["mask_token_id"]
    (no_mask / "config.json").write_text(json.dumps(config))
    assert re.search(
        r"ReFusion training needs a mask token.*refusion convert",
        user_error(capsys, train_args(no_mask, toy_data, tmp_path / "out")),
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CommandError, match=r"2 processes were launched .* add `--use-cpu`"):
        parse_arguments(["--model", "m", "--data", "d", "--output-dir", str(tmp_path / "out")])
