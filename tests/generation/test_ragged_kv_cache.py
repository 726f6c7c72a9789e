"""The ragged cache's map from cache columns to original positions, taking entries back (`invalidate`), and its
layers appending in place (`InPlaceLayer`) with `DynamicLayer`'s results."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, Qwen3Config

from refusion_hf._compat.transformers import map_cache_tensors
from refusion_hf.generation.batch_scheduler import decode_batch
from refusion_hf.generation.ragged_kv_cache import InPlaceKVCache, InPlaceLayer, forward_queries
from refusion_hf.generation.sequence_state import DecodingSettings, Stage
from tests.oracle import EOS, MASK

SETTINGS = DecodingSettings(
    max_new_tokens=24, slot_size=4, block_size=8, slot_threshold=0.6, token_threshold=0.5, mask_token_id=MASK,
    eos_token_ids=(EOS,),
)  # fmt: skip


def held_positions(kv, row: int) -> list[int]:
    held = kv.valid[row] if kv.tags is None else kv.valid[row] | (kv.tags[row] >= 0)
    return sorted(kv.positions[row][held].tolist())


def test_every_held_entry_maps_to_the_position_it_holds(model64):
    """Before every forward, a row's committed entries hold exactly the prompt's positions and the committed answer
    positions (pending ones: the infill prefixes), each once; two rows of different prompt lengths stay apart."""
    prompts = [torch.tensor([5, 9, 11, 7, 30]), torch.tensor([6, 8])]
    sequences, checked = [], [0]

    def forward(model, kv, queries, pad_token_id):
        for row, sequence in enumerate(s for s in sequences if s.stage is not Stage.DONE):
            committed = kv.positions[row][kv.valid[row]].tolist()
            answer = [sequence.prompt_length + i for i, flag in enumerate(sequence.written) if flag]
            assert sorted(committed) == list(range(sequence.prompt_length)) + answer
            assert len(held_positions(kv, row)) == kv.lengths[row]
            checked[0] += 1
        return forward_queries(model, kv, queries, pad_token_id)

    def on_step(states):
        sequences[:] = states

    decode_batch(model64, prompts, SETTINGS, 0, on_step=on_step, forward=forward)
    assert checked[0] > 4


def test_invalidate_drops_a_rows_entries_from_a_position_on(model64):
    """`invalidate(row, p)` turns the row's entries holding positions >= p into holes (and only those), and keeps
    the host-side counts in step. Checked on the live cache of a two-row decode, once row 0 holds answer tokens."""
    checked = []

    def forward(model, kv, queries, pad_token_id):
        if not checked and kv.valid.shape[0] == 2 and len(held_positions(kv, 0)) > 8:
            before, other = held_positions(kv, 0), held_positions(kv, 1)
            cut = before[-3]
            dropped = kv.invalidate(0, cut)
            assert dropped == sum(p >= cut for p in before) > 0
            assert held_positions(kv, 0) == [p for p in before if p < cut]
            assert kv.lengths[0] == len(held_positions(kv, 0))
            assert held_positions(kv, 1) == other
            assert kv.invalidate(0, cut) == 0
            checked.append(cut)
        return forward_queries(model, kv, queries, pad_token_id)

    prompts = [torch.tensor([5, 9, 11, 7, 30]), torch.tensor([6, 8, 10])]
    decode_batch(model64, prompts, SETTINGS, 0, forward=forward)
    assert checked


TWO_LAYERS = Qwen3Config(
    vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=4,
)  # fmt: skip
CACHE_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 300)),  # entries per row: past the room, at times
        st.tuples(st.just("crop"), st.integers(0, 40)),
        st.tuples(st.just("select rows"), st.lists(st.integers(0, 2), min_size=1, max_size=3)),
        st.tuples(st.just("gather"), st.integers(0, 2**16)),  # compaction's way: map_cache_tensors
    ),
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(operations=CACHE_OPERATIONS)
def test_in_place_layers_hold_what_dynamic_layers_hold(operations):
    """Whatever the ragged cache does to its cache (append, crop, keep rows, gather entries), `InPlaceKVCache`'s
    layers hold and return exactly the keys and values `DynamicCache`'s would."""
    ours, stock = InPlaceKVCache(TWO_LAYERS), DynamicCache(config=TWO_LAYERS)
    assert all(isinstance(layer, InPlaceLayer) for layer in ours.layers)
    generator, rows = torch.Generator().manual_seed(0), 3
    for operation, argument in [("append", 5), *operations]:
        length = stock.get_seq_length()
        if operation == "append":
            for layer in range(2):
                keys, values = torch.randn(2, rows, 2, argument, 4, generator=generator).unbind()
                got, expected = ours.update(keys, values, layer), stock.update(keys, values, layer)
                assert all(torch.equal(a, b) for a, b in zip(got, expected))
        elif operation == "crop" and length:
            for cache in (ours, stock):
                cache.crop(-min(argument, length))
        elif operation == "select rows" and length:
            indices = torch.tensor([row % rows for row in argument])
            for cache in (ours, stock):
                cache.batch_select_indices(indices)
            rows = len(indices)
        elif operation == "gather" and length:
            order = torch.randperm(length, generator=torch.Generator().manual_seed(argument))[: length // 2 + 1]
            for cache in (ours, stock):
                map_cache_tensors(cache, lambda tensor, order=order: tensor[:, :, order])
        assert ours.get_seq_length() == stock.get_seq_length()
        for mine, theirs in zip(ours.layers, stock.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_appends_within_the_room_copy_no_held_entry():
    """The point of `InPlaceLayer`: after a long prompt, a forward's few entries are written after the others; the
    held ones stay where they are (`DynamicLayer` copies all of them to append). Past the room, one copy grows it."""
    cache = InPlaceKVCache(TWO_LAYERS)
    prompt = torch.randn(1, 2, 4096, 4)
    keys, _ = cache.update(prompt, prompt, 0)
    start = keys.data_ptr()
    for _ in range(4096 // 16 // 8):  # the room: a sixteenth of the entries
        keys, values = cache.update(torch.ones(1, 2, 8, 4), torch.ones(1, 2, 8, 4), 0)
        assert keys.data_ptr() == start and torch.equal(keys[:, :, :4096], prompt)
    cache.crop(-8)
    keys, _ = cache.update(torch.zeros(1, 2, 9, 4), torch.zeros(1, 2, 9, 4), 0)
    assert keys.data_ptr() != start and keys.shape[2] == 4096 + 4096 // 16 - 8 + 9
    assert torch.equal(keys[:, :, :4096], prompt) and not keys[:, :, -9:].any()
