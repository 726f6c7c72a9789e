"""`refusion serve`'s request bodies, declared once: pydantic models of OpenAI's `/v1/chat/completions` and
`/v1/completions` requests (the fields, types and ranges of OpenAI's API reference), validated strictly (`"7"` is not
a number, `true` is not an integer) with unknown fields refused. They are what FastAPI validates each body against,
and what `/openapi.json` describes. The answers are the `openai` package's own response types (`handler.py`).

Fields of OpenAI's API that this server does not implement are declared too, so that a request giving one a value
other than the one that asks for nothing (`NEUTRAL_VALUES`, or null) is refused naming it, never ignored.
Every string must be encodable as UTF-8: JSON can carry a lone surrogate (`"\\ud800"`), which no tokenizer takes.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# OpenAI fields this server does not implement, at the values that ask for nothing (any other non-null value is a
# 422 naming the field).
NEUTRAL_VALUES = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": False,
    "top_logprobs": 0,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "parallel_tool_calls": True,
    "stream_options": {"include_usage": True},  # the last chunk carries the usage anyway
}
UNIMPLEMENTED_CHAT = (
    "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "parallel_tool_calls", "stream_options",
    "audio", "function_call", "functions", "metadata", "modalities", "prediction", "reasoning_effort",
    "response_format", "service_tier", "store", "tool_choice", "user", "web_search_options", "prompt_cache_key",
    "safety_identifier", "verbosity",
)  # fmt: skip
UNIMPLEMENTED_COMPLETION = (
    "n", "best_of", "echo", "logprobs", "presence_penalty", "frequency_penalty", "stream_options", "suffix", "user",
)  # fmt: skip
SEED_LIMIT = 2**63  # torch.manual_seed takes a 64-bit integer

Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
PositiveInt = Annotated[int, Field(ge=1)]
Stop = str | Annotated[list[str], Field(min_length=1, max_length=4)] | None


def check_text(value: Any, where: str = "") -> Any:
    """`value` unchanged; ValueError if a string in it (keys included) holds what UTF-8 cannot encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"holds a character UTF-8 cannot encode ({error.reason}: {value[error.start]!r})"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key)
            check_text(item)
    elif isinstance(value, list):
        for item in value:
            check_text(item)
    return value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def encodable(cls, value):
        if isinstance(value, str | dict | list):
            check_text(value)
        return value


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict:
        """The message as a chat template reads it: text parts joined by newlines (as vLLM joins them)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        return message


class Function(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class CommonFields(Strict):
    """The fields both routes take."""

    model: str | None = None  # OpenAI requires it; this server serves one model and does not
    stream: bool = False
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Annotated[int, Field(ge=-SEED_LIMIT, lt=SEED_LIMIT)] | None = None
    stop: Stop = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    # not implemented (refused unless neutral: `refuse_unimplemented`)
    n: Any = None
    logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    stream_options: Any = None
    user: Any = None

    unimplemented: ClassVar[tuple[str, ...]] = ()  # set by each route's model

    @field_validator("logit_bias", mode="after")
    @classmethod
    def token_ids(cls, value):
        if value and not all(key.isascii() and key.isdigit() for key in value):
            raise ValueError("its keys must be token ids (digits)")
        return value

    @model_validator(mode="after")
    def refuse_unimplemented(self):
        refused = sorted(
            name
            for name in self.unimplemented
            if getattr(self, name) is not None and getattr(self, name) != NEUTRAL_VALUES.get(name, object())
        )
        if refused:
            hint = " (`n`: send n requests)" if "n" in refused else ""
            raise ValueError(f"refusion serve does not implement {refused}: leave them out{hint}")
        return self

    def budget(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(CommonFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    top_logprobs: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    metadata: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    response_format: Any = None
    service_tier: Any = None
    store: Any = None
    tool_choice: Any = None
    web_search_options: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    verbosity: Any = None

    unimplemented: ClassVar[tuple[str, ...]] = UNIMPLEMENTED_CHAT

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(CommonFields):
    prompt: str
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    unimplemented: ClassVar[tuple[str, ...]] = UNIMPLEMENTED_COMPLETION
