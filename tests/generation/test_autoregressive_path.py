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
