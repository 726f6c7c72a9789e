"""`refusion serve`'s prompts: token ids for a chat (the chat template, then the tokenizer) or a completion (the
tokenizer), made off the event loop so that no request's prompt stalls the others or `/health`.

The model's own chat template renders through the tokenizer's public `apply_chat_template` on a worker thread.
A template sent in the request (`chat_template_kwargs.chat_template`, only with `--trust-request-chat-template`) is
a program from the client: it renders in a process of its own (`multiprocessing`'s forkserver, so that the child is
a clean copy, not a fork of the server's threads; it is started, with this module and the tokenizer's imported, when
the server starts), under an address-space limit (`RLIMIT_AS`: its current size plus `TEMPLATE_MEMORY_BYTES`) and a
deadline (`--request-chat-template-seconds`, default `TEMPLATE_SECONDS`); past either, or when the client goes away,
the process is killed and the request ends (400 naming the limit, or the client is gone). Jinja itself is
transformers' (its sandboxed environment, inside `apply_chat_template`).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import resource
import threading
import time
from collections.abc import Awaitable, Callable

import jinja2

TEMPLATE_SECONDS = 10.0  # default of `--request-chat-template-seconds`
TEMPLATE_MEMORY_BYTES = 256 * 2**20
POLL_SECONDS = 0.02


class PromptRefused(ValueError):
    """The request's prompt cannot be made (one line naming the field)."""


class ClientGone(Exception):
    """The client went away while its prompt was made."""


def virtual_memory_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def render_isolated(connection, tokenizer_bytes: bytes, arguments: dict, memory: int) -> None:
    """In the template's own process: render, send ("text", str) or ("error", str) back."""
    try:
        tokenizer = pickle.loads(tokenizer_bytes)
        if memory and virtual_memory_bytes():
            limit = virtual_memory_bytes() + memory
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        connection.send(("text", tokenizer.apply_chat_template(tokenize=False, **arguments)))
    except MemoryError:
        connection.send(("error", f"the chat template used more than its {memory // 2**20} MiB of memory"))
    except Exception as error:  # noqa: BLE001 - the template's own error, for the client
        connection.send(("error", f"the chat template refused them ({type(error).__name__}: {error})"))


class PromptMaker:
    """Token ids for requests to one tokenizer (see the module docstring); `max_chars`: the longest rendered text
    taken (a longer one cannot fit the context); `template_seconds`: how long a request's template may render
    (None: templates from requests are refused before they get here)."""

    def __init__(self, tokenizer, max_chars: int, template_seconds: float | None = None):
        self.tokenizer, self.max_chars, self.template_seconds = tokenizer, max_chars, template_seconds
        self._tokenizer_bytes: bytes | None = None
        self._processes = multiprocessing.get_context("forkserver")
        if template_seconds is not None:  # the forkserver, with the imports a render needs, before any request
            self._processes.set_forkserver_preload([__name__, type(tokenizer).__module__])
            self._tokenizer_bytes = pickle.dumps(tokenizer)
            warm = self._processes.Process(target=int, daemon=True)
            threading.Thread(target=lambda: (warm.start(), warm.join()), daemon=True).start()

    def _ids(self, text: str) -> list[int]:
        if len(text) > self.max_chars:
            raise PromptRefused(f"the rendered prompt has {len(text)} characters, more than any prompt that fits")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def completion(self, prompt: str) -> list[int]:
        return await asyncio.to_thread(lambda: self.tokenizer(prompt)["input_ids"])

    async def chat(self, arguments: dict, client_gone: Callable[[], Awaitable[bool]]) -> list[int]:
        """`arguments`: `apply_chat_template`'s (conversation, tools, the template's variables, and with a trusted
        request template `chat_template`)."""
        arguments = {**arguments, "add_generation_prompt": True}
        if "chat_template" not in arguments:
            try:
                text = await asyncio.to_thread(self.tokenizer.apply_chat_template, tokenize=False, **arguments)
            except (jinja2.TemplateError, ValueError, TypeError) as error:  # the template refused these messages
                raise PromptRefused(f"messages / tools: the chat template refused them ({error})") from None
        else:
            text = await self._render_isolated(arguments, client_gone)
        return await asyncio.to_thread(self._ids, text)

    async def _render_isolated(self, arguments: dict, client_gone) -> str:
        if self._tokenizer_bytes is None:
            self._tokenizer_bytes = pickle.dumps(self.tokenizer)
        receiving, sending = self._processes.Pipe(duplex=False)
        process = self._processes.Process(
            target=render_isolated,
            args=(sending, self._tokenizer_bytes, arguments, TEMPLATE_MEMORY_BYTES),
            daemon=True,
            name="refusion-chat-template",
        )
        await asyncio.to_thread(process.start)
        sending.close()
        deadline = time.monotonic() + self.template_seconds
        try:
            while not await asyncio.to_thread(receiving.poll, POLL_SECONDS):
                if not process.is_alive() and not receiving.poll():
                    raise PromptRefused("chat_template_kwargs.chat_template: the chat template's process died")
                if time.monotonic() > deadline:
                    raise PromptRefused(
                        "chat_template_kwargs.chat_template: the chat template rendered for over "
                        f"{self.template_seconds} s (this server's --request-chat-template-seconds)"
                    )
                if await client_gone():
                    raise ClientGone()
            kind, value = receiving.recv()
        except EOFError:
            raise PromptRefused("chat_template_kwargs.chat_template: the chat template's process died") from None
        finally:
            if process.is_alive():
                process.kill()
            await asyncio.to_thread(process.join, 5)
            receiving.close()
        if kind == "error":
            raise PromptRefused(f"chat_template_kwargs.chat_template: {value}")
        return value
