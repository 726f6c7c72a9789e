"""Sub-slot remasking (`remask_threshold`, revision.py): the REVISE stage under scripted logits, and the output
contract, batch invariance and termination with revision on (hypothesis, float64 fixture)."""

import dataclasses

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refusion_hf.generation.batch_scheduler import decode_batch
from refusion_hf.generation.sequence_state import MAX_REVISIONS, DecodingSettings, Stage
from tests.generation.scripted_logits import EOS, MASK, PAD, Belief, ScriptedForward
from tests.generation.test_stages import PROMPT, WRONG, answer, run

REVISING = DecodingSettings(
    max_new_tokens=4, slot_size=2, block_size=4, slot_threshold=0.5, token_threshold=0.5, mask_token_id=MASK,
    eos_token_ids=(EOS,), plan_ahead=False, remask_threshold=0.5,
)  # fmt: skip
OFF = dataclasses.replace(REVISING, remask_threshold=None)


def test_a_planted_low_probability_token_is_revised(model64):
    """The plan guesses WRONG for slot 1's first token (offset 2); a slot's first token is accepted on its plan
    score, so verification commits [a0, a1, WRONG, a3] and, without revision, that is the answer. With revision,
    the closed block is re-scored, each slot seeing the other but not itself: WRONG gets almost no probability and
    the re-score prefers a2 there, so a2 replaces it (the second opinion, counted as verified) and the rest of the
    slot (offset 3) is remasked, re-drafted and verified by infill, seeing slot 0 re-fed as context; the block's next
    re-score finds nothing, and it closes."""
    belief = Belief(answer(length=4), guess={2: WRONG})
    plain = run(model64, [belief], OFF)
    assert plain.tokens() == [20, 21, WRONG, 23]
    revised = run(model64, [belief], REVISING)
    assert revised.tokens() == [20, 21, 22, 23]
    assert revised.result.revised_tokens == [2]
    assert revised.result.revision_counts.tolist() == [[0, 0, 1, 1]]  # WRONG and the rest of its slot
    assert not plain.result.revision_counts.any()
    assert revised.stages == [[Stage.PLAN, Stage.VERIFY, Stage.REVISE, Stage.INFILL_DRAFT, Stage.INFILL_VERIFY,
                               Stage.REVISE, Stage.DONE]]  # fmt: skip
    plan, verify, rescore, draft, verify_tail, rescore_again = revised.fed()
    # The re-score: per slot the run [MASK at its first position, its tokens but the last], hiding its own slot.
    assert rescore.tokens == [MASK, 20, MASK, WRONG] and rescore.offsets == [0, 0, 2, 2]
    hidden = rescore.query.hidden.tolist()
    assert hidden == [[3, 5], [3, 5], [5, 7], [5, 7]]  # prompt of 3: slot 0 is positions 3-4, slot 1 is 5-6
    # The revision dropped the block's entries: slot 0 is re-fed as context, slot 1's prefix (the second opinion)
    # as its infill prefix, and its tail re-drafted.
    assert draft.cached == len(PROMPT)
    assert draft.query.num_context == 2 and draft.query.tokens.tolist() == [20, 21, 22, MASK]
    assert (verify_tail.tokens, verify_tail.offsets) == ([23], [3])  # the prefix is pending: only the tail is fed
    assert rescore_again.cached == len(PROMPT) + 4  # the whole block is back in the cache, once
    assert revised.commit_step()[:2] == plain.commit_step()[:2]
    assert revised.result.chosen_slots == [[[0, 2], [2]]]  # the revision's step names the slot it revised


def test_nothing_is_revised_when_every_written_token_holds(model64):
    """The model is sure of every token: the re-score finds nothing below the threshold, the block closes at once.
    Same tokens and commit steps as without revision, one forward more (the re-score)."""
    belief = Belief(answer(length=4))
    plain, revised = run(model64, [belief], OFF), run(model64, [belief], REVISING)
    assert revised.tokens() == plain.tokens() and revised.commit_step() == plain.commit_step()
    assert revised.result.revised_tokens == [0]
    assert revised.result.forward_passes_per_row == [plain.result.forward_passes_per_row[0] + 1]


def test_the_slot_holding_the_eos_is_never_revised(model64):
    """An EOS ends the answer as decided: a wrong guess in the slot holding the EOS stays (only slots wholly before
    the first EOS are re-scored)."""
    belief = Belief([20, 21, WRONG, EOS], guess={2: WRONG})
    revised = run(model64, [belief], REVISING)
    assert revised.tokens() == [20, 21, WRONG, EOS]
    assert revised.result.revised_tokens == [0]


def test_a_position_is_revised_at_most_max_revisions_times(model64):
    """A model that never settles (the re-score always prefers a token other than the one written) still ends:
    each position is remasked at most MAX_REVISIONS times."""

    class Restless(ScriptedForward):
        def _predict(self, belief, query, i, index):
            j = i - query.num_context
            if (
                query.hidden is not None
                and int(query.hidden[j, 1] - query.hidden[j, 0]) > 0
                and int(query.tokens[i]) == MASK
            ):  # a re-score's mask (not a plan riding along): something else
                return self.peaked(30 + len(self.calls), 0.9)  # a new token at every re-score
            return super()._predict(belief, query, i, index)

    forward = Restless([Belief(answer(length=4))], model64.config.vocab_size, 2)
    result = decode_batch(model64, [torch.tensor(PROMPT)], REVISING, PAD, forward=forward, on_finish=forward.finished)
    assert 0 < result.revised_tokens[0] <= MAX_REVISIONS * REVISING.max_new_tokens
    assert MASK not in result.tokens[0].tolist()


# ------------------------------------------------------------------------- planning ahead with revision on
TWO_BLOCKS = dataclasses.replace(REVISING, max_new_tokens=8)


def test_the_next_blocks_plan_rides_along_the_re_score_and_is_used_when_the_block_closes(model64):
    """Two blocks of two slots, the model sure of everything. With planning ahead the re-score of block 0 also
    carries block 1's plan: 4 masks after the re-score's runs, seeing none of them (the runs are never cached) and
    hiding nothing. The re-score finds nothing to revise and closes the block, so the plan's inputs are those of a
    plan forward of its own: its drafts are used and block 1 goes straight to verification. Same tokens, commit
    steps and chosen slots as one forward per stage, one forward fewer."""
    belief = Belief(answer())
    ahead = run(model64, [belief], dataclasses.replace(TWO_BLOCKS, plan_ahead=True))
    alone = run(model64, [belief], TWO_BLOCKS)
    assert alone.stages == [[Stage.PLAN, Stage.VERIFY, Stage.REVISE, Stage.PLAN, Stage.VERIFY, Stage.REVISE,
                             Stage.DONE]]  # fmt: skip
    assert ahead.stages == [[Stage.PLAN, Stage.VERIFY, Stage.REVISE, Stage.VERIFY, Stage.REVISE, Stage.DONE]]
    rescore = ahead.fed()[2]
    assert rescore.tokens == [MASK, 20, MASK, 22] + [MASK] * 4 and rescore.offsets == [0, 0, 2, 2, 4, 5, 6, 7]
    visible = rescore.query.visible
    assert not visible[4:, :4].any() and not visible[:4, 4:].any()  # neither sees the other
    assert torch.equal(visible[4:, 4:], torch.ones(4, 4, dtype=torch.bool).tril())  # the masks: causal
    assert rescore.query.hidden[4:].tolist() == [[0, 0]] * 4  # the masks hide nothing
    assert ahead.fed()[4].tokens == [MASK, 24, MASK, 26]  # block 1 is the last: its re-score carries no plan
    assert ahead.result.forward_passes_per_row == [alone.result.forward_passes_per_row[0] - 1]
    assert ahead.tokens() == alone.tokens() == answer()
    assert ahead.commit_step() == alone.commit_step()
    assert ahead.result.chosen_slots == alone.result.chosen_slots


def test_a_plan_riding_along_a_re_score_that_revises_is_discarded(model64):
    """The planted WRONG of the first test, in a two-block answer: block 0's re-score carries block 1's plan, but
    it revises WRONG, so the block does not close and the plan (which assumed WRONG in view) is discarded. The
    block's next re-score, after the revised slot is re-decoded, re-feeds nothing, carries the plan again and
    closes the block: that plan is used. Same answer and revisions as without planning ahead."""
    belief = Belief(answer(), guess={2: WRONG})
    ahead = run(model64, [belief], dataclasses.replace(TWO_BLOCKS, plan_ahead=True))
    alone = run(model64, [belief], TWO_BLOCKS)
    assert ahead.tokens() == alone.tokens() == answer()
    assert ahead.result.revision_counts.tolist() == alone.result.revision_counts.tolist() == [[0, 0, 1, 1, 0, 0, 0, 0]]
    assert ahead.commit_step() == alone.commit_step()
    first, again = (call for call in ahead.fed() if call.query.hidden is not None and call.offsets[0] == 0)
    assert first.masks == 2 + 4 and again.masks == 2 + 4  # each re-score: its runs' masks, then block 1's plan
    assert ahead.stages[0].count(Stage.PLAN) == 1  # the second re-score's plan was used: no plan forward of its own
    assert ahead.result.forward_passes_per_row == [alone.result.forward_passes_per_row[0] - 1]


# ------------------------------------------------------------------------------------ properties (real model)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompts=st.lists(st.lists(st.integers(4, 60), min_size=1, max_size=6), min_size=2, max_size=3),
    threshold=st.sampled_from([0.3, 0.6, 0.95]),
    shape=st.sampled_from([(2, 4), (2, 8), (4, 8)]),
    max_new_tokens=st.integers(1, 12),
)
def test_revision_keeps_the_contract_and_a_batched_row_equals_the_row_alone(model64, prompts, threshold, shape,
                                                                            max_new_tokens):  # fmt: skip
    """With revision on: every row has at most max_new_tokens tokens, no mask token, pad after its EOS; decoding
    ends within the bound (each forward either commits, re-scores or re-decodes; revisions per position bounded);
    and a row decoded in a batch equals the row decoded alone (tokens, commit steps, forward passes, revisions)."""
    slot_size, block_size = shape
    decoding = DecodingSettings(
        max_new_tokens=max_new_tokens, slot_size=slot_size, block_size=block_size, slot_threshold=0.5,
        token_threshold=0.4, mask_token_id=MASK, eos_token_ids=(EOS,), remask_threshold=threshold,
    )  # fmt: skip
    rows = [torch.tensor(p) for p in prompts]
    batched = decode_batch(model64, rows, decoding, PAD)
    canvas = -(-max_new_tokens // slot_size) * slot_size
    # Without revision a forward serves each row at most 2 * canvas times (plan/verify, infill rounds); each
    # remasked position adds at most a re-score and two infill forwards.
    bound = 2 * canvas + 2 + 3 * MAX_REVISIONS * canvas + decoding.num_blocks
    for row, prompt in enumerate(rows):
        tokens = batched.tokens[row].tolist()
        n = batched.answer_lengths[row]
        assert n <= max_new_tokens and MASK not in tokens[:n]
        assert all(t == PAD for t in tokens[n:])
        assert EOS not in tokens[: n - 1]
        assert batched.revised_tokens[row] <= MAX_REVISIONS * canvas
        assert batched.forward_passes_per_row[row] <= bound
        alone = decode_batch(model64, [prompt], decoding, PAD)
        assert alone.tokens[0, :n].tolist() == tokens[:n] and alone.answer_lengths[0] == n
        assert alone.commit_step[0, :n].tolist() == batched.commit_step[row, :n].tolist()
        assert alone.forward_passes_per_row[0] == batched.forward_passes_per_row[row]
        assert alone.revised_tokens[0] == batched.revised_tokens[row]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(4, 60), min_size=1, max_size=6),
    threshold=st.sampled_from([0.3, 0.6, 0.95]),
    shape=st.sampled_from([(2, 4), (2, 8), (4, 8)]),
    max_new_tokens=st.integers(1, 16),
)
def test_planning_ahead_with_revision_on_changes_forward_counts_only(model64, prompt, threshold, shape,
                                                                    max_new_tokens):  # fmt: skip
    """With revision on, planning ahead (plans riding along verifications and re-scores) decodes the same tokens,
    commit steps and revisions as one forward per stage, in at most as many forwards."""
    slot_size, block_size = shape
    decoding = DecodingSettings(
        max_new_tokens=max_new_tokens, slot_size=slot_size, block_size=block_size, slot_threshold=0.5,
        token_threshold=0.4, mask_token_id=MASK, eos_token_ids=(EOS,), remask_threshold=threshold, plan_ahead=True,
    )  # fmt: skip
    ahead = decode_batch(model64, [torch.tensor(prompt)], decoding, PAD)
    alone = decode_batch(model64, [torch.tensor(prompt)], dataclasses.replace(decoding, plan_ahead=False), PAD)
    n = alone.answer_lengths[0]
    assert ahead.answer_lengths[0] == n and ahead.tokens[0, :n].tolist() == alone.tokens[0, :n].tolist()
    assert ahead.commit_step[0, :n].tolist() == alone.commit_step[0, :n].tolist()
    assert ahead.revision_counts.tolist() == alone.revision_counts.tolist()
    assert ahead.forward_passes_per_row[0] <= alone.forward_passes_per_row[0]


# ------------------------------------------------------------------------- the generate contract with revision on
KNOBS = dict(
    max_new_tokens=24, slot_size=2, block_size=8, slot_threshold=0.6, token_threshold=0.3, remask_threshold=0.9
)
PROMPTS = [[32, 24, 53, 31, 52, 63, 5, 38], [7, 19, 44], [12, 50, 9, 27, 61]]


def test_streamers_see_only_final_tokens_with_revision_on(model64):
    """A streamed token is never taken back: pieces arrive as blocks close, and together they are the answer."""
    from tests.generation.test_streaming import Recorder, answer

    prompt = torch.tensor([PROMPTS[0]])
    recorder = Recorder(with_drafts=False)
    out = model64.generate(prompt, streamer=recorder, return_dict_in_generate=True, **KNOBS)
    assert int(out.revised_tokens[0]) > 0, "the threshold is high enough to revise on this prompt"
    counts = out.revision_counts[0]
    assert counts.shape == out.commit_step[0].shape and int(counts.sum()) <= int(out.revised_tokens[0])
    assert counts.any() and not counts[out.commit_step[0] < 0].any()  # nothing counted after the answer
    streamed = [token for piece in recorder.puts[1:] for token in piece]
    assert streamed == answer(out.sequences[0], prompt.shape[1]) and recorder.ended
    assert len(recorder.puts) > 2, "pieces arrive block by block"


def test_sampling_with_revision_on_keeps_the_contract_and_is_reproducible(model64):
    def sample(seed):
        torch.manual_seed(seed)
        ids = torch.tensor([PROMPTS[0]])
        return model64.generate(ids, do_sample=True, temperature=1.5, return_dict_in_generate=True, **KNOBS)

    first, again = sample(0), sample(0)
    assert torch.equal(first.sequences, again.sequences) and int(first.revised_tokens[0]) > 0
    tokens, n = first.sequences[0, len(PROMPTS[0]) :].tolist(), int(first.answer_lengths[0])
    assert MASK not in tokens[:n] and all(t == PAD for t in tokens[n:]) and EOS not in tokens[: n - 1]


def test_sampling_with_revision_on_draws_the_same_tokens_with_or_without_planning_ahead(model64):
    """A plan riding along a re-score is drawn only once it holds, so the random generator is consumed in the same
    order as with a plan forward of its own: same seed, same tokens, revisions and commit steps."""

    def sample(plan_ahead):
        torch.manual_seed(3)
        ids = torch.tensor([PROMPTS[0]])
        knobs = dict(KNOBS, plan_ahead=plan_ahead)
        return model64.generate(ids, do_sample=True, temperature=1.5, return_dict_in_generate=True, **knobs)

    ahead, alone = sample(True), sample(False)
    assert torch.equal(ahead.sequences, alone.sequences) and torch.equal(ahead.commit_step, alone.commit_step)
    assert torch.equal(ahead.revision_counts, alone.revision_counts) and int(ahead.revised_tokens[0]) > 0
    assert ahead.forward_passes_per_row[0] < alone.forward_passes_per_row[0]


def test_continuous_batching_with_revision_on_equals_each_request_alone(model64):
    """`generate_batch` (a continuous batch of 2 rows for 3 requests) decodes each request as `generate` alone."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    batch = model64.generate_batch(
        PROMPTS, continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=2), **KNOBS
    )
    for index, prompt in enumerate(PROMPTS):
        alone = model64.generate(torch.tensor([prompt]), return_dict_in_generate=True, **KNOBS)
        n = int(alone.answer_lengths[0])
        assert batch[f"req_{index}"].generated_tokens == alone.sequences[0, len(prompt) : len(prompt) + n].tolist()
