# Generated from refusion_hf.generation.custom_generate by refusion_hf.modeling.remote_code (save_pretrained writes it; `make embedded-bundle` refreshes the embedded model's copy): edit the source, not this file.
"""The `custom_generate/generate.py` every folder of this package carries: ReFusion decoding for stock models.

transformers loads it with `model.generate(**inputs, custom_generate=DIR_OR_REPO, trust_remote_code=True)` (and,
for a folder loaded with `trust_remote_code=True`, as the model's `generate`), so a stock `Qwen3ForCausalLM`
loaded from an official ReFusion checkpoint decodes with ReFusion where this package is not installed. It is
exported, flattened with its siblings, by `modeling/remote_code.write_custom_generate`: the same code as
`RefusionForCausalLM.generate`, so the same arguments give the same tokens.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import torch

from .refusion_generate import refusion_generate


@torch.no_grad()
def generate(*args, model=None, **kwargs):
    """`generate(model, ...)` with stock `GenerationMixin.generate` arguments. transformers passes the model as
    the keyword `model=` (both when it runs `custom_generate=` and when it binds this function as a loaded
    folder's `generate`); a positional first argument works too."""
    if model is None:
        if not args:
            raise ValueError("custom_generate's generate() needs the model: generate(model, input_ids, ...).")
        model, *args = args
    return refusion_generate(model, *args, **kwargs)
