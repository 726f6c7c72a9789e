"""Where models and prompts come from: the embedded default model's folder, and a prompt's token ids through the
tokenizer's chat template (the one encoding `refusion generate`, training data and the model card share; lm-eval
renders its own prompts). transformers does the work (`AutoTokenizer`, `apply_chat_template`)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_MODEL_RESOURCE = "assets/default_model"


def default_model_path() -> Path:
    """The small ReFusion model embedded in the package (what the commands use when no `--model` is given)."""
    return Path(str(resources.files("refusion_hf").joinpath(DEFAULT_MODEL_RESOURCE)))


def prompt_ids(tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids of a prompt (a user message, or chat messages), ending where the answer starts: through the chat
    template with the generation prompt when the tokenizer has one, else the text as it is. ValueError for
    messages without a chat template."""
    if tokenizer.chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(encoded["input_ids"])
    if isinstance(prompt, list):
        raise ValueError("chat messages need a chat template, but the tokenizer has none")
    return list(tokenizer(prompt)["input_ids"])
