"""`RefusionTrainer` on top of the stock `Trainer`: loss normalisation, logging of both parts, column pruning, the
collator's epoch, defaults and misuse."""

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM, Trainer, TrainingArguments

from refusion_hf import RefusionDataCollator, RefusionForCausalLM
from refusion_hf.training import RefusionEpochCallback, RefusionTrainer, RefusionTrainingArguments

EXAMPLE = {"input_ids": [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 1], "prompt_length": 4}


def arguments(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )
    return TrainingArguments(**{**values, **overrides})


def test_gradient_accumulation_averages_micro_batches_and_logs_both_parts(fixture_path, tmp_path):
    """Four identical examples, batch 2, accumulation 2: both micro-batches are the same, so one SGD step must
    move the weights by exactly -lr * (gradient of one micro-batch) -- not twice that."""
    model = RefusionForCausalLM.from_pretrained(fixture_path)
    collator = RefusionDataCollator(mask_token_id=3, pad_token_id=0, slot_sizes=(2, 4), seed=11)
    batch = collator([EXAMPLE, EXAMPLE])
    assert (batch["mdm_weights"] > 0).any(), "choose a seed whose batch has masked tokens"
    reference = RefusionForCausalLM.from_pretrained(fixture_path)
    output = reference(**batch)
    output.loss.backward()
    lr = 1e-2
    args = arguments(
        tmp_path,
        gradient_accumulation_steps=2,
        optim="sgd",
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
    )
    trainer = RefusionTrainer(model=model, args=args, data_collator=collator, train_dataset=[EXAMPLE] * 4)
    trainer.train()
    expected = reference.lm_head.weight.detach() - lr * reference.lm_head.weight.grad
    torch.testing.assert_close(model.lm_head.weight.detach(), expected, rtol=1e-5, atol=1e-6)
    log = trainer.state.log_history[0]
    assert log["loss"] == pytest.approx(output.loss.item(), rel=1e-5)
    assert log["ar_loss"] == pytest.approx(output.ar_loss.item(), rel=1e-5)
    assert log["mdm_loss"] == pytest.approx(output.mdm_loss.item(), rel=1e-5)
    assert list(log)[:3] == ["loss", "ar_loss", "mdm_loss"]


def test_stock_trainer_normalises_per_micro_batch_too(fixture_path, tmp_path):
    trainer = Trainer(model=RefusionForCausalLM.from_pretrained(fixture_path), args=arguments(tmp_path))
    assert trainer.model_accepts_loss_kwargs is False


def test_prompt_length_survives_column_pruning_and_epochs_reach_the_collator(fixture_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(fixture_path)
    dataset = [{**EXAMPLE, "text": "unused column", "source": 7}] * 4
    seen_epochs = []

    class SpyCollator(RefusionDataCollator):
        def __call__(self, features):
            assert set(features[0]) == {"input_ids", "prompt_length"}, "unused columns are pruned, prompt_length kept"
            seen_epochs.append(self.epoch)
            return super().__call__(features)

    collator = SpyCollator(tokenizer, seed=0)
    args = arguments(tmp_path, max_steps=-1, num_train_epochs=3, remove_unused_columns=True)
    trainer = RefusionTrainer(
        model=RefusionForCausalLM.from_pretrained(fixture_path),
        args=args,
        data_collator=collator,
        train_dataset=dataset,
    )
    assert any(isinstance(cb, RefusionEpochCallback) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    assert seen_epochs == [0, 0, 1, 1, 2, 2]

    stock = Trainer(
        model=RefusionForCausalLM.from_pretrained(fixture_path),
        args=args,
        data_collator=RefusionDataCollator(tokenizer, seed=0),
        train_dataset=dataset,
    )
    with pytest.raises(ValueError, match="prompt_length.*use `RefusionTrainer` or set `remove_unused_columns=False`"):
        stock.train()


def test_default_collator_and_misuse(fixture_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(fixture_path)
    model = RefusionForCausalLM.from_pretrained(fixture_path)
    trainer = RefusionTrainer(model=model, args=arguments(tmp_path, seed=5), processing_class=tokenizer)
    assert isinstance(trainer.data_collator, RefusionDataCollator)
    assert (trainer.data_collator.mask_token_id, trainer.data_collator.seed) == (3, 5)

    with pytest.raises(ValueError, match="label_smoothing_factor is 0.1.*set it to 0"):
        RefusionTrainer(model=model, args=arguments(tmp_path, label_smoothing_factor=0.1))
    with pytest.raises(ValueError, match="compute_loss_func would replace the ReFusion loss"):
        RefusionTrainer(model=model, args=arguments(tmp_path), compute_loss_func=lambda outputs, labels, **_: 0)

    stock_model = Qwen3ForCausalLM.from_pretrained(fixture_path)
    trainer = RefusionTrainer(
        model=stock_model,
        args=arguments(tmp_path),
        data_collator=RefusionDataCollator(tokenizer, seed=0),
        train_dataset=[EXAMPLE] * 2,
    )
    with pytest.raises(ValueError, match="ignored `mdm_weights`.*train a `RefusionForCausalLM`"):
        trainer.train()


def test_refusion_training_arguments_build_the_collator(fixture_path, tmp_path):
    """The data options of `RefusionTrainingArguments` reach the default collator; a collator that disagrees with
    them is refused instead of silently winning."""
    tokenizer = AutoTokenizer.from_pretrained(fixture_path)
    model = RefusionForCausalLM.from_pretrained(fixture_path)
    args = RefusionTrainingArguments(
        output_dir=str(tmp_path), slot_sizes="2,4", ar_fraction=0.5, packing_length=64, data_seed=9, report_to="none"
    )
    collator = RefusionTrainer(model=model, args=args, processing_class=tokenizer).data_collator
    assert (collator.slot_sizes, collator.ar_fraction, collator.packing_length, collator.seed) == ((2, 4), 0.5, 64, 9)
    agreeing = RefusionDataCollator(tokenizer, slot_sizes=(2, 4), ar_fraction=0.5, packing_length=64, seed=1)
    RefusionTrainer(model=model, args=args, data_collator=agreeing)
    with pytest.raises(ValueError, match="args sets slot_sizes, ar_fraction differently from the data_collator"):
        RefusionTrainer(model=model, args=args, data_collator=RefusionDataCollator(tokenizer, packing_length=64))
    for bad, message in [
        ({"slot_sizes": "4,x"}, "--slot-sizes must be comma-separated positive integers"),
        ({"ar_fraction": 2.0}, r"--ar-fraction must lie in \[0, 1\]"),
        ({"packing_length": 0}, "--packing-length must be a positive number of tokens"),
        ({"eps": 0.0}, r"--eps must lie in \(0, 1\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            RefusionTrainingArguments(output_dir=str(tmp_path), **bad)
