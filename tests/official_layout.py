"""Model folders laid out like the official ReFusion checkpoint on the Hub, built from the tiny fixture checkpoint
(tests/data/tiny-qwen3-refusion) by our own code (nothing here is copied from the authors' repository).

`build_official_layout(out)` writes what the official repository's config.json and files look like (the Hub
repository `GSAI-ML/ReFusion`, https://huggingface.co/GSAI-ML/ReFusion/tree/main; every fact used is stated here):
`model_type: qwen3`, `architectures: ["Qwen3ForCausalLM"]`, the official `auto_map` pointing at
`configuration_qwen3.py` and `modeling_qwen3_refusion.py` (remote code written for transformers 4.52: the modeling
file imports `transformers.modeling_attn_mask_utils`, which transformers 5 no longer has, so loading it fails
exactly as the real one does), `use_cache: false`,
`transformers_version: 4.52.4`, a chat template, and the special tokens at the end of the vocabulary as in Qwen3's
(`<|endoftext|>`, `<|im_end|>` = eos, `<|beginoftext|>` = bos, `<|mask|>` last).

The fixture's tokens are only renumbered (`OFFICIAL_IDS`): the embedding and LM-head rows move with their tokens,
so the folder is the same network as the fixture, and a decoding of it equals the fixture's decoding with every id
mapped through `to_official`.

`python -m tests.official_layout OUT` writes the official-layout folder into OUT (for a check by hand).

`build_marker_folder(out, marker_dir, model_type=...)` is the same folder in which every `.py` a loader could run
(the auto_map's configuration and modeling files, a tokenizer named by a tokenizer `auto_map`, and
`custom_generate/generate.py`) first writes a file named after itself into `marker_dir` when it is imported: a load
path ran folder code exactly when `marker_dir` is not empty.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.oracle import FIXTURE

FIXTURE_VOCAB = 64
# The official folder's remote code (written for transformers 4.52) imports transformers.modeling_attn_mask_utils:
# transformers 5.19 to 5.24 lack that module, so the folder's code fails to import; 5.25 has it again, and it loads.
OFFICIAL_CODE_IMPORTS = importlib.util.find_spec("transformers.modeling_attn_mask_utils") is not None
# The fixture's special tokens (ids 0-3: <|endoftext|>, <|im_end|>, <|beginoftext|>, <|mask|>) move to the end of
# the vocabulary in that order; the 60 word tokens t4..t63 move to the front.
OFFICIAL_IDS = [*range(FIXTURE_VOCAB - 4, FIXTURE_VOCAB), *range(0, FIXTURE_VOCAB - 4)]  # fixture id -> official id
PAD_ID, EOS_ID, BOS_ID, MASK_ID = OFFICIAL_IDS[:4]  # 60, 61, 62, 63

OFFICIAL_AUTO_MAP = {
    "AutoConfig": "configuration_qwen3.Qwen3Config",
    "AutoModel": "modeling_qwen3_refusion.Qwen3ForCausalLM",
    "AutoModelForCausalLM": "modeling_qwen3_refusion.Qwen3ForCausalLM",
}

# Qwen3's template in the fixture's words (the tokenizer splits on whitespace; t4 opens a turn, t5 / t6 / t7 are
# the system / user / assistant roles).
CHAT_TEMPLATE = (
    "{% set roles = {'system': 't5', 'user': 't6', 'assistant': 't7'} %}"
    "{% for message in messages %}t4 {{ roles[message['role']] }} {{ message['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}t4 t7 {% endif %}"
)

CONFIGURATION_CODE = '''"""Qwen3 configuration (remote code of the official-layout test folder)."""

from transformers import Qwen3Config as _Qwen3Config


class Qwen3Config(_Qwen3Config):
    model_type = "qwen3"
'''

# The official modeling file was written for transformers 4.52; this is the import that fails on transformers 5.
MODELING_CODE = '''"""Qwen3 with ReFusion decoding (official-layout test folder; written for transformers 4.52)."""

from transformers.modeling_attn_mask_utils import AttentionMaskConverter  # removed in transformers 5
from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM as _Qwen3ForCausalLM


class Qwen3ForCausalLM(_Qwen3ForCausalLM):
    mask_converter = AttentionMaskConverter
'''

TOKENIZATION_CODE = '''"""A tokenizer named by the tokenizer_config.json auto_map (marker test folder)."""

from transformers import PreTrainedTokenizerFast


class MarkerTokenizer(PreTrainedTokenizerFast):
    pass
'''

CUSTOM_GENERATE_CODE = '''"""A custom generate method (marker test folder): run in place of `generate`."""


def generate(*args, **kwargs):
    raise RuntimeError("the marker folder's custom_generate ran")
'''


def to_official(ids):
    """Fixture token ids -> the official-layout folder's ids (a list, or nested lists)."""
    if isinstance(ids, int):
        return OFFICIAL_IDS[ids]
    return [to_official(i) for i in ids]


def build_official_layout(out: Path) -> Path:
    """The fixture checkpoint as the official repository lays it out (see the module docstring), in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(FIXTURE / "model.safetensors"))
    order = sorted(range(FIXTURE_VOCAB), key=OFFICIAL_IDS.__getitem__)  # official id -> fixture id
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][order].contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(
        auto_map=OFFICIAL_AUTO_MAP, use_cache=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        mask_token_id=MASK_ID, transformers_version="4.52.4",
    )  # fmt: skip
    _write_json(out / "config.json", config)
    generation = json.loads((FIXTURE / "generation_config.json").read_text())
    generation.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    _write_json(out / "generation_config.json", generation)

    tokenizer = json.loads((FIXTURE / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokenizer["model"]["vocab"] = dict(sorted(((t, OFFICIAL_IDS[i]) for t, i in vocab.items()), key=lambda x: x[1]))
    tokenizer["added_tokens"] = [{**added, "id": OFFICIAL_IDS[added["id"]]} for added in tokenizer["added_tokens"]]
    _write_json(out / "tokenizer.json", tokenizer)
    tokenizer_config = json.loads((FIXTURE / "tokenizer_config.json").read_text())
    tokenizer_config["added_tokens_decoder"] = {
        str(OFFICIAL_IDS[int(i)]): token for i, token in tokenizer_config["added_tokens_decoder"].items()
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    shutil.copy(FIXTURE / "special_tokens_map.json", out / "special_tokens_map.json")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    (out / "configuration_qwen3.py").write_text(CONFIGURATION_CODE)
    (out / "modeling_qwen3_refusion.py").write_text(MODELING_CODE)
    return out


def build_marker_folder(out: Path, marker_dir: Path, model_type: str = "qwen3") -> Path:
    """The official-layout folder (with `model_type` in config.json: an unregistered one makes transformers look
    for the auto_map's code), plus a tokenizer `auto_map` and `custom_generate/generate.py`, every `.py` of which
    writes `marker_dir/<its name>` when imported."""
    out = build_official_layout(out)
    config = json.loads((out / "config.json").read_text())
    _write_json(out / "config.json", {**config, "model_type": model_type})
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    # tokenizer_class names transformers' own class too, as a Hub repo whose tokenizer has a stock fallback does:
    # AutoTokenizer takes the auto_map's class only with trust_remote_code=True.
    tokenizer_config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        auto_map={"AutoTokenizer": [None, "tokenization_marker.MarkerTokenizer"]},
    )
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    (out / "tokenization_marker.py").write_text(TOKENIZATION_CODE)
    (out / "custom_generate").mkdir()
    (out / "custom_generate" / "generate.py").write_text(CUSTOM_GENERATE_CODE)
    (out / "custom_generate" / "requirements.txt").write_text("")
    for code in out.rglob("*.py"):
        marker = Path(marker_dir) / code.relative_to(out).as_posix().replace("/", "__")
        code.write_text(f"open({str(marker)!r}, 'w').close()\n" + code.read_text())
    return out


def markers(marker_dir: Path) -> list[str]:
    """The folder files that ran (by name), sorted."""
    return sorted(path.name for path in Path(marker_dir).iterdir())


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    import sys

    print(build_official_layout(Path(sys.argv[1])))
