"""The stock generation contract under ReFusion decoding: stopping criteria and stop strings on the final prefix,
sampling through transformers' warpers, the context-free processors, and a refusal for everything else."""

import pytest
import torch
from lm_eval.models.utils_hf import stop_sequences_criteria
from transformers import AutoTokenizer, GenerationConfig, StoppingCriteria, StoppingCriteriaList, TextStreamer
from transformers.generation import WatermarkingConfig

from refusion_hf.generation.generate_arguments import ARGUMENT_SUPPORT, HONOURED, INERT

PROMPT = torch.tensor([[32, 24, 53, 31, 52, 63, 5, 38]])
KNOBS = dict(max_new_tokens=24, slot_size=4, block_size=8, slot_threshold=0.6, token_threshold=0.3)
EOS, PAD, MASK = 1, 0, 3


@pytest.fixture(scope="module")
def tokenizer(fixture_path):
    return AutoTokenizer.from_pretrained(fixture_path)


@pytest.fixture(scope="module")
def uncut(model64):
    return model64.generate(PROMPT, **KNOBS)[0, 8:].tolist()


class StopAtLength(StoppingCriteria):
    """Fires once the answer has `length` tokens; records every answer length it was shown."""

    def __init__(self, prompt_width: int, length: int):
        self.prompt_width, self.length, self.seen = prompt_width, length, []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(input_ids.shape[1] - self.prompt_width)
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - self.prompt_width >= self.length)


# ------------------------------------------------------------------------------------------------ stopping
@pytest.mark.parametrize("length", [1, 3, 5, 9, 17])
def test_a_criterion_sees_every_length_and_cuts_there(model64, uncut, length):
    criterion = StopAtLength(8, length)
    out = model64.generate(PROMPT, stopping_criteria=StoppingCriteriaList([criterion]), **KNOBS)
    assert out[0, 8:].tolist() == uncut[:length], "the row ends where the criterion fired, token kept"
    assert criterion.seen == list(range(1, length + 1)), "called once per answer length, in order, like stock"


def test_a_bare_criterion_is_accepted(model64, uncut):
    assert model64.generate(PROMPT, stopping_criteria=StopAtLength(8, 4), **KNOBS)[0, 8:].tolist() == uncut[:4]


def test_a_cut_saves_the_decoding_after_it(model64):
    full = model64.generate(PROMPT, return_dict_in_generate=True, **KNOBS)
    cut = model64.generate(PROMPT, return_dict_in_generate=True, stopping_criteria=StopAtLength(8, 3), **KNOBS)
    assert cut.num_forward_passes < full.num_forward_passes, "undecoded slots after the cut are not decoded"
    assert cut.commit_step.shape == (1, 3)


def test_lm_eval_multi_token_eos_criteria_cut_at_the_stop_sequence(model64, tokenizer, uncut):
    """lm-eval's HFLM passes exactly this list (stateful: it tracks rows by batch index)."""
    stop = "t57"
    criteria = stop_sequences_criteria(tokenizer, [stop], PROMPT.shape[1], 1)
    answer = model64.generate(PROMPT, stopping_criteria=criteria, tokenizer=tokenizer, **KNOBS)[0, 8:].tolist()
    assert answer == uncut[: len(answer)]
    assert stop in tokenizer.decode(answer) and stop not in tokenizer.decode(answer[:-1])
    assert len(answer) < len(uncut)


def test_lm_eval_criteria_over_a_batch_end_every_row_when_all_are_done(model64, tokenizer):
    """lm-eval's criterion answers for the whole batch (True once every row has shown its stop sequence), as
    with stock generate: the rows end together, and lm-eval cuts each row's text afterwards."""
    other = [32, 4, 25, 47, 15]
    ids = torch.tensor([PROMPT[0].tolist(), [PAD] * 3 + other])
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    alone = [
        model64.generate(PROMPT, **KNOBS)[0, 8:].tolist(),
        model64.generate(torch.tensor([other]), **KNOBS)[0, 5:].tolist(),
    ]
    stop = tokenizer.convert_tokens_to_ids("t57")
    assert stop in alone[0] and stop in alone[1]
    both_done = max(answer.index(stop) for answer in alone) + 1
    criteria = stop_sequences_criteria(tokenizer, ["t57"], ids.shape[1], 2)
    batch = model64.generate(ids, attention_mask=mask, stopping_criteria=criteria, tokenizer=tokenizer, **KNOBS)
    assert batch.shape[1] == 8 + both_done
    for row in range(2):
        assert batch[row, 8:].tolist() == alone[row][:both_done]


@pytest.fixture(scope="module")
def embedded():
    """The embedded model and its byte-level BPE tokenizer (stock `StopStringCriteria` needs a real vocabulary;
    the fixture's word-level one makes stock generate fail as well)."""
    from refusion_hf.modeling.loading import default_model_path, load_model_and_tokenizer

    return load_model_and_tokenizer(str(default_model_path()), "float32")


QUESTIONS = [
    "Ann has 12 apples. She buys 5 more. Then she gives away 3. How many apples does Ann have now?",
    "Tom has 4 pens. He buys 7 more. How many pens does Tom have now?",
    "List the numbers from 3 to 9.",
]


def test_stop_strings_with_tokenizer(embedded):
    model, tokenizer = embedded
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    width = ids.shape[1]
    uncut = model.generate(ids)[0, width:].tolist()
    text = tokenizer.decode(uncut)
    for stop in ("17", " = ", "####"):
        assert stop in text
        answer = model.generate(ids, stop_strings=stop, tokenizer=tokenizer)[0, width:].tolist()
        assert answer == uncut[: len(answer)]
        assert stop in tokenizer.decode(answer), "the token that completes the stop string is kept"
        assert stop not in tokenizer.decode(answer[:-1])
    from_config = model.generate(
        ids, generation_config=GenerationConfig(stop_strings=["####", "17"]), tokenizer=tokenizer
    )[0, width:].tolist()
    assert "17" in tokenizer.decode(from_config) and "####" not in tokenizer.decode(from_config)


def test_stop_strings_in_a_batch_cut_each_row_alone(embedded):
    model, tokenizer = embedded
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    width = batch.input_ids.shape[1]
    knobs = dict(stop_strings=[" + ", "9"], tokenizer=tokenizer)
    together = model.generate(**batch, **knobs)
    for row, text in enumerate(texts):
        ids = tokenizer(text, return_tensors="pt").input_ids
        alone = model.generate(ids, **knobs)[0, ids.shape[1] :].tolist()
        answer = together[row, width:].tolist()
        assert answer[: len(alone)] == alone and set(answer[len(alone) :]) <= {tokenizer.pad_token_id}


def test_the_streamer_sees_only_what_survives_the_cut(model64, tokenizer, uncut, capsys):
    model64.generate(
        PROMPT, streamer=TextStreamer(tokenizer, skip_prompt=True), stopping_criteria=StopAtLength(8, 6), **KNOBS
    )
    assert capsys.readouterr().out.split() == tokenizer.decode(uncut[:6]).split()


def test_max_length_counts_the_prompt_as_in_stock(model64, uncut):
    assert model64.generate(PROMPT, **{**KNOBS, "max_new_tokens": None}, max_length=8 + 5)[0, 8:].tolist() == uncut[:5]


def test_max_time_stops_decoding(model64):
    out = model64.generate(PROMPT, **{**KNOBS, "max_new_tokens": 400, "slot_threshold": 1.01}, max_time=0.0)
    assert out.shape[1] - 8 == 1, "the time is up at the first check: the answer ends after its first token"


# ------------------------------------------------------------------------------------------------ sampling
def test_sampling_with_top_k_1_is_greedy(model64):
    greedy = model64.generate(PROMPT, return_dict_in_generate=True, **KNOBS)
    for seed in range(3):
        torch.manual_seed(seed)
        sampled = model64.generate(PROMPT, return_dict_in_generate=True, do_sample=True, top_k=1, **KNOBS)
        assert torch.equal(sampled.sequences, greedy.sequences)
        assert sampled.chosen_slots == greedy.chosen_slots, "confidences are the model's, not the sampler's"


def test_do_sample_false_is_greedy_whatever_the_temperature(model64, caplog):
    from transformers.utils import logging as hf_logging

    greedy = model64.generate(PROMPT, **KNOBS)
    hf_logging.warning_once.cache_clear()  # stock warns once per process
    with caplog.at_level("WARNING"):
        hot = model64.generate(PROMPT, temperature=5.0, **KNOBS)
    assert torch.equal(hot, greedy)
    assert "temperature" in caplog.text, "stock's warning about a temperature without do_sample"


def test_warpers_shape_every_draw(model64):
    """Infill drafts too: with every token sent to infill (token threshold above 1), top_k=1 is still greedy
    and plain sampling is not."""
    knobs = dict(KNOBS, token_threshold=1.01)
    greedy = model64.generate(PROMPT, **knobs)
    torch.manual_seed(0)
    assert torch.equal(model64.generate(PROMPT, do_sample=True, top_k=1, **knobs), greedy)
    draws = set()
    for seed in range(4):
        torch.manual_seed(seed)
        draws.add(tuple(model64.generate(PROMPT, do_sample=True, temperature=1.5, top_k=0, **knobs)[0].tolist()))
    assert len(draws) > 1


def test_num_return_sequences_expands_rows_like_stock(model64):
    ids = torch.cat([PROMPT, PROMPT.flip(1)])
    torch.manual_seed(0)
    out = model64.generate(ids, do_sample=True, num_return_sequences=3, top_k=0, temperature=1.5, **KNOBS)
    assert out.shape[0] == 6
    assert all(torch.equal(out[row, :8], ids[row // 3]) for row in range(6))
    assert len({tuple(row) for row in out[:3, 8:].tolist()}) > 1, "the copies are sampled independently"


def test_min_new_tokens_keeps_eos_out_of_the_first_positions(model64):
    ids = torch.tensor([[61, 61, 33, 51, 20, 31, 13, 32, 23, 6, 13, 40]])
    knobs = dict(max_new_tokens=16, slot_size=4, slot_threshold=0.6, token_threshold=0.3)
    assert model64.generate(ids, **knobs)[0, 12:].tolist() == [EOS]
    for minimum in (1, 5, 9):
        answer = model64.generate(ids, min_new_tokens=minimum, **knobs)[0, 12:].tolist()
        assert len(answer) >= minimum and EOS not in answer[:minimum]
    total = model64.generate(ids, min_length=12 + 5, **knobs)[0, 12:].tolist()  # min_length counts the prompt
    assert EOS not in total[:5]


def test_suppressed_and_bad_tokens_are_never_drafted(model64, uncut):
    for kwargs in (
        dict(suppress_tokens=[13, 40]),
        dict(bad_words_ids=[[13], [40]]),
        dict(sequence_bias={(13,): -1e9, (40,): -1e9}),
    ):
        answer = model64.generate(PROMPT, **kwargs, **KNOBS)[0, 8:].tolist()
        assert 13 not in answer and 40 not in answer, kwargs
    first = model64.generate(PROMPT, begin_suppress_tokens=[uncut[0]], **KNOBS)[0, 8:].tolist()
    assert first[0] != uncut[0]


def test_sampled_answers_never_contain_mask_pad_or_bos():
    """The embedded model at temperature 2 (where stray special tokens would show): 200 answers."""
    from refusion_hf.modeling.loading import default_model_path, load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(default_model_path()), "float32")
    config = model.generation_config
    prompts = [f"Ann has {n} apples. She buys {n + 3} more. How many apples does Ann have now?" for n in range(10)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    special = {config.mask_token_id, config.pad_token_id, config.bos_token_id}
    torch.manual_seed(0)
    answers = []
    for _ in range(2):
        out = model.generate(
            **batch, do_sample=True, temperature=2.0, top_k=0, num_return_sequences=10, max_new_tokens=32
        )
        for row in out[:, batch.input_ids.shape[1] :].tolist():
            answers.append(row[: row.index(config.eos_token_id) + 1] if config.eos_token_id in row else row)
    assert len(answers) == 200
    assert not any(special & set(answer) for answer in answers)


# ------------------------------------------------------------------------------------------------ refusals
REFUSED_EXAMPLES = {
    "num_beams": 2,
    "num_beam_groups": 2,
    "diversity_penalty": 0.5,
    "constraints": ["a constraint"],
    "force_words_ids": [[5]],
    "penalty_alpha": 0.6,
    "dola_layers": "low",
    "use_mtp": True,
    "prompt_lookup_num_tokens": 3,
    "assistant_early_exit": 1,
    "cache_implementation": "static",
    "prefill_chunk_size": 4,
    "repetition_penalty": 1.2,
    "encoder_repetition_penalty": 1.2,
    "no_repeat_ngram_size": 2,
    "encoder_no_repeat_ngram_size": 2,
    "forced_bos_token_id": 5,
    "forced_eos_token_id": 1,
    "exponential_decay_length_penalty": (2, 1.5),
    "token_healing": True,
    "guidance_scale": 1.5,
    "watermarking_config": WatermarkingConfig(),
    "output_scores": True,
    "output_logits": True,
    "use_cache": False,
    "output_attentions": True,
    "output_hidden_states": True,
}


def test_every_stock_field_is_classified():
    stock_fields = set(GenerationConfig().__dict__) - {"_from_model_config", "transformers_version"}
    assert stock_fields <= set(ARGUMENT_SUPPORT), sorted(stock_fields - set(ARGUMENT_SUPPORT))
    refused = {name for name, support in ARGUMENT_SUPPORT.items() if support not in (HONOURED, INERT)}
    assert refused == set(REFUSED_EXAMPLES)


@pytest.mark.parametrize("name", sorted(REFUSED_EXAMPLES))
def test_unsupported_fields_are_refused_by_name(model64, name):
    with pytest.raises(ValueError, match=rf"`{name}"):
        model64.generate(PROMPT, **{name: REFUSED_EXAMPLES[name]}, **KNOBS)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(bad_words_ids=[[5, 6]]), "bad_words_ids"),
        (dict(sequence_bias={(5, 6): 1.0}), "sequence_bias"),
        (dict(prefix_allowed_tokens_fn=lambda batch, ids: [5]), "prefix_allowed_tokens_fn"),
        (dict(negative_prompt_ids=PROMPT), "negative_prompt_ids"),
        (dict(synced_gpus=True), "synced_gpus"),
        (dict(assistant_model="model"), "assistant_model"),
        (dict(position_ids=PROMPT), "position_ids"),
    ],
)
def test_other_unsupported_arguments_are_refused_by_name(model64, kwargs, name):
    with pytest.raises(ValueError, match=rf"`?{name}"):
        model64.generate(PROMPT, **kwargs, **KNOBS)
