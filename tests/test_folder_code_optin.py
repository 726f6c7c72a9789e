"""No code of a model folder runs unless the user opts in (`trust_remote_code=True`), as in transformers: every load
path of the package (each command, the `refusion` lm-eval model, a pipeline over our model) on a folder whose every
`.py` writes a marker file when imported (tests/official_layout.py: the official `auto_map`'s configuration and
modeling files, a tokenizer `auto_map`'s file, `custom_generate/generate.py`). The markers are first shown to
appear when transformers is told to run that code."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from refusion_hf import RefusionForCausalLM
from refusion_hf.cli import main
from refusion_hf.evaluation.lm_eval_model import RefusionLM
from refusion_hf.modeling.loading import load_model_and_tokenizer
from tests.official_layout import (
    MASK_ID,
    OFFICIAL_CODE_IMPORTS,
    build_marker_folder,
    build_official_layout,
    markers,
)
from tests.training.toy import write_toy_jsonl

UNREGISTERED = "marker_model_type"  # a model_type transformers does not know: it would look for the auto_map's code


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (tests/conftest.py)


@pytest.fixture
def marker_dir(tmp_path):
    (tmp_path / "markers").mkdir()
    return tmp_path / "markers"


def folder(tmp_path, marker_dir, model_type: str = "qwen3"):
    # A folder name of its own: transformers caches a folder's remote code under its name, imported once per process.
    return build_marker_folder(tmp_path / f"{tmp_path.name}_{model_type}", marker_dir, model_type=model_type)


def test_the_markers_appear_when_transformers_runs_the_folder_code(tmp_path, marker_dir):
    official = folder(tmp_path, marker_dir)
    if OFFICIAL_CODE_IMPORTS:  # transformers 5.25: the folder's 4.52 code imports again, and loads its generate too
        AutoModelForCausalLM.from_pretrained(official, trust_remote_code=True)  # the official card's snippet
        assert {"configuration_qwen3.py", "modeling_qwen3_refusion.py"} <= set(markers(marker_dir))
    else:
        with pytest.raises(ModuleNotFoundError, match="transformers.modeling_attn_mask_utils"):
            AutoModelForCausalLM.from_pretrained(official, trust_remote_code=True)  # the official card's snippet
        assert markers(marker_dir) == ["configuration_qwen3.py", "modeling_qwen3_refusion.py"]
    AutoTokenizer.from_pretrained(official, trust_remote_code=True)
    assert "tokenization_marker.py" in markers(marker_dir)
    # transformers runs custom_generate/ in place of generate() for any class loaded with trust_remote_code=True,
    # ours included: what the `refusion` lm-eval model used to do by default.
    model = RefusionForCausalLM.from_pretrained(official, trust_remote_code=True)
    assert "custom_generate__generate.py" in markers(marker_dir)
    with pytest.raises(RuntimeError, match="custom_generate ran"):
        model.generate(torch.tensor([[4, 5]]), max_new_tokens=2)


@pytest.mark.parametrize("model_type", ["qwen3", "refusion", UNREGISTERED])
def test_the_refusion_lm_eval_model_runs_no_folder_code(tmp_path, marker_dir, model_type):
    """As lm-eval's CLI builds it (`--model_args pretrained=DIR`): our class, its own generate(), no marker."""
    path = folder(tmp_path, marker_dir, model_type)
    lm = RefusionLM.create_from_arg_string(f"pretrained={path},device=cpu")
    assert type(lm.model) is RefusionForCausalLM and lm.model.config.mask_token_id == MASK_ID
    assert "generate" not in vars(lm.model), "generate() is the installed class's, not a folder's custom_generate"
    assert markers(marker_dir) == []


def test_trust_remote_code_reaches_the_tokenizer_only(tmp_path, marker_dir):
    path = folder(tmp_path, marker_dir)
    with pytest.warns(UserWarning, match="reaches the tokenizer only"):
        lm = RefusionLM.create_from_arg_string(f"pretrained={path},device=cpu,trust_remote_code=True")
    assert type(lm.model) is RefusionForCausalLM and "generate" not in vars(lm.model)
    assert markers(marker_dir) == ["configuration_qwen3.py", "tokenization_marker.py"]  # AutoTokenizer's doing


def test_commands_run_no_folder_code(tmp_path, marker_dir, capsys):
    """generate, eval, publish, convert, train (full and LoRA) on the marker folder: each succeeds without running a
    line of the folder's code (no marker)."""
    path = str(folder(tmp_path, marker_dir))
    data = str(write_toy_jsonl(tmp_path / "toy.jsonl", count=4))
    clean_tokenizer = str(build_official_layout(tmp_path / "official"))
    train = ["--data", data, "--max-steps", "1", "--save-strategy", "no", "--slot-sizes", "2", "--disable-tqdm", "true"]
    commands = {
        "generate": ["generate", "t8 t9", "--model", path, "--max-new-tokens", "4"],
        "eval": ["eval", "--model", path, "--limit", "1", "--max-new-tokens", "4", "--decodings", "refusion"],
        # publish refuses a tokenizer auto_map (it would publish another tokenizer): the same tokenizer without it
        "publish": ["publish", "--model", path, "--out", str(tmp_path / "published"), "--tokenizer", clean_tokenizer],
        "convert": ["convert", "--base", path, "--out", str(tmp_path / "converted")],
        "train": ["train", "--model", path, "--output-dir", str(tmp_path / "full"), *train],
        "train --lora": ["train", "--model", path, "--output-dir", str(tmp_path / "lora"), *train, "--lora"],
    }
    for name, argv in commands.items():
        capsys.readouterr()
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 0, (name, err)
        assert markers(marker_dir) == [], name


def test_loading_helpers_and_pipeline_run_no_folder_code(tmp_path, marker_dir):
    path = folder(tmp_path, marker_dir)
    model, tokenizer = load_model_and_tokenizer(str(path), "float32")
    assert type(model) is RefusionForCausalLM and "generate" not in vars(model)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    generator("t8 t9", max_new_tokens=4, do_sample=False)
    assert markers(marker_dir) == []
