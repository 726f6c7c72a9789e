"""`refusion convert` on a tiny randomly initialised stock Qwen3 with a tokenizer built here."""

import json
import re

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from refusion_hf import RefusionDataCollator, RefusionForCausalLM
from refusion_hf.cli import main
from tests.cli_errors import user_error

WORDS = [f"w{i}" for i in range(2, 40)]
TEXT = "w3 w7 w11 w19 w2 w38 w5"


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<|endoftext|>": 0, "<|im_end|>": 1, **{word: i for i, word in enumerate(WORDS, start=2)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def build_base(folder, vocab_size: int, tie: bool):
    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


@pytest.mark.parametrize("extra_rows, tie", [(0, False), (8, True)], ids=["resize-untied", "spare-rows-tied"])
def test_convert_adds_tokens_mean_initialises_and_keeps_outputs(tmp_path, capsys, extra_rows, tie):
    old_length = 2 + len(WORDS)
    base, base_tokenizer = build_base(tmp_path / "base", old_length + extra_rows, tie)
    out = tmp_path / "refusion"
    assert main(["convert", "--base", str(tmp_path / "base"), "--out", str(out)]) == 0
    assert "RefusionForCausalLM" in capsys.readouterr().out

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.mask_token == "<|mask|>" and tokenizer.bos_token == "<|beginoftext|>"
    begin_id, mask_id = tokenizer.convert_tokens_to_ids(["<|beginoftext|>", "<|mask|>"])
    assert (begin_id, mask_id) == (old_length, old_length + 1), "the paper's order: <|beginoftext|>, then <|mask|>"
    assert tokenizer(TEXT).input_ids == base_tokenizer(TEXT).input_ids, "ordinary text encodes as before"
    assert tokenizer.convert_ids_to_tokens(tokenizer("w3 <|mask|> w4").input_ids) == ["w3", "<|mask|>", "w4"]

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "refusion" and config["mask_token_id"] == mask_id
    assert config["vocab_size"] == max(old_length + extra_rows, old_length + 2)
    assert "AutoModelForCausalLM" in config["auto_map"] and (out / "refusion_loss.py").is_file()

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(model, RefusionForCausalLM)
    base_in, base_out = base.get_input_embeddings().weight, base.get_output_embeddings().weight
    new_in, new_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert torch.equal(new_in[:old_length], base_in[:old_length])
    assert torch.equal(new_out[:old_length], base_out[:old_length])
    for weights, reference in ((new_in, base_in), (new_out, base_out)):
        expected = reference[:old_length].mean(dim=0)
        for new_id in (begin_id, mask_id):
            torch.testing.assert_close(weights[new_id], expected, rtol=1e-6, atol=1e-7)
    assert (new_in.data_ptr() == new_out.data_ptr()) == tie

    ids = torch.tensor([tokenizer(TEXT).input_ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :old_length], base(ids).logits[..., :old_length])
        generated = model.generate(ids, max_new_tokens=6, slot_size=2)
    assert generated.shape == (1, ids.shape[1] + 6)

    collator = RefusionDataCollator(tokenizer, seed=0, slot_sizes=(2,))
    batch = collator([{"input_ids": ids[0].tolist() + [1], "prompt_length": 3}])
    loss = model.train()(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.get_input_embeddings().weight.grad is not None


def test_converting_twice_changes_nothing(tmp_path):
    build_base(tmp_path / "base", 2 + len(WORDS), False)
    main(["convert", "--base", str(tmp_path / "base"), "--out", str(tmp_path / "once")])
    main(["convert", "--base", str(tmp_path / "once"), "--out", str(tmp_path / "twice")])
    once = RefusionForCausalLM.from_pretrained(tmp_path / "once")
    twice = RefusionForCausalLM.from_pretrained(tmp_path / "twice")
    lengths = [len(AutoTokenizer.from_pretrained(tmp_path / name)) for name in ("once", "twice")]
    assert lengths[0] == lengths[1] == 2 + len(WORDS) + 2
    for (name, a), (_, b) in zip(once.state_dict().items(), twice.state_dict().items()):
        assert torch.equal(a, b), name


def test_other_architectures_are_refused(tmp_path, capsys):
    config = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    build_tokenizer().save_pretrained(tmp_path / "llama")
    assert re.search(
        r"--base: .* holds a 'llama' model; `refusion convert` turns Qwen3",
        user_error(capsys, ["convert", "--base", str(tmp_path / "llama"), "--out", str(tmp_path / "out")]),
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mask-token", "<|im_end|>"], "--mask-token '<|im_end|>' is already the tokenizer's eos token (id 1)"),
        (["--mask-token", "<|endoftext|>"], "--mask-token '<|endoftext|>' is already the tokenizer's pad token (id 0)"),
        (["--mask-token", "w5"], "--mask-token 'w5' is already a token of the vocabulary (id 5)"),
        (["--begin-token", "<|im_end|>"], "--begin-token '<|im_end|>' is already the tokenizer's eos token (id 1)"),
        (["--mask-token", "X", "--begin-token", "X"], "--mask-token and --begin-token are both 'X'"),
    ],
    ids=["mask-is-eos", "mask-is-pad", "mask-is-a-word", "begin-is-eos", "mask-is-begin"],
)
def test_tokens_of_the_vocabulary_or_of_another_role_are_refused(tmp_path, capsys, flags, message):
    build_base(tmp_path / "base", 2 + len(WORDS), False)
    out = tmp_path / "out"
    assert user_error(capsys, ["convert", "--base", str(tmp_path / "base"), "--out", str(out), *flags]).startswith(
        message
    )
    assert not out.exists(), "nothing written"


def test_a_converted_checkpoint_keeps_its_tokens_in_their_roles(tmp_path, capsys):
    build_base(tmp_path / "base", 2 + len(WORDS), False)
    assert main(["convert", "--base", str(tmp_path / "base"), "--out", str(tmp_path / "once")]) == 0
    argv = ["convert", "--base", str(tmp_path / "once"), "--out", str(tmp_path / "twice"), "--begin-token", "<|mask|>"]
    argv += ["--mask-token", "<|mask2|>"]
    assert user_error(capsys, argv).startswith("--begin-token '<|mask|>' is already the tokenizer's mask token (id 41)")
