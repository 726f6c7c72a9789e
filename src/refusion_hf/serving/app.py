"""`refusion serve`'s HTTP front: the routes, in one FastAPI app (FastAPI does the routing, JSON parsing and request
validation against `protocol.py`'s models; uvicorn the HTTP), around `handler.py`'s one handler and `decoding.py`'s
decoding worker. The app answers for the one model it was started with; nothing can make it open another path or
reach the Hub. Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics` (`metrics.py`); `/v1/responses`, `/v1/systemone` and `/v1/audio/transcriptions` answer 501.

`RequestGate`, a plain ASGI middleware (Starlette's interface), runs before any route: with an API key, every path
but `/health` and `/metrics` needs exactly one `Authorization: Bearer <key>` header (401 otherwise, 400 for two;
compared with `hmac.compare_digest`), and a request body longer than the longest one that can hold a prompt within
`--max-model-len` is refused (413) before it is parsed, whether it declares its length or not; a body that does not
arrive within `BODY_SECONDS` is a 408. It also counts the answers by status class and times the completion
requests to their last byte (`/metrics`). A body that breaks the request schema is a 422 whose detail names the
fields (`request body: messages.0.role: ...`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from transformers import AutoTokenizer

from ..generation.refusion_generate import DEFAULT_BATCH_ROWS
from ..modeling.modeling_refusion import RefusionForCausalLM
from .decoding import Decoder, WaitingRoom
from .handler import Client, Handler, Served
from .metrics import ServerMetrics
from .prompts import TEMPLATE_SECONDS, PromptMaker
from .protocol import ChatCompletionRequest, CompletionRequest

OPEN_PATHS = ("/health", "/metrics")  # answered without the API key (health checks, Prometheus; as vLLM)
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
NOT_SERVED = ("/v1/responses", "/v1/systemone", "/v1/audio/transcriptions")
SERVED_ENDPOINTS = "/v1/chat/completions and /v1/completions"
JSON_BYTES_PER_TEXT_BYTE = 6  # JSON may write any byte of text as a \u00XX escape
BODY_BYTES_BESIDES_PROMPT = 64 * 1024  # the request's other fields
BODY_SECONDS = 30.0  # a request body must arrive within this


class ServeOptionError(ValueError):
    """An option of `refusion serve` that does not fit the model (one line, naming the option)."""


def max_body_bytes(tokenizer, max_model_len: int) -> int:
    """The longest request body that can hold a prompt of `max_model_len` tokens: each token's text written with
    JSON's longest escapes, plus room for the other fields."""
    longest_token = max(len(token.encode()) for token in tokenizer.get_vocab())
    return JSON_BYTES_PER_TEXT_BYTE * longest_token * max_model_len + BODY_BYTES_BESIDES_PROMPT


def bearer_matches(header: bytes | None, api_key: str) -> bool:
    scheme, _, token = (header or b"").decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), api_key.encode())


def detail(status: int, text: str, **headers) -> JSONResponse:
    return JSONResponse({"detail": text}, status_code=status, headers=headers or None)


class RequestGate:
    """ASGI middleware: the API key, then the body size and read time (see the module docstring)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics):
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        arrived = time.monotonic()
        scope.setdefault("state", {})["arrived"] = arrived
        timed = scope["path"] in COMPLETION_PATHS
        answer = send

        async def send(message):  # counts the answer's status class; times the completions to their last byte
            if message["type"] == "http.response.start":
                self.metrics.responses.labels(f"{message['status'] // 100}xx").inc()
            elif message["type"] == "http.response.body" and not message.get("more_body") and timed:
                self.metrics.e2e_latency.observe(time.monotonic() - arrived)
            await answer(message)

        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            keys = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(keys) > 1:
                reply = detail(400, "more than one Authorization header: send exactly one.", Connection="close")
                return await reply(scope, receive, send)
            if not bearer_matches(keys[0] if keys else None, self.api_key):
                reply = detail(
                    401,
                    "missing or wrong API key: send the header `Authorization: Bearer <key>`.",
                    **{"WWW-Authenticate": "Bearer"},
                )
                return await reply(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self.too_large(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body, more = bytearray(), True
        deadline = arrived + BODY_SECONDS
        while more:  # read the body (at most max_body_bytes of it, within BODY_SECONDS) before anything parses it
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                reply = detail(408, f"the request body did not arrive within {BODY_SECONDS} s.", Connection="close")
                return await reply(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self.too_large(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # later messages (the client's disconnect) come through

        await self.app(scope, replay, send)

    async def too_large(self, scope, receive, send):
        reply = detail(
            413,
            f"request body over {self.max_body_bytes} bytes: longer than any request whose prompt fits this server's "
            "maximum context length (--max-model-len).",
            Connection="close",
        )
        await reply(scope, receive, send)


def validation_detail(error: RequestValidationError) -> str:
    """One line naming the first fields of the body that break the request schema."""
    named = []
    for problem in error.errors()[:3]:
        where = ".".join(str(part) for part in problem["loc"][1:4] if part not in ("function-after",))
        named.append(f"{where or 'body'}: {problem['msg']}")
    return f"request body: {'; '.join(named)}."


def load(model: str, dtype: str, device: str, attn_implementation: str | None):
    """The model (eval mode) and tokenizer, with the installed package's code: whatever a folder's `architectures`,
    `auto_map` or tokenizer `auto_map` say, none of its code runs."""
    options = dict(dtype=dtype if dtype == "auto" else getattr(__import__("torch"), dtype), device_map=device)
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=False)
    return RefusionForCausalLM.from_pretrained(model, trust_remote_code=False, **options).eval(), tokenizer


def build_app(
    model: str,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str | None = None,
    continuous_batching: bool = False,
    max_requests_per_batch: int | None = None,
    served_model_name: list[str] | None = None,
    max_model_len: int | None = None,
    trust_request_chat_template: bool = False,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    request_chat_template_seconds: float = TEMPLATE_SECONDS,
):
    """The FastAPI app for one model, loaded now, with ReFusion decoding. Returns `(app, decoder)`;
    `decoder.shutdown()` stops the decoding worker (answering the waiting requests 503). `served_model_name`: the
    names requests may give (default: `model` as given, as vLLM does); `max_model_len`: default the model's
    `max_position_embeddings`; `max_requests_per_batch`: requests decoded at once, the rest wait (default 16 with
    `continuous_batching`; without it 1, the only value it takes); `request_chat_template_seconds`: how long a
    trusted template from a request may render (`prompts.py`)."""
    if max_requests_per_batch is None:
        max_requests_per_batch = DEFAULT_BATCH_ROWS if continuous_batching else 1
    elif max_requests_per_batch > 1 and not continuous_batching:
        raise ServeOptionError(
            f"max_requests_per_batch {max_requests_per_batch}: without continuous batching requests decode one at a "
            "time (1); turn continuous batching on to decode more at once."
        )
    loaded, tokenizer = load(model, dtype, device, attn_implementation)
    positions = loaded.config.max_position_embeddings
    if max_model_len is None:
        max_model_len = positions
    elif max_model_len > positions:
        raise ServeOptionError(
            f"--max-model-len {max_model_len} is over the model's max_position_embeddings ({positions}): lower it."
        )
    served = Served(list(served_model_name or [model]), loaded, tokenizer, max_model_len, trust_request_chat_template)
    metrics = ServerMetrics()
    metrics.count_forwards(loaded)
    waiting = WaitingRoom(metrics, max_queued_requests)
    decoder = Decoder(loaded, tokenizer, metrics, waiting, continuous_batching, max_requests_per_batch)
    body_limit = max_body_bytes(tokenizer, max_model_len)
    handler = Handler(
        served,
        decoder,
        PromptMaker(tokenizer, body_limit, request_chat_template_seconds if trust_request_chat_template else None),
        metrics,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        decoder.waiting.resume()
        yield
        decoder.waiting.stop_waiting()
        await asyncio.to_thread(decoder.wait_idle, 5)  # cancelled decoding stops within a forward pass

    app = FastAPI(title="refusion serve", lifespan=lifespan)
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=body_limit, metrics=metrics)
    app.state.decoder = decoder

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, error: RequestValidationError):
        return detail(422, validation_detail(error))

    def client(request: Request) -> Client:
        return Client(arrived=request.scope["state"].get("arrived", time.monotonic()), gone=request.is_disconnected)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await handler.answer(body, client(request))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await handler.answer(body, client(request))

    async def not_served(request: Request):
        return detail(501, f"refusion serve does not serve {request.url.path}; use {SERVED_ENDPOINTS}.")

    for path in NOT_SERVED:
        app.add_api_route(path, not_served, methods=["POST"], include_in_schema=False)

    @app.get("/v1/models")
    async def list_models():
        listed = [{"id": name, "object": "model", "created": 0, "owned_by": "refusion"} for name in served.names]
        return JSONResponse({"object": "list", "data": listed})

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.exposition()
        return Response(content=body, media_type=content_type)

    @app.get("/health")
    async def health():  # on the event loop: nothing a request does holds it
        if not decoder.is_alive():
            return JSONResponse({"status": "unhealthy", "reason": "decoding worker died"}, status_code=503)
        return JSONResponse({"status": "ok"})

    return app, decoder
