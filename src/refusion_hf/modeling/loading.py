"""Where models and prompts come from: the embedded default model's folder, how the commands load a model (a dtype,
checks refused as `InputError`s naming the flag that gave the path), and a prompt's token ids through the
tokenizer's chat template (the one encoding `refusion generate`, training data and the model card share; lm-eval
renders its own prompts). transformers does the work (`AutoTokenizer`, `from_pretrained`, `apply_chat_template`)."""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..errors import InputError, first_line
from .checkpoint_checks import check_checkpoint_folder, check_tokenizer_files
from .remote_code import EMBEDDED_MODEL_RESOURCE


def default_model_path() -> Path:
    """The small ReFusion model embedded in the package (what the commands use when no `--model` is given). Its
    remote code and custom_generate/ are written by the package build (`remote_code.write_embedded_bundle`)."""
    return Path(str(resources.files("refusion_hf").joinpath(EMBEDDED_MODEL_RESOURCE)))


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


DTYPES = ("auto", "bfloat16", "float32", "float64")


def cpu_has_bfloat16_instructions(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes in bfloat16 natively (x86 `avx512_bf16` / `amx_bf16`, Arm `bf16`), read from
    /proc/cpuinfo; where that cannot be read, assume it does."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return True
    flags = set(text.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def load_model_and_tokenizer(model: str | None, dtype: str = "auto", option: str = "--model"):
    """The model (eval mode) and tokenizer. `dtype="auto"` keeps the checkpoint's own dtype (the embedded model is
    stored in bfloat16), except that a bfloat16 checkpoint runs in float32 on a CPU without bfloat16 instructions,
    where bfloat16 is emulated and slow (a note says so). Errors name `option`, the flag that gave the path."""
    from safetensors import SafetensorError

    from .modeling_refusion import RefusionForCausalLM

    if dtype not in DTYPES:
        raise InputError(f"--dtype must be one of {DTYPES}, got {dtype!r}.")
    source = str(model) if model else str(default_model_path())
    check_checkpoint_folder(source, option, dtype)
    check_tokenizer_files(source, option)
    try:
        # No code of the folder runs (its auto_map, a tokenizer auto_map, custom_generate/): the installed classes
        # load it, so decoding is always this package's.
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        loaded = RefusionForCausalLM.from_pretrained(
            source, dtype="auto" if dtype == "auto" else getattr(torch, dtype), trust_remote_code=False
        )
    except (OSError, ValueError, SafetensorError) as error:
        raise InputError(f"{option} {source}: the checkpoint does not load ({first_line(error)}).") from None
    bfloat16_on_cpu = dtype == "auto" and loaded.dtype == torch.bfloat16 and loaded.device.type == "cpu"
    if bfloat16_on_cpu and not cpu_has_bfloat16_instructions():  # /proc/cpuinfo read only when it decides
        print(
            "note: the checkpoint is bfloat16 but this CPU has no bfloat16 instructions: running in float32 "
            "(pass --dtype bfloat16 to keep bfloat16).",
            file=sys.stderr,
        )
        loaded = loaded.float()
    return loaded.eval(), tokenizer
