"""Left-padded batches: every row decodes exactly as it does alone, with one forward per step for all rows."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PAD = 0


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@st.composite
def batches(draw):
    prompts = draw(st.lists(st.lists(st.integers(4, 63), min_size=1, max_size=14), min_size=2, max_size=5))
    slot_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    max_new_tokens = draw(st.integers(1, 40))
    canvas = -(-max_new_tokens // slot_size) * slot_size
    block_size = slot_size * draw(st.integers(1, canvas // slot_size))
    knobs = dict(
        max_new_tokens=max_new_tokens,
        slot_size=slot_size,
        block_size=block_size,
        slot_threshold=draw(st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.01])),
        token_threshold=draw(st.sampled_from([0.0, 0.1, 0.3, 0.6, 0.9, 1.01])),
        plan_ahead=draw(st.booleans()),
    )
    return prompts, knobs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches())
def test_each_row_of_a_batch_decodes_as_alone(model64, batch):
    check_rows_decode_as_alone(model64, batch)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches())
def test_each_row_of_a_batch_decodes_as_alone_in_float32(model32, batch):
    """float32 too (tests/README.md: which dtypes guarantee it; benchmarks/batch_invariance.py, in git at 7247c5f,
    measured bfloat16)."""
    check_rows_decode_as_alone(model32, batch)


def check_rows_decode_as_alone(model64, batch):
    prompts, knobs = batch
    ids, mask = left_pad(prompts)
    together = model64.generate(ids, attention_mask=mask, return_dict_in_generate=True, **knobs)
    passes = []
    for row, prompt in enumerate(prompts):
        alone = model64.generate(torch.tensor([prompt]), return_dict_in_generate=True, **knobs)
        answer = alone.sequences[0, len(prompt) :]
        n = answer.shape[0]  # the batch is as wide as its longest answer: pad after this row's
        assert torch.equal(together.sequences[row, ids.shape[1] : ids.shape[1] + n], answer)
        assert set(together.sequences[row, ids.shape[1] + n :].tolist()) <= {PAD}
        assert torch.equal(together.sequences[row, : ids.shape[1]], ids[row]), "the prompt comes back as given"
        assert torch.equal(together.commit_step[row, :n], alone.commit_step[0])
        assert set(together.commit_step[row, n:].tolist()) <= {-1}
        assert together.chosen_slots[row] == alone.chosen_slots[0]
        assert together.tokens_per_forward[row] == alone.tokens_per_forward[0]
        passes.append(alone.num_forward_passes)
    # One forward serves every row: the batch takes exactly as many forwards as its slowest row.
    assert together.num_forward_passes == max(passes)


def test_finished_rows_leave_the_batch(model64):
    """A row that ends early is dropped from later forwards (it stops costing compute)."""
    prompts = [[61, 61, 33, 51, 20, 31, 13, 32, 23, 6, 13, 40], [32, 24, 53, 31, 52, 63, 5, 38]]
    ids, mask = left_pad(prompts)
    knobs = dict(max_new_tokens=16, slot_size=2, slot_threshold=1.01, token_threshold=0.3)
    short = model64.generate(torch.tensor(prompts[:1]), return_dict_in_generate=True, **knobs)
    long = model64.generate(torch.tensor(prompts[1:]), return_dict_in_generate=True, **knobs)
    assert short.num_forward_passes < long.num_forward_passes
    batch_sizes = []
    hook = model64.register_forward_hook(
        lambda module, args, kwargs, out: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        model64.generate(ids, attention_mask=mask, **knobs)
    finally:
        hook.remove()
    assert len(batch_sizes) == long.num_forward_passes
    assert batch_sizes[: short.num_forward_passes] == [2] * short.num_forward_passes
    assert batch_sizes[short.num_forward_passes :] == [1] * (long.num_forward_passes - short.num_forward_passes)
