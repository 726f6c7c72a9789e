"""The client people chat with: `pipeline("text-generation")` (chat messages and strings, batches, streaming), on the
embedded model (remote code). `refusion serve` is tested in tests/serving/."""

import threading

import pytest
import torch
from transformers import TextIteratorStreamer, pipeline

from refusion_hf.modeling.loading import default_model_path, load_model_and_tokenizer

QUESTIONS = [f"Tom has {n} pens. He buys 7 more. How many pens does Tom have now?" for n in (3, 12, 25, 40)]


@pytest.fixture(scope="module")
def embedded():
    return load_model_and_tokenizer(str(default_model_path()), "float32")


@pytest.fixture(scope="module")
def generator():
    return pipeline("text-generation", model=str(default_model_path()), trust_remote_code=True, dtype=torch.float32)


def direct_answer(model, tokenizer, messages, **kwargs) -> str:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(ids["input_ids"], **kwargs)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_pipeline_chat_batches_are_refusion_answers(generator, embedded):
    model, tokenizer = embedded
    assert type(generator.model).__name__ == "RefusionForCausalLM"
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = generator(chats, batch_size=2, max_new_tokens=48, do_sample=False)  # the pipeline samples by default
    for chat, output in zip(chats, outputs):
        reply = output[0]["generated_text"][-1]
        assert reply["role"] == "assistant"
        assert reply["content"] == direct_answer(model, tokenizer, chat, max_new_tokens=48)


def test_pipeline_strings_and_return_full_text(generator, embedded):
    model, tokenizer = embedded
    prompt = "Ann has 12 apples."
    # The text-generation pipeline's own defaults sample (do_sample=True, temperature=0.7): honoured, seeded.
    torch.manual_seed(5)
    new_only = generator(prompt, max_new_tokens=12, return_full_text=False)[0]["generated_text"]
    torch.manual_seed(5)
    full = generator(prompt, max_new_tokens=12)[0]["generated_text"]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    torch.manual_seed(5)
    sampled = model.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.7)[0, ids.shape[1] :]
    expected = tokenizer.decode(sampled, skip_special_tokens=True)
    assert new_only == expected and full == prompt + expected


def test_text_iterator_streamer_streams_the_answer(embedded):
    model, tokenizer = embedded
    chat = [{"role": "user", "content": QUESTIONS[1]}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    thread = threading.Thread(target=model.generate, kwargs=dict(input_ids=ids["input_ids"], streamer=streamer))
    thread.start()
    pieces = list(streamer)
    thread.join()
    assert len(pieces) > 1 and "".join(pieces) == direct_answer(model, tokenizer, chat)
