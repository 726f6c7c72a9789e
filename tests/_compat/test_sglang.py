"""The SGLang seam (`refusion_hf._compat.sglang`) against the installed SGLang; runs in .venv-sglang
(`make test-sglang`), skipped where SGLang is not installed."""

import pytest

pytest.importorskip("sglang")

from refusion_hf._compat import check_seam  # noqa: E402
from refusion_hf._compat import sglang as seam  # noqa: E402
from tests._compat.seam_checks import (  # noqa: E402
    assert_each_declaration_fails_when_changed,
    undeclared_private_members,
)


def test_installed_sglang_is_in_the_supported_range():
    assert seam.installed_version_supported()


def test_declarations_hold_for_the_installed_sglang():
    check_seam(seam)


def test_each_declaration_fails_naming_the_seam_when_sglang_changes_it(monkeypatch):
    assert_each_declaration_fails_when_changed(seam, monkeypatch)


def test_every_private_member_our_algorithm_and_attention_backend_override_or_use_is_declared():
    from refusion_hf.serving.sglang_algorithm import ReFusion
    from refusion_hf.serving.sglang_attention import MaskedTorchNativeAttnBackend

    assert not undeclared_private_members("sglang", seam.PRIVATE_MEMBERS, [ReFusion, MaskedTorchNativeAttnBackend])


def test_add_attention_backend_makes_the_name_a_choice_and_builds_ours(monkeypatch):
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention import attention_registry

    monkeypatch.setattr(choices, "ATTENTION_BACKEND_CHOICES", list(choices.ATTENTION_BACKEND_CHOICES))
    monkeypatch.setattr(choices, "add_attention_backend_choices", choices.ATTENTION_BACKEND_CHOICES.extend)
    monkeypatch.setattr(attention_registry, "ATTENTION_BACKENDS", dict(attention_registry.ATTENTION_BACKENDS))
    factory = object()
    seam.add_attention_backend("refusion_test_backend", factory)
    assert "refusion_test_backend" in choices.ATTENTION_BACKEND_CHOICES
    assert attention_registry.ATTENTION_BACKENDS["refusion_test_backend"] is factory


def test_add_algorithm_makes_the_algorithm_name_resolve(monkeypatch):
    from sglang.srt.dllm import algorithm

    from refusion_hf.serving.sglang_algorithm import ReFusion

    monkeypatch.delitem(algorithm.algo_name_to_cls, "ReFusion", raising=False)
    seam.add_algorithm(ReFusion)
    assert algorithm.get_algorithm_cls("ReFusion") is ReFusion


def test_add_model_architecture_reaches_sglangs_model_table(monkeypatch):
    from sglang.srt.models.registry import ModelRegistry

    marker = type("Marker", (), {})
    monkeypatch.setitem(ModelRegistry.models, "RefusionTestArchitecture", marker)
    seam.add_model_architecture("RefusionTestArchitecture", marker)
    assert ModelRegistry.models["RefusionTestArchitecture"] is marker


def test_return_full_logits_sets_what_sglangs_diffusion_path_reads():
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessor

    # constructed without SGLang's runtime context (its __init__ reads the published parallel config)
    processor = LogitsProcessor.__new__(LogitsProcessor)
    torch.nn.Module.__init__(processor)
    processor.return_full_logits = False
    seam.return_full_logits(processor)
    assert processor.return_full_logits


def test_serve_runs_sglangs_serve_command_with_the_arguments(capsys):
    """`seam.serve(argv)` is `sglang serve ARGV...`: asked for help, it prints SGLang's launch flags (the ones
    `refusion serve --engine sglang` builds among them) and returns without starting anything."""
    seam.serve(["--model-type", "llm", "--help"])
    printed = capsys.readouterr().out
    for flag in ("--dllm-algorithm", "--dllm-algorithm-config", "--max-running-requests", "--context-length"):
        assert flag in printed
