"""Long prompts at stock cost (issue 38): the prompt is prefilled through the causal path with no mask over it, every
later query builds only its own rows, and peak memory grows linearly with the prompt; the split attention equals
the dense one it replaces, on both backends; lengths past what the answer can use allocate nothing."""

import sys

import pytest
import torch
from transformers import DynamicCache

from refusion_hf._compat.transformers import cache_argument
from refusion_hf.generation import ragged_kv_cache
from refusion_hf.generation import split_attention as split_attention_module
from refusion_hf.generation.split_attention import IMPLEMENTATIONS, SplitMask, split_attention
from tests.generation.test_memory import peak_growth_kib
from tests.oracle import generate_kwargs, load_cases, mismatch
from tests.tiny_models import tiny_refusion_model

CASES = load_cases()


def _recorded_masks(monkeypatch, split_from: int = 0) -> list[SplitMask]:
    """Every mask the decoder builds from now on, in order; contexts split from `split_from` entries per row on
    (0: every context)."""
    monkeypatch.setattr(ragged_kv_cache, "SPLIT_FROM", split_from)
    masks = []
    build = ragged_kv_cache.RaggedKVCache.attention_mask

    def recording(self, *args, **kwargs):
        masks.append(build(self, *args, **kwargs))
        return masks[-1]

    monkeypatch.setattr(ragged_kv_cache.RaggedKVCache, "attention_mask", recording)
    return masks


def test_the_prompt_is_prefilled_with_no_mask_over_it(model32, monkeypatch):
    """The first forward's context rows get no mask at all (sdpa's causal kernel); its scored rows' mask is
    [S, C + S] with S the plan's masks; no later mask is wider than the cache plus its own query."""
    masks = _recorded_masks(monkeypatch)
    prompt = torch.randint(4, 60, (1, 300), generator=torch.Generator().manual_seed(0))
    model32.generate(prompt, max_new_tokens=16, slot_size=4, block_size=8)
    first = masks[0]
    assert first.context_width == 300 and first.context is None
    assert first.scored.shape == (1, 1, 8, 300 + 8)  # the block's two slots of masks
    for mask in masks[1:]:
        s = mask.scored.shape[2]
        assert s <= 8 + 8 and mask.scored.shape[3] <= 300 + 16 + s  # cache (prompt + answer) + query
        assert mask.context_width == 0 or mask.context.shape[2] == mask.context_width


def test_a_padded_batch_gets_a_boolean_context_mask_as_stock_does(model32, monkeypatch):
    """Prompts of different lengths: the context rows need their pads blocked, as stock's padded prefill does (a
    boolean [B, 1, C, C]); each row's answer equals its answer alone."""
    masks = _recorded_masks(monkeypatch)
    generator = torch.Generator().manual_seed(1)
    long, short = torch.randint(4, 60, (1, 40), generator=generator), torch.randint(4, 60, (1, 25), generator=generator)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 15, dtype=torch.long), short], dim=1)])
    mask = torch.cat([torch.ones(1, 40), torch.cat([torch.zeros(1, 15), torch.ones(1, 25)], dim=1)]).long()
    knobs = dict(max_new_tokens=12, slot_size=4, block_size=8, pad_token_id=0)
    together = model32.generate(ids, attention_mask=mask, **knobs)
    first = masks[0]
    assert first.context.dtype == torch.bool and first.context.shape == (2, 1, 40, 40)
    assert not first.context[1, 0, 20, :15].any() and first.context[1, 0, 20, 15:21].all()  # pads blocked
    for row, prompt in enumerate((long, short)):
        alone = model32.generate(prompt, **knobs)
        assert together[row, 40:].tolist()[: alone.shape[1] - prompt.shape[1]] == alone[0, prompt.shape[1] :].tolist()


def test_a_short_context_is_fed_with_one_dense_mask_and_decodes_as_split(model32, monkeypatch):
    """Below `SPLIT_FROM` entries per context row, the forward gets one dense additive [B, 1, C + S, T + C + S]
    mask for all its rows (context width 0: one kernel call per layer); at and above it, the split one. Same tokens
    and forward passes either way, on a padded batch too."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 60, (2, 40), generator=generator)
    ids[1, :9] = 0
    mask = (ids != 0).long()
    knobs = dict(max_new_tokens=12, slot_size=4, block_size=8, pad_token_id=0, return_dict_in_generate=True)
    masks = _recorded_masks(monkeypatch, split_from=40 * 48 + 1)  # the prompt's rows: 40 * (40 + 8) entries
    dense = model32.generate(ids, attention_mask=mask, **knobs)
    first = masks[0].scored
    assert masks[0].context_width == 0 and masks[0].context is None
    assert first.shape == (2, 1, 40 + 8, 40 + 8) and first.dtype == torch.float32
    assert (first[1, 0, 20, :9] < 0).all() and (first[1, 0, 20, 9:21] == 0).all()  # pads blocked, causal
    assert (first[0, 0, :40, 40:] < 0).all()  # the context does not see the scored tokens
    masks.clear()
    monkeypatch.setattr(ragged_kv_cache, "SPLIT_FROM", 40 * 48)
    split = model32.generate(ids, attention_mask=mask, **knobs)
    assert isinstance(masks[0], SplitMask) and masks[0].context_width == 40
    assert split.sequences.tolist() == dense.sequences.tolist()
    assert split.num_forward_passes == dense.num_forward_passes


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("cached", [0, 6], ids=["empty-cache", "filled-cache"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4], ids=["4-query-heads-per-kv", "2-per-kv", "no-grouping"])
@pytest.mark.parametrize(
    "pack_from, grouped_devices", [(0, ()), (2**62, ("cpu",)), (2**62, ())], ids=["packed", "grouped", "repeated"]
)
def test_split_attention_equals_the_dense_mask_it_replaces(
    backend, cached, kv_heads, pack_from, grouped_devices, monkeypatch
):
    """One forward with a `SplitMask` gives the logits of the same forward with the dense [C + S, T + C + S] mask,
    with an empty cache (causal context, no mask) and a filled one with holes (context sees the valid entries); with
    grouped query heads (the scored rows packed by key/value head from a long enough cache, run grouped by sdpa's
    `enable_gqa` below it on CPU, or on repeated key/value heads as transformers' backends do) and without. Equal at
    a stated tolerance, not bit for bit: the two forwards call other kernels that sum in other orders (and the CPU's
    instruction set, AVX2 or AVX-512/AMX, picks the blocking), so in float64 they agree to 1e-10 (sdpa), and to 1e-6
    on eager, whose softmax runs in float32."""
    monkeypatch.setattr(split_attention_module, "PACK_FROM", pack_from)
    monkeypatch.setattr(split_attention_module, "GROUPED_SDPA_DEVICES", grouped_devices)
    torch.manual_seed(0)
    model = tiny_refusion_model(attn_implementation=backend, num_attention_heads=4, num_key_value_heads=kv_heads)
    model = model.double()
    c, s = 5, 4
    past = torch.randint(4, 60, (1, cached))
    valid = torch.ones(1, cached, dtype=torch.bool)
    valid[0, 1:3] = False  # holes the new tokens must not see
    ids = torch.randint(4, 60, (1, c + s))
    visible = torch.rand(s, s) > 0.5
    visible |= torch.eye(s, dtype=torch.bool)
    sees_context = torch.rand(s, c) > 0.3
    dense = torch.zeros(c + s, cached + c + s, dtype=torch.bool)
    dense[:, :cached] = valid
    dense[:c, cached : cached + c] = torch.ones(c, c, dtype=torch.bool).tril()
    dense[c:, cached : cached + c] = sees_context
    dense[c:, cached + c :] = visible
    blocked, attend = torch.tensor(torch.finfo(torch.float64).min, dtype=torch.float64), torch.tensor(0.0).double()
    positions = torch.arange(cached, cached + c + s)[None]

    def run(mask):
        cache = DynamicCache(config=model.config)
        if cached:
            model(input_ids=past, **cache_argument(cache), use_cache=True)
        return model(
            input_ids=ids, position_ids=positions, attention_mask=mask, **cache_argument(cache), use_cache=True
        ).logits

    reference = run(torch.where(dense, attend, blocked)[None, None])
    scored = torch.where(dense[c:], attend, blocked)[None, None]
    split = SplitMask(c, dense[:c, : cached + c][None, None] if cached else None, scored)
    with split_attention(model):
        assert model.config._attn_implementation == IMPLEMENTATIONS[backend]
        logits = run({"full_attention": split})
    assert model.config._attn_implementation == backend  # restored
    tolerance = 1e-10 if backend == "sdpa" else 1e-6  # eager's softmax runs in float32 whatever the dtype
    torch.testing.assert_close(logits, reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("split_from", [0, 2**62], ids=["split", "dense"])
def test_grouped_heads_run_grouped_on_cpu_with_the_tokens_of_repeated_heads(split_from, monkeypatch):
    """On CPU, sdpa's masked rows with grouped key/value heads never copy the cache per query head (transformers'
    `repeat_kv`): torch's SDPA runs them grouped (`enable_gqa`), the tokens and forward passes those of repeated
    heads, on a left-padded batch (its context rows masked too) with contexts split or fed under one dense mask.
    The two ways sum in other orders (float32 logits up to ~1e-6 apart on AVX-512/AMX CPUs), so the random model runs
    in float64, where a near tie that such a difference could flip is out of reach: the tokens are then compared
    exactly."""
    from transformers.integrations import sdpa_attention

    copies = [0]
    repeat_kv = sdpa_attention.repeat_kv

    def counting(hidden_states, n_rep):
        copies[0] += n_rep > 1
        return repeat_kv(hidden_states, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counting)
    monkeypatch.setattr(ragged_kv_cache, "SPLIT_FROM", split_from)
    model = tiny_refusion_model(num_attention_heads=4, num_key_value_heads=2).double()
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 60, (2, 30), generator=generator)
    ids[1, :7] = 0
    knobs = dict(max_new_tokens=16, slot_size=4, block_size=8, pad_token_id=0, mask_token_id=3, eos_token_id=1)
    knobs["return_dict_in_generate"] = True
    grouped = model.generate(ids, attention_mask=(ids != 0).long(), **knobs)
    assert copies[0] == 0
    monkeypatch.setattr(split_attention_module, "GROUPED_SDPA_DEVICES", ())
    repeated = model.generate(ids, attention_mask=(ids != 0).long(), **knobs)
    assert copies[0] > 0
    assert grouped.sequences.tolist() == repeated.sequences.tolist()
    assert grouped.num_forward_passes == repeated.num_forward_passes


def test_the_grouped_call_leaves_what_it_does_not_handle_to_transformers_sdpa_wrapper():
    """`_grouped_sdpa` honours only what a Qwen3 decoding forward passes; a softcap is not dropped but reaches
    transformers' wrapper, which refuses it by name."""

    class Module:
        num_key_value_groups, training, is_causal = 2, False, False

    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="softcap"):
        split_attention_module._grouped_sdpa(Module(), query, key, key, torch.zeros(1, 1, 3, 5), softcap=30.0)


def test_eager_decodes_the_golden_cases_as_sdpa_does(fixture_path):
    from refusion_hf import RefusionForCausalLM

    eager = RefusionForCausalLM.from_pretrained(fixture_path, dtype=torch.float64, attn_implementation="eager").eval()
    for case in CASES[:6]:
        ids = torch.tensor([case["prompt_ids"]])
        out = eager.generate(ids, return_dict_in_generate=True, **generate_kwargs(case))
        assert mismatch(case, out.sequences[0, ids.shape[1] :].tolist(), out.num_forward_passes) is None, case["id"]


def test_other_attention_kernels_are_refused_by_name(model32):
    """flash-attention / flex-attention kernels take no per-query masks in this form: refused, saying what to do
    (and the model's own implementation is left as it was)."""
    ids = torch.tensor([[5, 6, 7]])
    own = model32.config._attn_implementation
    try:
        model32.config._attn_implementation = "flex_attention"
        with pytest.raises(ValueError, match=r"uses 'flex_attention'.*set_attn_implementation\('sdpa'\)"):
            model32.generate(ids, max_new_tokens=4, slot_size=2)
        assert model32.config._attn_implementation == "flex_attention"
    finally:
        model32.config._attn_implementation = own


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak resident memory from /proc")
@pytest.mark.filterwarnings("ignore:The longest prompt")
def test_peak_memory_grows_linearly_with_the_prompt():
    """4x the prompt costs at most about 4x the memory at its peak: dense masks over the context ([L, L], quadratic)
    would add over 1 GB at 16k tokens here, 16x what 4k adds."""
    torch.manual_seed(0)
    model = tiny_refusion_model(hidden_size=64, intermediate_size=128, head_dim=32, max_position_embeddings=32768)
    knobs = dict(max_new_tokens=8, slot_size=4, block_size=8, mask_token_id=3, eos_token_id=1, pad_token_id=0)
    growth = {}
    for length in (4096, 16384):
        prompt = torch.randint(4, 60, (1, length), generator=torch.Generator().manual_seed(length))
        model.generate(prompt[:, :16], **knobs)  # warm-up
        growth[length] = peak_growth_kib(lambda prompt=prompt: model.generate(prompt, **knobs))
    # the 4k call's own growth can be near 0 (its peak below the warm-up's): a 64 MiB floor; dense masks add 1.3 GB
    assert growth[16384] < 4 * growth[4096] * 1.5 + 64 * 1024, growth


@pytest.mark.parametrize("slot_size", [2**40, 2**20, 33])
def test_a_slot_larger_than_the_model_can_hold_is_refused_before_allocating(slot_size):
    """A slot is drafted whole (the canvas holds at least one): one wider than `max_position_embeddings` is refused
    with a message naming `slot_size` and the bound, before any allocation (2**40 once failed inside one); a block
    larger than the answer is clamped to it (one block), and a slot at the bound still decodes."""
    model = tiny_refusion_model(max_position_embeddings=32)
    ids = torch.tensor([[5, 6, 7]])
    knobs = dict(max_new_tokens=4, mask_token_id=3, eos_token_id=1, pad_token_id=0)
    with pytest.raises(ValueError, match=rf"`slot_size` \({slot_size}\) is larger than .* at most 32"):
        model.generate(ids, slot_size=slot_size, block_size=slot_size, **knobs)
    assert model.generate(ids, slot_size=32, block_size=2**40 - 2**40 % 32, **knobs).shape == (1, 7)
