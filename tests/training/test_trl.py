"""TRL's `SFTTrainer`, for real: `RefusionSFTTrainer` trains exactly the ReFusion objective (its loss on a batch is
the stock-Trainer path's on the same examples), on prompt/completion and messages data, with LoRA through
`peft_config`; a plain `SFTTrainer` fed a ReFusion collator fails instead of training something else."""

import re

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

from refusion_hf import RefusionDataCollator, RefusionForCausalLM, RefusionSFTTrainer
from refusion_hf.training import RefusionTrainer, load_sft_dataset
from refusion_hf.training.sft import RefusionSFTCollator
from tests.training.toy import toy_records, write_toy_jsonl


def sft_config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=3e-3,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
        bf16=False,  # SFTConfig defaults to bf16 mixed precision, which needs an accelerator
    )
    return SFTConfig(**{**values, **overrides})


@pytest.fixture
def tokenizer(fixture_path):
    return AutoTokenizer.from_pretrained(fixture_path)


def prompt_completion(records):
    return Dataset.from_list([{"prompt": r["query"], "completion": " " + r["response"]} for r in records])


def test_trl_loss_is_the_refusion_loss_of_the_same_examples(fixture_path, tokenizer, tmp_path):
    records = toy_records(8, seed=3)
    model = RefusionForCausalLM.from_pretrained(fixture_path)
    trainer = RefusionSFTTrainer(
        model=model, args=sft_config(tmp_path), train_dataset=prompt_completion(records), processing_class=tokenizer
    )
    prepared = [trainer.train_dataset[i] for i in range(len(records))]
    ours = load_sft_dataset(write_toy_jsonl(tmp_path / "toy.jsonl", count=8, seed=3), tokenizer)
    converted = [RefusionSFTCollator.to_refusion_feature(feature) for feature in prepared]
    assert converted == [ours[i] for i in range(len(records))], "TRL's tokenization gives our examples"

    collator = RefusionDataCollator(tokenizer, mask_token_id=3, seed=0)
    batch = collator(converted[:4])
    model.train()
    trl_loss = trainer.compute_loss(model, dict(batch))
    stock = RefusionTrainer(model=model, args=sft_config(tmp_path), data_collator=collator, train_dataset=ours)
    assert torch.equal(trl_loss, stock.compute_loss(model, dict(batch)))
    assert torch.equal(trl_loss, model(**batch).loss), "the model's own ReFusion loss"


@pytest.mark.parametrize("kind", ["prompt_completion", "messages"])
def test_trl_training_logs_both_loss_parts(fixture_path, tokenizer, tmp_path, kind):
    records = toy_records(16, seed=5)
    if kind == "messages":
        dataset = Dataset.from_list(
            [{"messages": [{"role": "user", "content": r["query"]}, {"role": "assistant", "content": r["response"]}]}
             for r in records]
        )  # fmt: skip
        tokenizer.chat_template = (
            "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
            "{% if add_generation_prompt %} {% endif %}"
        )
    else:
        dataset = prompt_completion(records)
    trainer = RefusionSFTTrainer(
        model=RefusionForCausalLM.from_pretrained(fixture_path),
        args=sft_config(tmp_path),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3 and all("ar_loss" in entry and "mdm_loss" in entry for entry in logged)
    assert all(entry["loss"] == pytest.approx(entry["ar_loss"] + entry["mdm_loss"], rel=1e-4) for entry in logged)
    if kind == "prompt_completion":  # the same steps as `refusion train`'s stock-Trainer path on the same records
        stock = RefusionTrainer(
            model=RefusionForCausalLM.from_pretrained(fixture_path),
            args=sft_config(tmp_path),
            train_dataset=load_sft_dataset(write_toy_jsonl(tmp_path / "toy.jsonl", count=16, seed=5), tokenizer),
            processing_class=tokenizer,
        )
        stock.train()
        reference = [entry for entry in stock.state.log_history if "loss" in entry]
        for ours, theirs in zip(logged, reference, strict=True):
            for key in ("loss", "ar_loss", "mdm_loss"):
                assert ours[key] == pytest.approx(theirs[key], rel=1e-6), (key, ours, theirs)


def test_lora_through_trl_peft_config(fixture_path, tokenizer, tmp_path):
    trainer = RefusionSFTTrainer(
        model=RefusionForCausalLM.from_pretrained(fixture_path),
        args=sft_config(tmp_path),
        train_dataset=prompt_completion(toy_records(16, seed=6)),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert before and any(not torch.equal(before[n], after[n]) for n in before), "the adapter trained"
    assert all(not p.requires_grad for n, p in after.items() if "lora_" not in n), "only the adapter trains"


def test_every_checkpoint_and_saved_model_carries_the_refusion_card_of_its_step(fixture_path, tokenizer, tmp_path):
    """TRL's `_save_checkpoint` builds its card in `output_dir` before any model is saved there, which made the first
    checkpoint of a ReFusion run fail; each checkpoint gets the ReFusion card of its own step instead."""
    from huggingface_hub import ModelCard

    out = tmp_path / "run"
    trainer = RefusionSFTTrainer(
        model=RefusionForCausalLM.from_pretrained(fixture_path),
        args=sft_config(out, max_steps=2, save_strategy="steps", save_steps=1),
        train_dataset=prompt_completion(toy_records(8, seed=3)),
        processing_class=tokenizer,
    )
    trainer.train()
    assert sorted(path.name for path in out.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    trainer.save_model()  # the final model: its card goes next to it
    for folder, step in ((out / "checkpoint-1", 1), (out / "checkpoint-2", 2), (out, 2)):
        card = ModelCard.load(folder / "README.md")
        assert card.data.library_name == "transformers" and "refusion" in card.data.tags
        assert card.text.lstrip().startswith("# run\n") and f"Optimizer steps: {step} of 2" in card.text


def test_an_adapter_checkpoint_without_a_hub_base_trains_on_without_a_card(fixture_path, tokenizer, tmp_path):
    """The adapter records the fixture's local path as its base, which a ReFusion card cannot name: the checkpoint
    keeps the card PEFT writes (a warning says why there is no ReFusion one), and training goes on."""
    from huggingface_hub import ModelCard
    from transformers.testing_utils import CaptureLogger

    from refusion_hf.training import trainer as trainer_module

    trainer = RefusionSFTTrainer(
        model=RefusionForCausalLM.from_pretrained(fixture_path),
        args=sft_config(tmp_path, max_steps=1, save_strategy="steps", save_steps=1),
        train_dataset=prompt_completion(toy_records(4, seed=6)),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    with CaptureLogger(trainer_module.logger) as captured:
        trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    assert "refusion" not in (ModelCard.load(checkpoint / "README.md").data.tags or [])
    assert "No model card in" in captured.out and "is a local path" in captured.out


@pytest.mark.parametrize(
    "option",
    [{"packing": True}, {"eval_packing": True}, {"padding_free": True}, {"completion_only_loss": False},
     {"loss_type": "dft"}],
)  # fmt: skip
def test_trl_options_that_change_the_objective_are_refused_by_name(fixture_path, tokenizer, tmp_path, option):
    """Packed or padding-free rows hold several examples, so the collator would take all but the last answer for
    prompt; completion_only_loss=False trains the prompt; DFT is another loss. None is the ReFusion objective:
    refused by name, not altered."""
    ((name, value),) = option.items()
    with pytest.raises(ValueError, match=re.escape(f"SFTConfig {name}={value!r}")):
        RefusionSFTTrainer(
            model=RefusionForCausalLM.from_pretrained(fixture_path),
            args=sft_config(tmp_path, **option),
            train_dataset=prompt_completion(toy_records(4, seed=1)),
            processing_class=tokenizer,
        )


def test_sft_config_pad_to_multiple_of_pads_the_refusion_batches(fixture_path, tokenizer, tmp_path):
    trainer = RefusionSFTTrainer(
        model=RefusionForCausalLM.from_pretrained(fixture_path),
        args=sft_config(tmp_path, pad_to_multiple_of=64),
        train_dataset=prompt_completion(toy_records(4, seed=1)),
        processing_class=tokenizer,
    )
    features = [trainer.train_dataset[i] for i in range(4)]
    longest = max(len(feature["input_ids"]) for feature in features)
    assert longest % 64  # padding is needed to reach a multiple of 64
    batch = trainer.data_collator(features)
    assert batch["input_ids"].shape[1] == 64 * -(-longest // 64) and "mdm_weights" in batch


def test_packing_under_trl_goes_through_the_refusion_collator(fixture_path, tokenizer, tmp_path):
    """What the refusal of `packing=True` points to: examples packed into one row under a block-diagonal mask, with
    the loss of the same examples unpacked."""
    from refusion_hf.training import RefusionSFTCollator

    def collator(**options):
        return RefusionSFTCollator(RefusionDataCollator(tokenizer, mask_token_id=3, seed=0, **options))

    trainer = RefusionSFTTrainer(
        model=RefusionForCausalLM.from_pretrained(fixture_path),
        args=sft_config(tmp_path, max_steps=1),
        train_dataset=prompt_completion(toy_records(4, seed=1)),
        processing_class=tokenizer,
        data_collator=collator(packing_length=128),
    )
    features = [trainer.train_dataset[i] for i in range(4)]
    packed, unpacked = trainer.data_collator(features), collator()(features)
    assert packed["input_ids"].shape[0] == 1 and packed["attention_mask"].dim() == 4  # one row, block-diagonal
    model = trainer.model.eval()
    assert model(**packed).loss.item() == pytest.approx(model(**unpacked).loss.item(), rel=1e-5)
    trainer.train()
    assert trainer.state.log_history[0]["mdm_loss"] > 0


def test_plain_sft_trainer_with_a_refusion_collator_fails_instead_of_training_something_else(
    fixture_path, tokenizer, tmp_path
):
    collator = RefusionDataCollator(tokenizer, mask_token_id=3, seed=0)
    trainer = SFTTrainer(
        model=RefusionForCausalLM.from_pretrained(fixture_path),
        args=sft_config(tmp_path, dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False),
        train_dataset=Dataset.from_list(
            list(load_sft_dataset(write_toy_jsonl(tmp_path / "toy.jsonl", count=8), tokenizer))
        ),  # what `refusion train` feeds the collator, already tokenized
        data_collator=collator,
        processing_class=tokenizer,
    )
    with pytest.raises(ValueError, match=r"RefusionSFTTrainer"):
        trainer.train()
