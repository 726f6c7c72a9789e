"""The library's user errors, declared once, and how a message is cut to one line.

A user error (a bad path or value, an unreadable or corrupt checkpoint, a folder without a tokenizer, bad data, an
output that cannot be written) is an `InputError`, a `ValueError` whose message names the input (the flag or
argument that gave it) and what to do instead. The library raises it; the commands (`refusion_hf.cli.main`) print
it as the one line `refusion <command>: error: <message>` and exit with status 2, without a traceback. Anything
else is an internal error and keeps its traceback. The commands' own refusals (`command_inputs.CommandError`) are
`InputError`s too.
"""

from __future__ import annotations


class InputError(ValueError):
    """A user's input that cannot be used; the message names it and what to do instead."""


def first_line(error: BaseException | str) -> str:
    """The first line of an error's message; for a strict config's validation error (`@strict`, whose own first
    line only names the validator), the message of the error it wraps."""
    if isinstance(error, BaseException):
        from huggingface_hub.errors import StrictDataclassError

        if isinstance(error, StrictDataclassError) and error.__cause__ is not None:
            error = error.__cause__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
