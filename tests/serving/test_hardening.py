"""`refusion serve` against hostile or careless clients, over 127.0.0.1 (httpx2, the HTTP client `openai` uses, and
the `openai` client). Pinned (no route loads or unloads a model, no
request opens a path), bounded (`--max-model-len`, body size, chat templates from the request, an event loop that a
slow template never blocks) and authenticated (`--api-key`). Model: the official-layout folder built from the tiny
fixture (512 positions)."""

import asyncio
import json
import logging
import re
import threading
import time

import httpx2
import openai
import pytest
from transformers import AutoTokenizer

from refusion_hf.cli import build_parser
from refusion_hf.modeling.modeling_refusion import RefusionForCausalLM
from refusion_hf.serving.app import ServeOptionError, build_app
from refusion_hf.serving.cli import warn_if_open
from refusion_hf.serving.decoding import Decoder
from tests.cli_errors import user_error
from tests.official_layout import build_official_layout
from tests.serving.servers import HeldRequest, rows_per_forward, running, slowed_forwards, until

TIMEOUT = 60  # seconds, per request
# A template that renders the generation prompt after a loop of N * N steps (about 1.5 s at N = 4000 here).
SLOW_TEMPLATE = "{% for i in range(4000) %}{% for j in range(4000) %}{% endfor %}{% endfor %}t4 t7 "


def words(count: int) -> str:
    """A prompt of `count` tokens of the tiny fixture's vocabulary (one token per word)."""
    return " ".join(f"t{8 + i % 50}" for i in range(count))


def answer_text(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    return tokenizer.decode(
        model.generate(ids, max_new_tokens=max_new_tokens)[0, ids.shape[1] :], skip_special_tokens=True
    )


def ours(folder: str, **options):
    app, state = build_app(folder, dtype="float32", device="cpu", **options)
    return app, state


def test_the_server_is_pinned_to_its_model(official, tmp_path, monkeypatch):
    folder, model, tokenizer = official
    other = str(build_official_layout(tmp_path / "other"))
    app, state = ours(folder, served_model_name=["tiny", "tiny-alias"])
    loads = []  # every load attempted once the server runs
    monkeypatch.setattr(RefusionForCausalLM, "from_pretrained", lambda *args, **kw: loads.append(args))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kw: loads.append(args))
    with running(app) as url, httpx2.Client(base_url=url, timeout=TIMEOUT) as http:
        for method, path in [("POST", "/load_model"), ("GET", "/load_model"), ("POST", "/reset"), ("GET", "/reset")]:
            assert http.request(method, path, json={"model": other}).status_code in (404, 405), path
        assert [entry["id"] for entry in http.get("/v1/models").json()["data"]] == ["tiny", "tiny-alias"]
        request = {"prompt": words(3), "max_tokens": 4}
        reply = http.post("/v1/completions", json={"model": "tiny-alias", **request})
        assert reply.status_code == 200 and reply.json()["model"] == "tiny"
        assert reply.json()["choices"][0]["text"] == answer_text(model, tokenizer, words(3), 4)
        refusals = set()
        for name in (other, str(tmp_path / "missing"), folder, "Qwen/Qwen3-0.6B", f"{other}/."):
            for path, body in (
                ("/v1/completions", request),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t9"}]}),
            ):
                refused = http.post(path, json={"model": name, **body})
                assert refused.status_code == 404 and "'tiny'" in refused.json()["detail"], refused.text
                refusals.add(refused.json()["detail"].replace(repr(name), "NAME"))
        assert len(refusals) == 1, refusals  # an existing and a missing path get the same answer: no oracle
    state.shutdown()
    assert loads == []


def test_prompt_plus_max_tokens_within_max_model_len(official, monkeypatch):
    folder, model, tokenizer = official
    decoded = []  # max_new_tokens of every request that reached decoding (each is submitted to the decoder)
    submit = Decoder.submit
    monkeypatch.setattr(
        Decoder, "submit", lambda self, job: [decoded.append(job.config.max_new_tokens), submit(self, job)]
    )
    app, state = ours(folder, max_model_len=64)
    with running(app) as url, httpx2.Client(base_url=url, timeout=TIMEOUT) as http:
        refusals = [
            (
                "/v1/completions",
                {"prompt": words(60), "max_tokens": 10},
                "60 in the prompt (prompt) + 10 in max_tokens",
            ),
            ("/v1/completions", {"prompt": words(64)}, "64 in the prompt (prompt)"),
            ("/v1/completions", {"prompt": words(600), "max_tokens": 1}, "600 in the prompt (prompt)"),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": words(70)}]},
                "in the prompt (messages)",
            ),
        ]
        for path, body, said in refusals:
            for stream in (False, True):
                refused = http.post(path, json={**body, "stream": stream})
                assert refused.status_code == 400 and said in refused.json()["detail"], refused.text
                assert "--max-model-len" in refused.json()["detail"]
        for max_tokens in (0, -3, "9", 2.5):
            refused = http.post("/v1/completions", json={"prompt": words(3), "max_tokens": max_tokens})
            assert refused.status_code in (400, 422) and "max_tokens" in refused.json()["detail"], refused.text
        assert decoded == []  # refused before any decoding
        fits = http.post("/v1/completions", json={"prompt": words(54), "max_tokens": 10})
        assert fits.status_code == 200
        assert fits.json()["choices"][0]["text"] == answer_text(model, tokenizer, words(54), 10)
        # no max_tokens: serve's default budget, cut to what the context has left
        short = http.post("/v1/completions", json={"prompt": words(60)})
        assert short.status_code == 200 and decoded[-1] == 4
        assert short.json()["choices"][0]["text"] == answer_text(model, tokenizer, words(60), 4)
    state.shutdown()


def test_bodies_too_large_for_any_prompt_are_refused_unread(official):
    folder, model, tokenizer = official
    big = {"prompt": "apples " * 300000, "max_tokens": 1, "no_such_field": 1}  # 2.1 MB
    app, state = ours(folder)
    with running(app) as url, httpx2.Client(base_url=url, timeout=TIMEOUT) as http:
        refused = http.post("/v1/completions", json=big)
        assert refused.status_code == 413 and "--max-model-len" in refused.json()["detail"]
        body = json.dumps(big).encode()
        pieces = iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
        chunked = http.post("/v1/completions", content=pieces, headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413, chunked.text[:200]  # no Content-Length: counted as it arrives
        # the longest body a prompt within the context can take is not refused unread: a 511-token prompt, every
        # character written as a JSON \u escape, gets its answer
        prompt = words(511)
        escaped = '{"prompt": "' + "".join(f"\\u{ord(c):04x}" for c in prompt) + '", "max_tokens": 1}'
        reply = http.post("/v1/completions", content=escaped, headers={"Content-Type": "application/json"})
        assert reply.status_code == 200, reply.text
        assert http.get("/health").status_code == 200
    state.shutdown()


def test_chat_templates_from_the_request(official):
    folder, model, tokenizer = official
    message = {"role": "user", "content": words(3)}
    template = "{{ 't4 t7 ' }}"  # ignores the messages
    for trusted in (False, True):
        app, state = ours(folder, trust_request_chat_template=trusted)
        with running(app) as url, httpx2.Client(base_url=url, timeout=TIMEOUT) as http:
            chat = {"messages": [message], "max_tokens": 3}
            reply = http.post(
                "/v1/chat/completions", json={**chat, "chat_template_kwargs": {"chat_template": template}}
            )
            if trusted:
                assert reply.json()["choices"][0]["message"]["content"] == answer_text(model, tokenizer, "t4 t7 ", 3)
            else:
                assert reply.status_code == 400 and "--trust-request-chat-template" in reply.json()["detail"]
            for arguments in ({"tokenize": False}, {"return_tensors": "np"}, {"add_generation_prompt": False}):
                refused = http.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": arguments})
                assert refused.status_code == 400 and repr(next(iter(arguments))) in refused.json()["detail"]
            # a template variable is the template's
            assert (
                http.post(
                    "/v1/chat/completions", json={**chat, "chat_template_kwargs": {"enable_thinking": False}}
                ).status_code
                == 200
            )
            assert http.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": "x"}).status_code == 422
        state.shutdown()


class LoopLag:
    """ASGI middleware of the test: from the first request on, a task on the server's event loop that sleeps
    `TICK` seconds over and over and records how late each wake-up was (the longest time the loop was held)."""

    TICK = 0.01

    def __init__(self, app):
        self.app, self.lags, self.task = app, [], None

    async def watch(self):
        while True:
            start = time.monotonic()
            await asyncio.sleep(self.TICK)
            self.lags.append(time.monotonic() - start - self.TICK)

    async def __call__(self, scope, receive, send):
        if self.task is None and scope["type"] == "http":
            self.task = asyncio.get_running_loop().create_task(self.watch())
        await self.app(scope, receive, send)


def test_a_slow_template_never_blocks_the_event_loop(official):
    """A request's (trusted) chat template that renders for seconds does not hold the server's event loop: the
    longest time the loop was held while it rendered is a small part of the render (the template renders in a
    process of its own; the model's own template and the tokenizer run on worker threads)."""
    folder, model, tokenizer = official
    slow = {"messages": [{"role": "user", "content": "t9"}], "max_tokens": 1}
    app, state = ours(folder, trust_request_chat_template=True)
    watched = LoopLag(app)
    with running(watched) as url, httpx2.Client(base_url=url, timeout=TIMEOUT) as http:
        assert http.get("/health").status_code == 200  # the watch starts
        time.sleep(0.2)
        before = len(watched.lags)
        begun = time.monotonic()
        reply = http.post(
            "/v1/chat/completions", json={**slow, "chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}}
        )
        took = time.monotonic() - begun
        during = watched.lags[before:]
    state.shutdown()
    assert reply.status_code == 200, reply.text
    assert took > 0.5, f"the template rendered in {took:.2f} s: make SLOW_TEMPLATE slower"
    assert len(during) > 10 and max(during) < took / 4, (took, max(during))


def test_api_key(official):
    folder, model, tokenizer = official
    app, state = ours(folder, api_key="s3cret key")
    with running(app) as url, httpx2.Client(base_url=url, timeout=TIMEOUT) as http:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret key"},
            {"Authorization": "Basic s3cret key"},
        ):
            for method, path in [
                ("GET", "/v1/models"),
                ("POST", "/v1/completions"),
                ("POST", "/load_model"),
                ("GET", "/openapi.json"),
            ]:
                refused = http.request(method, path, headers=headers, json={"prompt": "t9"})
                assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer", (path, headers)
        assert http.get("/health").status_code == 200  # for load balancers
        assert http.get("/metrics").status_code == 200  # for Prometheus (as vLLM)
        good = {"Authorization": "Bearer s3cret key"}
        assert http.get("/v1/models", headers=good).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).completions.create(
                model=folder, prompt="t9"
            )
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret key", timeout=TIMEOUT, max_retries=0)
        reply = client.completions.create(model=folder, prompt=words(3), max_tokens=4)
        assert reply.choices[0].text == answer_text(model, tokenizer, words(3), 4)
    state.shutdown()


def test_api_key_from_the_environment_and_the_open_host_warning(monkeypatch, caplog, capsys, official):
    monkeypatch.setenv("REFUSION_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "given"]).api_key == "given"
    monkeypatch.setenv("REFUSION_API_KEY", " ")
    assert "--api-key" in user_error(capsys, ["serve", official[0]])
    with caplog.at_level(logging.WARNING, logger="refusion_hf.serving"):
        for host, key in (("127.0.0.1", None), ("localhost", None), ("::1", None), ("0.0.0.0", "k")):
            warn_if_open(host, key)
        assert caplog.records == []
        for host in ("0.0.0.0", "192.168.1.4", "example.org"):
            warn_if_open(host, None)
        assert [
            host in record.getMessage()
            for record, host in zip(caplog.records, ("0.0.0.0", "192.168.1.4", "example.org"))
        ] == [True] * 3


def test_max_model_len_over_the_models_positions_is_refused(capsys, official):
    assert "--max-model-len 4096" in user_error(capsys, ["serve", official[0], "--max-model-len", "4096"])


def test_max_queued_requests(official):
    """One request decodes and at most `--max-queued-requests` wait: one more is a 503 with Retry-After, before any
    work; transformers serve queues without limit. Forwards slowed by a hook of the test so that they overlap."""
    folder, model, tokenizer = official
    request = {"prompt": words(3), "max_tokens": 4}

    def crowd(url: str, count: int, all_answered_or_queued=None) -> list:
        replies = [None] * count

        def ask(index):
            time.sleep(0.1 * index)  # in this order: one decodes, then they queue
            replies[index] = httpx2.post(f"{url}/v1/completions", json=request, timeout=TIMEOUT)
            if index == count - 1 and all_answered_or_queued is not None:
                all_answered_or_queued.set()

        clients = [threading.Thread(target=ask, args=(index,)) for index in range(count)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(TIMEOUT)
        return replies

    app, state = ours(folder, max_queued_requests=2)
    # forwards slow enough that the first request still decodes when the fourth arrives (0.3 s later), however fast,
    # until the fourth has its answer; full speed after it (the queue's verdict is given by then)
    fourth_answered = threading.Event()
    with running(app) as url, slowed_forwards(RefusionForCausalLM, lambda: 0 if fourth_answered.is_set() else 0.2):
        replies = crowd(url, 4, fourth_answered)
        assert [reply.status_code for reply in replies] == [200, 200, 200, 503], [r.text for r in replies]
        assert replies[3].headers["Retry-After"] == "1" and "--max-queued-requests 2" in replies[3].json()["detail"]
        assert replies[0].json()["choices"][0]["text"] == answer_text(model, tokenizer, words(3), 4)
        assert httpx2.post(f"{url}/v1/completions", json=request, timeout=TIMEOUT).status_code == 200  # room again
    state.shutdown()


def test_max_num_seqs(official):
    """With continuous batching and `--max-num-seqs 2`, at most two requests decode at once (two rows per forward,
    counted from outside) and the rest wait in the queue that `--max-queued-requests` bounds (one more is a 503);
    without continuous batching requests decode one at a time, and a larger value is refused."""
    folder, model, tokenizer = official
    with pytest.raises(ServeOptionError, match="one at a time"):
        ours(folder, max_requests_per_batch=2)
    body = {"prompt": words(3), "max_tokens": 400}

    def gauge(url: str, name: str) -> float:
        return float(re.search(rf"^refusion_requests_{name} (\S+)$", httpx2.get(f"{url}/metrics").text, re.M)[1])

    app, state = ours(folder, continuous_batching=True, max_requests_per_batch=2, max_queued_requests=3)
    with running(app) as url, slowed_forwards(RefusionForCausalLM, 0.1) as starts, rows_per_forward() as rows:
        first = HeldRequest(url, body)
        until(lambda: starts, "the first request to decode")
        queued = [HeldRequest(url, body) for _ in range(3)]
        until(lambda: gauge(url, "waiting") == 3, "three requests to wait")
        reply = httpx2.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
        assert reply.status_code == 503 and "--max-queued-requests 3" in reply.json()["detail"]
        left = first.leave()  # its row is dropped: the next round takes two of the three, the third waits
        until(lambda: any(t > left and n == 2 for t, n in rows), "two requests to decode together")
        time.sleep(0.3)
        assert (gauge(url, "running"), gauge(url, "waiting")) == (2, 1)
        assert max(n for t, n in rows) == 2, rows
        for request in queued:
            request.leave()
    state.shutdown()
