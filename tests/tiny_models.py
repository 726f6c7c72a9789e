"""Randomly initialised tiny models for tests that need a config the fixture does not have: a ReFusion model, and
the stock Qwen3 causal LM with the same config (for what must hold for stock transformers models)."""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from refusion_hf import RefusionConfig, RefusionForCausalLM

TINY_CONFIG = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}


def tiny_refusion_model(seed: int = 0, **config_overrides) -> RefusionForCausalLM:
    torch.manual_seed(seed)
    return RefusionForCausalLM(RefusionConfig(**{**TINY_CONFIG, **config_overrides})).eval()


def tiny_qwen3_model(seed: int = 0, **config_overrides) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**{**TINY_CONFIG, **config_overrides})).eval()
