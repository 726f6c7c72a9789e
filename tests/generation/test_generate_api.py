"""`generate()` keeps Hugging Face's conventions: arguments, configs, outputs, errors."""

import json
import math

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

from refusion_hf import RefusionForCausalLM, RefusionGenerationConfig, RefusionGenerationOutput
from tests.oracle import FIXTURE
from tests.tiny_models import tiny_refusion_model

PROMPT = torch.tensor([[32, 24, 53, 31, 52, 63, 5, 38]])
KNOBS = dict(max_new_tokens=13, slot_size=4, slot_threshold=0.6, token_threshold=0.3)
EOS, PAD, MASK = 1, 0, 3


def test_returns_prompt_plus_the_answer(model64):
    out = model64.generate(PROMPT, **KNOBS)  # 13 is not a multiple of 4: the canvas is 16, cut to 13
    assert isinstance(out, torch.Tensor) and out.dtype == torch.long
    assert out.shape == (1, 8 + 13)  # this prompt's answer has no EOS within 13 tokens
    assert torch.equal(out[:, :8], PROMPT)
    assert MASK not in out[0, 8:].tolist()


def test_output_is_as_wide_as_the_longest_answer(model64):
    """Like stock generate when every row ends early: [B, prompt + longest answer], pad after each row's end."""
    ids = torch.tensor([[61, 61, 33, 51, 20, 31, 13, 32, 23, 6, 13, 40]])
    knobs = dict(slot_size=1, slot_threshold=0.0, token_threshold=1.01)
    short = model64.generate(ids, max_new_tokens=200, **knobs)
    assert short[0, 12:].tolist() == [EOS], "the answer ends at its EOS whatever max_new_tokens says"
    both = model64.generate(
        torch.cat([ids, torch.tensor([[0, 0, 0, 0] + PROMPT[0].tolist()])]),
        attention_mask=torch.tensor([[1] * 12, [0] * 4 + [1] * 8]),
        max_new_tokens=20,
        **knobs,
    )
    long = model64.generate(PROMPT, max_new_tokens=20, **knobs)
    assert both.shape == (2, 12 + long.shape[1] - 8)
    assert both[0, 12:].tolist() == [EOS] + [PAD] * (both.shape[1] - 13)
    assert torch.equal(both[1, 12:], long[0, 8:])


def test_large_max_new_tokens_costs_nothing_when_answers_end_early(model64):
    """Blocks are decoded one after another and a row stops after the block of its EOS, so max_new_tokens far
    beyond what is needed (even beyond the 512 positions of the fixture: stock only warns) adds no forward."""
    ids = torch.tensor([[61, 61, 33, 51, 20, 31, 13, 32, 23, 6, 13, 40]])
    knobs = dict(slot_size=4, slot_threshold=0.6, token_threshold=0.3, return_dict_in_generate=True)
    small = model64.generate(ids, max_new_tokens=64, **knobs)
    assert EOS in small.sequences[0].tolist()
    with pytest.warns(UserWarning, match="exceeds the model's predefined maximum length"):
        large = model64.generate(ids, max_new_tokens=1024, **knobs)
    assert torch.equal(large.sequences, small.sequences)
    assert large.num_forward_passes == small.num_forward_passes


def test_default_block_size_is_fixed(model64):
    """Unset, block_size is 128 (rounded up to a multiple of slot_size): a step's plan never covers more than a
    block, so its cost does not grow with max_new_tokens."""
    widths = []
    hook = model64.register_forward_hook(
        lambda module, args, kwargs, out: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        model64.generate(PROMPT, max_new_tokens=300, slot_size=8, slot_threshold=1.01, token_threshold=0.0)
    finally:
        hook.remove()
    assert max(widths) <= 8 + 128


def test_dict_output_fields(model64):
    out = model64.generate(PROMPT, return_dict_in_generate=True, **KNOBS)
    assert isinstance(out, RefusionGenerationOutput)
    generated = out.sequences[0, 8:].tolist()
    length = generated.index(EOS) + 1 if EOS in generated else len(generated)
    assert out.num_forward_passes >= 2
    assert math.isclose(float(out.tokens_per_forward[0]), length / out.num_forward_passes, rel_tol=1e-6)
    steps = out.commit_step[0].tolist()
    assert all(s >= 0 for s in steps[:length]) and all(s == -1 for s in steps[length:])
    assert len(out.chosen_slots[0]) == max(steps) + 1  # one entry per planning step
    for step, starts in enumerate(out.chosen_slots[0]):
        assert starts == sorted(starts) and all(s % 4 == 0 for s in starts)
        committed_here = [p for p, s in enumerate(steps) if s == step]
        assert {p - p % 4 for p in committed_here} <= set(starts)


def test_custom_pad_and_eos_lists(model64):
    ids = torch.cat([torch.tensor([[61, 61, 33, 51]]), PROMPT], dim=1)
    knobs = dict(max_new_tokens=12, slot_size=1, slot_threshold=0.0, token_threshold=1.01)
    plain = model64.generate(ids, **knobs)[0, 12:].tolist()
    second_eos = next(t for t in plain if t != EOS)  # a token the plain answer produces: make it an EOS too
    out = model64.generate(ids, eos_token_id=[EOS, second_eos], pad_token_id=7, **knobs)[0, 12:].tolist()
    end = plain.index(second_eos) + 1
    assert out == plain[:end], "the answer ends at the first id of the EOS list"
    batch = model64.generate(
        torch.cat([ids, torch.cat([torch.tensor([[0] * 4]), PROMPT], dim=1)]),
        attention_mask=torch.tensor([[1] * 12, [0] * 4 + [1] * 8]),
        eos_token_id=[EOS, second_eos],
        pad_token_id=7,
        **knobs,
    )
    if batch.shape[1] > 12 + end:
        assert set(batch[0, 12 + end :].tolist()) == {7}, "pad_token_id fills the rest of an ended row"


def test_thresholds_above_one_are_legal(model64):
    out = model64.generate(
        PROMPT, return_dict_in_generate=True, max_new_tokens=8, slot_size=2, slot_threshold=1.5, token_threshold=2.0
    )
    assert all(len(starts) == 1 for starts in out.chosen_slots[0]), "slot threshold > 1: one slot per step"


def test_generation_config_round_trip(fixture_path, tmp_path):
    model = RefusionForCausalLM.from_pretrained(fixture_path)
    assert isinstance(model.generation_config, RefusionGenerationConfig)
    model.generation_config.slot_size = 8
    model.generation_config.token_threshold = 0.25
    model.generation_config.block_size = 16
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert (saved["slot_size"], saved["token_threshold"], saved["block_size"]) == (8, 0.25, 16)
    reloaded = RefusionForCausalLM.from_pretrained(tmp_path)
    config = reloaded.generation_config
    assert isinstance(config, RefusionGenerationConfig)
    assert (config.slot_size, config.token_threshold, config.block_size, config.eos_token_id) == (8, 0.25, 16, 1)


def test_plain_generation_config_is_upcast_without_losing_values(model64):
    model64_config = model64.generation_config
    try:
        model64.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0, max_new_tokens=5)
        assert isinstance(model64.generation_config, RefusionGenerationConfig)
        assert model64.generation_config.max_new_tokens == 5
        assert model64.generate(PROMPT, slot_size=1).shape == (1, 13)
    finally:
        model64.generation_config = model64_config


def test_passed_plain_config_keeps_the_models_fields_it_leaves_unset(tmp_path, fixture_path):
    """Stock merge semantics: a plain GenerationConfig(max_new_tokens=32) changes the length only; the checkpoint's
    tuned decoding settings stay."""
    model = RefusionForCausalLM.from_pretrained(fixture_path, dtype=torch.float64).eval()
    model.generation_config.update(slot_size=4, block_size=8, slot_threshold=0.6, token_threshold=0.3)
    tuned = model.generate(PROMPT, max_new_tokens=32, return_dict_in_generate=True)
    for config in (GenerationConfig(max_new_tokens=32), RefusionGenerationConfig(max_new_tokens=32)):
        merged = model.generate(PROMPT, generation_config=config, return_dict_in_generate=True)
        assert torch.equal(merged.sequences, tuned.sequences)
        assert merged.chosen_slots == tuned.chosen_slots
    class_defaults = model.generate(PROMPT, max_new_tokens=32, slot_size=32, block_size=128, slot_threshold=0.9,
                                    token_threshold=0.4, return_dict_in_generate=True)  # fmt: skip
    assert class_defaults.chosen_slots != tuned.chosen_slots, "the settings do matter here"


def test_config_argument_and_overrides(model64):
    config = RefusionGenerationConfig(max_new_tokens=12, slot_size=4, slot_threshold=0.6, token_threshold=0.3)
    by_config = model64.generate(PROMPT, generation_config=config)
    by_kwargs = model64.generate(PROMPT, max_new_tokens=12, slot_size=4, slot_threshold=0.6, token_threshold=0.3)
    assert torch.equal(by_config, by_kwargs)
    overridden = model64.generate(PROMPT, generation_config=config, max_new_tokens=6)
    assert overridden.shape == (1, 14)
    assert config.max_new_tokens == 12, "the caller's config object is not modified"
    assert model64.generation_config.slot_size is None, "nor is the model's (the fixture sets no slot size)"


def test_hf_positional_signature_and_autoregressive_only_arguments(model64):
    config = RefusionGenerationConfig(max_new_tokens=12, slot_size=4, slot_threshold=0.6, token_threshold=0.3)
    assert torch.equal(model64.generate(PROMPT, config), model64.generate(input_ids=PROMPT, generation_config=config))
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    assert (
        model64.generate(PROMPT, logits_processor=LogitsProcessorList(), max_new_tokens=4, slot_size=4).shape[1] <= 12
    )
    with pytest.raises(ValueError, match=r"`logits_processor` is not supported by ReFusion decoding.*autoregressive"):
        model64.generate(PROMPT, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]), max_new_tokens=4)
    out = model64.generate(
        PROMPT, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]), max_new_tokens=4,
        decoding="autoregressive",
    )  # fmt: skip
    assert out.shape == (1, 12)


def test_refusion_generate_has_exactly_stock_generates_parameters():
    """The function behind `generate()` and `custom_generate/generate.py` takes stock's parameters (names, kinds,
    defaults), model first: no private hooks on the public signature."""
    import inspect

    from transformers import GenerationMixin

    from refusion_hf.generation.refusion_generate import refusion_generate

    ours = list(inspect.signature(refusion_generate).parameters.values())
    stock = list(inspect.signature(GenerationMixin.generate).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[1:]] == [(p.name, p.kind, p.default) for p in stock[1:]]


def test_every_generate_signature_is_derived_from_the_declared_stock_arguments():
    """Issue 56: stock generate's and generate_batch's named arguments are declared once (`STOCK_ARGUMENTS`,
    `STOCK_BATCH_ARGUMENTS`, with how ReFusion decoding treats each); the mixin's `generate` / `generate_batch` and
    the functions behind them take exactly stock's parameters (names, kinds, defaults), and a positional call binds
    as stock's would."""
    import inspect

    from transformers import GenerationMixin

    from refusion_hf.generation.generate_batch import refusion_generate_batch
    from refusion_hf.generation.refusion_generate import refusion_generate
    from refusion_hf.generation.stock_fields import STOCK_ARGUMENTS, STOCK_BATCH_ARGUMENTS

    def parameters(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()][1:]

    stock_generate, stock_batch = parameters(GenerationMixin.generate), parameters(GenerationMixin.generate_batch)
    assert [name for name, _, _ in stock_generate[2:-2]] == list(STOCK_ARGUMENTS)
    assert [name for name, _, _ in stock_batch[2:-1]] == list(STOCK_BATCH_ARGUMENTS)
    assert parameters(RefusionForCausalLM.generate) == parameters(refusion_generate) == stock_generate
    assert parameters(RefusionForCausalLM.generate_batch) == parameters(refusion_generate_batch) == stock_batch


def test_a_plain_generation_config_passed_in_is_not_modified(model64):
    config = GenerationConfig(max_new_tokens=12, eos_token_id=[2, 60])
    before = config.to_dict()
    assert model64.generate(PROMPT, generation_config=config, slot_size=4, max_new_tokens=6).shape[1] <= 14
    assert config.to_dict() == before and config.eos_token_id == [2, 60]


def test_sampling_is_reproducible_with_manual_seed(model64):
    knobs = dict(KNOBS, do_sample=True, max_new_tokens=32, token_threshold=0.0)
    torch.manual_seed(0)
    first = model64.generate(PROMPT, **knobs)
    torch.manual_seed(0)
    second = model64.generate(PROMPT, **knobs)
    draws = set()
    for seed in range(5):
        torch.manual_seed(seed)
        draws.add(tuple(model64.generate(PROMPT, **knobs)[0].tolist()))
    assert torch.equal(first, second)
    assert len(draws) > 1, "do_sample=True samples"


def test_planning_ahead_draws_the_same_samples(model64):
    """A plan that rides along draws its samples only when it is used, so sampling consumes the random stream
    exactly as without planning ahead."""
    knobs = dict(KNOBS, do_sample=True, top_k=0, max_new_tokens=32, token_threshold=0.1)
    for seed in range(4):
        torch.manual_seed(seed)
        ahead = model64.generate(PROMPT, return_dict_in_generate=True, **knobs)
        torch.manual_seed(seed)
        alone = model64.generate(PROMPT, return_dict_in_generate=True, plan_ahead=False, **knobs)
        assert torch.equal(ahead.sequences, alone.sequences)
        assert ahead.num_forward_passes < alone.num_forward_passes, "the plans that rode along were used"


def test_autoregressive_fallback_is_stock_greedy_decoding(model64, fixture_path):
    stock = Qwen3ForCausalLM.from_pretrained(fixture_path, dtype=torch.float64).eval()
    ours = model64.generate(PROMPT, decoding="autoregressive", max_new_tokens=10)
    theirs = stock.generate(PROMPT, max_new_tokens=10, do_sample=False)
    assert torch.equal(ours, theirs)


def test_autoregressive_fallback_keeps_left_padding_semantics(model64):
    ids = torch.tensor([[0, 0, 32, 24, 53], [61, 61, 33, 51, 20]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    batch = model64.generate(ids, attention_mask=mask, decoding="autoregressive", max_new_tokens=6)
    alone = model64.generate(ids[:1, 2:], decoding="autoregressive", max_new_tokens=6)
    assert torch.equal(batch[0, 5:], alone[0, 3:])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(slot_size=0), r"`slot_size` must be an integer >= 1"),
        (dict(slot_size=4, block_size=6), r"`block_size` must be a positive multiple of `slot_size` \(4\)"),
        (dict(slot_size=4, block_size=0), r"`block_size` must be a positive multiple"),
        (dict(slot_threshold=float("nan")), r"`slot_threshold` must be a number"),
        (dict(token_threshold=-0.1), r"`token_threshold` must be a number >= 0"),
        (dict(max_new_tokens=0), r"`max_new_tokens` must be greater than 0"),
        (dict(temperature=-1.0), r"`temperature` must be >= 0"),
        (dict(decoding="beam"), r"`decoding` must be one of"),
        (dict(plan_ahead="yes"), r"`plan_ahead` must be True or False"),
        (dict(no_such_knob=1), r"ReFusion decoding does not use: \['no_such_knob'\]"),
        (dict(max_new_tokens="8"), r"`max_new_tokens` must be an integer, got '8'"),
        (dict(max_new_tokens=True), r"`max_new_tokens` must be an integer, got True"),
        (dict(temperature="1"), r"`temperature` must be a number, got '1'"),
        (dict(eos_token_id=[[1]]), r"`eos_token_id` must be a token id or a flat list of token ids"),
        (dict(eos_token_id=64), r"`eos_token_id` \[64\] is outside the vocabulary \(0 .. 63\)"),
        (dict(pad_token_id=100), r"`pad_token_id` \[100\] is outside the vocabulary"),
        (dict(mask_token_id=-1), r"`mask_token_id` must be a token id"),
        (dict(do_sample="yes"), r"`do_sample` must be True or False"),
        (dict(do_sample=True, top_p=2.0), r"`top_p` must be in \[0.0, 1.0\], got 2.0"),
        (dict(do_sample=True, temperature=0.0), r"`temperature` \(=0.0\) has to be a strictly positive float"),
        (dict(num_return_sequences=2), r"`num_return_sequences` different than 1"),
        (dict(stop_strings=["t9"]), r"could not locate a tokenizer"),
        (dict(suppress_tokens=[[4]]), r"`suppress_tokens` must be a list of token ids"),
    ],
)
def test_bad_arguments_name_the_argument(model64, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model64.generate(PROMPT, **kwargs)


@pytest.mark.parametrize("decoding", ["refusion", "autoregressive"])
def test_stop_strings_a_tokenizer_cannot_match_name_the_argument(model64, decoding):
    """transformers' StopStringCriteria cannot read a word-level vocabulary (the fixture's): its bare "substring not
    found" becomes a ValueError naming `stop_strings` (a server answers it as a 4xx naming the field)."""
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    with pytest.raises(ValueError, match=r"`stop_strings` \['t9'\]: transformers' StopStringCriteria cannot read"):
        model64.generate(PROMPT, stop_strings=["t9"], tokenizer=tokenizer, decoding=decoding, max_new_tokens=4)


def test_bad_inputs_name_the_argument(model64):
    with pytest.raises(ValueError, match=r"contains the mask token \(id 3\)"):
        model64.generate(torch.tensor([[5, 3, 6]]), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"right padding.*padding_side = 'left'"):
        model64.generate(torch.tensor([[5, 6, 0]]), attention_mask=torch.tensor([[1, 1, 0]]), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"empty batch"):
        model64.generate(torch.zeros(0, 4, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"`attention_mask` has shape"):
        model64.generate(PROMPT, attention_mask=torch.ones(1, 3), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"`streamer` follows one sequence"):
        model64.generate(PROMPT.repeat(2, 1), streamer=object(), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"`input_ids` holds ids outside the vocabulary \(0 .. 63\)"):
        model64.generate(torch.tensor([[5, 64]]), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"`input_ids` must hold integer token ids, got dtype torch.float32"):
        model64.generate(PROMPT.float(), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"`input_ids` must be a 2-D tensor"):
        model64.generate(PROMPT[0], max_new_tokens=4)
    for decoding in ("refusion", "autoregressive"):  # both paths check ids and lengths
        with pytest.raises(ValueError, match=r"outside the vocabulary"):
            model64.generate(torch.tensor([[5, 99]]), max_new_tokens=4, decoding=decoding)
        with pytest.raises(ValueError, match=r"`max_new_tokens` must be an integer"):
            model64.generate(PROMPT, max_new_tokens=2.5, decoding=decoding)


def test_missing_eos_is_reported():
    model = tiny_refusion_model(vocab_size=16, mask_token_id=3, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"needs an EOS token: pass `eos_token_id=`"):
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, slot_size=2)
    assert model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, slot_size=2, eos_token_id=1).shape == (1, 6)


def test_attention_mask_is_inferred_from_padding_as_in_stock(model64):
    """lm-eval's HFLM passes left-padded `input_ids` without a mask: like stock generate, the mask comes from
    `pad_token_id` (when it differs from EOS)."""
    ids = torch.tensor([[PAD, PAD, PAD] + PROMPT[0, :5].tolist(), PROMPT[0].tolist()])
    mask = (ids != PAD).long()
    knobs = dict(max_new_tokens=12, slot_size=4, slot_threshold=0.6, token_threshold=0.3)
    assert torch.equal(model64.generate(ids, **knobs), model64.generate(ids, attention_mask=mask, **knobs))


def test_a_callers_max_length_wins_over_the_checkpoints_max_new_tokens(fixture_path):
    model = RefusionForCausalLM.from_pretrained(fixture_path, dtype=torch.float64).eval()
    model.generation_config.max_new_tokens = 4
    knobs = dict(slot_size=4, slot_threshold=0.6, token_threshold=0.3)
    assert model.generate(PROMPT, **knobs).shape[1] <= 8 + 4
    assert model.generate(PROMPT, max_length=8 + 12, **knobs).shape[1] == 8 + 12  # lm-eval's max_gen_toks
    assert model.generate(PROMPT, max_new_tokens=6, **knobs).shape[1] == 8 + 6


def test_presets_are_the_authors_settings(model64):
    from refusion_hf.generation.refusion_generation_config import DECODING_PRESETS

    assert DECODING_PRESETS["gsm8k_cot"] == dict(slot_size=32, block_size=128, slot_threshold=0.9, token_threshold=0.4)
    assert DECODING_PRESETS["gpqa_main_generative_n_shot"]["block_size"] == 512 // 32
    config = RefusionGenerationConfig.from_preset("minerva_math", token_threshold=0.5)
    assert (config.slot_size, config.block_size, config.slot_threshold, config.token_threshold) == (32, 64, 0.8, 0.5)
    assert config.max_new_tokens == 512
    by_preset = model64.generate(PROMPT, preset="arc_challenge_chat", max_new_tokens=16, return_dict_in_generate=True)
    explicit = model64.generate(PROMPT, max_new_tokens=16, slot_size=8, block_size=8, slot_threshold=0.8,
                                token_threshold=0.1, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(by_preset.sequences, explicit.sequences) and by_preset.chosen_slots == explicit.chosen_slots
    with pytest.raises(ValueError, match=r"`preset` must be one of \['arc_challenge_chat'"):
        model64.generate(PROMPT, preset="squad")
    assert model64.generate(PROMPT, preset="mbpp", decoding="autoregressive", max_new_tokens=5).shape == (1, 13)


def test_special_ids_equal_to_the_mask_are_refused(model64):
    """The answer's masks are filled with drafts: the mask can be neither its end nor its padding (ReFusion only:
    the mask means nothing to left-to-right decoding, where stock generate takes them)."""
    for kwargs, name in (
        (dict(eos_token_id=MASK), "eos_token_id"),
        (dict(eos_token_id=[EOS, MASK]), "eos_token_id"),
        (dict(mask_token_id=EOS), "eos_token_id"),
        (dict(pad_token_id=MASK), "pad_token_id"),
    ):
        message = rf"`{name}` equals the mask token id \({kwargs.get('mask_token_id', MASK)}\)"
        with pytest.raises(ValueError, match=message):
            model64.generate(PROMPT, max_new_tokens=4, **kwargs)
        with pytest.raises(ValueError, match=message):
            model64.generate_batch(PROMPT.tolist(), max_new_tokens=4, **kwargs)
    out = model64.generate(PROMPT, max_new_tokens=4, eos_token_id=MASK, pad_token_id=MASK, decoding="autoregressive")
    assert out.shape == (1, 12)


def test_a_generation_config_that_is_not_one_is_refused(model64):
    message = r"`generation_config` must be a `GenerationConfig` \(or None\), got dict: pass `RefusionGenerationConfig"
    for call in (
        lambda config: model64.generate(PROMPT, generation_config=config),
        lambda config: model64.generate(PROMPT, config),
        lambda config: model64.generate(PROMPT, generation_config=config, decoding="autoregressive"),
        lambda config: model64.generate_batch([[5, 6]], generation_config=config),
        lambda config: model64.generate_batch([[5, 6]], generation_config=config, decoding="autoregressive"),
    ):
        with pytest.raises(ValueError, match=message):
            call({"max_new_tokens": 4})


@pytest.mark.parametrize("decoding", ["refusion", "autoregressive"])
def test_without_inputs_generation_starts_from_bos(model64, decoding):
    """As stock generate (transformers' `test_generate_without_input_ids`): neither `input_ids` nor `inputs_embeds`
    starts each row from `bos_token_id` (one row, or as many as `attention_mask` has); without a BOS, stock's error."""
    bos = model64.generation_config.bos_token_id
    from_bos = model64.generate(torch.tensor([[bos]]), max_new_tokens=6, decoding=decoding, do_sample=False)
    assert torch.equal(model64.generate(max_new_tokens=6, decoding=decoding, do_sample=False), from_bos)
    rows = torch.ones(2, 1, dtype=torch.long)
    assert torch.equal(
        model64.generate(attention_mask=rows, max_new_tokens=6, decoding=decoding, do_sample=False),
        from_bos.repeat(2, 1),
    )
    with pytest.raises(ValueError, match=r"`bos_token_id` has to be defined when no `input_ids` are provided"):
        model64.generate(max_new_tokens=6, decoding=decoding, bos_token_id=None)


def test_without_inputs_autoregressive_decoding_is_stocks(model64, fixture_path):
    stock = Qwen3ForCausalLM.from_pretrained(fixture_path, dtype=torch.float64).eval()
    ours = model64.generate(max_new_tokens=6, decoding="autoregressive", do_sample=False)
    assert torch.equal(ours, stock.generate(max_new_tokens=6, do_sample=False))


def test_generate_batch_merges_the_generation_config_once(model64, monkeypatch):
    """Issue 56: `generate_batch` merges the configuration once (as `generate()` does) and decodes from it."""
    from refusion_hf.generation import generate_batch, refusion_generate

    merges = []
    for module in (refusion_generate, generate_batch):
        if hasattr(module, "merge_generation_config"):
            merge = module.merge_generation_config
            monkeypatch.setattr(
                module, "merge_generation_config", lambda *a, merge=merge, **k: merges.append(1) or merge(*a, **k)
            )
    out = model64.generate_batch([[5, 6, 7]], max_new_tokens=4, slot_size=4)
    assert merges == [1]
    assert 1 <= len(out["req_0"].generated_tokens) <= 4
