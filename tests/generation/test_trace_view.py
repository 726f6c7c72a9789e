"""The decoding-order summary `refusion generate --show-order` prints: slots per step, out-of-order slots, revised
tokens; and how the pictures mark a revised token."""

from refusion_hf.generation.trace_view import (
    DecodeTrace,
    _trace_html,
    ansi_by_step,
    order_summary,
    slots_out_of_order,
    slots_per_step,
)


def trace(commit_step: list[int], slot_size: int = 2) -> DecodeTrace:
    steps = max(commit_step) + 1
    return DecodeTrace([f"t{i}" for i in range(len(commit_step))], commit_step, [[] for _ in range(steps)], slot_size)


def test_parallel_out_of_order_slots_are_counted():
    """Step 0 commits slots 0 and 2, step 1 slot 1, step 2 slot 3: slot 2 was written before slot 1."""
    parallel = trace([0, 0, 1, 1, 0, 0, 2, 2])
    assert slots_per_step(parallel) == [2, 1, 1]
    assert slots_out_of_order(parallel) == 1
    summary = order_summary(parallel)
    assert "per step: 2 1 1 (slot size 2)" in summary and "1 of 3 steps committed several" in summary
    assert summary.endswith("1 slots were written before a slot to their left; 0 tokens were revised")


def test_one_slot_per_step_left_to_right_shows_neither():
    serial = trace([0, 0, 1, 1, 2, 2])
    assert slots_per_step(serial) == [1, 1, 1] and slots_out_of_order(serial) == 0
    assert "0 of 3 steps" in order_summary(serial)


def test_a_slot_finished_later_by_infill_counts_by_its_last_token():
    """Slot 0's second token comes at step 2 (infill), after slot 1 was complete at step 1: slot 1 is out of order;
    step 2 wrote one token of one slot."""
    infilled = trace([0, 2, 1, 1])
    assert slots_per_step(infilled) == [1, 1, 1]
    assert slots_out_of_order(infilled) == 1


def test_a_revised_token_is_underlined_counted_and_outlined_where_it_was_written_again():
    """Position 2 was remasked once and written again at step 2: underlined in the terminal, counted in the
    summary, outlined in red in step 2's row only; the other tokens are not marked."""
    revised = DecodeTrace(["a", "b", "c", "d"], [0, 0, 2, 1], [[0], [2], [2]], 2, revisions=[0, 0, 1, 0])
    coloured = ansi_by_step(revised)
    assert "\033[4;33mc\033[0m" in coloured  # underlined, in step 2's colour
    assert coloured.count("\033[4;") == 1 and coloured.rstrip().endswith("\033[4mrevised\033[0m")
    assert order_summary(revised).endswith("; 1 tokens were revised")
    rows = _trace_html(revised).split("<tr>")[1:]
    assert ["#c62828" in row for row in rows] == [False, False, True]
    assert "\033[4" not in ansi_by_step(trace([0, 0, 1, 1]))
