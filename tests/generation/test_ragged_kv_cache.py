"""The ragged cache's map from cache columns to original positions, and taking entries back (`invalidate`)."""

import torch

from refusion_hf.generation.batch_scheduler import decode_batch
from refusion_hf.generation.ragged_kv_cache import forward_queries
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
