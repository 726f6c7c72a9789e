"""Fuzzed `generate()` keyword arguments: a `ValueError` naming the problem, or an output that keeps the contract
(shape, prompt kept, no mask token, pad after the end, at most `max_new_tokens`, the honoured constraints)."""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EOS, PAD, MASK, BOS, VOCAB = 1, 0, 3, 2, 64
STOCK_DEFAULT_NEW_TOKENS = 20  # the fixture's generation config sets no length

junk = st.sampled_from(["8", None, [1], 2.5, True, float("nan"), -1])
small_int = st.integers(-2, 24)
probability = st.floats(-0.5, 1.5, allow_nan=False)
token = st.integers(-1, VOCAB + 2)


def maybe(strategy):
    return st.one_of(strategy, strategy, strategy, junk)  # mostly plausible values, sometimes the wrong type


ARGUMENTS = {
    "max_new_tokens": maybe(small_int),
    "min_new_tokens": maybe(st.integers(0, 12)),
    "slot_size": maybe(st.integers(0, 8)),
    "block_size": maybe(st.integers(0, 24)),
    "slot_threshold": maybe(probability),
    "token_threshold": maybe(probability),
    "plan_ahead": maybe(st.booleans()),
    "do_sample": maybe(st.booleans()),
    "temperature": maybe(st.floats(-1, 3, allow_nan=False)),
    "top_k": maybe(st.integers(-1, 10)),
    "top_p": maybe(probability),
    "min_p": maybe(probability),
    "num_return_sequences": maybe(st.integers(0, 3)),
    "eos_token_id": maybe(st.one_of(token, st.lists(token, min_size=1, max_size=3), st.just([[1]]))),
    "pad_token_id": maybe(token),
    "suppress_tokens": maybe(st.lists(token, max_size=3)),
    "bad_words_ids": maybe(st.lists(st.lists(token, min_size=1, max_size=2), min_size=1, max_size=2)),
    "repetition_penalty": maybe(st.floats(0.5, 2.0)),
    "return_dict_in_generate": maybe(st.booleans()),
}


@st.composite
def calls(draw):
    prompts = draw(st.lists(st.lists(st.integers(4, 63), min_size=1, max_size=10), min_size=1, max_size=3))
    names = draw(st.lists(st.sampled_from(sorted(ARGUMENTS)), max_size=6, unique=True))
    return prompts, {name: draw(ARGUMENTS[name]) for name in names}


def as_list(value):
    return value if isinstance(value, list) else [value]


def test_only_value_errors_and_every_output_keeps_the_contract(model64):
    outcomes = []

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(call=calls())
    def check(call):
        outcomes.append(generate_and_check(model64, *call))

    check()
    assert outcomes.count("decoded") > 15 and outcomes.count("refused") > 5, "both branches are exercised"


def generate_and_check(model64, prompts, kwargs) -> str:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    try:
        out = model64.generate(ids, attention_mask=mask, **kwargs)
    except ValueError:
        return "refused"
    sequences = out if torch.is_tensor(out) else out.sequences
    assert sequences.dtype == torch.long
    repeats = kwargs.get("num_return_sequences") or 1
    assert sequences.shape[0] == len(prompts) * repeats
    assert torch.equal(sequences[:, :width], ids.repeat_interleave(repeats, dim=0))
    limit = kwargs.get("max_new_tokens") or STOCK_DEFAULT_NEW_TOKENS
    assert 1 <= sequences.shape[1] - width <= limit
    eos_ids = set(as_list(kwargs.get("eos_token_id", EOS)))
    pad = kwargs.get("pad_token_id", PAD)
    pad = pad if pad is not None else min(eos_ids)
    for row in sequences[:, width:].tolist():
        assert MASK not in row
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        assert all(t == pad for t in row[end:]), "pad after the end"
        answer = row[:end]
        assert not ({BOS, pad} - eos_ids) & set(answer), "pad and bos are never drafted (unless they are EOS)"
        if kwargs.get("min_new_tokens"):
            assert not eos_ids & set(answer[: kwargs["min_new_tokens"]])
        for banned in kwargs.get("suppress_tokens") or []:
            assert banned not in answer
        for word in kwargs.get("bad_words_ids") or []:
            if len(word) == 1 and word[0] not in eos_ids:
                assert word[0] not in answer
    if not torch.is_tensor(out):
        assert all(math.isfinite(x) and x > 0 for x in out.tokens_per_forward.tolist())
    return "decoded"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=calls())
def test_the_autoregressive_path_raises_only_value_errors(model64, call):
    prompts, kwargs = call
    ids = torch.tensor([prompts[0]])
    kwargs = {k: v for k, v in kwargs.items() if k not in ("num_return_sequences",)}
    try:
        out = model64.generate(ids, decoding="autoregressive", **kwargs)
    except ValueError:
        return
    sequences = out if torch.is_tensor(out) else out.sequences
    assert torch.equal(sequences[:, : ids.shape[1]], ids)
