"""`refusion convert`: turn an autoregressive Qwen3 checkpoint into a ReFusion starting point, as the paper does
from Qwen3-8B.

* the tokenizer gets `<|beginoftext|>` (as its BOS when it has none and that does not change how text is encoded)
  and `<|mask|>` (as its mask token) as special tokens; tokens already there in that role are reused;
* the embedding matrices grow when a new id does not fit (Qwen3's are usually larger than its vocabulary already),
  and the rows of the new tokens, in the input embeddings and the LM head, are set to the mean of the rows of the
  original vocabulary, so that the network's outputs on ordinary text are unchanged;
* `mask_token_id` is set and the model is written as `RefusionForCausalLM` (config `model_type: refusion`, same
  weight names), with the flat remote code, next to the tokenizer: into a staging folder moved into place when
  complete.

A mask or begin token already in the vocabulary as an ordinary token or in another role (`--mask-token
'<|im_end|>'`, the EOS) is refused: its id would be that of a token the model reads and writes.

Only Qwen3 checkpoints are supported: `RefusionForCausalLM` *is* a Qwen3 causal LM. Other architectures whose
forward takes `position_ids` would need their own subclass carrying the ReFusion loss and decoder.
"""

from __future__ import annotations

import argparse
import copy
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AddedToken, AutoTokenizer

from ..command_inputs import CommandError
from ..errors import first_line
from ..modeling import RefusionConfig, RefusionForCausalLM
from ..modeling.checkpoint_checks import check_checkpoint_folder, check_tokenizer_files, check_tokenizer_fits
from ..modeling.configuration_refusion import OFFICIAL_MODEL_TYPE
from ..outputs import check_output_folder, staged_output

logger = logging.getLogger(__name__)

MASK_TOKEN = "<|mask|>"
BEGIN_TOKEN = "<|beginoftext|>"
SUPPORTED_MODEL_TYPES = (OFFICIAL_MODEL_TYPE, RefusionConfig.model_type)
_PROBE_TEXT = "Converting a checkpoint: 12 + 30 = 42, isn't it?\nYes."


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def add_refusion_tokens(tokenizer, mask_token: str = MASK_TOKEN, begin_token: str = BEGIN_TOKEN):
    """The tokenizer with `begin_token` and `mask_token` added as special tokens (a new object when it changes)."""
    probe = _encode(tokenizer, _PROBE_TEXT)
    tokenizer.add_tokens([AddedToken(begin_token, special=True, normalized=False)], special_tokens=True)
    if tokenizer.mask_token != mask_token:
        tokenizer.add_special_tokens({"mask_token": AddedToken(mask_token, special=True, normalized=False)})
    if tokenizer.bos_token is None:
        candidate = copy.deepcopy(tokenizer)
        candidate.add_special_tokens({"bos_token": begin_token})
        if _encode(candidate, _PROBE_TEXT) == probe:
            tokenizer = candidate
        else:
            logger.warning("%s not set as BOS: the tokenizer would then prepend it to every text", begin_token)
    if _encode(tokenizer, _PROBE_TEXT) != probe:
        raise CommandError(
            "--base: adding the ReFusion special tokens would change how the tokenizer encodes ordinary text."
        )
    return tokenizer


def check_new_tokens(tokenizer, mask_token: str, begin_token: str) -> None:
    """`mask_token` and `begin_token` must be two different tokens, each new to the vocabulary or already the
    tokenizer's own in that role (a converted checkpoint converted again): a token of the vocabulary or of another
    role (`--mask-token '<|im_end|>'` is the EOS) would make the mask id that of a token the model reads and writes."""
    if mask_token == begin_token:
        raise CommandError(f"--mask-token and --begin-token are both {mask_token!r}; pass two different tokens.")
    vocab = tokenizer.get_vocab()
    roles = {token: role.removesuffix("_token") for role, token in tokenizer.special_tokens_map.items()}
    for token, role, flag in ((mask_token, "mask", "--mask-token"), (begin_token, "bos", "--begin-token")):
        if token in vocab and getattr(tokenizer, f"{role}_token") != token:
            what = f"the tokenizer's {roles[token]} token" if token in roles else "a token of the vocabulary"
            raise CommandError(
                f"{flag} {token!r} is already {what} (id {vocab[token]}); pass a token that is not in the vocabulary "
                f"(default {MASK_TOKEN if role == 'mask' else BEGIN_TOKEN!r})."
            )


@torch.no_grad()
def _mean_initialise(embedding: torch.Tensor, old_rows: int, new_ids: list[int]) -> None:
    mean = embedding[:old_rows].float().mean(dim=0)
    embedding[new_ids] = mean.to(embedding.dtype)


def convert_checkpoint(base: str | Path, out: str | Path, mask_token: str = MASK_TOKEN, begin_token: str = BEGIN_TOKEN):
    """Convert the Qwen3 checkpoint + tokenizer in `base` into a ReFusion checkpoint in `out`; returns the model."""
    base, out = str(base), Path(out)
    check_checkpoint_folder(base, "--base")
    check_tokenizer_files(base, "--base")
    check_output_folder(out, "--out")
    try:
        config_dict, _ = RefusionConfig.get_config_dict(base)
    except (OSError, ValueError) as error:
        raise CommandError(f"--base {base}: the checkpoint's config does not load ({first_line(error)}).") from None
    model_type = config_dict.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CommandError(
            f"--base: {base} holds a {model_type!r} model; `refusion convert` turns Qwen3 checkpoints "
            f"(model_type {SUPPORTED_MODEL_TYPES[0]!r}) into ReFusion ones, because RefusionForCausalLM is a Qwen3 "
            "causal LM."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(base, trust_remote_code=False)
        model = RefusionForCausalLM.from_pretrained(base, dtype="auto")
    except (OSError, ValueError, SafetensorError) as error:
        raise CommandError(f"--base {base}: the checkpoint does not load ({first_line(error)}).") from None
    vocab_size = model.get_input_embeddings().weight.shape[0]
    check_tokenizer_fits(tokenizer, vocab_size, f"--base {base}")
    old_length = len(tokenizer)
    if old_length > vocab_size:
        raise CommandError(f"--base: the tokenizer has {old_length} tokens but the embeddings only {vocab_size} rows.")
    check_new_tokens(tokenizer, mask_token, begin_token)
    known = dict(tokenizer.get_vocab())
    others = {
        i for i in (*tokenizer.all_special_ids, model.config.eos_token_id, model.config.pad_token_id) if i is not None
    }
    tokenizer = add_refusion_tokens(tokenizer, mask_token, begin_token)
    new_ids = sorted(tokenizer.convert_tokens_to_ids(t) for t in (begin_token, mask_token) if t not in known)
    if mask_token not in known and tokenizer.mask_token_id in others:
        raise CommandError(
            f"--mask-token {mask_token}: it would get id {tokenizer.mask_token_id}, which another special token "
            "already uses; the tokenizer looks broken."
        )
    if any(i < old_length for i in new_ids):  # new tokens take new rows, never the rows of existing tokens
        raise CommandError(f"--base {base}: the tokenizer gave new tokens ids {new_ids} inside its vocabulary.")
    if len(tokenizer) > vocab_size:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    if new_ids:
        _mean_initialise(model.get_input_embeddings().weight, old_length, new_ids)
        output_embeddings = model.get_output_embeddings()
        if output_embeddings is not None and output_embeddings.weight is not model.get_input_embeddings().weight:
            _mean_initialise(output_embeddings.weight, old_length, new_ids)
    model.config.mask_token_id = tokenizer.mask_token_id
    if tokenizer.bos_token_id is not None and model.config.bos_token_id is None:
        model.config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.mask_token_id = tokenizer.mask_token_id
    with staged_output(out, "--out") as staging:  # a failed save (a full disk) leaves nothing in `out`
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    logger.info("converted %s -> %s: mask token id %d, new token ids %s", base, out, tokenizer.mask_token_id, new_ids)
    return model, tokenizer


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="turn an autoregressive Qwen3 checkpoint into a ReFusion starting point",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    parser.add_argument("--base", required=True, help="folder of the autoregressive Qwen3 checkpoint and tokenizer")
    parser.add_argument("--out", required=True, help="folder to write the ReFusion checkpoint into")
    parser.add_argument("--mask-token", default=MASK_TOKEN, help=f"mask token to add (default {MASK_TOKEN})")
    parser.add_argument("--begin-token", default=BEGIN_TOKEN, help=f"begin-of-text token (default {BEGIN_TOKEN})")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model, tokenizer = convert_checkpoint(args.base, args.out, args.mask_token, args.begin_token)
    print(
        f"wrote {args.out}: RefusionForCausalLM, vocabulary {model.config.vocab_size}, mask token "
        f"{tokenizer.mask_token!r} id {tokenizer.mask_token_id}, begin token {args.begin_token!r} id "
        f"{tokenizer.convert_tokens_to_ids(args.begin_token)}"
    )
    return 0


__all__ = ["add_refusion_tokens", "check_new_tokens", "convert_checkpoint"]
