# Generated from refusion_hf.modeling.configuration_refusion by refusion_hf.modeling.remote_code (save_pretrained writes it; `make embedded-bundle` refreshes the embedded model's copy): edit the source, not this file.
"""`RefusionConfig`: a Qwen3 configuration plus the id of the mask token.

Official ReFusion checkpoints are stock Qwen3 checkpoints (`model_type: qwen3`) whose config.json carries a
`mask_token_id`; they load through this class unchanged and are saved back with `model_type: refusion`.

This module is part of the self-contained remote-code bundle (see `remote_code.py`): it may import only the
standard library, torch, transformers and its bundle siblings.
"""

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config

OFFICIAL_MODEL_TYPE = "qwen3"
# The sizes that shape the network (`RefusionConfig.validate_sizes`).
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


@strict
class RefusionConfig(Qwen3Config):
    r"""
    Configuration of a ReFusion model: every field of [`Qwen3Config`] plus

    mask_token_id (`int`, *optional*):
        Id of the `<|mask|>` token that marks undecoded positions, both in training (masked slots) and in
        decoding (the canvas). A config without it loads, but decoding and ReFusion training raise an error
        asking for it.
    """

    model_type = "refusion"

    mask_token_id: int | None = None

    def __post_init__(self, **kwargs):
        # An official checkpoint's `model_type: qwen3` arrives as an instance attribute through `from_dict`;
        # the class attribute is the truth for this class (saved configs say `refusion`).
        self.__dict__.pop("model_type", None)
        super().__post_init__(**kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") == OFFICIAL_MODEL_TYPE:
            # Official ReFusion format: a Qwen3 config with a mask token. Same architecture, same weight names.
            config_dict = {**config_dict, "model_type": cls.model_type}
        return config_dict, kwargs

    def validate_sizes(self):
        """Part of `@strict` validation, so every load path runs it before any layer is built (`@strict` already
        refuses a float or a string size): the sizes that shape the network are integers >= 1, the query heads
        share the key/value heads evenly, and the mask id is a row of the embedding matrix. Stock Qwen3Config
        accepts a negative vocabulary or zero heads and fails later, inside the model."""
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value}")
        if self.num_key_value_heads is not None and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            last = self.vocab_size - 1
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0 .. {last})")

    def require_mask_token_id(self, purpose: str) -> int:
        """The mask token id, or a `ValueError` that says how to set it."""
        if self.mask_token_id is None:
            raise ValueError(
                f"{purpose} needs a mask token, but `config.mask_token_id` is not set. Set it to the id of "
                "`<|mask|>` (e.g. `model.config.mask_token_id = tokenizer.mask_token_id`), or pass "
                "`mask_token_id=` explicitly; `refusion convert` adds the token to an autoregressive checkpoint."
            )
        return self.mask_token_id


__all__ = ["RefusionConfig"]
