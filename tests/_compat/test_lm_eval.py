"""The lm-eval seam (`refusion_hf._compat.lm_eval`) against the installed lm-eval."""

from refusion_hf._compat import check_seam
from refusion_hf._compat import lm_eval as seam
from tests._compat.seam_checks import (
    assert_each_declaration_fails_when_changed,
    our_classes,
    undeclared_private_members,
)


def test_declarations_hold_for_the_installed_lm_eval():
    check_seam(seam)


def test_each_declaration_fails_naming_the_seam_when_lm_eval_changes_it(monkeypatch):
    assert_each_declaration_fails_when_changed(seam, monkeypatch)


def test_every_private_member_our_subclasses_override_or_use_is_declared():
    assert not undeclared_private_members("lm_eval", seam.PRIVATE_MEMBERS, list(our_classes()))


def test_set_rank_is_what_hflm_reports():
    from lm_eval.models.huggingface import HFLM

    lm = HFLM.__new__(HFLM)
    seam.set_rank(lm, 3, 4)
    assert (lm.rank, lm.world_size) == (3, 4)
