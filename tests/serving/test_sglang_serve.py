"""`refusion serve --engine sglang` for real: the command in a subprocess on 127.0.0.1 (SGLang's own server, started
once for the module), driven with the `openai` client. Its greedy answers are `generate()`'s tokens
(tests/data/sglang_golden.json, re-checked against `generate()` in the main suite by test_sglang_golden.py): token-id
prompts as concurrent completions, and chat messages through the model's chat template. Runs in .venv-sglang
(`make test-sglang`); skipped where SGLang is not installed. Traffic: 24 requests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("sglang")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.serving.sglang_golden import EMBEDDED_PROMPTS, GOLDEN, embedded_model_path  # noqa: E402

GOLDEN_DATA = json.loads(GOLDEN.read_text())["embedded"]
ANSWERS = GOLDEN_DATA["configurations"]["installed"]["answers"]  # the model's own decoding: no settings file
CONCURRENT = 16  # completions sent at once (the server decodes --max-num-seqs 4 at a time)
CHATS = 4
EOS = 2  # the embedded model's
START_SECONDS = 300  # SGLang's start-up: 30-70 s here, more on a loaded machine
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`refusion serve --engine sglang` on the embedded model with its own decoding settings (block 16, two slots of
    8, remasking 0.1); yields (base URL, the served name). Stopped with SIGTERM (then its process group killed if it
    lingers)."""
    folder = tmp_path_factory.mktemp("sglang-serve")
    port = free_port()
    command = [sys.executable, "-m", "refusion_hf.cli", "serve", "--engine", "sglang", str(embedded_model_path()),
               "--port", str(port), "--dtype", "float32", "--continuous-batching", "--max-num-seqs", "4",
               "--served-model-name", "refusion-embedded"]  # fmt: skip
    log = (folder / "server.log").open("w")
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited ({process.returncode}): {(folder / 'server.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not up after {START_SECONDS} s"
            time.sleep(1)
        yield url, "refusion-embedded"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)  # SGLang's scheduler and detokenizer, if any is left
        except ProcessLookupError:
            pass
        process.wait()
        log.close()


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_name(server, client):
    assert [model.id for model in client.models.list().data] == [server[1]]


def test_concurrent_completions_give_generates_tokens(server, client):
    prompts = GOLDEN_DATA["prompts"][:CONCURRENT]

    def complete(prompt):
        return client.completions.create(
            model=server[1], prompt=prompt, max_tokens=GOLDEN_DATA["max_new_tokens"], temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip

    with ThreadPoolExecutor(CONCURRENT) as pool:
        replies = list(pool.map(complete, prompts))
    got = [reply.choices[0].token_ids for reply in replies]
    expected = ANSWERS[:CONCURRENT]
    mismatched = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert not mismatched, f"prompts {mismatched} differ from generate(): {[got[i] for i in mismatched[:3]]}"
    for reply, answer in zip(replies, expected, strict=True):
        assert reply.usage.completion_tokens == len(answer)
        assert reply.choices[0].finish_reason == ("stop" if answer[-1] == EOS else "length")


def test_chat_messages_give_generates_tokens(server, client):
    """The server renders the chat template itself: its prompt and answer are generate()'s on the same messages."""
    from refusion_hf.evaluation.synthetic_tasks import generate_problems

    problems = generate_problems("test", EMBEDDED_PROMPTS, 0)[:CHATS]  # the golden prompts' (sglang_golden.py)
    for problem, prompt, answer in zip(problems, GOLDEN_DATA["prompts"], ANSWERS, strict=False):
        reply = client.chat.completions.create(
            model=server[1], messages=[{"role": "user", "content": problem.prompt}],
            max_tokens=GOLDEN_DATA["max_new_tokens"], temperature=0,
            extra_body={"return_token_ids": True, "return_prompt_token_ids": True},
        )  # fmt: skip
        choice = reply.choices[0]
        assert (choice.model_extra["prompt_token_ids"], choice.model_extra["response_token_ids"]) == (prompt, answer)


def test_a_sampled_request_is_refused_by_name(server, client):
    with pytest.raises(openai.BadRequestError, match="greedily only.*temperature 0.8"):
        client.completions.create(model=server[1], prompt=GOLDEN_DATA["prompts"][0], max_tokens=8, temperature=0.8)
