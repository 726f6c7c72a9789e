"""The seams: every use of another library's private names (or of a global it does not offer as an extension
point) goes through one module per library here, so one upstream release breaks one known place, and its test says
which (tests/_compat/).

* `transformers.py`: `GenerationMixin`'s `_prepare*` / `_get_*` helpers, `GenerationConfig`'s private members,
  `DynamicCache` layers' tensors, `Trainer`'s and transformers serve's private members. Part of the remote-code
  bundle (it reaches the decoder), so it imports only torch and transformers, the rest lazily.
* `accelerate.py`: `PartialState._shared_state`.
* `lm_eval.py`: lm-eval's `_cli`, `tasks._yaml_loader`, HFLM's private members.
* `evaluate.py`: replacing `evaluate.load` within a block.

Each seam module calls the private names in small functions (each with a comment naming the public alternative, or
why there is none) and declares every private member our code touches, including the private methods our subclasses
override or call on `self` (an override has to stay in its subclass, where the library calls it): `PRIVATE_MEMBERS`,
a tuple of `(owner, name, kind)` where owner is a dotted path (`module:Class` or a module), and kind is the
parameter names a method must still take (`"(self, body)"`), `ATTRIBUTE` for a class or module attribute, or
`SET_BY_OWNER` for an instance attribute the owner's code sets (`.name = ...`) or annotates (`name: type`).
`check_seam(module)` resolves every declaration against the installed library and raises `SeamBroken` naming the
seam, the member and what changed.

Outside this package, src/refusion_hf uses no other library's private name: tests/test_repository_layout.py's
`private_names_outside_seams` enforces it (ast), except `self.` / `cls.` accesses, which the seam declarations cover.
"""

from __future__ import annotations

import importlib
import inspect
import re

ATTRIBUTE = "attribute"
SET_BY_OWNER = "set by owner"


class SeamBroken(RuntimeError):
    """An installed library no longer has a private member one of the seams relies on, or its signature changed."""


def resolve(owner: str):
    """`package.module:Class.attr` (or a module path) to the object."""
    module_name, _, qualname = owner.partition(":")
    target = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        target = getattr(target, part)
    return target


def check_seam(seam) -> None:
    """Raise `SeamBroken` for the first declaration of `seam.PRIVATE_MEMBERS` the installed library breaks."""
    for owner, name, expected in seam.PRIVATE_MEMBERS:
        where = f"{seam.__name__}: {owner}.{name}"
        try:
            target = resolve(owner)
        except (ImportError, AttributeError) as error:
            raise SeamBroken(f"{where}: {owner} is gone ({error}); update the seam to the new layout") from None
        if expected == SET_BY_OWNER:
            if not re.search(rf"(\.|^[ \t]+){name}\s*(=|:)", inspect.getsource(target), flags=re.M):
                raise SeamBroken(f"{where}: {owner} no longer sets or declares `{name}`; update the seam")
            continue
        if not hasattr(target, name):
            raise SeamBroken(f"{where} is gone; update the seam (its comment names the public alternative)")
        if expected == ATTRIBUTE:
            continue
        parameters = "(" + ", ".join(inspect.signature(getattr(target, name)).parameters) + ")"
        if parameters != expected:
            raise SeamBroken(f"{where} now takes {parameters}, the seam expects {expected}; update the seam")


__all__ = ["ATTRIBUTE", "SET_BY_OWNER", "SeamBroken", "check_seam", "resolve"]
