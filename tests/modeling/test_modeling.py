"""The network is exactly Qwen3's: logits equal stock `Qwen3ForCausalLM` with the same weights."""

import pytest
import torch
from transformers import DynamicCache, Qwen3ForCausalLM

from refusion_hf import RefusionForCausalLM

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
        model(input_ids=TOKENS[:, :12], position_ids=PERMUTED[:, :12], cache=cache, use_cache=True)
        out = model(
            input_ids=TOKENS[:, 12:],
            position_ids=PERMUTED[:, 12:],
            attention_mask=ones(22),
            cache=cache,
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
        model(input_ids=PROMPT, cache=cache, use_cache=True)
        results.append(model(input_ids=slots, position_ids=positions, attention_mask=mask, cache=cache).logits)
    assert torch.equal(*results)
    # each packed slot equals that slot run alone on the prompt
    for s in range(2):
        cache = DynamicCache(config=model64.config)
        model64(input_ids=PROMPT, cache=cache, use_cache=True)
        span = slice(s * k, (s + 1) * k)
        alone = model64(
            input_ids=slots[:, span], position_ids=positions[:, span], attention_mask=ones(16), cache=cache
        ).logits
        torch.testing.assert_close(results[0][:, span], alone, rtol=1e-10, atol=1e-10)


def test_packed_sequence_trap_cannot_hit_our_model(model64, stock64):
    """transformers 5.24 treats non-monotonic position_ids without a mask and without a cache as packed
    sequences (attention cut at each position jump). Ours always attends causally over the whole buffer."""
    reference = stock64(input_ids=TOKENS, position_ids=PERMUTED, attention_mask=ones(22), use_cache=False).logits
    trapped = stock64(input_ids=TOKENS, position_ids=PERMUTED, use_cache=False).logits
    assert not torch.allclose(trapped, reference), "the trap no longer exists in this transformers version"
    ours = model64(input_ids=TOKENS, position_ids=PERMUTED, use_cache=False).logits
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_save_load_round_trip_keeps_logits(fixture_path, tmp_path, dtype):
    model = RefusionForCausalLM.from_pretrained(fixture_path, dtype=dtype).eval()
    model.save_pretrained(tmp_path)
    reloaded = RefusionForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    assert reloaded.dtype == dtype
    before = model(input_ids=TOKENS, position_ids=PERMUTED).logits
    after = reloaded(input_ids=TOKENS, position_ids=PERMUTED).logits
    assert torch.equal(before, after)
