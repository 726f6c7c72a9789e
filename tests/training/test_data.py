"""Loading training data: both record formats, chat templates, EOS, over-long examples, malformed input."""

import json
import logging
import re

import pytest
from transformers import AutoTokenizer

from refusion_hf.training import DataFormatError, load_sft_dataset

TEMPLATE = (
    "{% for m in messages %}{{ 't' ~ (10 if m['role'] == 'system' else 11 if m['role'] == 'user' else 12) }} "
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t13 {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(fixture_path):
    return AutoTokenizer.from_pretrained(fixture_path)


@pytest.fixture(scope="module")
def chat_tokenizer(fixture_path):
    tokenizer = AutoTokenizer.from_pretrained(fixture_path)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_query_response_records_without_template(tmp_path, tokenizer):
    records = [{"query": "t5 t6 t7", "response": "t8 t9"}, {"query": "", "response": ""}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    dataset = load_sft_dataset(path, tokenizer)
    assert len(dataset) == 2
    assert dataset[0] == {"input_ids": [5, 6, 7, 8, 9, 1], "prompt_length": 3}
    assert dataset[1] == {"input_ids": [1], "prompt_length": 0}, "an empty answer is just EOS"


def test_chat_template_applies_to_both_formats(tmp_path, chat_tokenizer):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"query": "t5 t6", "response": "t7"},
            {
                "messages": [
                    {"role": "system", "content": "t40"},
                    {"role": "user", "content": "t41"},
                    {"role": "assistant", "content": "t42 t43"},
                ]
            },
        ],
    )
    dataset = load_sft_dataset(path, chat_tokenizer)
    assert dataset[0] == {"input_ids": [11, 5, 6, 13, 7, 1], "prompt_length": 4}
    assert dataset[1] == {"input_ids": [10, 40, 11, 41, 13, 42, 43, 1], "prompt_length": 5}


def test_json_array_file(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"query": "t5", "response": "t6"}, {"query": "t7", "response": "t8 t9"}], indent=2))
    dataset = load_sft_dataset(path, tokenizer)
    assert [f["input_ids"] for f in dataset] == [[5, 6, 1], [7, 8, 9, 1]]


def test_over_long_examples_are_skipped_and_counted(tmp_path, tokenizer, caplog):
    records = [{"query": "t5 t6", "response": "t7 t8"}, {"query": "t5 t6 t7", "response": "t8 t9 t10 t11"}] * 2
    path = write_jsonl(tmp_path / "d.jsonl", records)
    with caplog.at_level(logging.WARNING, logger="refusion_hf.training.data"):
        dataset = load_sft_dataset(path, tokenizer, max_length=5)
    assert len(dataset) == 2
    stats = dataset.stats
    assert (stats.total, stats.kept, stats.skipped_too_long) == (4, 2, 2)
    assert stats.skipped_at == ["line 2", "line 4"]
    assert "skipped 2 of 4 examples longer than max_length=5 tokens (first at line 2)" in caplog.text
    with pytest.raises(ValueError, match=r"no usable example \(4 read, 4 longer than max_length=3\).*--max-length"):
        load_sft_dataset(path, tokenizer, max_length=3)


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"query": "t5", "response": "t6"}', "", '{"query": "t5", "response": '], r"line 3: invalid JSON"),
        (['{"query": "t5", "response": "t6"}', '{"prompt": "t5", "answer": "t6"}'], r"line 2: a record needs either"),
        (['{"query": "t5", "response": 6}'], r"line 1: 'response' must be a string, got int"),
        (['["t5", "t6"]'], r"item 1: expected a JSON object, got str"),
        (['{"messages": [{"role": "user", "content": "t5"}]}'], r"line 1: 'messages' must be a list of at least two"),
        (
            ['{"messages": [{"role": "user", "content": "t5"}, {"role": "user", "content": "t6"}]}'],
            r"line 1: the last message must be the assistant's answer",
        ),
        (['{"messages": [{"role": "user"}, {"role": "assistant", "content": "t6"}]}'], r"line 1: message 0 must be"),
    ],
)
def test_malformed_records_name_file_and_line(tmp_path, chat_tokenizer, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=rf"^{re.escape(str(path))}: {message}"):
        load_sft_dataset(path, chat_tokenizer)


def test_messages_need_a_chat_template(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"messages": [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t6"}]}],
    )
    with pytest.raises(DataFormatError, match=r"line 1: 'messages' records need a chat template"):
        load_sft_dataset(path, tokenizer)


def test_invalid_json_array_and_missing_file(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"query": "t5", "response": "t6"},\n  {"query": \n]')
    with pytest.raises(DataFormatError, match=rf"^{re.escape(str(path))}: line 4: invalid JSON"):
        load_sft_dataset(path, tokenizer)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_sft_dataset(tmp_path / "missing.jsonl", tokenizer)
