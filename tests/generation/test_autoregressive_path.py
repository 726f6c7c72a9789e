"""`decoding="autoregressive"` is stock `generate` with the same weights: same arguments, same tokens."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

PROMPT = torch.tensor([[32, 24, 53, 31, 52, 63, 5, 38]])


@pytest.fixture(scope="module")
def stock(fixture_path):
    return Qwen3ForCausalLM.from_pretrained(fixture_path, dtype=torch.float64).eval()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(do_sample=False),
        dict(do_sample=True, top_k=5, temperature=0.8),
        dict(do_sample=True, top_p=0.9, min_p=0.05),
        dict(cache_implementation="static"),
        dict(prompt_lookup_num_tokens=3),
        dict(num_beams=3),
        dict(repetition_penalty=1.3, no_repeat_ngram_size=2),
        dict(do_sample=True, num_return_sequences=3),
        dict(eos_token_id=-1, pad_token_id=-1),  # "never stop", as transformers' own tests use it
    ],
    ids=lambda kwargs: ",".join(kwargs),
)
def test_same_tokens_as_stock_qwen3(model64, stock, kwargs):
    torch.manual_seed(0)
    theirs = stock.generate(PROMPT, max_new_tokens=12, **kwargs)
    torch.manual_seed(0)
    ours = model64.generate(PROMPT, max_new_tokens=12, decoding="autoregressive", **kwargs)
    assert torch.equal(ours, theirs)


def test_assistant_model_and_refusion_knobs(model64, stock):
    """ReFusion knobs are dropped (they mean nothing left to right); the assistant is stock assisted decoding."""
    theirs = stock.generate(PROMPT, max_new_tokens=10, assistant_model=stock, do_sample=False)
    ours = model64.generate(
        PROMPT, max_new_tokens=10, assistant_model=stock, decoding="autoregressive", slot_size=4, do_sample=False
    )
    assert torch.equal(ours, theirs)


def test_default_length_is_stocks(model64, stock):
    """Neither the call nor the config sets a length: 20 new tokens, as stock."""
    theirs = stock.generate(PROMPT, do_sample=False)
    assert torch.equal(model64.generate(PROMPT, decoding="autoregressive", do_sample=False), theirs)
    assert theirs.shape[1] == 8 + 20


def test_inputs_embeds_alone(model64, stock):
    embeds = stock.get_input_embeddings()(PROMPT)
    theirs = stock.generate(inputs_embeds=embeds, max_new_tokens=8, do_sample=False)
    ours = model64.generate(inputs_embeds=embeds, max_new_tokens=8, decoding="autoregressive", do_sample=False)
    assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="ReFusion decoding needs `input_ids`.*decoding='autoregressive'"):
        model64.generate(inputs_embeds=embeds, max_new_tokens=8)


@pytest.mark.parametrize("main", ["ours", "stock"])
def test_ours_as_assistant(model64, stock, main):
    """Stock assisted decoding calls the assistant's `generate` with the main model's prepared config
    (`is_assistant`): ours then drafts left to right, as stock Qwen3 does with the same weights."""
    theirs = stock.generate(PROMPT, max_new_tokens=10, assistant_model=stock, do_sample=False)
    if main == "ours":
        tokens = model64.generate(
            PROMPT, max_new_tokens=10, assistant_model=model64, decoding="autoregressive", do_sample=False
        )
    else:
        tokens = stock.generate(PROMPT, max_new_tokens=10, assistant_model=model64, do_sample=False)
    assert torch.equal(tokens, theirs)


def test_prefill_computes_one_row_of_logits(model64):
    """`logits_to_keep` reaches the forward: stock generate asks for the last position's logits only."""
    widths = []
    hook = model64.lm_head.register_forward_hook(lambda module, args, output: widths.append(args[0].shape[1]))
    try:
        model64.generate(PROMPT, max_new_tokens=3, decoding="autoregressive", do_sample=False)
    finally:
        hook.remove()
    assert widths == [1, 1, 1]
