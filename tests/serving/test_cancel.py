"""Abandoned work, over 127.0.0.1: a client that goes away (streaming or not) stops its request's decoding within one
forward pass of the server seeing it gone, and the next request is answered at once; a server told to stop (what
uvicorn does on SIGTERM / SIGINT) ends the requests in flight within its graceful-shutdown timeout. Every forward of
the served model is slowed by a hook of the test (torch's global forward pre-hook, which also counts them), so
that decoding outlasts the client. Model: the official-layout folder built from the tiny fixture."""

import re
import threading
import time

import httpx2
import pytest

from refusion_hf.modeling.modeling_refusion import RefusionForCausalLM
from refusion_hf.serving.app import build_app
from tests.serving.servers import (
    HeldRequest,
    rows_per_forward,
    running,
    running_server,
    slowed_forwards,
    until,
)

FORWARD_SECONDS = 0.1  # each forward of the served model, slowed
MAX_TOKENS = 400
REQUEST = {"prompt": "t9 t10 t11", "max_tokens": MAX_TOKENS}


def abandon(url: str, stream: bool, after: float, request: dict = REQUEST) -> float:
    """Sends `request` and closes the connection about `after` seconds in; returns when it closed."""
    with httpx2.Client(base_url=url, timeout=httpx2.Timeout(60, read=after)) as http:
        try:
            if stream:
                with http.stream("POST", "/v1/completions", json={**request, "stream": True}) as reply:
                    for _ in reply.iter_lines():
                        pass
            else:
                http.post("/v1/completions", json=request)
        except (httpx2.ReadTimeout, httpx2.RemoteProtocolError):  # we left, or the server stopped
            pass
    return time.monotonic()


def settle(starts: list, quiet: float) -> None:
    """Waits until no forward started for `quiet` seconds (at most 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not starts or time.monotonic() - starts[-1] < quiet):
        time.sleep(quiet / 4)


class Enough(Exception):
    pass


def answer_outlasts(model, tokenizer, forwards: int) -> bool:
    """Whether generate()'s answer to REQUEST needs more than `forwards` forward passes (stopped there)."""
    seen = []

    def count(module, args):
        seen.append(1)
        if len(seen) > forwards:
            raise Enough()

    handle = model.register_forward_pre_hook(count)
    try:
        model.generate(tokenizer(REQUEST["prompt"], return_tensors="pt").input_ids, max_new_tokens=MAX_TOKENS)
    except Enough:
        return True
    finally:
        handle.remove()
    return False


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_a_client_that_leaves_stops_its_decoding(official, stream):
    folder, model, tokenizer = official
    assert answer_outlasts(model, tokenizer, 30), "the answer is too short for a client to leave it"
    app, state = build_app(folder, dtype="float32", device="cpu")
    with running(app) as url, slowed_forwards(RefusionForCausalLM, FORWARD_SECONDS) as starts:
        closed = abandon(url, stream=stream, after=0.5)
        settle(starts, quiet=4 * FORWARD_SECONDS)
        before = [t for t in starts if t <= closed]
        after = [t for t in starts if t > closed]
        assert len(before) < 25, "the client left too late: the answer might have ended by itself"
        # the forward running when the client left, then at most one more (started, then stopped by the server)
        assert len(after) <= 2, (len(before), len(after))
    with running(app) as url:  # the next request (its forwards no longer slowed) is answered at once
        begun = time.monotonic()
        reply = httpx2.post(f"{url}/v1/completions", json={"prompt": "t9", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200 and time.monotonic() - begun < 5
    state.shutdown()


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_continuous_batching_drops_the_row_of_a_client_that_left(official, stream):
    """With --continuous-batching, two requests that decode as one batch (2 rows per forward): when one client
    leaves, its row is dropped within one forward (the other decodes on, alone), and when the other leaves too the
    decoding stops; a first request, decoding alone while they wait, stops when its client leaves. The next request
    is answered at once."""
    folder, model, tokenizer = official
    assert answer_outlasts(model, tokenizer, 30), "the answer is too short for a client to leave it"
    app, state = build_app(folder, dtype="float32", device="cpu", continuous_batching=True)
    body = {**REQUEST, "stream": stream}
    with (
        running(app) as url,
        slowed_forwards(RefusionForCausalLM, FORWARD_SECONDS) as starts,
        rows_per_forward() as rows,
    ):
        first = HeldRequest(url, body)
        until(lambda: starts, "the first request to decode")
        pair = [HeldRequest(url, body), HeldRequest(url, body)]
        waiting = re.compile(r"^refusion_requests_waiting 2\.0$", re.MULTILINE)
        until(lambda: waiting.search(httpx2.get(f"{url}/metrics").text), "the next two to wait")
        first_left = first.leave()
        until(lambda: any(n == 2 for t, n in rows), "the two to decode together")
        assert len([t for t, n in rows if t > first_left and n == 1]) <= 2, rows  # the first one's row, dropped
        time.sleep(4 * FORWARD_SECONDS)
        one_left = pair[0].leave()
        until(lambda: len([t for t, n in rows if t > one_left]) >= 6, "six forwards after the client left")
        other_left = pair[1].leave()
        settle(starts, quiet=4 * FORWARD_SECONDS)
        between = [n for t, n in rows if one_left < t <= other_left]
        # the forward running when the client left, then at most one more with its row; then the other row alone
        assert between[2:] == [1] * (len(between) - 2), between
        assert len([t for t, n in rows if t > other_left]) <= 2, rows
    with running(app) as url:  # the next request (its forwards no longer slowed) is answered at once
        begun = time.monotonic()
        reply = httpx2.post(f"{url}/v1/completions", json={"prompt": "t9", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200 and time.monotonic() - begun < 5
    state.shutdown()


def test_stopping_the_server_ends_requests_in_flight(official):
    """What uvicorn does on SIGTERM / SIGINT (`should_exit`): with a graceful-shutdown timeout of 1 s, a server with
    a streaming and a non-streaming request in flight stops within it, and their decoding stops."""
    folder, model, tokenizer = official
    app, state = build_app(folder, dtype="float32", device="cpu")
    with (
        running_server(app, timeout_graceful_shutdown=1) as (url, server),
        slowed_forwards(RefusionForCausalLM, FORWARD_SECONDS) as starts,
    ):
        clients = [threading.Thread(target=abandon, args=(url, stream, 60), daemon=True) for stream in (True, False)]
        for client in clients:
            client.start()
        time.sleep(0.5)
        asked = time.monotonic()
        server.should_exit = True
    stopped = time.monotonic() - asked
    settle(starts, quiet=4 * FORWARD_SECONDS)
    state.shutdown()
    assert stopped < 1 + 10 * FORWARD_SECONDS, stopped
    assert [t for t in starts if t > asked + 1 + 2 * FORWARD_SECONDS] == []
