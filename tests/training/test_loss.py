"""The ReFusion loss in `RefusionForCausalLM.forward`, checked against a hand computation (torch.log_softmax and
explicit loops over positions), plus the stock causal-LM loss when the collator's fields are absent."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from refusion_hf import RefusionDataCollator, RefusionForCausalLM

MASK = 3


def hand_batch():
    """Two examples written out by hand, both with clean labelled tokens and masked tokens.

    Example 0: prompt [10, 11], answer [20, 21, 22, 23, 24, 1] (A = 6) in slots of 2: (20 21) (22 23) (24 1); the
        middle slot masked with p_mask 0.5; the clean slots in the order (24 1), (20 21).
    Example 1: prompt [12], answer [30, 31, 32, 1] (A = 4) in slots of 3: (30 31 32) clean, (1) masked with
        p_mask 0.25; then three padding tokens.
    """
    x = -100
    input_ids = torch.tensor(
        [
            [10, 11, 24, 1, 20, 21, MASK, MASK],
            [12, 30, 31, 32, MASK, 0, 0, 0],
        ]
    )
    position_ids = torch.tensor([[0, 1, 6, 7, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7]])
    labels = torch.tensor([[x, x, 1, x, 21, x, 22, 23], [x, 31, 32, x, 1, x, x, x]])
    w0, w1 = 1 / (0.5 * 6 * 2), 1 / (0.25 * 4 * 2)  # 1 / (p_mask * answer_length * num_examples)
    mdm_weights = torch.tensor([[0, 0, 0, 0, 0, 0, w0, w0], [0, 0, 0, 0, w1, 0, 0, 0]], dtype=torch.float32)
    attention_mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    return dict(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        mdm_weights=mdm_weights,
        attention_mask=attention_mask,
    )


def hand_loss(logits, labels, mdm_weights):
    log_probs = torch.log_softmax(logits.detach().double(), dim=-1)
    ar_terms, mdm_sum = [], 0.0
    for b in range(labels.shape[0]):
        for i in range(labels.shape[1]):
            target = int(labels[b, i])
            if target == -100:
                continue
            nll = -float(log_probs[b, i, target])
            weight = float(mdm_weights[b, i])
            if weight > 0:
                mdm_sum += nll * weight
            else:
                ar_terms.append(nll)
    return sum(ar_terms) / len(ar_terms), mdm_sum


def test_loss_matches_hand_computation_on_a_two_example_batch(model32):
    batch = hand_batch()
    output = model32(**batch)
    logits = model32(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    ar, mdm = hand_loss(logits, batch["labels"], batch["mdm_weights"])
    assert output.ar_loss.item() == pytest.approx(ar, rel=1e-5)
    assert output.mdm_loss.item() == pytest.approx(mdm, rel=1e-5)
    assert output.loss.item() == pytest.approx(ar + mdm, rel=1e-5)
    # AR is a mean over the 4 clean labelled tokens of the batch, MDM is divided by the 2 examples
    assert ar == pytest.approx(
        sum(
            -float(torch.log_softmax(logits.detach().double(), -1)[b, i, t])
            for b, i, t in [(0, 2, 1), (0, 4, 21), (1, 1, 31), (1, 2, 32)]
        )
        / 4
    )


def test_loss_on_a_collator_batch_and_float32_under_bfloat16(fixture_path):
    collator = RefusionDataCollator(mask_token_id=MASK, pad_token_id=0, slot_sizes=(2, 3), seed=5)
    features = [
        {"input_ids": [10, 11, 12, 20, 21, 22, 23, 24, 25, 1], "prompt_length": 3},
        {"input_ids": [13, 30, 31, 32, 33, 1], "prompt_length": 1},
    ]
    batch = collator(features)
    assert (batch["mdm_weights"] > 0).any() and ((batch["mdm_weights"] == 0) & (batch["labels"] != -100)).any()
    model = RefusionForCausalLM.from_pretrained(fixture_path, dtype=torch.bfloat16).eval()
    output = model(**batch)
    assert output.loss.dtype == output.ar_loss.dtype == output.mdm_loss.dtype == torch.float32
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    ar, mdm = hand_loss(logits.float(), batch["labels"], batch["mdm_weights"])
    assert output.ar_loss.item() == pytest.approx(ar, rel=1e-5)
    assert output.mdm_loss.item() == pytest.approx(mdm, rel=1e-5)


def test_padded_rows_score_as_they_do_alone(model32):
    """Right padding with the explicit mask changes nothing for the real tokens of a row."""
    batch = hand_batch()
    both = model32(**batch)
    alone = {name: tensor[1:, :5] for name, tensor in batch.items()}
    single = model32(**alone)
    torch.testing.assert_close(both.logits[1, :5], single.logits[0], rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing_keeps_the_loss(fixture_path):
    """Gradient checkpointing turns the cache off: exactly where the packed-sequence trap would cut attention."""
    model = RefusionForCausalLM.from_pretrained(fixture_path, dtype=torch.float32)
    batch = hand_batch()
    reference = model(**batch).loss
    model.gradient_checkpointing_enable()
    model.train()
    checkpointed = model(**batch).loss
    checkpointed.backward()
    assert checkpointed.item() == pytest.approx(reference.item(), rel=1e-6)
    assert model.model.embed_tokens.weight.grad is not None


def test_without_collator_fields_labels_mean_the_stock_causal_lm_loss(fixture_path, model32):
    input_ids = torch.tensor([[5, 9, 14, 20, 33, 1], [7, 8, 9, 10, 11, 12]])
    labels = input_ids.clone()
    labels[0, :2] = -100
    output = model32(input_ids=input_ids, labels=labels)
    log_probs = torch.log_softmax(output.logits.detach().double(), -1)
    terms = [-float(log_probs[b, i, labels[b, i + 1]]) for b in range(2) for i in range(5) if labels[b, i + 1] != -100]
    assert output.loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert getattr(output, "ar_loss", None) is None
    stock = Qwen3ForCausalLM.from_pretrained(fixture_path, dtype=torch.float32).eval()
    assert output.loss.item() == pytest.approx(stock(input_ids=input_ids, labels=labels).loss.item(), rel=1e-6)


@pytest.mark.parametrize("packing_length", [None, 64])
def test_plain_autoregressive_examples_carry_the_stock_causal_lm_loss(fixture_path, model32, packing_length):
    """A batch of `ar_fraction=1` examples: `ar_loss` is the stock causal-LM loss of the answers (prompt tokens
    unlabelled), `mdm_loss` is zero, packed or padded."""
    features = [
        {"input_ids": [5, 9, 14, 20, 33, 1], "prompt_length": 2},
        {"input_ids": [7, 8, 9, 10, 11, 12, 40, 41, 1], "prompt_length": 4},
    ]
    collator = RefusionDataCollator(mask_token_id=MASK, pad_token_id=0, ar_fraction=1.0, packing_length=packing_length)
    output = model32(**collator(features))
    stock = Qwen3ForCausalLM.from_pretrained(fixture_path, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for f in features:
        ids = torch.tensor([f["input_ids"]])
        labels = ids.clone()
        labels[0, : f["prompt_length"]] = -100
        answer_tokens = len(f["input_ids"]) - f["prompt_length"]
        total += stock(input_ids=ids, labels=labels).loss.item() * answer_tokens
        count += answer_tokens
    assert output.ar_loss.item() == pytest.approx(total / count, rel=1e-5)
    assert output.mdm_loss.item() == 0.0


def test_tuple_output_and_misuse_errors(model32):
    batch = hand_batch()
    as_tuple = model32(**batch, return_dict=False)
    assert isinstance(as_tuple, tuple) and as_tuple[0].item() == pytest.approx(model32(**batch).loss.item())
    with pytest.raises(ValueError, match="`mdm_weights` was given without `labels`"):
        model32(**{k: v for k, v in batch.items() if k != "labels"})
    with pytest.raises(ValueError, match="must both have the shape"):
        model32(**{**batch, "mdm_weights": batch["mdm_weights"][:, :4]})
    with pytest.raises(ValueError, match="every masked position must be labelled"):
        model32(**{**batch, "labels": torch.full_like(batch["labels"], -100)})
    with pytest.raises(ValueError, match="logits_to_keep"):
        model32(**batch, logits_to_keep=1)


def test_a_batch_without_masked_or_clean_tokens_has_a_zero_part(model32):
    batch = hand_batch()
    no_mdm = model32(**{**batch, "mdm_weights": torch.zeros_like(batch["mdm_weights"])})
    assert no_mdm.mdm_loss.item() == 0.0 and torch.isfinite(no_mdm.loss)
    only_mdm = batch["labels"].masked_fill(batch["mdm_weights"] == 0, -100)
    no_ar = model32(**{**batch, "labels": only_mdm})
    assert no_ar.ar_loss.item() == 0.0 and no_ar.loss.item() == pytest.approx(model32(**batch).mdm_loss.item())
