"""`refusion serve`'s decoding: one worker thread that decodes the admitted requests (`Job`s) through this package's
own `generate()` (one request at a time, the default) or `generate_batch()` (`--continuous-batching`), and hands
each answer's final tokens back as they are decided.

* `Job`: one request's prompt ids, generation config and seed, its cancel flag (`Withdrawal`) and where its events
  go (`events`, an asyncio queue on the server's loop, fed from the worker thread with `call_soon_threadsafe`):
  lists of final token ids as they are decided, then one `End` (the error, if any).
* Streaming: `batch_scheduler.following` reports each prompt's final prefix as it grows, in `generate()` and in
  `generate_batch()` alike, so that both stream each piece when it is final.
* Cancellation: a job whose client went away (or whose task the server cancels while stopping) sets its flag;
  `batch_scheduler.withdrawing` drops it before the next forward of the call decoding it (its row freed), and a job
  cancelled while it waits is never decoded.
* `WaitingRoom`: the jobs waiting for their decoding, counted (`/metrics`) and, with `--max-queued-requests N`, at
  most N (one more is refused: `QueueFull`, an HTTP 503). When the server stops, `stop_waiting` ends every waiting
  job with `ServerStopping` (an HTTP 503) at once, and no new job is taken.
* Continuous batching: the worker takes the waiting jobs (at most `--max-num-seqs`, the rest wait for the next
  round), groups them by generation config and decodes each group with `model.generate_batch`; a job with a seed
  or `stop` strings decodes alone with `generate()` (a per-request RNG; stopping criteria see one sequence).
  Jobs arriving while a group decodes wait for the next round (`generate_batch` takes its requests up front).
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import ContinuousBatchingConfig

from ..generation.batch_scheduler import following, withdrawing
from .metrics import ServerMetrics

RETRY_AFTER_SECONDS = 1


class QueueFull(Exception):
    """`--max-queued-requests` jobs wait already."""


class ServerStopping(Exception):
    """The server is stopping: the job was not decoded."""


class Cancelled(Exception):
    """The job's client went away: its decoding stopped."""


class Withdrawal(threading.Event):
    """A job's cancel flag: once its decoding started (`joined` a call's withdrawal set under `withdrawing`), setting
    it also withdraws it from that call, which drops it before its next forward."""

    _call: tuple[set[int], int] | None = None

    def set(self) -> None:
        super().set()
        call = self._call
        if call is not None:
            call[0].add(call[1])

    def joined(self, withdrawn: set[int], index: int) -> None:
        self._call = (withdrawn, index)
        if self.is_set():
            withdrawn.add(index)


@dataclass
class End:
    """A job's last event: `error` None when its answer is complete."""

    error: BaseException | None = None


@dataclass(eq=False)
class Job:
    input_ids: list[int]
    config: object  # GenerationConfig, checked by the handler
    seed: int | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: Withdrawal = field(default_factory=Withdrawal)
    tokens: list[int] = field(default_factory=list)  # final tokens handed over so far (worker thread)

    def send(self, event) -> None:  # worker thread -> the server's loop
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop closed (the server stopped): nobody reads this job any more
            pass

    def final(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.send(tokens)

    def finish(self, answer: list[int] | None = None, error: BaseException | None = None) -> None:
        """The job's end: the rest of `answer` (what `following` did not report), then `End`."""
        if error is None and self.cancel.is_set():
            error = Cancelled()
        if error is None and answer is not None and len(answer) > len(self.tokens):
            self.final(list(answer[len(self.tokens) :]))
        self.send(End(error))

    def group_key(self) -> str:
        return json.dumps(self.config.to_dict(), sort_keys=True, default=str)

    def decodes_alone(self) -> bool:
        return self.seed is not None or self.config.stop_strings is not None


class WaitingRoom:
    """The jobs waiting for their decoding (see the module docstring)."""

    def __init__(self, metrics: ServerMetrics, limit: int | None = None):
        self.metrics, self.limit = metrics, limit
        self.jobs: list[Job] = []
        self.stopping = False
        self.ready = threading.Condition()

    def enter(self, job: Job) -> None:
        with self.ready:
            if self.stopping:
                raise ServerStopping()
            if self.limit is not None and len(self.jobs) >= self.limit:
                raise QueueFull(len(self.jobs))
            self.jobs.append(job)
            self.metrics.waiting.inc()
            self.ready.notify()

    def take(self, most: int, timeout: float = 0.05) -> list[Job]:
        """Up to `most` waiting jobs, in arrival order (waits up to `timeout` for one); cancelled ones are ended."""
        with self.ready:
            if not self.jobs:
                self.ready.wait(timeout)
            taken, self.jobs = self.jobs[:most], self.jobs[most:]
            self.metrics.waiting.dec(len(taken))
        live = []
        for job in taken:
            if job.cancel.is_set():  # its client left while it waited: never decoded
                job.finish(error=Cancelled())
            else:
                live.append(job)
        return live

    def resume(self) -> None:
        """Jobs are taken again (the app started anew)."""
        with self.ready:
            self.stopping = False

    def stop_waiting(self) -> None:
        """No job is taken any more; every waiting one ends with `ServerStopping`."""
        with self.ready:
            self.stopping = True
            taken, self.jobs = self.jobs, []
            self.metrics.waiting.dec(len(taken))
            self.ready.notify_all()
        for job in taken:
            job.finish(error=ServerStopping())


class Decoder:
    """The decoding worker (see the module docstring). `rows`: jobs decoded at once (1 without continuous
    batching)."""

    def __init__(self, model, tokenizer, metrics: ServerMetrics, waiting: WaitingRoom, continuous: bool, rows: int):
        # generate()'s stop strings use the tokenizer on this worker's thread while the event loop encodes and
        # decodes with the server's: a fast tokenizer is not safe to share across threads (its Rust state, e.g.
        # truncation and padding, is set per call), so the worker has a copy of its own
        self.model, self.tokenizer, self.metrics, self.waiting = model, copy.deepcopy(tokenizer), metrics, waiting
        self.continuous, self.rows = continuous, rows
        self.fatal_error: BaseException | None = None
        self.busy = False
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._run, name="refusion-decoding", daemon=True)
        self._worker.start()

    def is_alive(self) -> bool:
        return self.fatal_error is None and self._worker.is_alive()

    def submit(self, job: Job) -> None:
        if not self.is_alive():
            raise RuntimeError(f"the decoding worker died: {self.fatal_error!r}")
        self.waiting.enter(job)

    def wait_idle(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.01)

    def shutdown(self) -> None:
        self.waiting.stop_waiting()
        self._stop.set()
        if self._worker is not threading.current_thread():
            self._worker.join(timeout=10)

    def _run(self) -> None:
        jobs: list[Job] = []
        try:
            while not self._stop.is_set():
                jobs = self.waiting.take(self.rows)
                if not jobs:
                    continue
                self.busy = True
                self.metrics.running.inc(len(jobs))
                try:
                    groups: dict[str, list[Job]] = {}
                    for job in jobs:
                        groups.setdefault(job.group_key(), []).append(job)
                    for group in groups.values():
                        self._decode(group)
                finally:
                    self.metrics.running.dec(len(jobs))
                    self.busy = False
                jobs = []
        except BaseException as error:  # reported to the jobs it leaves, to every later one and by /health
            self.fatal_error = error
            for job in jobs:
                job.finish(error=RuntimeError(f"the decoding worker died: {error!r}"))
            self.waiting.stop_waiting()
            raise

    @staticmethod
    def _withdrawals(jobs: list[Job]) -> set[int]:
        withdrawn: set[int] = set()
        for index, job in enumerate(jobs):
            job.cancel.joined(withdrawn, index)
        return withdrawn

    def _decode(self, group: list[Job]) -> None:
        """`generate_batch` for a group of two or more that may share a call, else `generate()` one at a time (also
        after a batch that failed on one job's input, so that an error reaches only its job)."""
        if len(group) > 1 and not group[0].decodes_alone():
            rows = ContinuousBatchingConfig(max_requests_per_batch=self.rows)
            try:
                with withdrawing(self._withdrawals(group)), following(lambda i, tokens: group[i].final(tokens)):
                    results = self.model.generate_batch(
                        [job.input_ids for job in group],
                        generation_config=group[0].config,
                        continuous_batching_config=rows,
                    )
            except ValueError as error:  # one job's input (refused up front): found below, job by job
                for job in [job for job in group if job.tokens]:  # (none has streamed: refused before decoding)
                    job.finish(error=error)
                group = [job for job in group if not job.tokens]
            except Exception as error:  # noqa: BLE001 - e.g. out of memory: every job of the batch is told
                for job in group:
                    job.finish(error=error)
                return
            else:
                for index, job in enumerate(group):
                    self._complete(job, results[f"req_{index}"].generated_tokens)
                return
        for job in group:
            if job.cancel.is_set():  # its client went away while the ones before it decoded
                job.finish(error=Cancelled())
                continue
            try:
                if job.seed is not None:
                    torch.manual_seed(job.seed)
                prompt = torch.tensor([job.input_ids], device=self.model.device)
                with withdrawing(self._withdrawals([job])), following(lambda _, tokens, job=job: job.final(tokens)):
                    out = self.model.generate(
                        prompt,
                        attention_mask=torch.ones_like(prompt),  # a prompt may hold the pad token: all of it counts
                        generation_config=job.config,
                        tokenizer=self.tokenizer,
                    )
                self._complete(job, out[0, prompt.shape[1] :].tolist())
            except Exception as error:  # noqa: BLE001 - the job's own error (generate() refused its input), to it
                job.finish(error=error)

    def _complete(self, job: Job, answer: list[int]) -> None:
        if not job.cancel.is_set():
            self.metrics.generation_tokens.inc(len(answer))
        job.finish(answer)
