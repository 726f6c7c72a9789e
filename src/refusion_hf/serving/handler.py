"""`refusion serve`'s one request handler: the whole path from a validated request (`protocol.py`) to its answer,
with every per-request value passed as an argument.

1. The model: the request's `model`, if given, must be one of the served names (else 404; no request reaches a
   loader). 2. The prompt's token ids (`prompts.py`, off the event loop): a chat's through the model's chat template
   (`chat_template_kwargs` are the template's variables; one that `apply_chat_template` or the renderer set
   themselves is refused, and a template from the request only with `--trust-request-chat-template`), a
   completion's through the tokenizer. 3. The limits: prompt tokens + `max_tokens` within `--max-model-len` (400
   saying both). 4. The generation config: the model's own, with the request's fields in `generate()`'s terms, checked
   as `generate()` checks it (400 naming the field). 5. The job, admitted to the decoding worker's queue (503 when
   full or stopping) and decoded by this package's `generate()` / `generate_batch()` (`decoding.py`). 6. The answer:
   OpenAI's response types from the `openai` package, whole or streamed (server-sent events, each piece when it is
   final); a client that goes away cancels its job, which stops decoding before its next forward.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from ..generation.generate_arguments import refuse_unsupported
from ..generation.refusion_generate import merge_generation_config
from ..generation.refusion_generation_config import sampling_arguments
from .decoding import RETRY_AFTER_SECONDS, Cancelled, Decoder, End, Job, QueueFull, ServerStopping
from .metrics import ServerMetrics
from .prompts import ClientGone, PromptMaker, PromptRefused
from .protocol import ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_NEW_TOKENS = 1024  # without max_tokens: at least this many (as transformers serve), cut to the context
DISCONNECT_POLL_SECONDS = 0.02
# Template variables the renderer sets itself (apply_chat_template's arguments are added from its signature).
RESERVED_VARIABLES = {"messages", "conversation", "conversations", "tools", "documents", "add_generation_prompt"}


@dataclass
class Served:
    """The one model a server answers for: its names (answers carry the first), model, tokenizer and limits."""

    names: list[str]
    model: object  # RefusionForCausalLM
    tokenizer: object
    max_model_len: int
    trust_request_chat_template: bool = False


@dataclass
class Client:
    """The HTTP client of one request: when it arrived, and whether it went away."""

    arrived: float
    gone: Callable[[], Awaitable[bool]]


class IncrementalText:
    """An answer's text as its tokens arrive: each piece once the tokens before it decode to whole characters (a
    token may end in the middle of a UTF-8 character); the pieces join to the whole answer's decoded text.

    Each step decodes a short window, not the answer so far (which would make a stream quadratic in its length):
    the tokens from `start` (where the last piece's window began) to the end, against the same window without the
    new tokens (`tokens[start:end]`). Decoding both from the same token keeps whatever the tokenizer does at a
    window's first token (a leading space dropped, say) out of the difference. This is the windowed detokenizing of
    vLLM's and text-generation-inference's streams."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens = tokenizer, []
        self.start = self.end = 0  # the window before the new tokens: tokens[start:end] were sent

    def add(self, tokens: list[int]) -> str:
        self.tokens += tokens
        return self._piece(final=False)

    def rest(self) -> str:
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        sent = self.tokenizer.decode(self.tokens[self.start : self.end], skip_special_tokens=True)
        text = self.tokenizer.decode(self.tokens[self.start :], skip_special_tokens=True)
        if not final and text.endswith("\ufffd") or not text.startswith(sent):
            return ""  # a character is not whole yet (or the window's text changed): wait for more tokens
        self.start, self.end = self.end, len(self.tokens)
        return text[len(sent) :]


def error(status: int, detail: str, **headers) -> HTTPException:
    return HTTPException(status_code=status, detail=detail, headers=headers or None)


class Handler:
    """Answers `/v1/chat/completions` and `/v1/completions` for one served model (see the module docstring)."""

    def __init__(self, served: Served, decoder: Decoder, prompts: PromptMaker, metrics: ServerMetrics):
        self.served, self.decoder, self.prompts, self.metrics = served, decoder, prompts, metrics
        self.template_arguments = set(inspect.signature(served.tokenizer.apply_chat_template).parameters)
        self.eos = set(self.eos_ids())

    def eos_ids(self) -> list[int]:
        eos = self.served.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    async def answer(self, request: ChatCompletionRequest | CompletionRequest, client: Client):
        chat = isinstance(request, ChatCompletionRequest)
        self.check_model(request.model)
        input_ids = await self.prompt_ids(request, client)
        budget = request.budget()
        room = self.served.max_model_len - len(input_ids)
        if (budget is not None and budget > room) or room < 1:
            asked = f"{len(input_ids)} in the prompt ({'messages' if chat else 'prompt'})"
            if budget is not None:
                asked += f" + {budget} in max_tokens"
            raise error(
                400,
                f"this server's maximum context length (--max-model-len) is {self.served.max_model_len} tokens; the "
                f"request asks for {asked}: shorten the prompt or lower max_tokens.",
            )
        config = self.generation_config(request, room)
        self.metrics.prompt_tokens.inc(len(input_ids))
        job = Job(input_ids, config, request.seed, asyncio.get_running_loop())
        try:
            self.decoder.submit(job)
        except QueueFull as full:
            limit = self.decoder.waiting.limit
            raise error(
                503,
                f"{full.args[0]} requests are waiting already (--max-queued-requests {limit}): retry later.",
                **{"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from None
        except ServerStopping:
            raise error(503, "the server is stopping.") from None
        except RuntimeError as dead:
            raise error(503, str(dead)) from None
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            first = await self.next_event(job, client)
        except asyncio.CancelledError:  # the server stopped past its --shutdown-timeout
            job.cancel.set()
            raise error(503, "the server stopped before this answer was complete: retry on another.") from None
        except BaseException:
            job.cancel.set()
            raise
        if isinstance(first, End) and first.error is not None:
            raise self.job_error(first.error)
        if request.stream:
            return StreamingResponse(
                self.stream(job, first, chat, ident, config.max_new_tokens, client), media_type="text/event-stream"
            )
        self.metrics.time_to_first_token.observe(time.monotonic() - client.arrived)
        tokens = []
        try:
            event = first
            while not isinstance(event, End):
                tokens += event
                event = await self.next_event(job, client)
        except asyncio.CancelledError:  # the server stopped past its --shutdown-timeout: this answer is not complete
            raise error(503, "the server stopped before this answer was complete: retry on another.") from None
        finally:
            job.cancel.set()  # a no-op once it ended; otherwise (the client left, the server stops) it stops decoding
        if event.error is not None:
            raise self.job_error(event.error)
        text = self.served.tokenizer.decode(tokens, skip_special_tokens=True)
        return JSONResponse(self.whole(chat, ident, text, len(input_ids), tokens, config.max_new_tokens))

    # -- 1.-4.
    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in self.served.names:
            raise error(
                404,
                f"model {requested!r} is not served here: this server serves {self.served.names[0]!r} (refusion serve "
                "serves the model it was started with, under --served-model-name).",
            )

    async def prompt_ids(self, request, client: Client) -> list[int]:
        try:
            if isinstance(request, CompletionRequest):
                ids = await self.prompts.completion(request.prompt)
            else:
                ids = await self.prompts.chat(self.template_arguments_of(request), client.gone)
        except PromptRefused as refused:
            raise error(400, f"{refused}.") from None
        except ClientGone:
            raise error(499, "the client closed the request") from None
        if not ids:
            field = "prompt" if isinstance(request, CompletionRequest) else "messages"
            raise error(400, f"{field}: the prompt has no tokens; give it some text.")
        return ids

    def template_arguments_of(self, request: ChatCompletionRequest) -> dict:
        variables = dict(request.chat_template_kwargs or {})
        if "chat_template" in variables and not self.served.trust_request_chat_template:
            raise error(
                400,
                "chat_template_kwargs.chat_template: this server renders the model's own chat template; a template "
                "from the request is refused unless the server runs with --trust-request-chat-template.",
            )
        if "chat_template" in variables and not isinstance(variables["chat_template"], str):
            raise error(400, "chat_template_kwargs.chat_template must be a string (a Jinja template).")
        refused = sorted((set(variables) & (self.template_arguments | RESERVED_VARIABLES)) - {"chat_template"})
        if refused:
            raise error(
                400,
                f"chat_template_kwargs {refused}: these are set by the server (apply_chat_template's own arguments, "
                "or the messages and tools it renders); chat_template_kwargs carries the template's variables only.",
            )
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        conversation = [message.for_template() for message in request.messages]
        return dict(conversation=conversation, tools=tools, **variables)

    def generation_config(self, request, room: int):
        config = self.served.model.generation_config.__class__.from_dict(self.served.model.generation_config.to_dict())
        budget = request.budget()
        if budget is None:
            budget = min(max(config.max_new_tokens or 0, DEFAULT_MAX_NEW_TOKENS), room)
        config.max_new_tokens, config.max_length = budget, None
        if request.temperature is not None:
            config.update(**sampling_arguments(request.temperature))
        elif request.top_p is not None:
            config.do_sample = True  # top_p alone samples at the model's temperature, as OpenAI's API does
        if request.top_p is not None:
            config.top_p = request.top_p
        if request.stop is not None:
            config.stop_strings = [request.stop] if isinstance(request.stop, str) else list(request.stop)
        if request.logit_bias:
            config.sequence_bias = {(int(token),): bias for token, bias in request.logit_bias.items()}
        try:
            merged, _ = merge_generation_config(self.served.model, config, {})
            merged.validate()
            if merged.decoding == "refusion":
                refuse_unsupported(merged, {}, defaultdict(lambda: None))
            vocab = self.served.model.get_input_embeddings().num_embeddings
            if request.logit_bias and max(int(token) for token in request.logit_bias) >= vocab:
                raise ValueError(f"logit_bias: token ids must be below the vocabulary size ({vocab})")
        except ValueError as refused:
            raise error(400, str(refused)) from None
        return config

    # -- 5.-6.
    async def next_event(self, job: Job, client: Client):
        """The job's next event; meanwhile, every DISCONNECT_POLL_SECONDS, whether its client went away (then the
        job is cancelled and the request ends with 499, which no client reads)."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_SECONDS)
            except TimeoutError:
                if await client.gone():
                    job.cancel.set()
                    raise error(499, "the client closed the request") from None

    def job_error(self, failure: BaseException) -> HTTPException:
        if isinstance(failure, ServerStopping):
            return error(503, "the server is stopping: retry on another.")
        if isinstance(failure, Cancelled):
            return error(499, "the client closed the request")
        if isinstance(failure, ValueError):  # what generate() refuses about this request's input
            return error(400, str(failure))
        return error(503, f"decoding failed: {failure!r}")

    def finish_reason(self, tokens: list[int], max_new_tokens: int) -> str:
        cut = len(tokens) >= max_new_tokens and not (tokens and tokens[-1] in self.eos)
        return "length" if cut else "stop"

    def whole(self, chat: bool, ident: str, text: str, prompt_tokens: int, tokens: list[int], budget: int) -> dict:
        usage = CompletionUsage(
            prompt_tokens=prompt_tokens, completion_tokens=len(tokens), total_tokens=prompt_tokens + len(tokens)
        )
        reason = self.finish_reason(tokens, budget)
        common = dict(id=ident, created=int(time.time()), model=self.served.names[0], usage=usage)
        if chat:
            message = ChatCompletionMessage(role="assistant", content=text)
            choice = ChatChoice(index=0, message=message, finish_reason=reason)
            answer = ChatCompletion(object="chat.completion", choices=[choice], **common)
        else:
            choice = CompletionChoice(index=0, text=text, finish_reason=reason)
            answer = Completion(object="text_completion", choices=[choice], **common)
        return answer.model_dump(mode="json", exclude_none=True)

    def chunk(self, chat: bool, ident: str, text: str | None, reason=None, usage=None, role=None) -> str:
        common = dict(id=ident, created=int(time.time()), model=self.served.names[0], usage=usage)
        if chat:
            delta = ChoiceDelta(content=text, role=role)
            answer = ChatCompletionChunk(
                object="chat.completion.chunk",
                choices=[ChunkChoice(index=0, delta=delta, finish_reason=reason)],
                **common,
            )
        else:
            choice = CompletionChoice.model_construct(index=0, text=text or "", finish_reason=reason, logprobs=None)
            answer = Completion.model_construct(object="text_completion", choices=[choice], **common)
        return f"data: {json.dumps(answer.model_dump(mode='json', exclude_none=True))}\n\n"

    async def stream(self, job: Job, first, chat: bool, ident: str, budget: int, client: Client) -> AsyncIterator[str]:
        """Server-sent events: a chunk per final piece of text, the last with the finish reason and usage, then
        `[DONE]`. Cancelled with its client (Starlette ends the iteration): the job is cancelled."""
        text = IncrementalText(self.served.tokenizer)
        first_piece = True
        try:
            if chat:
                yield self.chunk(chat, ident, "", role="assistant")
            event = first
            while not isinstance(event, End):
                piece = text.add(event)
                if piece:
                    if first_piece:
                        self.metrics.time_to_first_token.observe(time.monotonic() - client.arrived)
                        first_piece = False
                    yield self.chunk(chat, ident, piece)
                event = await self.next_event(job, client)
            if event.error is not None:
                failure = self.job_error(event.error)
                yield f"data: {json.dumps({'error': {'message': failure.detail, 'code': failure.status_code}})}\n\n"
                return
            if first_piece:
                self.metrics.time_to_first_token.observe(time.monotonic() - client.arrived)
            tokens = text.tokens
            usage = CompletionUsage(
                prompt_tokens=len(job.input_ids),
                completion_tokens=len(tokens),
                total_tokens=len(job.input_ids) + len(tokens),
            )
            reason = self.finish_reason(tokens, budget)
            yield self.chunk(chat, ident, text.rest(), reason=reason, usage=usage)
            yield "data: [DONE]\n\n"
        except HTTPException:  # the client left (499): nobody reads on
            return
        finally:
            job.cancel.set()
