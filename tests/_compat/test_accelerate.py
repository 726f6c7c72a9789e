"""The accelerate seam (`refusion_hf._compat.accelerate`) against the installed accelerate."""

from refusion_hf._compat import accelerate as seam
from refusion_hf._compat import check_seam
from tests._compat.seam_checks import (
    assert_each_declaration_fails_when_changed,
    our_classes,
    undeclared_private_members,
)


def test_declarations_hold_for_the_installed_accelerate():
    check_seam(seam)


def test_each_declaration_fails_naming_the_seam_when_accelerate_changes_it(monkeypatch):
    assert_each_declaration_fails_when_changed(seam, monkeypatch)


def test_every_private_member_our_subclasses_override_or_use_is_declared():
    assert not undeclared_private_members("accelerate", seam.PRIVATE_MEMBERS, list(our_classes()))


def test_set_shared_distributed_type_reaches_every_state(monkeypatch):
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    monkeypatch.setitem(PartialState._shared_state, "distributed_type", DistributedType.NO)
    seam.set_shared_distributed_type(DistributedType.FSDP)
    assert PartialState._shared_state["distributed_type"] == DistributedType.FSDP
