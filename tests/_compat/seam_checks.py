"""What every seam test checks (tests/_compat/test_<library>.py): the seam's declarations hold for the installed
library, each declaration fails with a message naming the seam when the library changes it, and every private
member of that library our classes override or call on `self` is declared in the seam."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import re
import textwrap

import pytest

import refusion_hf
from refusion_hf import _compat
from refusion_hf._compat import ATTRIBUTE, SET_BY_OWNER, SeamBroken, check_seam, resolve


def declarations(seam) -> list[tuple[str, str, str]]:
    return list(seam.PRIVATE_MEMBERS)


def break_member(monkeypatch, owner: str, name: str, kind: str) -> str:
    """Change the installed library so that this declaration no longer holds; returns the message part expected."""
    target = resolve(owner)
    if kind == SET_BY_OWNER:
        real = inspect.getsource
        monkeypatch.setattr(  # the owner's source, with the attribute renamed
            _compat.inspect,
            "getsource",
            lambda obj: real(obj).replace(name, f"{name}_renamed") if obj is target else real(obj),
        )
        return "no longer sets or declares"
    if kind == ATTRIBUTE:
        holders = [c for c in inspect.getmro(target) if name in vars(c)] if inspect.isclass(target) else [target]
        for holder in holders:  # every class of the MRO that defines it
            monkeypatch.delattr(holder, name)
        return "is gone"
    monkeypatch.setattr(target, name, lambda self, renamed_argument: None)  # a method whose signature changed
    return "now takes"


def assert_each_declaration_fails_when_changed(seam, monkeypatch) -> None:
    """Break each declaration in turn (the library object patched): `check_seam` names the seam and the member."""
    assert declarations(seam), f"{seam.__name__} declares nothing"
    for owner, name, kind in declarations(seam):
        with monkeypatch.context() as patch:
            expected = break_member(patch, owner, name, kind)
            with pytest.raises(SeamBroken) as raised:
                check_seam(seam)
        message = str(raised.value)
        assert message.startswith(f"{seam.__name__}: {owner}.{name}"), message
        assert expected in message, message


# ----------------------------------------------------------------------------------------------- coverage
# modules that subclass an engine installed in its own environment (`make sglang`), with the engine they import
ENGINE_MODULES = {"refusion_hf.serving.sglang_algorithm": "sglang", "refusion_hf.serving.sglang_attention": "sglang"}


def our_classes():
    """Every class defined in src/refusion_hf (the generated bundle copies under assets/ excluded; an engine's module
    only where that engine is installed)."""
    for info in pkgutil.walk_packages(refusion_hf.__path__, "refusion_hf."):
        if ".assets" in info.name or info.name.startswith("refusion_hf._compat"):
            continue
        if info.name in ENGINE_MODULES and importlib.util.find_spec(ENGINE_MODULES[info.name]) is None:
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                yield value


def _library(cls) -> str:
    return cls.__module__.partition(".")[0]


def _self_attributes(cls) -> set[str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return set()
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
    }


def _defined_in_body(cls) -> set[str]:
    """The names the class statement itself defines (methods, assigned attributes): not what a library caches on
    the class later (transformers sets `_can_set_*_cached_value` on model classes when it builds them)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return set(vars(cls))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


def undeclared_private_members(library: str, seam_declarations, classes) -> list[str]:
    """`Class._name` for each private member of `library`'s classes that a class of ours (subclassing one) defines
    or reads on `self` / `cls`, and that `seam_declarations` does not name."""
    declared = {name for _, name, _ in seam_declarations}
    found = set()
    for cls in classes:
        theirs = [base for base in cls.__mro__ if _library(base) == library]
        if not theirs:
            continue
        ours = [base for base in cls.__mro__ if base.__module__.startswith(("refusion_hf.", "tests."))]
        names = {name for base in ours for name in _defined_in_body(base)} | _self_attributes(cls)
        for name in names:
            if not re.fullmatch(r"_[A-Za-z]\w*", name) or name in declared or name == "_abc_impl":
                continue
            if any(name in vars(base) for base in theirs):
                found.add(f"{cls.__qualname__}.{name}")
    return sorted(found)
