import json

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, Qwen3Config

import refusion_hf
from refusion_hf import RefusionConfig, RefusionForCausalLM
from tests.tiny_models import tiny_refusion_model


def test_official_config_loads_with_mask_token(fixture_path):
    assert json.loads((fixture_path / "config.json").read_text())["model_type"] == "qwen3"
    config = RefusionConfig.from_pretrained(fixture_path)
    assert isinstance(config, Qwen3Config)
    assert config.mask_token_id == 3
    assert config.model_type == "refusion"
    assert config.to_dict()["model_type"] == "refusion"


def test_config_without_mask_token_loads_but_decoding_asks_for_it():
    model = tiny_refusion_model(eos_token_id=1)
    config = model.config
    assert config.mask_token_id is None
    with pytest.raises(ValueError, match=r"config.mask_token_id.*tokenizer.mask_token_id"):
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, slot_size=2)


def test_auto_classes_are_registered_on_import(fixture_path, tmp_path):
    assert isinstance(AutoConfig.for_model("refusion", mask_token_id=3), refusion_hf.RefusionConfig)
    model = RefusionForCausalLM.from_pretrained(fixture_path)
    model.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), RefusionConfig)
    # Dream / LLaDA users load diffusion LMs with AutoModel: they must get the LM-head model with generate().
    for auto in (AutoModel, AutoModelForCausalLM):
        loaded = auto.from_pretrained(tmp_path)
        assert type(loaded) is RefusionForCausalLM
        assert loaded.generate.__func__ is RefusionForCausalLM.generate
