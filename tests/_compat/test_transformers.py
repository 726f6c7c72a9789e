"""The transformers seam (`refusion_hf._compat.transformers`) against the installed transformers."""

import pytest
import torch
from transformers import DynamicCache, Trainer

from refusion_hf._compat import SeamBroken, check_seam
from refusion_hf._compat import transformers as seam
from tests._compat.seam_checks import (
    assert_each_declaration_fails_when_changed,
    our_classes,
    undeclared_private_members,
)


def test_declarations_hold_for_the_installed_transformers():
    check_seam(seam)


def test_each_declaration_fails_naming_the_seam_when_transformers_changes_it(monkeypatch):
    assert_each_declaration_fails_when_changed(seam, monkeypatch)


def test_a_moved_module_fails_naming_the_seam(monkeypatch):
    monkeypatch.setattr(seam, "PRIVATE_MEMBERS", (("transformers.no_such_module:Trainer", "_save_checkpoint", "()"),))
    with pytest.raises(SeamBroken, match=r"^refusion_hf\._compat\.transformers: transformers\.no_such_module:Trainer"):
        check_seam(seam)


def test_every_private_member_our_subclasses_override_or_use_is_declared():
    assert not undeclared_private_members("transformers", seam.PRIVATE_MEMBERS, list(our_classes()))


class PlantedTrainer(Trainer):
    """An undeclared override, and an undeclared private method called on `self`."""

    def _save_checkpoint(self, model, trial):
        return self._get_output_dir(trial)


def test_the_coverage_check_finds_an_undeclared_override_and_self_use():
    found = undeclared_private_members("transformers", (), [PlantedTrainer])
    assert found == ["PlantedTrainer._get_output_dir", "PlantedTrainer._save_checkpoint"]
    assert not undeclared_private_members("transformers", seam.PRIVATE_MEMBERS, [PlantedTrainer])


def test_map_cache_tensors_replaces_every_layers_keys_and_values():
    cache = DynamicCache()
    other = DynamicCache()
    for layer in range(2):
        cache.update(torch.zeros(1, 1, 2, 4), torch.ones(1, 1, 2, 4), layer)
        other.update(torch.full((1, 1, 2, 4), 2.0), torch.full((1, 1, 2, 4), 3.0), layer)
    seam.map_cache_tensors(cache, lambda mine, theirs: torch.cat([mine, theirs]), other)
    for layer in cache.layers:
        assert layer.keys.shape == (2, 1, 2, 4) and layer.keys[1].eq(2).all() and layer.values[1].eq(3).all()
    assert cache.get_seq_length() == 2
