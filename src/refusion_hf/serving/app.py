"""`refusion serve`'s HTTP front: the FastAPI app (FastAPI does the routing and JSON parsing, uvicorn the HTTP)
around transformers serve's request handlers as `handlers.py` extends them, decoding through `server.py`'s and
`batching.py`'s managers.

The app is built here rather than by transformers serve's `build_server`, whose app also has `/load_model` (load
any local folder or Hub id into memory, for ever), `/reset` (unload the served model), and routes for endpoints
`refusion serve` does not offer; here the server answers for the one model it was started with and nothing can
make it open another path or reach the Hub. Routes: `POST /v1/chat/completions`, `POST /v1/completions`,
`GET /v1/models`, `GET /health`, `GET /metrics` (`metrics.py`); `/v1/responses`, `/v1/systemone` and
`/v1/audio/transcriptions` answer 501.

`RequestGate`, a plain ASGI middleware (Starlette's interface), runs before any route: with an API key, every path
but `/health` and `/metrics` needs `Authorization: Bearer <key>` (401 otherwise; compared with
`hmac.compare_digest`), and a request body longer than the longest one that can hold a prompt within
`--max-model-len` is refused (413) before it is parsed, whether it declares its length or not. It also counts the
answers by status class and times the completion requests to their last byte (`/metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from transformers.cli.serving.utils import X_REQUEST_ID, CBWorkerDeadError

from .._compat.transformers import request_params_class
from ..generation.refusion_generate import DEFAULT_BATCH_ROWS
from .batching import RefusionGenerationState
from .handlers import (
    OPTIONAL_FIELDS,
    NotServed,
    RefusionChatCompletionHandler,
    RefusionCompletionHandler,
    ServedModel,
    request_schema,
)
from .metrics import ARRIVED, ServerMetrics
from .server import CLIENT, RefusionModelManager

OPEN_PATHS = ("/health", "/metrics")  # answered without the API key (health checks, Prometheus; as vLLM)
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
JSON_BYTES_PER_TEXT_BYTE = 6  # JSON may write any byte of text as a \u00XX escape
BODY_BYTES_BESIDES_PROMPT = 64 * 1024  # the request's other fields


class ServeOptionError(ValueError):
    """An option of `refusion serve` that does not fit the model (one line, naming the option)."""


def max_body_bytes(tokenizer, max_model_len: int) -> int:
    """The longest request body that can hold a prompt of `max_model_len` tokens: each token's text written with
    JSON's longest escapes, plus room for the other fields."""
    longest_token = max(len(token.encode()) for token in tokenizer.get_vocab())
    return JSON_BYTES_PER_TEXT_BYTE * longest_token * max_model_len + BODY_BYTES_BESIDES_PROMPT


def bearer_matches(header: bytes | None, api_key: str) -> bool:
    scheme, _, token = (header or b"").decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class RequestGate:
    """ASGI middleware: the API key, then the body size (see the module docstring)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics):
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        arrived = time.monotonic()
        ARRIVED.set(arrived)
        timed = scope["path"] in COMPLETION_PATHS
        answer = send

        async def send(message):  # counts the answer's status class; times the completions to their last byte
            if message["type"] == "http.response.start":
                self.metrics.responses.labels(f"{message['status'] // 100}xx").inc()
            elif message["type"] == "http.response.body" and not message.get("more_body") and timed:
                self.metrics.e2e_latency.observe(time.monotonic() - arrived)
            await answer(message)

        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            if not bearer_matches(headers.get(b"authorization"), self.api_key):
                response = JSONResponse(
                    {"detail": "missing or wrong API key: send the header `Authorization: Bearer <key>`."},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await response(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self.too_large(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body, more = bytearray(), True
        while more:  # read the body (at most max_body_bytes of it) before anything parses it
            message = await receive()
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
        response = JSONResponse(
            {
                "detail": f"request body over {self.max_body_bytes} bytes: longer than any request whose prompt "
                "fits this server's maximum context length (--max-model-len)."
            },
            status_code=413,
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)


def describe_request_bodies(app: FastAPI, bodies: dict[str, type]) -> None:
    """FastAPI's OpenAPI document (`/openapi.json`), with each route of `bodies` taking the OpenAI request schema of
    serve's type for it (the one requests are validated against) instead of any JSON object (FastAPI's pattern for
    extending the document: a replacement `app.openapi`)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = document.setdefault("components", {}).setdefault("schemas", {})
            for path, params_class in bodies.items():
                schema = request_schema(params_class).json_schema(ref_template="#/components/schemas/{model}")
                components.update(schema.pop("$defs", {}))
                schema["required"] = [name for name in schema.get("required", []) if name not in OPTIONAL_FIELDS]
                schema["additionalProperties"] = False
                document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"] = schema
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi


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
):
    """The FastAPI app for one model, loaded now, with ReFusion decoding. Returns `(app, generation_state)`;
    `generation_state.shutdown()` stops the decoding worker. `served_model_name`: the names requests may give
    (default: `model` as given, as vLLM does); `max_model_len`: default the model's `max_position_embeddings`;
    `max_requests_per_batch`: requests decoded at once, the rest wait (default 16 with `continuous_batching`; without
    it 1, the only value it takes)."""
    if max_requests_per_batch is None:
        max_requests_per_batch = DEFAULT_BATCH_ROWS if continuous_batching else 1
    elif max_requests_per_batch > 1 and not continuous_batching:
        raise ServeOptionError(
            f"max_requests_per_batch {max_requests_per_batch}: without continuous batching requests decode one at a "
            "time (1); turn continuous batching on to decode more at once."
        )
    models = RefusionModelManager(
        device=device,
        dtype=dtype,
        attn_implementation=attn_implementation,
        continuous_batching=continuous_batching,
        force_model=model,
    )
    loaded, tokenizer = models.load_model_and_processor(models.process_model_name(model))
    positions = loaded.config.max_position_embeddings
    if max_model_len is None:
        max_model_len = positions
    elif max_model_len > positions:
        raise ServeOptionError(
            f"--max-model-len {max_model_len} is over the model's max_position_embeddings ({positions}): lower it."
        )
    served = ServedModel(
        names=list(served_model_name or [model]),
        model=loaded,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        modality=models.get_model_modality(loaded, processor=tokenizer),
        trust_request_chat_template=trust_request_chat_template,
    )
    metrics = ServerMetrics()
    metrics.count_forwards(loaded)
    state = RefusionGenerationState(continuous_batching, max_requests_per_batch, metrics, max_queued_requests)
    chat = RefusionChatCompletionHandler(models, state, served)
    completion = RefusionCompletionHandler(models, state, served)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(state.wait_idle, 5)  # cancelled decoding stops within a forward pass

    app = FastAPI(title="refusion serve", lifespan=lifespan)
    gate = dict(api_key=api_key, max_body_bytes=max_body_bytes(tokenizer, max_model_len), metrics=metrics)
    app.add_middleware(RequestGate, **gate)

    @app.exception_handler(CBWorkerDeadError)
    async def worker_died(_request: Request, error: CBWorkerDeadError):
        return JSONResponse({"detail": str(error)}, status_code=503)

    def with_request_id(request: Request, response):
        response.headers[X_REQUEST_ID] = request.state.request_id
        return response

    async def answer(handler, request: Request, body: dict):
        request.state.request_id = request.headers.get(X_REQUEST_ID) or str(uuid.uuid4())
        CLIENT.set(request)  # watched for the client going away while its answer decodes
        return with_request_id(request, await handler.handle_request(body, request.state.request_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: dict):
        return await answer(chat, request, body)

    @app.post("/v1/completions")
    async def completions(request: Request, body: dict):
        return await answer(completion, request, body)

    for path in ("/v1/responses", "/v1/systemone", "/v1/audio/transcriptions"):
        app.add_api_route(path, NotServed(path).endpoint, methods=["POST"], include_in_schema=False)

    describe_request_bodies(
        app, {"/v1/chat/completions": request_params_class(chat), "/v1/completions": request_params_class(completion)}
    )

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
        if not state.is_cb_alive():
            return JSONResponse({"status": "unhealthy", "reason": "decoding worker died"}, status_code=503)
        return JSONResponse({"status": "ok"})

    return app, state
