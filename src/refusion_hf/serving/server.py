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
* `ContinuousBatchManager` (`--continuous-batching`): serve's own manager drives transformers' paged-attention
  continuous batching (`init_continuous_batching`), which decodes autoregressively and takes the first request's
  generation config for all. Here a worker thread takes every waiting request, groups them by generation config and
  decodes each group with the model's `generate_batch` (ReFusion continuous batching in the ragged cache: at most
  `max_requests_per_batch` rows at once, a finished row's place taken by the next request of the group); requests
  that need a per-request RNG (`seed`) or stopping criteria (`stop`) decode one at a time on the same worker.
  Requests that arrive while a group decodes wait for the next round (`generate_batch` takes its requests up front).
  Streamed answers arrive when their request finishes (`generate_batch` does not stream).
* `RefusionGenerationState(GenerationState)`: hands those managers out.

The request's `seed` (`REQUEST_SEED`, set by the handler) is applied on the thread that decodes it, right before its
own decoding (serve seeds the global RNG when the request arrives, which a request decoding at that moment would
consume).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from fastapi import HTTPException
from transformers import AutoTokenizer, ContinuousBatchingConfig
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.utils import (
    BaseGenerateManager,
    DirectStreamer,
    GenerateManager,
    GenerationState,
    split_revision,
)

from .._compat.transformers import GenerationCancelled as _GenerationCancelled  # serve's private exceptions
from .._compat.transformers import StreamError as _StreamError
from ..generation.generate_arguments import refuse_unsupported
from ..generation.refusion_generate import DEFAULT_BATCH_ROWS, merge_generation_config
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

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        check_generation_config(model, gen_config)
        cancel = self._watch(model)
        work = asyncio.ensure_future(super().generate_non_streaming(model, processor, inputs, gen_config, request_id))
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


@dataclass
class BatchRequest:
    """A request waiting for `ContinuousBatchManager`'s worker; `deliver` gets its answer's token ids or the error
    (called on the worker thread)."""

    input_ids: list[int]
    config: object  # GenerationConfig
    seed: int | None
    deliver: Callable[[list[int] | BaseException], None]
    cancel: threading.Event  # set when its client goes away: not decoded if its group has not started

    def group_key(self) -> str:
        return json.dumps([self.config.to_dict(), self.seed], sort_keys=True, default=str)

    def decodes_alone(self) -> bool:
        return self.seed is not None or self.config.stop_strings is not None


class ContinuousBatchManager(BaseGenerateManager):
    """ReFusion continuous batching behind serve's generation-manager interface (see the module docstring)."""

    def __init__(
        self,
        max_requests_per_batch: int = DEFAULT_BATCH_ROWS,
        metrics: ServerMetrics | None = None,
        waiting: WaitingRoom | None = None,
    ):
        self.max_requests_per_batch = max_requests_per_batch
        self.metrics = metrics or ServerMetrics()
        self.waiting = waiting or WaitingRoom(self.metrics)
        self.fatal_error: BaseException | None = None
        self._requests: queue.Queue[BatchRequest] = queue.Queue()
        self._stopping = threading.Event()
        self._worker: threading.Thread | None = None
        self._model = self._tokenizer = None

    def init_cb(self, model, gen_config) -> None:
        """Starts the worker for `model` (once). `gen_config` is the first request's: each request keeps its own."""
        if self._worker is None:
            self._model = model
            self._worker = threading.Thread(target=self._run, name="refusion-batches", daemon=True)
            self._worker.start()

    def is_alive(self) -> bool:
        return self.fatal_error is None

    def _submit(self, model, processor, inputs, gen_config, deliver) -> threading.Event:
        if self.fatal_error is not None:
            raise HTTPException(status_code=503, detail=f"the decoding worker died: {self.fatal_error}")
        check_generation_config(model, gen_config)
        self._tokenizer = processor
        cancel = threading.Event()

        def deliver_counted(result):
            if not isinstance(result, BaseException):
                self.metrics.generation_tokens.inc(len(result))
            deliver(result)

        self.waiting.enter()
        self._requests.put(
            BatchRequest(list(inputs["input_ids"]), gen_config, REQUEST_SEED.get(), deliver_counted, cancel)
        )
        return cancel

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def settle(result):
            if answer.done():
                return
            if isinstance(result, BaseException):
                answer.set_exception(result)
            else:
                answer.set_result(result)

        cancel = self._submit(
            model, processor, inputs, gen_config, lambda result: loop.call_soon_threadsafe(settle, result)
        )
        try:
            generated = await until_done_or_gone(answer, cancel)
        except ValueError as error:
            raise HTTPException(status_code=400, detail=str(error)) from None
        return processor.decode(generated, skip_special_tokens=True), len(inputs["input_ids"]), generated

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        streamer = DirectStreamer(processor.backend_tokenizer, loop, chunks, response_parser=response_parser)
        prompt = torch.tensor(list(inputs["input_ids"]))
        arrived = ARRIVED.get()

        def deliver(result):
            if arrived is not None and not isinstance(result, BaseException):  # the whole answer at once
                self.metrics.time_to_first_token.observe(time.monotonic() - arrived)
            if isinstance(result, BaseException):
                loop.call_soon_threadsafe(chunks.put_nowait, _StreamError(str(result)))
                return
            try:
                streamer.put(prompt)  # serve's streamer skips the first put (the prompt), as from generate()
                streamer.put(torch.tensor(result, dtype=torch.long))
                streamer.end()
            except _GenerationCancelled:  # the client went away
                loop.call_soon_threadsafe(chunks.put_nowait, None)

        cancel = self._submit(model, processor, inputs, gen_config, deliver)
        stop_streamer = streamer.cancel

        def cancel_request():
            stop_streamer()
            cancel.set()

        streamer.cancel = cancel_request
        return chunks, streamer

    def _run(self) -> None:
        waiting: list[BatchRequest] = []
        try:
            while not self._stopping.is_set():
                try:
                    waiting = [self._requests.get(timeout=0.05)]
                except queue.Empty:
                    continue
                while True:
                    try:
                        waiting.append(self._requests.get_nowait())
                    except queue.Empty:
                        break
                groups: dict[str, list[BatchRequest]] = {}
                for request in waiting:
                    groups.setdefault(request.group_key(), []).append(request)
                for group in groups.values():
                    self._decode_group(group)
                waiting = []
        except BaseException as error:  # reported to the requests it leaves, to every later one and by /health
            self.fatal_error = error
            for request in waiting:
                request.deliver(RuntimeError(f"the decoding worker died: {error!r}"))
            raise

    def _decode_group(self, group: list[BatchRequest]) -> None:
        """One generation config: `generate_batch` for all, else (seeded, stop strings, or a batch that failed on
        one request's input) one at a time, so that an error reaches only its request. Requests whose client went
        away before the group starts are dropped (a group that decodes runs to its end: `generate_batch` takes its
        requests up front)."""
        self.waiting.leave(len(group))
        self.metrics.running.inc(len(group))
        try:
            self._decode_live(group)
        finally:
            self.metrics.running.dec(len(group))

    def _decode_live(self, group: list[BatchRequest]) -> None:
        for request in [r for r in group if r.cancel.is_set()]:
            request.deliver(_GenerationCancelled())
        group = [r for r in group if not r.cancel.is_set()]
        if len(group) > 1 and not group[0].decodes_alone():
            rows = ContinuousBatchingConfig(max_requests_per_batch=self.max_requests_per_batch)
            try:
                results = self._model.generate_batch(
                    [r.input_ids for r in group], generation_config=group[0].config, continuous_batching_config=rows
                )
            except ValueError:  # one request's input: found below, request by request
                pass
            except Exception as error:  # noqa: BLE001 - e.g. out of memory: every request of the batch is told
                for request in group:
                    request.deliver(error)
                return
            else:
                for index, request in enumerate(group):
                    request.deliver(results[f"req_{index}"].generated_tokens)
                return
        for request in group:
            if request.cancel.is_set():  # its client went away while the ones before it decoded
                request.deliver(_GenerationCancelled())
                continue
            try:
                if request.seed is not None:
                    torch.manual_seed(request.seed)
                prompt = torch.tensor([request.input_ids], device=self._model.device)
                out = self._model.generate(prompt, generation_config=request.config, tokenizer=self._tokenizer)
                request.deliver(out[0, prompt.shape[1] :].tolist())
            except Exception as error:  # noqa: BLE001 - the request's own error, delivered to it
                request.deliver(error)

    def stop(self) -> None:
        self._stopping.set()
        if self._worker is not None:
            self._worker.join(timeout=5)


class RefusionGenerationState(GenerationState):
    """serve's generation state, handing out `SequentialGenerateManager`s, or with continuous batching one
    `ContinuousBatchManager`."""

    def __init__(
        self,
        continuous_batching: bool = False,
        max_requests_per_batch: int = DEFAULT_BATCH_ROWS,
        metrics: ServerMetrics | None = None,
        max_queued_requests: int | None = None,
    ):
        super().__init__(continuous_batching=continuous_batching)
        self.max_requests_per_batch = max_requests_per_batch
        self.metrics = metrics or ServerMetrics()
        self.waiting = WaitingRoom(self.metrics, max_queued_requests)

    def wait_idle(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for manager in self._generate_managers.values():
            manager.wait_idle(deadline)

    def get_manager(self, model_id: str, use_cb: bool = False) -> BaseGenerateManager:
        if use_cb:
            if self._cb_model_id != model_id and self._cb_manager is not None:
                self._cb_manager.stop()
                self._cb_manager = None
            if self._cb_manager is None:
                self._cb_manager = ContinuousBatchManager(self.max_requests_per_batch, self.metrics, self.waiting)
                self._cb_model_id = model_id
            return self._cb_manager
        if model_id not in self._generate_managers:  # one inference thread per model, made once
            self._generate_managers[model_id] = SequentialGenerateManager(self.metrics, self.waiting)
        return self._generate_managers[model_id]
