"""The pieces a stream sends (`serving.handler.IncrementalText`) join to the whole answer's decoded text, however
the tokens arrive (hypothesis: any text, in any chunking), and each step decodes a window, not the answer so far.
Tokenizers: the embedded model's byte-level BPE (characters split across tokens) and the tiny fixture's word-level
vocabulary (every token a word, spaces between)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from refusion_hf.modeling.loading import default_model_path
from refusion_hf.serving.handler import IncrementalText
from tests.oracle import FIXTURE

TOKENIZERS = {"byte_level": AutoTokenizer.from_pretrained(default_model_path()), "word_level": None}
TOKENIZERS["word_level"] = AutoTokenizer.from_pretrained(FIXTURE)


def streamed(tokenizer, ids: list[int], cuts: list[int]) -> str:
    text = IncrementalText(tokenizer)
    bounds = [0, *sorted({c % (len(ids) + 1) for c in cuts}), len(ids)]
    pieces = [text.add(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    return "".join(pieces) + text.rest()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.text(max_size=60), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_pieces_join_to_the_whole_text_byte_level(words, cuts):
    tokenizer = TOKENIZERS["byte_level"]
    ids = tokenizer.encode(words, add_special_tokens=False)
    assert streamed(tokenizer, ids, cuts) == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(min_value=4, max_value=63), max_size=30),
    st.lists(st.integers(min_value=0, max_value=200), max_size=12),
)
def test_pieces_join_to_the_whole_text_word_level(ids, cuts):
    tokenizer = TOKENIZERS["word_level"]
    assert streamed(tokenizer, ids, cuts) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_each_step_decodes_a_window_not_the_answer_so_far(name):
    """A 400-token answer, one token at a time: no decode call sees more than a few tokens (the answer so far each
    time would be 80,000 token decodes in all)."""
    tokenizer = TOKENIZERS[name]
    ids = tokenizer.encode("t9 t10 t11 " * 134 if name == "word_level" else "héllo wörld, 12+34. " * 40)[:400]
    seen = []
    decode = tokenizer.decode

    def counting(tokens, **kwargs):
        seen.append(len(tokens))
        return decode(tokens, **kwargs)

    tokenizer.decode = counting
    try:
        assert streamed(tokenizer, ids, list(range(len(ids)))) == decode(ids, skip_special_tokens=True)
    finally:
        del tokenizer.decode
    assert max(seen) <= 4, max(seen)
