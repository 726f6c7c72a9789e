"""The published folder where `refusion_hf` cannot be imported (only torch + transformers): it loads through
`AutoModelForCausalLM` and `AutoModel` with `trust_remote_code=True`, and `generate()` there returns exactly the
tokens the package returns on the original checkpoint, with the same knobs; the card's usage snippet runs there
and prints the package's answer."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from refusion_hf import RefusionForCausalLM
from tests.bare_env import run_bare

from .conftest import EXAMPLE_PROMPT, FIXTURE, PUBLISHED_DEFAULTS
from .test_card import usage_snippet

PROMPTS = [EXAMPLE_PROMPT, "t9 t10"]
KNOBS = {"slot_size": 4, "block_size": None, "slot_threshold": 0.5, "token_threshold": 0.2}

BARE_SCRIPT = """
import contextlib, io, json, re, sys
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

folder, prompts, knobs, snippet = FOLDER, PROMPTS, KNOBS, SNIPPET
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
left = AutoTokenizer.from_pretrained(folder, padding_side="left", trust_remote_code=True)
ids = tokenizer(prompts[0], return_tensors="pt").input_ids
result = {}
for name, auto in (("AutoModelForCausalLM", AutoModelForCausalLM), ("AutoModel", AutoModel)):
    model = auto.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    defaults = model.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
    tuned = model.generate(ids, max_new_tokens=40, return_dict_in_generate=True, **knobs)
    batch = left(prompts, return_tensors="pt", padding=True)
    result[name] = {
        "class": type(model).__module__ + "." + type(model).__name__,
        "defaults": [defaults.sequences.tolist(), defaults.num_forward_passes],
        "knobs": [tuned.sequences.tolist(), tuned.num_forward_passes],
        "batch": model.generate(**batch, max_new_tokens=24).tolist(),
        "autoregressive": model.generate(ids, max_new_tokens=24, decoding="autoregressive").tolist(),
    }
code = re.sub(r"^model_id = .*$", "model_id = " + json.dumps(folder), snippet, flags=re.M)
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    exec(compile(code, "card_snippet", "exec"), {})
result["snippet"] = printed.getvalue()
result["refusion_hf_imported"] = sorted(name for name in sys.modules if name.startswith("refusion_hf"))
print(json.dumps(result))
"""


def _script(folder, snippet) -> str:
    values = {"FOLDER": str(folder), "PROMPTS": PROMPTS, "KNOBS": KNOBS, "SNIPPET": snippet}
    return "".join(f"{name} = {value!r}\n" for name, value in values.items()) + BARE_SCRIPT


def test_published_folder_generates_the_package_tokens_without_the_package(published, tmp_path, monkeypatch):
    text = (published.folder / "README.md").read_text()
    snippet = usage_snippet(text)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as in this process (conftest): tiny model, shared machine
    bare = run_bare(_script(published.folder, snippet), tmp_path)
    assert bare["refusion_hf_imported"] == []

    # What the package returns on the *original* (official-format) checkpoint, same prompts and knobs.
    model = RefusionForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    left = AutoTokenizer.from_pretrained(FIXTURE, padding_side="left")
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    defaults = model.generate(ids, return_dict_in_generate=True, **{**PUBLISHED_DEFAULTS, "max_new_tokens": 40})
    tuned = model.generate(ids, max_new_tokens=40, return_dict_in_generate=True, **KNOBS)
    batch = left(PROMPTS, return_tensors="pt", padding=True)
    expected = {
        "defaults": [defaults.sequences.tolist(), defaults.num_forward_passes],
        "knobs": [tuned.sequences.tolist(), tuned.num_forward_passes],
        "batch": model.generate(**batch, **{**PUBLISHED_DEFAULTS, "max_new_tokens": 24}).tolist(),
        "autoregressive": model.generate(ids, max_new_tokens=24, decoding="autoregressive").tolist(),
    }
    assert expected["defaults"] != expected["knobs"]  # the knobs matter, so the comparison can tell them apart
    for auto in ("AutoModelForCausalLM", "AutoModel"):
        entry = bare[auto]
        assert entry["class"].startswith("transformers_modules.") and entry["class"].endswith(".RefusionForCausalLM")
        for key, value in expected.items():
            assert entry[key] == value, (auto, key)

    # The card's snippet (defaults from the saved generation config) prints the package's answer and pass count.
    assert "max_new_tokens=48," in snippet
    reference = model.generate(ids, return_dict_in_generate=True, **PUBLISHED_DEFAULTS)
    lines = bare["snippet"].splitlines()
    assert lines[0] == tokenizer.decode(reference.sequences[0, ids.shape[1] :], skip_special_tokens=True)
    assert lines[1].startswith(f"{reference.num_forward_passes} forward passes, ")
