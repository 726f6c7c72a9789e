"""`refusion serve` through the real `openai` client over 127.0.0.1: greedy and seeded answers equal `generate()`'s,
streamed text equals the non-streamed text, usage and finish reasons, refused fields (HTTP 4xx, and the server keeps
serving), 8 concurrent clients one request at a time and with continuous batching, and the command's start and clean
shutdown. Models: the embedded one (chat), and the official-layout folder built from the tiny fixture."""

import contextlib
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from refusion_hf.modeling.loading import default_model_path, load_model_and_tokenizer
from refusion_hf.serving.app import build_app
from tests.cli_errors import user_error
from tests.official_layout import build_marker_folder, markers
from tests.serving.servers import running_server

QUESTIONS = [f"Tom has {n} pens. He buys 7 more. How many pens does Tom have now?" for n in (3, 12)]
WORDS = [" ".join(f"t{8 + (7 * i + j) % 50}" for j in range(3 + i % 4)) for i in range(8)]  # 8 distinct prompts
TIMEOUT = 120  # seconds, per request


@contextlib.contextmanager
def serving(model: str, **options):
    """`refusion serve`'s app on a free 127.0.0.1 port in a thread; yields an `openai` client. Stops on exit."""
    app, state = build_app(model, dtype="float32", device="cpu", **options)
    try:
        with running_server(app) as (url, _):
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=TIMEOUT, max_retries=0)
    finally:
        state.shutdown()


@pytest.fixture(scope="module")
def embedded():
    return load_model_and_tokenizer(str(default_model_path()), "float32")


def chat_ids(tokenizer, content: str) -> torch.LongTensor:
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def answer(model, input_ids, **kwargs) -> list[int]:
    """generate()'s new tokens for one prompt."""
    return model.generate(input_ids, **kwargs)[0, input_ids.shape[1] :].tolist()


def stream_chat(client, **request):
    """The streamed text and the last chunk."""
    pieces, last = [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        last = chunk
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    return "".join(pieces), last


def test_chat_answers_equal_generate_streamed_or_not(embedded):
    """Greedy chat answers of the embedded model are generate()'s; streaming gives the same text, usage counts the
    answer's tokens, and the finish reason says whether it ended (stop: within serve's default budget of 1024 new
    tokens, cut to what the context has left (512 positions), at its EOS) or was cut at max_tokens (length); `stop`
    strings end the answer as generate()'s `stop_strings` do."""
    model, tokenizer = embedded
    ids = [chat_ids(tokenizer, question) for question in QUESTIONS]
    budget = model.config.max_position_embeddings - ids[0].shape[1]
    answers = [answer(model, ids[0], max_new_tokens=budget), answer(model, ids[1], max_new_tokens=6)]
    with serving(str(default_model_path())) as client:
        name = client.models.list().data[0].id
        for expected, question, max_tokens, finish in zip(answers, QUESTIONS, (None, 6), ("stop", "length")):
            text = tokenizer.decode(expected, skip_special_tokens=True)
            request = dict(model=name, messages=[{"role": "user", "content": question}])
            if max_tokens is not None:
                request["max_tokens"] = max_tokens
            reply = client.chat.completions.create(temperature=0, **request)
            assert reply.choices[0].message.content == text
            assert reply.usage.completion_tokens == len(expected)
            assert reply.choices[0].finish_reason == finish
            streamed, last = stream_chat(client, **request)
            assert streamed == text
            assert last.usage.completion_tokens == len(expected)
            assert last.choices[0].finish_reason == finish

        # `stop`: generate()'s stop_strings (the answer ends with the stop string, as in transformers serve)
        expected = answer(model, ids[0], max_new_tokens=64, stop_strings=["="], tokenizer=tokenizer)
        text = tokenizer.decode(expected, skip_special_tokens=True)
        assert text.endswith("=") and len(expected) < len(answers[0])
        request = dict(model=name, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=64, stop=["="])
        reply = client.chat.completions.create(**request)
        assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens == len(expected)
        assert stream_chat(client, **request)[0] == text


def test_completions_seeded_sampling_and_refusals(official):
    """/v1/completions on the official-layout folder: a seeded sample is generate()'s with that seed (and repeats);
    refused fields are 4xx with the reason, streamed or not, and the server keeps serving."""
    folder, model, tokenizer = official
    prompt = WORDS[0]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with serving(folder) as client:
        request = dict(model=folder, prompt=prompt, max_tokens=12)
        torch.manual_seed(7)
        sampled = answer(model, ids, max_new_tokens=12, do_sample=True, temperature=0.9, top_p=0.8)
        for _ in range(2):
            reply = client.completions.create(temperature=0.9, top_p=0.8, seed=7, **request)
            assert reply.choices[0].text == tokenizer.decode(sampled, skip_special_tokens=True)
            assert reply.usage.completion_tokens == len(sampled)

        greedy = answer(model, ids, max_new_tokens=12)
        refusals = [
            (dict(frequency_penalty=0.5), 422, "frequency_penalty"),  # not implemented: never ignored
            (dict(presence_penalty=0.5), 422, "presence_penalty"),
            (dict(n=2), 422, "'n'"),
            (dict(suffix=" t9"), 422, "suffix"),
            (dict(top_p=1.5), 422, "top_p"),  # OpenAI's range (0, 1]
            (dict(extra_body={"no_such_field": 1}), 422, "no_such_field"),
        ]
        for fields, status, named in refusals:
            for stream in (False, True):
                with pytest.raises(openai.APIStatusError) as refused:
                    client.completions.create(stream=stream, **request, **fields)
                assert refused.value.status_code == status and named in str(refused.value.body), fields
        with pytest.raises(openai.APIStatusError) as refused:
            client.responses.create(model=folder, input=prompt)
        assert refused.value.status_code == 501 and "/v1/chat/completions" in str(refused.value.body)
        reply = client.completions.create(**request)  # still serving
        assert reply.choices[0].text == tokenizer.decode(greedy, skip_special_tokens=True)
        # ReFusion decoding, not the autoregressive decoding transformers serve gives an official folder
        assert greedy != answer(model, ids, max_new_tokens=12, decoding="autoregressive")


@pytest.mark.parametrize("continuous_batching", [False, True], ids=["one-at-a-time", "continuous-batching"])
def test_concurrent_clients_each_get_their_own_answer(official, continuous_batching):
    """8 clients at once, each with its own prompt (some streaming, two sampling with a seed): each gets
    generate()'s answer to its own prompt (with its seed: the seed is not consumed by the requests around it)."""
    folder, model, tokenizer = official
    seeded = {3: 5, 7: 11}  # request index -> seed; they sample at temperature 0.9
    expected = []
    for index, words in enumerate(WORDS):
        sampling = dict(do_sample=True, temperature=0.9) if index in seeded else {}
        torch.manual_seed(seeded.get(index, 0))
        expected.append(answer(model, chat_ids(tokenizer, words), max_new_tokens=16, **sampling))

    def ask(client, index):
        request = dict(model=folder, messages=[{"role": "user", "content": WORDS[index]}], max_tokens=16)
        if index in seeded:
            request.update(temperature=0.9, seed=seeded[index])
        if index % 3 == 2:
            return stream_chat(client, **request)[0]
        return client.chat.completions.create(**request).choices[0].message.content

    rows = dict(max_requests_per_batch=4) if continuous_batching else {}  # one at a time: 1, the only value
    with serving(folder, continuous_batching=continuous_batching, **rows) as client:
        with ThreadPoolExecutor(len(WORDS)) as pool:
            replies = list(pool.map(lambda i: ask(client, i), range(len(WORDS))))
    assert replies == [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in expected]
    assert len(set(replies)) > 4, "the prompts must give different answers for this test to see mixing"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_command_serves_and_stops_cleanly(official):
    """`refusion serve MODEL --port P` answers, and SIGTERM stops it with status 0 (uvicorn re-raises the signal
    once it has stopped: the command turns SIGTERM, as SIGINT, into a clean exit)."""
    folder, model, tokenizer = official
    port = free_port()
    command = [sys.executable, "-m", "refusion_hf.cli", "serve", folder, "--port", str(port), "--dtype", "float32"]
    command += ["--shutdown-timeout", "2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=TIMEOUT, max_retries=0)
        deadline = time.monotonic() + 90
        while True:
            try:
                [listed] = client.models.list().data
                break
            except openai.APIConnectionError:
                assert process.poll() is None and time.monotonic() < deadline, "refusion serve did not start"
                time.sleep(0.2)
        assert listed.id == folder
        reply = client.completions.create(model=folder, prompt=WORDS[1], max_tokens=8)
        ids = tokenizer(WORDS[1], return_tensors="pt").input_ids
        assert reply.choices[0].text == tokenizer.decode(answer(model, ids, max_new_tokens=8), skip_special_tokens=True)
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    assert "Traceback" not in output, output


def test_command_errors_are_one_line(capsys, tmp_path):
    assert "no such folder" in user_error(capsys, ["serve", str(tmp_path / "missing")])
    assert "--continuous-batching" in user_error(capsys, ["serve", "--max-requests-per-batch", "4"])
    assert "decode one at a time (--max-num-seqs 1)" in user_error(capsys, ["serve", "--max-num-seqs", "2"])


def test_no_folder_code_runs(tmp_path):
    """The server loads an official-layout folder as ReFusion with the installed package's code: none of the
    folder's own `.py` files (auto_map modeling and configuration, a tokenizer auto_map, custom_generate) runs."""
    marker_dir = tmp_path / "ran"
    marker_dir.mkdir()
    folder = build_marker_folder(tmp_path / "model", marker_dir)
    app, state = build_app(str(folder), dtype="float32", device="cpu")
    state.shutdown()
    assert markers(marker_dir) == []
