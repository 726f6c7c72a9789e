"""Servers for the serving tests, each on a free 127.0.0.1 port in a thread: `running(app)` runs any ASGI app under
uvicorn and yields its base URL (`running_server`: and the uvicorn server, or the server `make_server(config)`
builds). `slowed_forwards` and `rows_per_forward` observe the served model's forwards from
outside (torch's global forward pre-hooks); `HeldRequest` is a client that leaves when the test says."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import torch
import uvicorn


@contextlib.contextmanager
def running_server(app, make_server=uvicorn.Server, **config):
    """`app` under uvicorn (options `config`) on 127.0.0.1 (a free port) in a thread; yields
    `("http://127.0.0.1:PORT", server)`. Stops on exit."""
    server = make_server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"


@contextlib.contextmanager
def running(app):
    """`app` under uvicorn on 127.0.0.1 (a free port) in a thread; yields `http://127.0.0.1:PORT`. Stops on exit."""
    with running_server(app) as (url, _):
        yield url


@contextlib.contextmanager
def slowed_forwards(model_class, seconds):
    """Every forward of a `model_class` module sleeps `seconds` first (torch's global forward pre-hook, which runs
    before the module's own hooks), or `seconds()` when it is callable (asked at each forward); yields the list of
    their start times."""
    starts = []

    def hook(module, args):
        if isinstance(module, model_class):
            starts.append(time.monotonic())
            time.sleep(seconds() if callable(seconds) else seconds)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield starts
    finally:
        handle.remove()


@contextlib.contextmanager
def rows_per_forward():
    """The rows of each forward of the served model (its embedding's input: torch's global forward pre-hook)."""
    rows = []

    def hook(module, args):
        if isinstance(module, torch.nn.Embedding) and args and args[0].dim() == 2:
            rows.append((time.monotonic(), args[0].shape[0]))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield rows
    finally:
        handle.remove()


class HeldRequest:
    """A completion request sent over a socket to 127.0.0.1 and held open until `leave()` closes the connection."""

    def __init__(self, url: str, body: dict):
        host, port = url.removeprefix("http://").split(":")
        self.socket = socket.create_connection((host, int(port)), timeout=60)
        data = json.dumps(body).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        self.socket.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)

    def leave(self) -> float:
        self.socket.close()
        return time.monotonic()


def until(condition, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.01)
