"""`refusion serve`'s server: `transformers serve` (transformers 5.24, `transformers.cli.serving`) with ReFusion
decoding.

transformers serve does the work: the inference thread that runs one `generate()` at a time, SSE streaming (its
`DirectStreamer`), model loading options (dtype, `device_map`, attention implementation, quantization); its request
handlers as `handlers.py` extends them, in the app `app.py` builds. What this module extends, and why:

* `RefusionModelManager(ModelManager)`: serve resolves a model's class as
  `getattr(transformers, config.architectures[0])`, which fails for `RefusionForCausalLM` and would load an
  official checkpoint (`architectures: ["Qwen3ForCausalLM"]`) as the stock class, which decodes autoregressively.
  Here every checkpoint loads through `RefusionForCausalLM.from_pretrained` with serve's own loading options,
  whatever its `architectures` or `auto_map` say, without running the folder's code; the processor is the tokenizer.
* `SequentialGenerateManager(GenerateManager)` (the default): serve's one-`generate()`-at-a-time inference thread;
  each request's generation config is checked against ReFusion decoding before anything is answered, so a refused
  argument (`frequency_penalty`, which serve maps to `repetition_penalty`) is an HTTP 400 naming it rather than a 500
  or an error event after a 200.

Continuous batching (`--continuous-batching`) and the generation state that hands the managers out are in
`batching.py`.

The request's `seed` (`REQUEST_SEED`, set by the handler) is applied on the thread that decodes it, right before its
own decoding (serve seeds the global RNG when the request arrives, which a request decoding at that moment would
consume).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from fastapi import HTTPException
from transformers import AutoTokenizer
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.utils import (
    GenerateManager,
    split_revision,
)
from transformers.generation.streamers import BaseStreamer

from .._compat.transformers import GenerationCancelled as _GenerationCancelled  # serve's private exceptions
from ..generation.generate_arguments import refuse_unsupported
from ..generation.refusion_generate import merge_generation_config
from ..modeling.modeling_refusion import RefusionForCausalLM
from .metrics import ARRIVED, ServerMetrics

# The `seed` of the request being handled: set by the handler, read where the request is submitted for decoding
# (the same asyncio task), applied on the decoding thread.
REQUEST_SEED: contextvars.ContextVar[int | None] = contextvars.ContextVar("refusion_request_seed", default=None)
# The HTTP request being answered (set by the app's route: its client may go away), and the cancel flag of the
# request being submitted for decoding.
CLIENT: contextvars.ContextVar = contextvars.ContextVar("refusion_client", default=None)
CANCEL: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("refusion_cancel", default=None)
DISCONNECT_POLL_SECONDS = 0.02
RETRY_AFTER_SECONDS = 1


class RefusionModelManager(ModelManager):
    """serve's model manager, loading every checkpoint as a `RefusionForCausalLM` (see the module docstring)."""

    def _load_processor(self, model_id_and_revision: str, gguf_file: str | None = None):
        model_id, revision = split_revision(model_id_and_revision)
        return AutoTokenizer.from_pretrained(model_id, revision=revision, trust_remote_code=False)

    def _load_model(self, model_id_and_revision: str, tqdm_class=None, progress_callback=None, gguf_file=None):
        model_id, revision = split_revision(model_id_and_revision)
        options = dict(revision=revision, dtype=self.dtype, device_map=self.device, tqdm_class=tqdm_class)
        if self.attn_implementation is not None:
            options["attn_implementation"] = self.attn_implementation
        quantization_config = self.get_quantization_config()
        if quantization_config is not None:
            options["quantization_config"] = quantization_config
        if progress_callback is not None:
            progress_callback({"status": "loading", "model": model_id_and_revision, "stage": "weights"})
        return RefusionForCausalLM.from_pretrained(model_id, **options).eval()


def check_generation_config(model, config) -> None:
    """HTTP 400 naming the first field of a request's generation config that the model's generate() refuses (the
    checks generate() itself makes first: stock value validation, then ReFusion's refusals)."""
    try:
        merged, _ = merge_generation_config(model, config, {})
        merged.validate()
        if merged.decoding == "refusion":
            refuse_unsupported(merged, {}, defaultdict(lambda: None))
    except ValueError as error:
        raise HTTPException(status_code=400, detail=str(error)) from None


def _seeded(fn: Callable, seed: int | None) -> Callable:
    """`fn` that seeds torch's RNG first, on whichever thread runs it."""
    if seed is None:
        return fn

    def run(*args, **kwargs):
        torch.manual_seed(seed)
        return fn(*args, **kwargs)

    return run


async def until_done_or_gone(work: asyncio.Future, cancel: threading.Event):
    """`work`'s result; meanwhile, every DISCONNECT_POLL_SECONDS, whether the request's client (`CLIENT`) went away:
    if so, or if this task is cancelled (the server stopping), `cancel` is set (decoding stops before its next
    forward pass) and the request ends (HTTP 499, nginx's "client closed request", which no client reads)."""
    client = CLIENT.get()
    try:
        while not work.done():
            await asyncio.wait({work}, timeout=DISCONNECT_POLL_SECONDS)
            if not work.done() and client is not None and await client.is_disconnected():
                cancel.set()
        return work.result()
    except asyncio.CancelledError:
        cancel.set()
        raise
    except _GenerationCancelled:
        raise HTTPException(status_code=499, detail="the client closed the request") from None


class WaitingRoom:
    """The requests waiting for their decoding: counted (`refusion_requests_waiting`) and, with
    `--max-queued-requests N`, at most N: one more is an HTTP 503 with `Retry-After` (as SGLang)."""

    def __init__(self, metrics: ServerMetrics, limit: int | None = None):
        self.metrics, self.limit = metrics, limit
        self._count = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            if self.limit is not None and self._count >= self.limit:
                raise HTTPException(
                    status_code=503,
                    detail=f"{self._count} requests are waiting already (--max-queued-requests {self.limit}): retry "
                    "later.",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                )
            self._count += 1
        self.metrics.waiting.inc()

    def leave(self, count: int = 1) -> None:
        with self._lock:
            self._count -= count
        self.metrics.waiting.dec(count)


class FirstTokenClock(BaseStreamer):
    """A transformers streamer that only notes, in `refusion_time_to_first_token_seconds`, when a non-streamed
    request's first answer token is final (generate()'s second `put`; the first is the prompt)."""

    def __init__(self, metrics: ServerMetrics, arrived: float | None):
        self.metrics, self.arrived, self.puts = metrics, arrived, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.arrived is not None:
            self.metrics.time_to_first_token.observe(time.monotonic() - self.arrived)

    def end(self) -> None:
        pass


class SequentialGenerateManager(GenerateManager):
    """serve's inference thread (one `generate()` at a time), checking each request's generation config before it
    is answered, seeding each request on that thread, and stopping a request's decoding when its client goes away
    or the server stops: a forward pre-hook on the model (torch's `register_forward_pre_hook`) raises serve's
    `_GenerationCancelled` before the next forward pass of a cancelled request, and a request cancelled while it
    waits is never decoded. serve's streamer only checks when the answer grows, and its non-streaming path never."""

    def __init__(self, metrics: ServerMetrics, waiting: WaitingRoom):
        super().__init__()
        self.metrics, self.waiting = metrics, waiting
        self._decoding: threading.Event | None = None  # the cancel flag of the request decoding now
        self._busy = False
        self._hooked: set[int] = set()

    def wait_idle(self, deadline: float) -> None:
        """Until no request decodes (at most until time.monotonic() reaches `deadline`): the server waits for this
        before its event loop closes, which the inference thread reports its (cancelled) result to."""
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.01)

    def _stop_if_cancelled(self, module, args) -> None:
        if self._decoding is not None and self._decoding.is_set():
            raise _GenerationCancelled()

    def _watch(self, model) -> threading.Event:
        """A cancel flag for the request being submitted (read by `submit` in this context)."""
        if id(model) not in self._hooked:
            model.register_forward_pre_hook(self._stop_if_cancelled)
            self._hooked.add(id(model))
        cancel = threading.Event()
        CANCEL.set(cancel)
        return cancel

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        check_generation_config(model, gen_config)
        context = contextvars.copy_context()  # the flag set for this request only, not for the handler's task
        cancel = context.run(self._watch, model)
        queue, streamer = context.run(
            super().generate_streaming, model, processor, inputs, gen_config, request_id, response_parser
        )
        stop_streamer = streamer.cancel  # serve calls it when the client goes away (or the server stops)
        put, end, arrived, pieces = streamer.put, streamer.end, ARRIVED.get(), []

        def put_counted(value):  # the first put is the prompt, the second the answer's first piece
            put(value)
            pieces.append(1)
            if len(pieces) == 2 and arrived is not None:
                self.metrics.time_to_first_token.observe(time.monotonic() - arrived)

        def end_counted():
            self.metrics.generation_tokens.inc(streamer.total_tokens)
            end()

        streamer.put, streamer.end = put_counted, end_counted

        def cancel_decoding():
            stop_streamer()
            cancel.set()

        streamer.cancel = cancel_decoding
        return queue, streamer

    async def _generate_timed(self, model, processor, inputs, gen_config):
        """serve's `generate_non_streaming` (the same `generate()` call on the inference thread), with a streamer
        that only times the answer's first final token (`FirstTokenClock`)."""
        clock = FirstTokenClock(self.metrics, ARRIVED.get())
        kwargs = {**inputs, "generation_config": gen_config, "tokenizer": processor, "streamer": clock}
        sequences = await self.async_submit(model.generate, **kwargs)
        prompt_tokens = inputs["input_ids"].shape[-1]
        generated = sequences[0, prompt_tokens:]
        return processor.decode(generated, skip_special_tokens=True), prompt_tokens, generated

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        check_generation_config(model, gen_config)
        cancel = self._watch(model)
        work = asyncio.ensure_future(self._generate_timed(model, processor, inputs, gen_config))
        try:
            text, prompt_tokens, generated = await until_done_or_gone(work, cancel)
            self.metrics.generation_tokens.inc(len(generated))
            return text, prompt_tokens, generated
        except ValueError as error:  # what generate() refuses about this request's inputs
            raise HTTPException(status_code=400, detail=str(error)) from None

    def _cancellable(self, fn: Callable) -> Callable:
        cancel = CANCEL.get()
        self.waiting.enter()

        def run(*args, **kwargs):
            self.waiting.leave()
            if cancel is not None and cancel.is_set():  # cancelled while it waited: never decoded
                raise _GenerationCancelled()
            self._decoding = cancel
            self._busy = True
            self.metrics.running.inc()
            try:
                return fn(*args, **kwargs)
            finally:
                self._decoding, self._busy = None, False
                self.metrics.running.dec()

        return run

    def submit(self, fn, *args, **kwargs):
        return super().submit(self._cancellable(_seeded(fn, REQUEST_SEED.get())), *args, **kwargs)

    def async_submit(self, fn, *args, **kwargs):
        return super().async_submit(self._cancellable(_seeded(fn, REQUEST_SEED.get())), *args, **kwargs)
