"""The official ReFusion checkpoint as it is on the Hub (tests/official_layout.py: `model_type: qwen3`, the
official `auto_map` to remote code that cannot import on transformers 5, `use_cache: false`, special tokens at the
end of the vocabulary, a chat template), through every entry point: each decodes with ReFusion (the fixture's
tokens renumbered, never stock autoregressive decoding) without running the folder's code, or is documented as
what it is (the stock Auto classes; the card's own snippet fails)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM, pipeline

from refusion_hf import RefusionForCausalLM
from refusion_hf.cli import main
from refusion_hf.generation.cli import encode_prompt
from refusion_hf.modeling.loading import default_model_path
from tests.official_layout import (
    BOS_ID,
    EOS_ID,
    MASK_ID,
    OFFICIAL_CODE_IMPORTS,
    build_official_layout,
    to_official,
)
from tests.oracle import FIXTURE
from tests.training.toy import write_toy_jsonl

KNOBS = dict(max_new_tokens=16, slot_size=4, block_size=8, slot_threshold=0.6, token_threshold=0.3)
PROMPTS = ["t8 t9 t10 t11", "t30 t31", "t50 t12 t13 t40 t41"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (tests/conftest.py)


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    return build_official_layout(tmp_path_factory.mktemp("official") / "ReFusion")


@pytest.fixture(scope="module")
def loaded(official):
    model = RefusionForCausalLM.from_pretrained(official, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(official)


def refusion_answer(model, ids: list[int], **kwargs) -> list[int]:
    # An explicit mask: words out of the tiny vocabulary encode as <|endoftext|>, the pad token.
    ids = torch.tensor([ids])
    return model.generate(ids, attention_mask=torch.ones_like(ids), **{**KNOBS, **kwargs})[0, ids.shape[1] :].tolist()


def test_the_class_decodes_the_official_layout_as_the_fixture(official, loaded):
    """`RefusionForCausalLM.from_pretrained(official)`: the fixture's decoding, token for token (ids renumbered),
    whatever the folder's auto_map and use_cache say."""
    model, tokenizer = loaded
    assert model.config.mask_token_id == MASK_ID and tokenizer.mask_token_id == MASK_ID
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)
    fixture = RefusionForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    for prompt in ([8, 9, 10, 11, 12], [40, 5, 33]):
        ours = model.generate(torch.tensor([to_official(prompt)]), return_dict_in_generate=True, **KNOBS)
        reference = fixture.generate(torch.tensor([prompt]), return_dict_in_generate=True, **KNOBS)
        assert ours.sequences.tolist() == to_official(reference.sequences.tolist())
        assert ours.num_forward_passes == reference.num_forward_passes


def test_the_auto_classes_and_the_cards_snippet(official):
    """What the README says of the Auto classes on an official folder: without remote code they give stock Qwen3
    (autoregressive generate); with it, the folder's code written for transformers 4.52 does not import where
    transformers lacks `modeling_attn_mask_utils` (5.19 to 5.24), and is what loads where it has it (5.25)."""
    assert type(AutoConfig.from_pretrained(official)).__name__ == "Qwen3Config"
    assert type(AutoModelForCausalLM.from_pretrained(official)) is Qwen3ForCausalLM
    if OFFICIAL_CODE_IMPORTS:
        remote = AutoModelForCausalLM.from_pretrained(official, trust_remote_code=True)
        assert type(remote).__module__.startswith("transformers_modules"), type(remote).__module__
    else:
        with pytest.raises(ModuleNotFoundError, match="transformers.modeling_attn_mask_utils"):
            AutoModelForCausalLM.from_pretrained(official, trust_remote_code=True)


def test_stock_model_with_custom_generate_equals_the_class(official, loaded):
    model, tokenizer = loaded
    stock = AutoModelForCausalLM.from_pretrained(official, dtype=torch.float32).eval()
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    through_folder = stock.generate(ids, custom_generate=str(default_model_path()), trust_remote_code=True, **KNOBS)
    assert through_folder.tolist() == model.generate(ids, **KNOBS).tolist()


def test_pipeline_with_our_model_object(loaded):
    model, tokenizer = loaded
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    chat = [{"role": "user", "content": PROMPTS[1]}]
    reply = generator(chat, do_sample=False, **KNOBS)[0]["generated_text"][-1]["content"]
    ids = encode_prompt(tokenizer, PROMPTS[1])
    assert reply == tokenizer.decode(refusion_answer(model, ids[0].tolist()), skip_special_tokens=True)


def test_refusion_generate_and_eval_commands(official, loaded, tmp_path, capsys):
    model, tokenizer = loaded
    flags = ["--max-new-tokens", "16", "--slot-size", "4", "--block-size", "8", "--slot-threshold", "0.6",
             "--token-threshold", "0.3"]  # fmt: skip
    assert main(["generate", PROMPTS[2], "--model", str(official), "--dtype", "float32", "--no-compare", *flags]) == 0
    expected = tokenizer.decode(refusion_answer(model, encode_prompt(tokenizer, PROMPTS[2])[0].tolist()),
                                skip_special_tokens=True)  # fmt: skip
    assert capsys.readouterr().out.startswith(f"ReFusion:\n{expected}\n[refusion] ")

    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(official), "--dtype", "float32", "--limit", "1", "--json", str(out),
            "--decodings", "refusion", "--timing-repeats", "1", *flags]  # fmt: skip
    assert main(argv) == 0
    (problem,) = json.loads(out.read_text())["problems"]
    ids = tokenizer(problem["prompt"], add_special_tokens=False).input_ids  # the rendered chat template
    assert problem["refusion"]["answer"] == tokenizer.decode(refusion_answer(model, ids), skip_special_tokens=True)


def test_refusion_lm_eval_model_decodes_with_refusion(official, loaded, tmp_path):
    """The `refusion` lm-eval model on the official folder, through lm-eval's evaluator as `refusion lm-eval` runs
    it: ReFusion's answers and forward passes with `slot_size` & co. as model args (before: the folder's code failed
    to import; without the auto_map, stock autoregressive decoding, and `slot_size` refused)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from refusion_hf.evaluation import lm_eval_model

    model, tokenizer = loaded
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": p, "answer": "t5"}) + "\n" for p in PROMPTS))
    (tmp_path / "official_toy.yaml").write_text(
        f"task: official_toy\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        f"generation_kwargs:\n  until: []\n  max_gen_toks: {KNOBS['max_new_tokens']}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    knobs = ",".join(f"{name}={value}" for name, value in KNOBS.items() if name != "max_new_tokens")
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)  # lm-eval's own 14k tasks: not indexed
    results = simple_evaluate(
        model="refusion", model_args=f"pretrained={official},dtype=float32,device=cpu,{knobs}", tasks=["official_toy"],
        batch_size=1, task_manager=tasks, log_samples=True,
    )  # fmt: skip
    report = lm_eval_model.INSTANCES.pop().decoding_report()["tasks"]["official_toy"]
    answers = {s["doc"]["question"]: s["resps"][0][0] for s in results["samples"]["official_toy"]}
    stock = AutoModelForCausalLM.from_pretrained(official, dtype=torch.float32).eval()
    forward_passes, differs_from_autoregressive = 0, False
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])
        ours = model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **KNOBS)
        forward_passes += ours.num_forward_passes
        assert answers[prompt] == tokenizer.decode(ours.sequences[0, ids.shape[1] :], skip_special_tokens=True)
        stock_ids = stock.generate(ids, max_new_tokens=KNOBS["max_new_tokens"], do_sample=False)
        differs_from_autoregressive |= answers[prompt] != tokenizer.decode(
            stock_ids[0, ids.shape[1] :], skip_special_tokens=True
        )
    assert differs_from_autoregressive, "the prompts tell ReFusion from autoregressive decoding apart"
    assert report["forward_passes"] == forward_passes and report["requests"] == len(PROMPTS)


def test_publish_is_bit_exact(official, tmp_path, capsys):
    """The published folder holds the official weights and tokenizer unchanged, with our config and remote code
    instead of the authors' (it then loads where refusion_hf is absent: tests/hub_card/test_round_trip.py)."""
    out = tmp_path / "published"
    assert main(["publish", "--model", str(official), "--out", str(out)]) == 0
    source, published = load_file(official / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == published.keys() and all(torch.equal(source[k], published[k]) for k in source)
    assert not (out / "modeling_qwen3_refusion.py").exists() and not (out / "configuration_qwen3.py").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_refusion.RefusionForCausalLM"
    original, republished = AutoTokenizer.from_pretrained(official), AutoTokenizer.from_pretrained(out)
    assert original.get_vocab() == republished.get_vocab()
    assert original.special_tokens_map == republished.special_tokens_map
    assert original.chat_template == republished.chat_template


def test_convert_and_train_on_the_official_layout(official, tmp_path, capsys):
    """convert keeps the official tokens (the mask and begin tokens are already there: the weights and vocabulary
    come out unchanged, in our format); train, full and LoRA, runs on it."""
    assert main(["convert", "--base", str(official), "--out", str(tmp_path / "converted")]) == 0
    assert f"mask token '<|mask|>' id {MASK_ID}, begin token '<|beginoftext|>' id {BOS_ID}" in capsys.readouterr().out
    source, converted = load_file(official / "model.safetensors"), load_file(tmp_path / "converted/model.safetensors")
    assert all(torch.equal(source[k], converted[k]) for k in source)
    converted_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "converted")
    assert converted_tokenizer.get_vocab() == AutoTokenizer.from_pretrained(official).get_vocab()

    data = str(write_toy_jsonl(tmp_path / "toy.jsonl", count=8))
    train = ["--data", data, "--max-steps", "2", "--save-strategy", "no", "--slot-sizes", "2,4", "--disable-tqdm",
             "true"]  # fmt: skip
    for name, extra in (("full", []), ("lora", ["--lora"])):
        assert main(["train", "--model", str(official), "--output-dir", str(tmp_path / name), *train, *extra]) == 0
    trained = RefusionForCausalLM.from_pretrained(tmp_path / "full")
    assert trained.config.mask_token_id == MASK_ID and trained.config.bos_token_id == BOS_ID
    adapter = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(official)
