"""The unsafe cases of issue 53, over 127.0.0.1 (the `openai` client, or httpx2 / a raw socket where a client must
send what `openai` never would): bad values get a 4xx naming the field (never a 500); trusted chat templates are
bounded in time and memory and abandoned with their client; a stopping server answers its queued clients 503
within `--shutdown-timeout` with nothing left unretrieved; continuous batching streams each piece when it is final;
API keys no client can send are refused at start; two `Authorization` headers are refused; connections that never
send their request are closed. Model: the official-layout folder built from the tiny fixture."""

import json
import logging
import os
import signal
import socket
import threading
import time

import httpx2
import openai
import pytest

from refusion_hf.modeling.modeling_refusion import RefusionForCausalLM
from refusion_hf.serving import app as app_module
from refusion_hf.serving.app import build_app
from refusion_hf.serving.cli import draining_server
from refusion_hf.serving.connections import HeadDeadlineProtocol
from tests.cli_errors import user_error
from tests.serving.servers import HeldRequest, rows_per_forward, running, running_server, slowed_forwards, until

TIMEOUT = 60
MESSAGES = [{"role": "user", "content": "t9 t10"}]
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}t4"


@pytest.fixture(scope="module")
def trusting(official):
    """One server for the module: trusts request templates (60 s each, so that only a client leaving ends one)."""
    app, decoder = build_app(
        official[0], dtype="float32", device="cpu", trust_request_chat_template=True, request_chat_template_seconds=60
    )
    with running(app) as url:
        yield url
    decoder.shutdown()


def post(url: str, path: str, body, timeout=TIMEOUT):
    """`body` as JSON (NaN and lone surrogates included, which Python's json writes)."""
    content = json.dumps(body)
    return httpx2.post(f"{url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=timeout)


def test_bad_values_are_4xx_naming_the_field(trusting):
    cases = [
        ({"messages": MESSAGES, "temperature": -1}, "temperature"),
        ({"messages": MESSAGES, "temperature": 1e308}, "temperature"),
        ({"messages": MESSAGES, "temperature": float("nan")}, "temperature"),
        ({"messages": MESSAGES, "top_p": float("inf")}, "top_p"),
        ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content"),
        ({"messages": MESSAGES, "stop": ["\udc00"]}, "stop"),
        ({"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}, "'messages'"),
        ({"messages": MESSAGES, "chat_template_kwargs": {"conversation": []}}, "'conversation'"),
        ({"messages": MESSAGES, "seed": 2**70}, "seed"),
        ({"messages": MESSAGES, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ]
    for body, field in cases:
        refused = post(trusting, "/v1/chat/completions", {**body, "max_tokens": 2})
        assert 400 <= refused.status_code < 500 and field in refused.json()["detail"], (body, refused.text)
    refused = post(trusting, "/v1/completions", {"prompt": "hi \ud800", "max_tokens": 2})
    assert refused.status_code == 422 and "prompt" in refused.json()["detail"], refused.text
    client = openai.OpenAI(base_url=f"{trusting}/v1", api_key="-", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.chat.completions.create(model="-", messages=MESSAGES, temperature=-1)
    assert "temperature" in str(refused.value.body)
    reply = client.chat.completions.create(messages=MESSAGES, model=client.models.list().data[0].id, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"  # still serving


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def render_processes() -> list[int]:
    """The template processes alive: children of this process's multiprocessing forkserver."""
    servers = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as status:
                fields = dict(line.split(":\t", 1) for line in status if ":\t" in line)
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except (OSError, ValueError):
            continue
        servers.append((pid, int(fields["PPid"]), b"forkserver" in command))
    forkservers = {pid for pid, parent, fork in servers if fork and parent == os.getpid()}
    return [pid for pid, parent, _ in servers if str(parent) in forkservers]


def test_trusted_templates_are_bounded_in_memory_and_abandoned_with_their_client(trusting):
    before = resident_bytes()
    bomb = {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"chat_template": "{{ 'a'*1000000000 }}"}}
    refused = post(trusting, "/v1/chat/completions", bomb)
    assert refused.status_code == 400 and "memory" in refused.json()["detail"], refused.text
    assert resident_bytes() - before < 200 * 2**20

    endless = {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"chat_template": ENDLESS}}
    clients = [threading.Thread(target=lambda: pytest.raises(httpx2.ReadTimeout, post, trusting,
               "/v1/chat/completions", endless, timeout=httpx2.Timeout(60, read=8))) for _ in range(8)]  # fmt: skip
    for client in clients:
        client.start()
    until(lambda: len(render_processes()) == 8, "eight templates to render", seconds=60)
    # an ordinary chat is answered while the eight render
    reply = post(trusting, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    for client in clients:
        client.join(TIMEOUT)
    # the clients left after 8 s: their templates' processes are gone within a few polls, long before 60 s
    until(lambda: render_processes() == [], "the abandoned templates to stop", seconds=10)


def test_sigterm_answers_the_queued_clients_503_within_the_shutdown_timeout(official, caplog):
    folder, model, tokenizer = official
    app, decoder = build_app(folder, dtype="float32", device="cpu")
    body = {"prompt": "t9 t10 t11", "max_tokens": 400}
    replies = []

    def ask():
        try:
            replies.append(httpx2.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).status_code)
        except httpx2.HTTPError as error:  # the one decoding: its connection ends with the server
            replies.append(type(error).__name__)

    make = lambda config: draining_server(config, decoder)  # noqa: E731
    with caplog.at_level(logging.ERROR, logger="asyncio"), slowed_forwards(RefusionForCausalLM, 0.1) as starts:
        with running_server(app, make_server=make, timeout_graceful_shutdown=2) as (url, server):
            clients = [threading.Thread(target=ask)]
            clients[0].start()
            until(lambda: starts, "the first request to decode")
            clients += [threading.Thread(target=ask) for _ in range(4)]
            for client in clients[1:]:
                client.start()
            until(lambda: decoder.metrics.waiting._value.get() == 4, "four requests to wait")
            asked = time.monotonic()
            server.handle_exit(signal.SIGTERM, None)  # what uvicorn does on SIGTERM
            for client in clients[1:]:
                client.join(TIMEOUT)
            answered = time.monotonic() - asked
        stopped = time.monotonic() - asked
        clients[0].join(TIMEOUT)
    decoder.shutdown()
    assert replies == [503] * 5, replies  # the four waiting at once, the one decoding at the timeout
    assert answered < 1.5 and stopped < 2 + 1.5, (answered, stopped)
    assert "never retrieved" not in caplog.text and "Traceback" not in caplog.text


def test_continuous_batching_streams_each_piece_when_it_is_final(official):
    """Two streamed requests decoding together in one `generate_batch` call (two rows per forward, counted from
    outside; they queue behind a first request, whose client then leaves): each answer's first piece arrives long
    before its end (forwards slowed to 0.05 s by a hook of the test), and the pieces join to generate()'s answer."""
    folder, model, tokenizer = official
    prompts = ["t9 t10 t11", "t12 t13"]
    app, decoder = build_app(folder, dtype="float32", device="cpu", continuous_batching=True)
    arrivals, texts = [[], []], ["", ""]

    def stream(index):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=TIMEOUT, max_retries=0)
        for chunk in client.completions.create(model=folder, prompt=prompts[index], max_tokens=200, stream=True):
            if chunk.choices and chunk.choices[0].text:
                arrivals[index].append(time.monotonic())
                texts[index] += chunk.choices[0].text
        arrivals[index].append(time.monotonic())  # the end

    with running(app) as url, slowed_forwards(RefusionForCausalLM, 0.05) as starts, rows_per_forward() as rows:
        first = HeldRequest(url, {"prompt": "t9", "max_tokens": 400})
        until(lambda: starts, "the first request to decode")
        clients = [threading.Thread(target=stream, args=(index,)) for index in range(2)]
        for client in clients:
            client.start()
        until(lambda: decoder.metrics.waiting._value.get() == 2, "the two to wait")
        left = first.leave()  # the two start decoding now
        for client in clients:
            client.join(TIMEOUT)
    decoder.shutdown()
    assert any(n == 2 for t, n in rows), "the two did not decode together"
    for prompt, text, times in zip(prompts, texts, arrivals):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert text == tokenizer.decode(
            model.generate(ids, max_new_tokens=200)[0, ids.shape[1] :], skip_special_tokens=True
        )
        # pieces over the decoding: the first one at least ten (slowed) forwards before the end, where an answer
        # delivered whole arrives as one burst
        assert len(times) >= 2 and times[-1] - times[0] > 10 * 0.05, [t - left for t in times]


def test_api_keys_no_client_can_send_are_refused_at_start(capsys, official):
    for key in (" key", "key ", "kéy", "k\x01y", "k\ny"):
        said = user_error(capsys, ["serve", official[0], "--api-key", key])
        assert "--api-key" in said and "\n" not in said.strip(), (key, said)


def test_two_authorization_headers_are_refused(official):
    app, decoder = build_app(official[0], dtype="float32", device="cpu", api_key="k")
    with running(app) as url:
        both = [("Authorization", "Bearer wrong"), ("Authorization", "Bearer k")]
        for headers in (both, both[::-1]):
            refused = httpx2.get(f"{url}/v1/models", headers=headers, timeout=TIMEOUT)
            assert refused.status_code == 400 and "Authorization" in refused.json()["detail"]
        assert httpx2.get(f"{url}/v1/models", headers=[both[1]], timeout=TIMEOUT).status_code == 200
    decoder.shutdown()


def test_slow_and_idle_connections_are_closed(official, monkeypatch):
    monkeypatch.setattr(HeadDeadlineProtocol, "head_seconds", 1.0)
    monkeypatch.setattr(app_module, "BODY_SECONDS", 1.0)
    app, decoder = build_app(official[0], dtype="float32", device="cpu")
    with running_server(app, http=HeadDeadlineProtocol, timeout_keep_alive=1) as (url, _):
        host, port = url.removeprefix("http://").split(":")

        def closed_after(send: bytes) -> tuple[float, bytes]:
            with socket.create_connection((host, int(port)), timeout=30) as connection:
                begun = time.monotonic()
                connection.sendall(send)
                received = b""
                while chunk := connection.recv(65536):
                    received += chunk
                return time.monotonic() - begun, received

        for head in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"):  # nothing; a head that never ends
            took, received = closed_after(head)
            assert took < 5 and received == b"", (head, took, received)
        took, received = closed_after(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        assert took < 5 and received.startswith(b"HTTP/1.1 408"), received[:200]
        held = HeldRequest(url, {"prompt": "t9", "max_tokens": 2})  # a whole request: answered as usual
        assert held.socket.recv(65536).startswith(b"HTTP/1.1 200")
        held.leave()
    decoder.shutdown()
