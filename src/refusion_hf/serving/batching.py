"""`refusion serve`'s continuous batching and generation state (transformers serve's `BaseGenerateManager` and
`GenerationState`, transformers 5.24, `transformers.cli.serving.utils`; the shared pieces are `server.py`'s):

* `ContinuousBatchManager` (`--continuous-batching`): serve's own manager drives transformers' paged-attention
  continuous batching (`init_continuous_batching`), which decodes autoregressively and takes the first request's
  generation config for all. Here a worker thread takes the waiting requests (at most `max_requests_per_batch`, the
  rest wait in the queue), groups them by generation config and decodes each group with the model's
  `generate_batch` (ReFusion continuous batching in the ragged cache); requests that need a per-request RNG (`seed`)
  or stopping criteria (`stop`) decode one at a time on the same worker. Requests that arrive while a group decodes
  wait for the next round (`generate_batch` takes its requests up front). A request whose client goes away is
  withdrawn from the call decoding it (`batch_scheduler.withdrawing`): dropped before its next forward pass, its row
  freed. Streamed answers arrive when their request finishes (`generate_batch` does not stream).
* `RefusionGenerationState(GenerationState)`: hands out `server.SequentialGenerateManager`s, or with continuous
  batching one `ContinuousBatchManager`.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from fastapi import HTTPException
from transformers import ContinuousBatchingConfig
from transformers.cli.serving.utils import (
    BaseGenerateManager,
    DirectStreamer,
    GenerationState,
)

from .._compat.transformers import GenerationCancelled as _GenerationCancelled  # serve's private exceptions
from .._compat.transformers import StreamError as _StreamError
from ..generation.batch_scheduler import withdrawing
from ..generation.refusion_generate import DEFAULT_BATCH_ROWS
from .metrics import ARRIVED, ServerMetrics
from .server import REQUEST_SEED, SequentialGenerateManager, WaitingRoom, check_generation_config, until_done_or_gone


class Withdrawal(threading.Event):
    """A continuous-batching request's cancel flag (set when its client goes away): once its decoding started
    (`joined` a call's withdrawal set under `withdrawing`), setting it also withdraws it from that call, which drops
    it before its next forward (`batch_scheduler.withdrawing`)."""

    _call: tuple[set[int], int] | None = None

    def set(self) -> None:
        super().set()
        call = self._call
        if call is not None:
            call[0].add(call[1])

    def joined(self, withdrawn: set[int], index: int) -> None:
        self._call = (withdrawn, index)
        if self.is_set():  # set before it joined
            withdrawn.add(index)


@dataclass
class BatchRequest:
    """A request waiting for `ContinuousBatchManager`'s worker; `deliver` gets its answer's token ids or the error
    (called on the worker thread)."""

    input_ids: list[int]
    config: object  # GenerationConfig
    seed: int | None
    deliver: Callable[[list[int] | BaseException], None]
    cancel: Withdrawal  # set when its client goes away: never decoded, or dropped before its next forward

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

    def _submit(self, model, processor, inputs, gen_config, deliver) -> Withdrawal:
        if self.fatal_error is not None:
            raise HTTPException(status_code=503, detail=f"the decoding worker died: {self.fatal_error}")
        check_generation_config(model, gen_config)
        self._tokenizer = processor
        cancel = Withdrawal()

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

        arrived = ARRIVED.get()

        def settle(result):
            if answer.done():
                return
            if arrived is not None and not isinstance(result, BaseException):  # the whole answer at once
                self.metrics.time_to_first_token.observe(time.monotonic() - arrived)
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
                while len(waiting) < self.max_requests_per_batch:  # the rest wait in the queue (`WaitingRoom`)
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
        one request's input) one at a time, so that an error reaches only its request. A request whose client goes
        away is withdrawn (`withdrawing`): never decoded if it has not started, else dropped before the next
        forward, its row freed for the others."""
        self.waiting.leave(len(group))
        self.metrics.running.inc(len(group))
        try:
            self._decode_live(group)
        finally:
            self.metrics.running.dec(len(group))

    @staticmethod
    def _withdrawals(requests: list[BatchRequest]) -> set[int]:
        withdrawn: set[int] = set()
        for index, request in enumerate(requests):
            request.cancel.joined(withdrawn, index)
        return withdrawn

    def _decode_live(self, group: list[BatchRequest]) -> None:
        for request in [r for r in group if r.cancel.is_set()]:
            request.deliver(_GenerationCancelled())
        group = [r for r in group if not r.cancel.is_set()]
        if len(group) > 1 and not group[0].decodes_alone():
            rows = ContinuousBatchingConfig(max_requests_per_batch=self.max_requests_per_batch)
            try:
                with withdrawing(self._withdrawals(group)) as withdrawn:
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
                    gone = index in withdrawn
                    request.deliver(_GenerationCancelled() if gone else results[f"req_{index}"].generated_tokens)
                return
        for request in group:
            if request.cancel.is_set():  # its client went away while the ones before it decoded
                request.deliver(_GenerationCancelled())
                continue
            try:
                if request.seed is not None:
                    torch.manual_seed(request.seed)
                prompt = torch.tensor([request.input_ids], device=self._model.device)
                with withdrawing(self._withdrawals([request])) as withdrawn:
                    out = self._model.generate(prompt, generation_config=request.config, tokenizer=self._tokenizer)
                request.deliver(_GenerationCancelled() if withdrawn else out[0, prompt.shape[1] :].tolist())
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
