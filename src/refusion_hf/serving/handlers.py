"""`refusion serve`'s request handlers: transformers serve's (transformers 5.24, `transformers.cli.serving`)
`ChatCompletionHandler` and `CompletionHandler`, which do the work (request validation against the OpenAI schemas,
the chat template, SSE streaming, usage accounting and finish reasons), extended by `RefusionRequests`:

* the server is pinned to one model (`ServedModel`): a request naming another is a 404, and no request reaches
  serve's model manager (which loads whatever path or Hub id it is given);
* the prompt (chat template included) is tokenized on a worker thread, and prompt tokens + `max_tokens` over
  `--max-model-len` is a 400 before any decoding; a chat template from the request is refused unless the operator
  trusts them, and `chat_template_kwargs` carry template variables only;
* serve logs a warning and ignores the OpenAI fields it does not implement (`n`, `presence_penalty`, `logprobs`,
  ...): here a value other than the neutral one is an HTTP 422 naming the field; serve's `generation_config` field
  is refused too;
* `temperature` / `top_p` sample (serve only sets them, which leaves a greedy checkpoint greedy);
  `temperature: 0` is greedy; the request's `seed` is applied on the thread that decodes it (`server.py`).

`/v1/responses`, `/v1/systemone` and `/v1/audio/transcriptions` are not served (`NotServed`: HTTP 501 naming the
two endpoints that are). Decoding (the generation managers) is `server.py`'s and
`batching.py`'s.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Iterable
from dataclasses import dataclass

import jinja2
from fastapi import HTTPException
from pydantic import TypeAdapter, ValidationError
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler

from .._compat.transformers import stock_unused_fields
from ..generation.refusion_generation_config import sampling_arguments
from .server import REQUEST_SEED

# The OpenAI fields serve accepts but ignores, at the values that ask for nothing (any other value is refused).
NEUTRAL_VALUES = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": False,
    "presence_penalty": 0,
    "parallel_tool_calls": True,
    "stream_options": {"include_usage": True},  # serve sends the usage with the last chunk anyway
}
SERVED_ENDPOINTS = "/v1/chat/completions and /v1/completions"


@dataclass
class ServedModel:
    """The one model a server answers for: its names (the first is the one answers carry), the loaded model and
    tokenizer, and the limits every request is held to."""

    names: list[str]
    model: object  # RefusionForCausalLM
    tokenizer: object
    max_model_len: int
    modality: object  # transformers serve's Modality
    trust_request_chat_template: bool = False


def context_error(prompt_tokens: int, max_new_tokens: int | None, max_model_len: int, source: str) -> HTTPException:
    asked = f"{prompt_tokens} in the prompt ({source})"
    if max_new_tokens is not None:
        asked += f" + {max_new_tokens} in max_tokens"
    return HTTPException(
        status_code=400,
        detail=f"this server's maximum context length (--max-model-len) is {max_model_len} tokens; the request asks "
        f"for {asked}: shorten the prompt or lower max_tokens.",
    )


def positive_count(body: dict, field: str) -> int | None:
    """`body[field]` if it is a positive integer, None if absent; HTTP 400 naming the field otherwise."""
    value = body.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise HTTPException(status_code=400, detail=f"{field} must be a positive integer, got {value!r}.")
    return value


OPTIONAL_FIELDS = {"model", "stream"}  # the OpenAI schemas require them; this server does not (`/openapi.json`)


@functools.cache
def request_schema(params_class) -> TypeAdapter:
    """pydantic's validator (and JSON schema) for one of serve's request types (OpenAI's TypedDicts)."""
    return TypeAdapter(params_class)


def consume(value) -> None:
    """Walks a validated value: pydantic validates `Iterable` fields (`messages`, `tools`, content parts) lazily,
    as they are iterated, so this is where their errors show."""
    if isinstance(value, dict):
        value = value.values()
    elif isinstance(value, str | bytes) or not isinstance(value, Iterable):
        return
    for item in value:
        consume(item)


def check_types(params_class, body: dict) -> None:
    """HTTP 422 naming the first fields of `body` whose values do not have the types of OpenAI's request schema."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):  # serve's chat type only has `stream: true`: checked here, then set for the rest
        raise HTTPException(status_code=422, detail=f"request body: stream must be true or false, got {stream!r}.")
    problems = []
    try:  # `model`: OpenAI's schema requires it, this server does not
        validated = request_schema(params_class).validate_python({"model": "", **body, "stream": True}, strict=True)
        for name, value in validated.items():
            try:
                consume(value)
            except ValidationError as error:
                problems += [{**problem, "loc": (name, *problem["loc"])} for problem in error.errors()]
    except ValidationError as error:
        problems = error.errors()
    if problems:
        named = "; ".join(f"{'.'.join(str(part) for part in p['loc'][:3])}: {p['msg']}" for p in problems[:3])
        raise HTTPException(status_code=422, detail=f"request body: {named}.")


class RefusionRequests:
    """What `refusion serve` adds to a serve handler (see the module docstring); mixed in before the handler.

    `handle_request` replaces serve's (same steps, in the same order) for three reasons serve has no hook for: the
    model is the pinned one (`_resolve_model` never reaches serve's model manager, which would load any path or Hub
    id it is given); the prompt is tokenized (chat template included) on a worker thread, not on the event loop,
    so that no request's rendering stalls the others or `/health`; and the prompt's length plus `max_tokens` is
    checked against `--max-model-len` before any decoding. The rest is serve's (`_streaming`, `_non_streaming`)."""

    def __init__(self, model_manager, generation_state, served: ServedModel):
        super().__init__(model_manager=model_manager, generation_state=generation_state)
        self.served = served

    async def handle_request(self, body: dict, request_id: str):
        self._validate_request(body)
        model_id, model, processor = self._resolve_model(body)
        use_cb = self.generation_state.use_continuous_batching(model, self.served.modality)
        gen_manager = self.generation_state.get_manager(model_id, use_cb=use_cb)
        asked = positive_count(body, "max_completion_tokens") or positive_count(body, "max_tokens")
        for field in ("temperature", "top_p"):
            value = body.get(field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise HTTPException(status_code=400, detail=f"{field} must be a number, got {body[field]!r}.")
        prompt = self._prompt(body)  # checked on the event loop (cheap); tokenized off it
        inputs = await asyncio.to_thread(self._tokenize, processor, prompt, body, None if use_cb else "pt")
        ids = inputs["input_ids"]
        prompt_tokens = len(ids) if isinstance(ids, list) else ids.shape[-1]
        gen_config = self._build_generation_config(body, model.generation_config, use_cb=use_cb)
        room = self.served.max_model_len - prompt_tokens
        if (asked is not None and asked > room) or room < 1:
            raise context_error(prompt_tokens, asked, self.served.max_model_len, self._prompt_field)
        self.generation_state.metrics.prompt_tokens.inc(prompt_tokens)
        if asked is None:  # serve's default budget (at least 1024 new tokens), within the context
            gen_config.max_new_tokens = min(gen_config.max_new_tokens, room)
        if use_cb:
            gen_manager.init_cb(model, gen_config)
        else:
            inputs = inputs.to(model.device)
        return await self._answer(request_id, model, processor, model_id, inputs, gen_config, gen_manager, body)

    def _resolve_model(self, body: dict):
        requested = body.get("model")
        if requested is not None and requested not in self.served.names:
            served = self.served.names[0]
            raise HTTPException(
                status_code=404,
                detail=f"model {requested!r} is not served here: this server serves {served!r} (refusion serve "
                "serves the model it was started with, under --served-model-name).",
            )
        return self.served.names[0], self.served.model, self.served.tokenizer

    def _validate_request(self, body: dict) -> None:
        super()._validate_request(body)  # 422 for fields that no OpenAI schema has
        check_types(self._valid_params_class, body)
        if body.get("generation_config") is not None:  # serve's own field: a whole GenerationConfig as JSON
            raise HTTPException(
                status_code=422,
                detail="refusion serve does not take generation_config (it could set anything generate() takes, "
                "past --max-model-len too): use the OpenAI fields (max_tokens, temperature, top_p, seed, stop).",
            )
        refused = sorted(
            name
            for name in set(body) & self._unused_fields
            if body[name] is not None and body[name] != NEUTRAL_VALUES.get(name, object())
        )
        if refused:
            raise HTTPException(
                status_code=422,
                detail=f"refusion serve does not support {refused} (transformers serve would ignore them): leave "
                f"them out{' (`n`: send n requests)' if 'n' in refused else ''}.",
            )
        REQUEST_SEED.set(body.pop("seed", None))  # applied where the request decodes, not here (serve's place)

    def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        # `use_cb` only turns the KV cache off for transformers' paged cache; ReFusion's batches keep their own cache.
        bias = body.get("logit_bias") or {}
        if not all(isinstance(key, str) and key.isdigit() for key in bias):
            raise HTTPException(status_code=400, detail="logit_bias: its keys must be token ids (digits).")
        if body.get("logit_bias") == {}:  # no bias at all (OpenAI's meaning); serve's config would refuse it
            body["logit_bias"] = None
        config = super()._build_generation_config(body, model_generation_config, use_cb=False)
        if body.get("temperature") is not None:
            config.update(**sampling_arguments(float(body["temperature"])))
        elif body.get("top_p") is not None:
            config.do_sample = True  # top_p alone samples at the model's temperature, as OpenAI's API does
        return config


class RefusionChatCompletionHandler(RefusionRequests, ChatCompletionHandler):
    """serve's `/v1/chat/completions` handler with `RefusionRequests`. The chat template is the model's own: one in
    the request (`chat_template_kwargs.chat_template`) is refused unless the operator passed
    `--trust-request-chat-template` (a template is a program: it can loop for ever); the other
    `chat_template_kwargs` are the template's variables (e.g. `enable_thinking`), and any that would instead set an
    argument of `apply_chat_template` itself (`tokenize`, `return_tensors`, `tools`, ...) is refused."""

    _prompt_field = "messages"

    def _prompt(self, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HTTPException(status_code=400, detail="messages must be a non-empty list of messages.")
        try:
            conversation = self.get_processor_inputs_from_messages(messages, self.served.modality)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise HTTPException(
                status_code=400, detail=f"messages: each must be a {{role, content}} object ({error!r})."
            ) from None
        variables = body.get("chat_template_kwargs") or {}
        if not isinstance(variables, dict):
            raise HTTPException(status_code=400, detail="chat_template_kwargs must be an object.")
        arguments = set(inspect.signature(self.served.tokenizer.apply_chat_template).parameters)
        if "chat_template" in variables and not self.served.trust_request_chat_template:
            raise HTTPException(
                status_code=400,
                detail="chat_template_kwargs.chat_template: this server renders the model's own chat template; a "
                "template from the request is refused unless the server runs with --trust-request-chat-template.",
            )
        refused = sorted(set(variables) & arguments - {"chat_template"})
        if refused:
            raise HTTPException(
                status_code=400,
                detail=f"chat_template_kwargs {refused}: these are apply_chat_template's own arguments, which the "
                "server sets; chat_template_kwargs carries the template's variables only.",
            )
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise HTTPException(status_code=400, detail="tools must be a list of tool definitions.")
        return dict(conversation=conversation, tools=tools, **{**self.chat_template_kwargs, **variables})

    def _tokenize(self, processor, prompt: dict, body: dict, return_tensors):
        try:
            return processor.apply_chat_template(
                add_generation_prompt=True, return_tensors=return_tensors, return_dict=True, tokenize=True, **prompt
            )
        except (jinja2.TemplateError, ValueError) as error:  # the template refused these messages or tools
            detail = f"messages / tools: the chat template refused them ({error})."
            raise HTTPException(status_code=400, detail=detail) from None

    async def _answer(self, request_id, model, processor, model_id, inputs, gen_config, gen_manager, body):
        arguments = (request_id, model, processor, model_id, inputs, gen_config)
        if body.get("stream"):
            return self._streaming(*arguments, gen_manager=gen_manager, tools=body.get("tools"))
        return await self._non_streaming(*arguments, gen_manager=gen_manager, tools=body.get("tools"))


class RefusionCompletionHandler(RefusionRequests, CompletionHandler):
    """serve's `/v1/completions` handler with `RefusionRequests`. `suffix` is refused too: serve appends it to the
    answer, which is not conditioned on it (OpenAI's meaning: the text that follows the completion)."""

    _unused_fields = stock_unused_fields(CompletionHandler) | {"suffix"}

    _prompt_field = "prompt"

    def _prompt(self, body: dict) -> str:
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise HTTPException(status_code=400, detail="prompt must be a string.")
        return prompt

    def _tokenize(self, processor, prompt: str, body: dict, return_tensors):
        return getattr(processor, "tokenizer", processor)(prompt, return_tensors=return_tensors)

    async def _answer(self, request_id, model, processor, model_id, inputs, gen_config, gen_manager, body):
        arguments = (request_id, model, processor, model_id, inputs, gen_config, gen_manager)
        if body.get("stream"):
            return self._streaming(*arguments)
        return await self._non_streaming(*arguments)


class NotServed:
    """A serve endpoint `refusion serve` does not offer: HTTP 501 naming the ones it does."""

    def __init__(self, path: str):
        self.path = path

    async def endpoint(self):
        raise HTTPException(
            status_code=501, detail=f"refusion serve does not serve {self.path}; use {SERVED_ENDPOINTS}."
        )
