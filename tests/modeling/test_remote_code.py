"""Saved folders carry their own flat remote code and load where refusion_hf is not installed."""

import json

import pytest
import torch

from refusion_hf import RefusionForCausalLM
from refusion_hf.modeling import remote_code
from tests.bare_env import run_bare

PROMPT = [[61, 61, 33, 51, 20, 31, 13, 32, 23, 6, 13, 40]]
KNOBS = dict(max_new_tokens=24, slot_size=4, block_size=8, slot_threshold=0.6, token_threshold=0.3)


def test_save_writes_auto_map_and_flat_bundle(fixture_path, tmp_path):
    RefusionForCausalLM.from_pretrained(fixture_path).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "refusion"
    assert config["mask_token_id"] == 3
    assert config["auto_map"] == {
        "AutoConfig": "configuration_refusion.RefusionConfig",
        "AutoModel": "modeling_refusion.RefusionForCausalLM",
        "AutoModelForCausalLM": "modeling_refusion.RefusionForCausalLM",
    }
    written = sorted(p.name for p in tmp_path.glob("*.py"))
    assert {"configuration_refusion.py", "modeling_refusion.py", "batch_scheduler.py", "stages.py"} <= set(written)
    for path in [*tmp_path.glob("*.py"), *tmp_path.glob("custom_generate/*.py")]:
        first_line = path.read_text().splitlines()[0]
        assert first_line.startswith("# Generated from refusion_hf.") and "make embedded-bundle" in first_line, path
        for line in path.read_text().splitlines():
            statement = line.strip()
            assert not statement.startswith(("from ..", "from refusion_hf", "import refusion_hf")), line
            if statement.startswith("from ."):
                module = statement.split()[1][1:]
                assert (path.parent / f"{module}.py").exists(), f"{path.name} imports missing sibling {module}"


def test_flatten_rewrites_every_relative_form():
    source = "from ..generation.refusion_decoder import a\nfrom .configuration_refusion import b\n"
    assert remote_code.flatten_source(source) == (
        "from .refusion_decoder import a\nfrom .configuration_refusion import b\n"
    )


def test_export_refuses_imports_the_loader_cannot_follow(tmp_path, monkeypatch):
    package = tmp_path / "bundlepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bad.py").write_text("from . import other\nclass Thing: pass\n")
    (package / "other.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    from bundlepkg.bad import Thing

    with pytest.raises(remote_code.RemoteCodeExportError, match=r"from \. import"):
        remote_code.collect_bundle_modules(Thing)


def test_bare_environment_loads_and_generates_identically(fixture_path, tmp_path):
    model = RefusionForCausalLM.from_pretrained(fixture_path, dtype=torch.float64).eval()
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    ids = torch.tensor(PROMPT)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 11, 10, 9, 8]])
    expected_logits = model(input_ids=ids, position_ids=positions).logits
    expected_tokens = model.generate(ids, **KNOBS).tolist()

    result = run_bare(
        f"""
        import json, torch
        from transformers import AutoModel, AutoModelForCausalLM
        out = {{}}
        for name, auto in (("AutoModel", AutoModel), ("AutoModelForCausalLM", AutoModelForCausalLM)):
            model = auto.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.float64).eval()
            assert "refusion_hf" not in type(model).__module__
            ids = torch.tensor({PROMPT})
            positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 11, 10, 9, 8]])
            out[name] = dict(
                cls=type(model).__name__,
                module=type(model).__module__,
                logits=model(input_ids=ids, position_ids=positions).logits.tolist(),
                tokens=model.generate(ids, **{KNOBS!r}).tolist(),
                slot_size=model.generation_config.slot_size,
            )
        print(json.dumps(out))
        """,
        tmp_path,
    )
    for name in ("AutoModel", "AutoModelForCausalLM"):
        got = result[name]
        assert got["cls"] == "RefusionForCausalLM" and got["module"].startswith("transformers_modules")
        assert torch.equal(torch.tensor(got["logits"], dtype=torch.float64), expected_logits)
        assert got["tokens"] == expected_tokens
        assert got["slot_size"] == model.generation_config.slot_size


def test_embedded_model_folder_carries_the_current_bundle(tmp_path):
    """The embedded folder's remote code and custom_generate/ are exactly what save_pretrained writes today
    (refresh them with `make embedded-bundle`)."""
    from refusion_hf.modeling.loading import default_model_path

    embedded = default_model_path()
    RefusionForCausalLM.from_pretrained(embedded).save_pretrained(tmp_path)
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.suffix in (".py", ".txt"))
    shipped = sorted(str(p.relative_to(embedded)) for p in embedded.rglob("*") if p.suffix in (".py", ".txt"))
    assert written == shipped
    stale = [name for name in written if (tmp_path / name).read_text() != (embedded / name).read_text()]
    assert not stale, f"run `make embedded-bundle`: {stale} differ from what save_pretrained writes"
    assert (
        json.loads((embedded / "config.json").read_text())["auto_map"]
        == json.loads((tmp_path / "config.json").read_text())["auto_map"]
    )


def test_embedded_model_loads_anywhere(tmp_path):
    from refusion_hf.modeling.loading import default_model_path

    embedded = default_model_path()
    model = RefusionForCausalLM.from_pretrained(embedded, dtype=torch.float32).eval()
    ids = [[1, 372, 285, 44, 300, 10]]  # token ids of the embedded vocabulary (770 tokens)
    expected = model.generate(torch.tensor(ids), max_new_tokens=16).tolist()
    result = run_bare(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(embedded)!r}, trust_remote_code=True, dtype=torch.float32)
        assert type(model).__module__.startswith("transformers_modules")
        print(json.dumps(model.eval().generate(torch.tensor({ids}), max_new_tokens=16).tolist()))
        """,
        tmp_path,
    )
    assert result == expected
