"""The network is exactly Qwen3's: logits equal stock `Qwen3ForCausalLM` with the same weights."""

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    DynamicCache,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForQuestionAnswering,
    Qwen3ForSequenceClassification,
    Qwen3ForTokenClassification,
    Qwen3Model,
)

from refusion_hf import RefusionConfig, RefusionForCausalLM
from refusion_hf._compat.transformers import cache_argument

PROMPT = torch.tensor([[61, 61, 33, 51, 20, 31, 13, 32, 23, 6, 13, 40]])
# A ReFusion-style buffer: prompt, then slots in generation order (not position order).
PERMUTED = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 12, 13, 14, 15, 20, 21]])
TOKENS = torch.tensor([[61, 61, 33, 51, 20, 31, 13, 32, 23, 6, 13, 40, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])


@pytest.fixture(scope="module")
def stock64(fixture_path):
    return Qwen3ForCausalLM.from_pretrained(fixture_path, dtype=torch.float64).eval()


def ones(n):
    return torch.ones(1, n, dtype=torch.long)


def test_fixture_weights_are_loaded_unchanged(model64, stock64):
    ours, theirs = model64.state_dict(), stock64.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_permuted_positions_without_cache(model64, stock64):
    ours = model64(input_ids=TOKENS, position_ids=PERMUTED, attention_mask=ones(22), use_cache=False).logits
    theirs = stock64(input_ids=TOKENS, position_ids=PERMUTED, attention_mask=ones(22), use_cache=False).logits
    assert torch.equal(ours, theirs)


def test_permuted_positions_with_cache(model64, stock64):
    results = []
    for model in (model64, stock64):
        cache = DynamicCache(config=model.config)
        model(input_ids=TOKENS[:, :12], position_ids=PERMUTED[:, :12], **cache_argument(cache), use_cache=True)
        out = model(
            input_ids=TOKENS[:, 12:],
            position_ids=PERMUTED[:, 12:],
            attention_mask=ones(22),
            **cache_argument(cache),
            use_cache=True,
        )
        results.append(out.logits)
    assert torch.equal(*results)
    # and the cached run equals the one-shot run
    one_shot = model64(input_ids=TOKENS, position_ids=PERMUTED, attention_mask=ones(22)).logits[:, 12:]
    torch.testing.assert_close(results[0], one_shot, rtol=1e-10, atol=1e-10)


def test_left_padding_matches_unpadded(model64, stock64):
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), PROMPT], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), ones(12)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ours = model64(input_ids=padded, attention_mask=mask, position_ids=positions).logits[:, 3:]
    theirs = stock64(input_ids=padded, attention_mask=mask, position_ids=positions).logits[:, 3:]
    alone = stock64(input_ids=PROMPT).logits
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(ours, alone, rtol=1e-10, atol=1e-10)


def test_additive_4d_block_diagonal_mask(model64, stock64):
    """Two slots packed in one row that must not see each other: an additive float 4D mask."""
    cache_len, k = 12, 4
    allowed = torch.zeros(1, 1, 2 * k, cache_len + 2 * k, dtype=torch.bool)
    allowed[..., :cache_len] = True
    for s in range(2):
        block = slice(cache_len + s * k, cache_len + (s + 1) * k)
        allowed[0, 0, s * k : (s + 1) * k, block] = torch.ones(k, k, dtype=torch.bool).tril()
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    slots = torch.tensor([[7, 8, 9, 10, 11, 12, 13, 14]])
    positions = torch.tensor([[16, 17, 18, 19, 12, 13, 14, 15]])
    results = []
    for model in (model64, stock64):
        cache = DynamicCache(config=model.config)
        model(input_ids=PROMPT, **cache_argument(cache), use_cache=True)
        results.append(
            model(input_ids=slots, position_ids=positions, attention_mask=mask, **cache_argument(cache)).logits
        )
    assert torch.equal(*results)
    # each packed slot equals that slot run alone on the prompt
    for s in range(2):
        cache = DynamicCache(config=model64.config)
        model64(input_ids=PROMPT, **cache_argument(cache), use_cache=True)
        span = slice(s * k, (s + 1) * k)
        alone = model64(
            input_ids=slots[:, span], position_ids=positions[:, span], attention_mask=ones(16), **cache_argument(cache)
        ).logits
        torch.testing.assert_close(results[0][:, span], alone, rtol=1e-10, atol=1e-10)


def test_the_cache_is_taken_as_cache_or_past_key_values_on_every_release(model64):
    """`cache=` (transformers >= 5.24's name) and `past_key_values=` (the name before; deprecated from 5.24) both
    reach the stock forward on every supported release; both at once is refused."""
    one_shot = model64(input_ids=TOKENS).logits[:, 12:]
    for name in ("cache", "past_key_values"):
        cache = DynamicCache(config=model64.config)
        model64(input_ids=TOKENS[:, :12], use_cache=True, **{name: cache})
        assert cache.get_seq_length() == 12, name
        rest = model64(input_ids=TOKENS[:, 12:], use_cache=True, **{name: cache}).logits
        torch.testing.assert_close(rest, one_shot, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="`cache` and `past_key_values` were both given"):
        model64(input_ids=PROMPT, cache=DynamicCache(config=model64.config), past_key_values=cache)


# Two sequences packed in one row, padding-free: the position ids restart where the second one begins.
FIRST, SECOND = PROMPT[:, :7], TOKENS[:, 12:17]
PACKED = torch.cat([FIRST, SECOND], dim=1)
PACKED_POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])


def pair(fixture_path, attn_implementation):
    """Ours and stock Qwen3 with the fixture's weights, float64, one attention implementation."""
    load = dict(dtype=torch.float64, attn_implementation=attn_implementation)
    ours = RefusionForCausalLM.from_pretrained(fixture_path, **load).eval()
    return ours, Qwen3ForCausalLM.from_pretrained(fixture_path, **load).eval()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_padding_free_packing_is_stocks(fixture_path, attn_implementation):
    """Without ReFusion's training fields, position-id restarts without a mask are packed sequences, as in stock
    Qwen3 (transformers' DataCollatorWithFlattening, TRL's padding-free batches): each attends only to itself."""
    ours, stock = pair(fixture_path, attn_implementation)
    labels = PACKED.clone()
    labels[:, 7] = -100  # the second sequence's first token is not predicted from the first sequence
    for use_cache in (False, None):  # None: config.use_cache, under which stock builds a cache and does not unpack
        inputs = dict(input_ids=PACKED, position_ids=PACKED_POSITIONS, labels=labels, use_cache=use_cache)
        mine, theirs = ours(**inputs), stock(**inputs)
        assert torch.equal(mine.logits, theirs.logits)
        assert torch.equal(mine.loss, theirs.loss)
    packed = ours(input_ids=PACKED, position_ids=PACKED_POSITIONS, use_cache=False).logits
    # eager's softmax runs in float32 whatever the dtype: a row of 12 columns and one of 7 may round apart there
    tolerance = 1e-10 if attn_implementation == "sdpa" else 1e-5
    torch.testing.assert_close(packed[:, :7], ours(input_ids=FIRST).logits, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(packed[:, 7:], ours(input_ids=SECOND).logits, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_refusion_training_layout_keeps_causal_attention_over_the_row(fixture_path, attn_implementation):
    """A `RefusionDataCollator` batch (`mdm_weights`) has permuted position ids on purpose: without an attention
    mask it still attends causally over the whole row, as with the collator's mask and as stock Qwen3 with an
    all-ones mask, not as stock without one (which would cut attention at every position jump)."""
    from refusion_hf import RefusionDataCollator

    ours, stock = pair(fixture_path, attn_implementation)
    collator = RefusionDataCollator(mask_token_id=3, pad_token_id=0, slot_sizes=(2,), seed=1)
    batch = collator([{"input_ids": TOKENS[0].tolist(), "prompt_length": 12}])
    positions = batch["position_ids"]
    assert (positions.diff() != 1).any(), "the draw must permute some slots for this test to mean anything"
    unmasked = {name: value for name, value in batch.items() if name != "attention_mask"}
    with_mask, without_mask = ours(**batch), ours(**unmasked)
    assert torch.equal(without_mask.logits, with_mask.logits)
    assert torch.equal(without_mask.loss, with_mask.loss)
    ids = batch["input_ids"]
    causal = stock(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids), use_cache=False)
    assert torch.equal(without_mask.logits, causal.logits)
    cut = stock(input_ids=ids, position_ids=positions, use_cache=False)
    assert not torch.allclose(cut.logits, causal.logits), "stock no longer cuts attention at position jumps"


def test_logits_to_keep_is_stocks(model64, stock64):
    assert model64._supports_logits_to_keep()
    for keep in (1, 3, torch.tensor([0, 5, 11])):
        ours = model64(input_ids=PROMPT, logits_to_keep=keep).logits
        assert torch.equal(ours, stock64(input_ids=PROMPT, logits_to_keep=keep).logits)
    assert model64(input_ids=PROMPT, logits_to_keep=1).logits.shape == (1, 1, 64)
    with pytest.raises(ValueError, match="`logits_to_keep` must be 0 with the ReFusion loss"):
        model64(input_ids=PROMPT, labels=PROMPT, mdm_weights=torch.ones(1, 12), logits_to_keep=1)


@pytest.fixture(scope="module")
def refusion_folder(fixture_path, tmp_path_factory):
    """The fixture saved by `RefusionForCausalLM` (config.json says `model_type: refusion`)."""
    folder = tmp_path_factory.mktemp("refusion")
    RefusionForCausalLM.from_pretrained(fixture_path).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "head", [Qwen3ForSequenceClassification, Qwen3ForTokenClassification, Qwen3ForQuestionAnswering]
)
def test_qwen3_task_heads_on_a_refusion_config_get_the_base_model(fixture_path, refusion_folder, head):
    """`AutoModel` maps a RefusionConfig to the LM head (for users, as the official checkpoint's auto_map does);
    a transformers task head, which builds its backbone with `AutoModel.from_config`, gets the base model and
    equals the same head built on a plain Qwen3Config."""
    config = AutoConfig.from_pretrained(refusion_folder)
    assert type(config) is RefusionConfig
    assert type(AutoModel.from_config(config)) is RefusionForCausalLM
    backbone = head.base_model_prefix  # "model", or "transformer" for question answering
    assert type(getattr(head(config), backbone)) is Qwen3Model
    model = head.from_pretrained(refusion_folder, config=config, dtype=torch.float64).eval()
    assert type(model.config) is RefusionConfig and type(getattr(model, backbone)) is Qwen3Model
    stock = head.from_pretrained(fixture_path, dtype=torch.float64).eval()  # official config.json: a Qwen3Config
    assert type(stock.config) is Qwen3Config
    ours_weights, stock_weights = model.state_dict(), stock.state_dict()
    assert ours_weights.keys() == stock_weights.keys()
    if backbone == "model":  # stock's question-answering head calls it `transformer`: no LM checkpoint loads there
        loaded = [name for name in ours_weights if name.startswith("model.")]
        assert all(torch.equal(ours_weights[name], stock_weights[name]) for name in loaded)
    stock.load_state_dict(ours_weights)  # the newly initialised layers, the same in both
    ours, theirs = model(input_ids=PROMPT, use_cache=False), stock(input_ids=PROMPT, use_cache=False)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours.keys())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_save_load_round_trip_keeps_logits(fixture_path, tmp_path, dtype):
    model = RefusionForCausalLM.from_pretrained(fixture_path, dtype=dtype).eval()
    model.save_pretrained(tmp_path)
    reloaded = RefusionForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    assert reloaded.dtype == dtype
    before = model(input_ids=TOKENS, position_ids=PERMUTED).logits
    after = reloaded(input_ids=TOKENS, position_ids=PERMUTED).logits
    assert torch.equal(before, after)
