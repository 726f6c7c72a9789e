"""The decoder stage by stage, driven by scripted logits: one test per transition of docs/design.md §3.

Each test states what the model believes (a `Belief` per row: the answer it expects, how sure it is of each
draft and of each token given the one before it) and runs the real decoder on it (`decode_batch` with a
`ScriptedForward`, tests/generation/scripted_logits.py: no network, logits built from the belief). What is
asserted is the decoder's reaction: the stage each forward served (each sequence's `.stage`, seen by `on_step`),
the slots chosen per step, the tokens and the step that committed each, the forward passes per row, what each
forward fed and what the ragged cache held for the row (`kv.lengths` / `kv.pending`).

Throughout: prompt [10, 11, 12], answers of tokens 20 and up, slot size k = 2 unless said, slot and token
thresholds 0.5 (`SURE` = 0.9 passes them, `UNSURE` = 0.3 does not), and one forward per stage
(`plan_ahead=False`) except in the tests of planning ahead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import EosTokenCriteria, StoppingCriteriaList

# The decoder's names, in one place.
from refusion_hf.generation.batch_scheduler import BatchDecodeResult, decode_batch
from refusion_hf.generation.prefix_stopping import PrefixStopping
from refusion_hf.generation.sequence_state import DecodingSettings, Stage
from refusion_hf.generation.stages import STAGES
from tests.generation.scripted_logits import EOS, MASK, PAD, UNSURE, Belief, Call, ScriptedForward

PLAN, VERIFY, INFILL_DRAFT, INFILL_VERIFY, DONE = (
    Stage.PLAN, Stage.VERIFY, Stage.INFILL_DRAFT, Stage.INFILL_VERIFY, Stage.DONE,
)  # fmt: skip
PROMPT = [10, 11, 12]
WRONG = 40  # a plan's guess that the model, once it reads the token before, does not expect


def settings(max_new_tokens=8, slot_size=2, block_size=8, plan_ahead=False) -> DecodingSettings:
    return DecodingSettings(
        max_new_tokens=max_new_tokens,
        slot_size=slot_size,
        block_size=block_size,
        slot_threshold=0.5,
        token_threshold=0.5,
        mask_token_id=MASK,
        eos_token_ids=(EOS,),
        plan_ahead=plan_ahead,
    )


@dataclass
class Run:
    result: BatchDecodeResult
    stages: list[list[Stage]] | None  # per prompt: the stage each of its forwards served, then DONE
    calls: list[list[Call]]  # per forward, per row

    def fed(self, prompt: int = 0) -> list[Call]:
        """The prompt's row in each forward it took part in."""
        return [call for forward in self.calls for call in forward if call.prompt == prompt]

    def tokens(self, row: int = 0) -> list[int]:
        return self.result.tokens[row].tolist()

    def commit_step(self, row: int = 0) -> list[int]:
        return self.result.commit_step[row].tolist()


def run(model, beliefs, decoding, prompts=None, stopping=None, max_rows=None, registry=STAGES) -> Run:
    """Decode `prompts` (default: PROMPT for each belief) with the scripted model; record the stages (not with
    `max_rows`: continuous batching streams no steps). `registry`: which unit serves each stage."""
    prompts = [torch.tensor(p) for p in (prompts or [PROMPT] * len(beliefs))]
    forward = ScriptedForward(beliefs, model.config.vocab_size, decoding.slot_size)
    stages = [[PLAN] for _ in prompts]
    forwards = [0] * len(prompts)

    def on_step(sequences):
        for index, sequence in enumerate(sequences):
            if sequence.forward_passes > forwards[index]:
                forwards[index] = sequence.forward_passes
                stages[index].append(sequence.stage)

    result = decode_batch(
        model,
        prompts,
        decoding,
        PAD,
        stopping=stopping,
        on_step=None if max_rows else on_step,
        forward=forward,
        max_rows=max_rows,
        on_finish=forward.finished,
        stages=registry,
    )
    return Run(result, None if max_rows else stages, forward.calls)


def answer(*tokens: int, length: int = 8) -> list[int]:
    """`tokens`, then 20 + offset up to `length`."""
    return list(tokens) + [20 + o for o in range(len(tokens), length)]


# ------------------------------------------------------------------------------------------------ plan + verify
def test_whole_slots_verified_together_are_committed_with_the_kv_of_that_forward(model64):
    """Two blocks of two slots, the model sure of everything. Each block takes a plan (all its slots as masks; both
    slots pass the slot threshold, so both are chosen) and a verification (the drafts in position order; every
    token passes), which commits both slots at once: step 0 writes offsets 0-3, step 1 offsets 4-7. The verified
    tokens' KV from that forward is kept: block 1's plan feeds its 4 masks alone on a cache of 3 + 4 entries."""
    decoded = run(model64, [Belief(answer())], settings(block_size=4))
    assert decoded.stages == [[PLAN, VERIFY, PLAN, VERIFY, DONE]]
    assert decoded.result.chosen_slots == [[[0, 2], [4, 6]]]
    assert decoded.tokens() == answer()
    assert decoded.commit_step() == [0, 0, 0, 0, 1, 1, 1, 1]
    plan0, verify0, plan1, verify1 = decoded.fed()
    assert (plan0.tokens, plan0.offsets, plan0.cached) == ([MASK] * 4, [0, 1, 2, 3], 0)  # after the prompt
    assert (verify0.tokens, verify0.cached) == ([20, 21, 22, 23], 3)
    assert (plan1.tokens, plan1.offsets, plan1.cached) == ([MASK] * 4, [4, 5, 6, 7], 7)
    assert (verify1.tokens, verify1.cached) == ([24, 25, 26, 27], 7)
    assert decoded.result.forward_passes_per_row == [4]


def test_several_slots_pass_the_slot_threshold_or_the_single_best_is_chosen(model64):
    """A slot is chosen when its first draft's probability passes the slot threshold. First-draft probabilities
    0.9, 0.8, 0.3, 0.2: slots 0 and 1 are chosen together (step 0), then, none of the other two passing, the
    better one alone (slot 2 at 0.3), then slot 3. With 0.3, 0.4, 0.2, 0.1 none ever passes: one slot per step,
    the most probable first, so the answer is decoded out of order (slot 1, 0, 2, 3)."""
    several = run(model64, [Belief(answer(), draft_p={0: 0.9, 2: 0.8, 4: 0.3, 6: 0.2})], settings())
    assert several.result.chosen_slots == [[[0, 2], [4], [6]]]
    assert several.commit_step() == [0, 0, 0, 0, 1, 1, 2, 2]
    single = run(model64, [Belief(answer(), draft_p={0: 0.3, 2: 0.4, 4: 0.2, 6: 0.1})], settings())
    assert single.result.chosen_slots == [[[2], [0], [4], [6]]]
    assert single.commit_step() == [1, 1, 0, 0, 2, 2, 3, 3]
    assert several.tokens() == single.tokens() == answer()
    assert single.stages == [[PLAN, VERIFY] * 4 + [DONE]]
    assert [call.offsets for call in single.fed() if call.masks] == [  # each plan: the block's undecoded slots
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 4, 5, 6, 7],
        [4, 5, 6, 7],
        [6, 7],
    ]


def test_a_block_is_decoded_before_the_next_block_is_planned(model64):
    """Blocks of two slots. Block 1's slots are the surest of all (0.95), yet the plans of block 0 never include
    them: block 0's plan chooses slot 0 (0.9), its next plan holds slot 1 alone (0.3: the single best of a pool of
    one), and only then is block 1 planned, both its slots chosen at once."""
    belief = Belief(answer(), draft_p={0: 0.9, 2: UNSURE, 4: 0.95, 6: 0.95})
    decoded = run(model64, [belief], settings(block_size=4))
    assert decoded.result.chosen_slots == [[[0], [2], [4, 6]]]
    assert [call.offsets for call in decoded.fed() if call.masks] == [[0, 1, 2, 3], [2, 3], [4, 5, 6, 7]]
    assert decoded.commit_step() == [0, 0, 1, 1, 2, 2, 2, 2]
    assert decoded.tokens() == answer()


def test_an_eos_accepted_in_verification_ends_the_answer(model64):
    """The model is sure the answer is 20 21 EOS. The plan chooses slots 0 and 1 (slots 2 and 3 unsure); the
    verification accepts 20 21 EOS 23, so the slots are committed up to the EOS only, the undecoded slots after it
    are dropped and the sequence is done after two forwards: three answer tokens."""
    belief = Belief(answer(20, 21, EOS), draft_p={4: UNSURE, 6: UNSURE})
    decoded = run(model64, [belief], settings())
    assert decoded.stages == [[PLAN, VERIFY, DONE]]
    assert decoded.result.chosen_slots == [[[0, 2]]]
    assert decoded.fed()[1].tokens == [20, 21, EOS, 23]
    assert decoded.tokens() == [20, 21, EOS]
    assert decoded.result.answer_lengths == [3]
    assert decoded.result.forward_passes_per_row == [2]


# ------------------------------------------------------------------------------------------------------- infill
def test_a_rejected_draft_sends_the_slots_to_infill_until_each_is_complete(model64):
    """k = 4, a block of two slots, then a block of one. The plan guesses WRONG at offset 1; the verification reads
    20 and expects 21, so it rejects WRONG: not even one whole slot is verified, and both chosen slots go to infill,
    each completed alone (neither sees the other) from its own verified prefix (slot 0: 20; slot 1: all four).

    Infill round 1 feeds slot 0's 20 and three masks (re-drafted: 21 22 23) and slot 1's four tokens (their KV
    recomputed with the slot alone); those five verified tokens stay in the cache as pending entries. Its
    verification feeds 21 22 23: 21 is the first unverified token (always accepted), but the model doubts 22 after
    21 (0.3), so slot 0 is verified up to 21, which stays pending too. Round 2 re-drafts offsets 2 and 3 (two
    masks) and verifies 22 23: slot 0 is complete and both slots are committed together with the KV each computed
    alone, none fed again: block 1's plan runs on 3 + 8 committed entries, none pending."""
    belief = Belief(answer(length=12), guess={1: WRONG}, follow_p={2: UNSURE})
    decoded = run(model64, [belief], settings(max_new_tokens=12, slot_size=4, block_size=8))
    assert decoded.stages == [
        [PLAN, VERIFY, INFILL_DRAFT, INFILL_VERIFY, INFILL_DRAFT, INFILL_VERIFY, PLAN, VERIFY, DONE]
    ]
    _, verify, draft1, verify1, draft2, verify2, plan_next, _ = decoded.fed()
    assert verify.tokens == [20, WRONG, 22, 23, 24, 25, 26, 27]
    assert (draft1.tokens, draft1.cached, draft1.pending) == ([20, MASK, MASK, MASK, 24, 25, 26, 27], 3, 0)
    visible = draft1.query.visible  # slot 0's four query tokens, then slot 1's: neither sees the other
    assert visible[:4, :4].equal(torch.ones(4, 4, dtype=torch.bool).tril()) and not visible[4:, :4].any()
    assert (verify1.tokens, verify1.cached, verify1.pending) == ([21, 22, 23], 3 + 5, 5)
    assert (draft2.tokens, draft2.offsets, draft2.cached, draft2.pending) == ([MASK, MASK], [2, 3], 9, 6)
    assert (verify2.tokens, verify2.cached, verify2.pending) == ([22, 23], 9, 6)
    assert (plan_next.offsets, plan_next.cached, plan_next.pending) == ([8, 9, 10, 11], 11, 0)
    assert decoded.result.chosen_slots == [[[0, 4], [8]]]
    assert decoded.tokens() == answer(length=12)
    assert decoded.commit_step() == [0] * 8 + [1] * 4  # the two infilled slots in one step


def test_an_eos_accepted_in_infill_ends_the_answer_and_discards_the_slots_after_it(model64):
    """Five slots in one block; the model is sure of slots 0, 2 and 3 (chosen) and unsure of 1 and 4. The
    verification rejects the plan's WRONG at offset 1, so the three chosen slots go to infill; slots 2 (24 EOS) and
    3 (26 27) are verified on their own already and their tokens are fed once, pending. Slot 0's infill
    verification accepts its re-drafted 21, and the EOS verified in slot 2 ends the answer: slot 3, decoded but
    after the EOS, is discarded with its pending entries, slot 4 leaves the pool undecoded, and slots 0 and 2 are
    committed. The next plan holds slot 1 alone, on a cache of 3 + 4 committed entries (20 21 24 EOS), none
    pending; the answer is 20 21 22 23 24 EOS."""
    belief = Belief(answer(20, 21, 22, 23, 24, EOS, length=10), guess={1: WRONG}, draft_p={2: UNSURE, 8: UNSURE})
    decoded = run(model64, [belief], settings(max_new_tokens=10, block_size=10))
    assert decoded.stages == [[PLAN, VERIFY, INFILL_DRAFT, INFILL_VERIFY, PLAN, VERIFY, DONE]]
    assert decoded.result.chosen_slots == [[[0, 4, 6], [2]]]
    _, verify, draft, verify_infill, plan_next, _ = decoded.fed()
    assert verify.tokens == [20, WRONG, 24, EOS, 26, 27]
    assert (draft.tokens, draft.pending) == ([20, MASK, 24, EOS, 26, 27], 0)
    assert (verify_infill.tokens, verify_infill.pending) == ([21], 5)  # 20; 24 EOS; 26 27
    assert (plan_next.offsets, plan_next.cached, plan_next.pending) == ([2, 3], 3 + 4, 0)
    assert decoded.tokens() == [20, 21, 22, 23, 24, EOS]
    assert decoded.commit_step() == [0, 0, 1, 1, 0, 0]


def test_after_an_eos_is_accepted_no_later_block_is_decoded(model64):
    """The story above with planning ahead and a second block (offsets 10, 11). Once slot 2's EOS is accepted,
    decoding ends with block 0: slot 1, before the EOS, is still planned and verified, but its verification, all
    of whose drafts are sure, carries no plan of block 1. The infill verification before it did carry a plan (of
    slots 1 and 4, the pool it assumed), which the EOS then discarded."""
    belief = Belief(answer(20, 21, 22, 23, 24, EOS, length=12), guess={1: WRONG}, draft_p={2: UNSURE, 8: UNSURE})
    decoded = run(model64, [belief], settings(max_new_tokens=12, block_size=10, plan_ahead=True))
    assert decoded.stages == [[PLAN, VERIFY, INFILL_DRAFT, INFILL_VERIFY, PLAN, VERIFY, DONE]]
    assert [call.masks for call in decoded.fed()] == [10, 0, 1, 4, 2, 0]
    assert decoded.fed()[-1].tokens == [22, 23]
    assert decoded.tokens() == [20, 21, 22, 23, 24, EOS]


# -------------------------------------------------------------------------------------------------- plan ahead
def test_planning_ahead_saves_the_next_plans_forward(model64):
    """Two blocks of two slots, the model sure of everything. Every draft of block 0 was drafted above the token
    threshold, so its verification also carries block 1's plan (4 masks that see the whole query; the query does
    not see them). The verification commits everything it verified, so that plan's inputs are those of a plan
    forward of its own: its drafts are used and block 1 goes straight to verification. Same slots, tokens and
    commit steps as one forward per stage, one forward fewer."""
    belief = Belief(answer())
    ahead = run(model64, [belief], settings(block_size=4, plan_ahead=True))
    alone = run(model64, [belief], settings(block_size=4, plan_ahead=False))
    assert ahead.stages == [[PLAN, VERIFY, VERIFY, DONE]]
    assert alone.stages == [[PLAN, VERIFY, PLAN, VERIFY, DONE]]
    verify0 = ahead.fed()[1]
    assert (verify0.tokens, verify0.offsets) == ([20, 21, 22, 23] + [MASK] * 4, list(range(8)))
    assert ahead.result.forward_passes_per_row == [3] and alone.result.forward_passes_per_row == [4]
    assert ahead.result.chosen_slots == alone.result.chosen_slots == [[[0, 2], [4, 6]]]
    assert ahead.tokens() == alone.tokens() == answer()
    assert ahead.commit_step() == alone.commit_step()


def test_a_plan_riding_along_is_discarded_when_the_step_commits_less(model64):
    """Blocks of two slots; the plan guesses WRONG at offset 3, with probability 0.9, so the verification carries
    block 1's plan. The model expects 23 after 22 and rejects WRONG: only slot 0 is committed, slot 1 returns to
    the pool, the plan that rode along assumed another pool and is discarded, and a plan forward of its own
    follows. Slot 1's verification (carrying block 1's plan again) rejects WRONG again, so it goes to infill;
    there 23 is re-drafted and the infill verification, committing everything it fed, carries block 1's plan once
    more, and this time it is used. One forward saved of eight, the same answer."""
    belief = Belief(answer(), guess={3: WRONG})
    ahead = run(model64, [belief], settings(block_size=4, plan_ahead=True))
    alone = run(model64, [belief], settings(block_size=4, plan_ahead=False))
    assert ahead.stages == [[PLAN, VERIFY, PLAN, VERIFY, INFILL_DRAFT, INFILL_VERIFY, VERIFY, DONE]]
    assert alone.stages == [[PLAN, VERIFY, PLAN, VERIFY, INFILL_DRAFT, INFILL_VERIFY, PLAN, VERIFY, DONE]]
    assert [call.masks for call in ahead.fed()] == [4, 4, 2, 4, 1, 4, 0]  # the plans' masks, the draft's mask
    assert ahead.fed()[1].tokens == [20, 21, 22, WRONG] + [MASK] * 4
    assert ahead.result.forward_passes_per_row == [7] and alone.result.forward_passes_per_row == [8]
    assert ahead.result.chosen_slots == alone.result.chosen_slots == [[[0, 2], [2], [4, 6]]]
    assert ahead.tokens() == alone.tokens() == answer()
    assert ahead.commit_step() == alone.commit_step() == [0, 0, 1, 1, 2, 2, 2, 2]


def test_a_plan_rides_along_only_when_it_is_likely_to_be_used(model64):
    """Slots 0 and 1 chosen, 2 and 3 undecoded. With every draft sure, the next plan (slots 2 and 3) rides along
    the verification. When slot 1's drafts hold an EOS, accepting it would drop slots 2 and 3, and not accepting
    it would leave part of the query uncommitted: that plan could never be used, so none rides along. Nor does one
    when a draft to be verified was drafted below the token threshold (21, at 0.3): it is likely to be rejected,
    and the extra masks are not free. (Here the model, reading 20, accepts 21 after all: the step commits
    everything, and the plan gets a forward of its own.)"""
    unsure_tail = {4: UNSURE, 6: UNSURE}
    going_on = run(model64, [Belief(answer(), draft_p=unsure_tail)], settings(plan_ahead=True))
    assert going_on.fed()[1].tokens == [20, 21, 22, 23] + [MASK] * 4
    ending = run(model64, [Belief(answer(20, 21, EOS), draft_p=unsure_tail)], settings(plan_ahead=True))
    assert ending.fed()[1].tokens == [20, 21, EOS, 23]
    assert ending.tokens() == [20, 21, EOS]
    doubtful = run(model64, [Belief(answer(), draft_p={1: UNSURE, **unsure_tail})], settings(plan_ahead=True))
    assert doubtful.fed()[1].tokens == [20, 21, 22, 23]
    assert doubtful.stages[0][:4] == [PLAN, VERIFY, PLAN, VERIFY]


# ----------------------------------------------------------------------------------------------------- batches
def test_a_row_that_finishes_leaves_the_batch_while_the_other_continues(model64):
    """Two prompts of different lengths decode in lock step, one forward for both. Row 0's answer is 20 EOS: its
    first verification accepts the EOS and it is done after two forwards; it leaves the batch, so the next forwards
    serve row 1 alone (its cache row: 5 prompt + 4 committed entries) and row 0's forward count stops at 2. Row 0
    is padded after its EOS, with no commit step there."""
    beliefs = [Belief(answer(20, EOS)), Belief(answer())]
    decoded = run(model64, beliefs, settings(block_size=4), prompts=[PROMPT, [13, 14, 15, 16, 17]])
    assert [[call.prompt for call in forward] for forward in decoded.calls] == [[0, 1], [0, 1], [1], [1]]
    assert decoded.stages == [[PLAN, VERIFY, DONE], [PLAN, VERIFY, PLAN, VERIFY, DONE]]
    assert decoded.result.forward_passes_per_row == [2, 4] and decoded.result.num_forward_passes == 4
    assert decoded.calls[2][0].cached == 5 + 4
    assert decoded.tokens(0) == [20, EOS] + [PAD] * 6 and decoded.commit_step(0) == [0, 0] + [-1] * 6
    assert decoded.tokens(1) == answer() and decoded.commit_step(1) == [0] * 4 + [1] * 4


def test_continuous_batching_a_waiting_prompt_joins_when_a_row_is_free(model64):
    """One row at a time (`max_rows=1`), two prompts. Prompt 1 waits while prompt 0 decodes (20 21 EOS: a plan and
    a verification); as soon as prompt 0 is done, prompt 1 is prefilled (its prompt and first plan) and decodes
    in the freed row. Each answer, its commit steps and its forward count are those it has alone."""
    beliefs = [Belief(answer(20, 21, EOS)), Belief([30 + o for o in range(8)], draft_p={4: UNSURE, 6: UNSURE})]
    prompts = [PROMPT, [13, 14, 15, 16, 17]]
    stream = run(model64, beliefs, settings(), prompts=prompts, max_rows=1)
    assert [[call.prompt for call in forward] for forward in stream.calls] == [[0], [0]] + [[1]] * 6
    assert stream.calls[2][0].query.num_context == 5  # prompt 1 prefilled after prompt 0 finished
    for row, (belief, prompt) in enumerate(zip(beliefs, prompts)):
        alone = run(model64, [belief], settings(), prompts=[prompt])
        n = alone.result.answer_lengths[0]
        assert stream.result.answer_lengths[row] == n
        assert stream.tokens(row)[:n] == alone.tokens()[:n] and stream.commit_step(row)[:n] == alone.commit_step()[:n]
        assert stream.result.forward_passes_per_row[row] == alone.result.forward_passes_per_row[0]
    assert stream.result.forward_passes_per_row == [2, 6] and stream.result.num_forward_passes == 8


# ---------------------------------------------------------------------------------------------------- stopping
class StopAt(EosTokenCriteria):
    """transformers' criterion for a stop token, recording the width of every `input_ids` it is shown."""

    def __init__(self, token: int):
        super().__init__(token)
        self.widths = []

    def __call__(self, input_ids, scores, **kwargs):
        self.widths.append(input_ids.shape[1])
        return super().__call__(input_ids, scores, **kwargs)


def test_a_stopping_criterion_cuts_the_answer_and_ends_decoding(model64):
    """One slot per step (first drafts 0.9, then 0.3, 0.2, 0.1). The criterion stops at token 22. It is shown the
    finished prefix as stock generate shows it, once per answer length: after step 0 commits 20 21, at lengths 1
    and 2; after step 1 commits 22 23, at length 3, where it fires. The answer is cut there (23, decoded, is not
    returned) and decoding ends: slots 2 and 3 are never planned again."""
    belief = Belief(answer(), draft_p={2: UNSURE, 4: 0.2, 6: 0.1})
    criterion = StopAt(22)
    stopping = PrefixStopping(StoppingCriteriaList([criterion]), torch.tensor([PROMPT]), PAD)
    stopped = run(model64, [belief], settings(), stopping=stopping)
    assert criterion.widths == [3 + 1, 3 + 2, 3 + 3]
    assert stopped.stages == [[PLAN, VERIFY, PLAN, VERIFY, DONE]]
    assert stopped.result.chosen_slots == [[[0], [2]]]
    assert stopped.tokens() == [20, 21, 22] and stopped.result.answer_lengths == [3]
    assert run(model64, [belief], settings()).result.chosen_slots == [[[0], [2], [4], [6]]]
