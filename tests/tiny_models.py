"""A randomly initialised one-layer ReFusion model for tests that need a config the fixture does not have."""

import torch

from refusion_hf import RefusionConfig, RefusionForCausalLM


def tiny_refusion_model(seed: int = 0, **config_overrides) -> RefusionForCausalLM:
    config = RefusionConfig(
        **{
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            **config_overrides,
        }
    )
    torch.manual_seed(seed)
    return RefusionForCausalLM(config).eval()
