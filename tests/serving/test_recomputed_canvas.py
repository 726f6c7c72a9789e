"""The mapping of the decoder's forwards onto a recomputed canvas (`serving/recomputed_canvas.py`, what ReFusion on
SGLang runs), checked without SGLang: `decode_on_recomputed_canvas` runs the package's decoder (its `SequenceState`
and stage units, as the SGLang algorithm does) and computes each forward with transformers' own forward of the
whole sequence, nothing cached: the prompt causal, each finished block under its `BlockLedger.close` mask, then the
canvas under its `BlockLedger.canvas` mask (what SGLang computes with its KV cache and the masked attention backend).
Its tokens are generate()'s on the embedded model's installed decoding (several slots per block, remasking) and the
authors' on every golden case of their decoder; the SGLang tests (`make test-sglang`) check the engine itself."""

from __future__ import annotations

import json

import pytest
import torch

from refusion_hf import RefusionForCausalLM
from refusion_hf.generation.draft_policy import DraftPolicy
from refusion_hf.generation.sequence_state import Kept, Query, SequenceState, Stage
from refusion_hf.generation.stages import STAGES, begin_step, examine_steps, finish_step
from refusion_hf.serving.recomputed_canvas import CANVAS_BLOCKS, BlockLedger, context_mask, request_settings
from refusion_hf.serving.sglang_plugin import refusion_settings
from tests.oracle import FIXTURE, expected, load_cases, mismatch
from tests.serving.sglang_golden import GOLDEN, embedded_model_path

CASES = load_cases()
GOLDEN_DATA = json.loads(GOLDEN.read_text())["embedded"]


def decode_on_recomputed_canvas(model, model_path, prompt: list[int], max_new_tokens: int, overrides=None):
    """One prompt decoded through `BlockLedger` with full recomputation: (answer tokens, decoder forwards)."""
    settings_dict = refusion_settings(str(model_path), overrides or {})
    settings = request_settings(settings_dict["knobs"], settings_dict["eos_token_ids"], max_new_tokens)
    width = CANVAS_BLOCKS * settings.block_size  # the algorithm's canvas
    policy = DraftPolicy.greedy(settings_dict["never_drafted"], "cpu")
    state = SequenceState(torch.tensor(prompt), settings, policy)
    units = STAGES.units(settings)
    n = len(prompt)
    tokens, positions = list(prompt), list(range(n))  # the context: prompt and finished blocks
    sees = torch.ones(n, n, dtype=torch.bool).tril()  # [context, context]
    ledger, forwards = BlockLedger(n), 0
    while state.stage is not Stage.DONE:
        block = state.block
        step = begin_step(state, units)
        layout = ledger.canvas(step.fed.query, width, settings.mask_token_id)
        c = len(tokens)
        mask = torch.ones(c + width, c + width, dtype=torch.bool)
        mask[:c, c:] = False
        mask[:c, :c] = sees
        mask[c:, c:] = layout.mask
        additive = torch.zeros(mask.shape, dtype=model.dtype).masked_fill(~mask, torch.finfo(model.dtype).min)
        with torch.inference_mode():
            logits = model(
                input_ids=torch.tensor([tokens + layout.tokens]),
                position_ids=torch.tensor([positions + layout.positions]),
                attention_mask={"full_attention": additive[None, None]},
            ).logits[0, c:]
        forwards += 1
        scored = logits[None, layout.scored_start : layout.scored_start + step.fed.query.num_scored]
        (examination,) = examine_steps([step], scored)
        ledger.keep(layout, step.fed.query, finish_step(step, examination))
        if state.stage is not Stage.DONE and state.block != block:  # the block is final: it joins the context
            length = settings.block_size
            grown = torch.ones(c + length, c + length, dtype=torch.bool)
            grown[:c, c:] = False
            grown[:c, :c] = sees
            refed = None if state.context is None else state.context_positions.tolist()
            grown[c:, c:] = ledger.close(length, refed)
            sees = grown
            start = ledger.block_start
            tokens += state.canvas[start - n : start - n + length].tolist()
            positions += list(range(start, start + length))
            ledger = BlockLedger(start + length)
    return state.canvas[: state.answer_length].tolist(), forwards


@pytest.fixture(scope="module")
def embedded():
    return RefusionForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["installed", "one_slot"])
def test_the_embedded_models_decoding_on_the_recomputed_canvas_is_generates(embedded, name):
    """50 prompts of the synthetic suite (tests/data/sglang_golden.json: generate()'s answers, re-checked by
    test_sglang_golden.py), the installed decoding (block 16, two slots of 8, remasking 0.1) and one slot per block."""
    configuration = GOLDEN_DATA["configurations"][name]
    for prompt, answer in zip(GOLDEN_DATA["prompts"], configuration["answers"], strict=True):
        got, _ = decode_on_recomputed_canvas(
            embedded, embedded_model_path(), prompt, GOLDEN_DATA["max_new_tokens"], configuration["settings"]
        )
        assert got == answer


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_the_authors_golden_cases_on_the_recomputed_canvas(model64, case):
    """Every golden case of the authors' decoder (tests/oracle.py's comparison), float64: the same tokens, and the
    authors' forward passes at most (planning ahead is off on the canvas, so no fewer than theirs either)."""
    overrides = {
        "slot_size": case["slot_size"],
        "block_size": case["block_length"],
        "slot_threshold": case["slot_threshold"],
        "token_threshold": case["token_threshold"],
        "remask_threshold": None,
    }
    got, forwards = decode_on_recomputed_canvas(model64, FIXTURE, case["prompt_ids"], case["gen_length"], overrides)
    problem = mismatch(case, got, forwards)
    assert problem is None, problem
    if expected(case).hole_free:
        assert forwards == case["forward_calls"]


# ------------------------------------------------------------------------------------------- the ledger itself
def query(tokens, positions, visible, num_context=0, pending_view=None, hidden=None) -> Query:
    return Query(torch.tensor(tokens), torch.tensor(positions), visible, num_context, pending_view, hidden)


def causal(n: int) -> torch.BoolTensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def test_pending_entries_are_seen_only_by_their_own_slot_then_promoted_as_they_were_computed():
    """Two slots infilled together (positions 10-11 and 12-13): each keeps a verified token pending, seen only by its
    own slot's later tokens; when both complete they are committed, each with the KV it computed alone."""
    ledger = BlockLedger(10)
    first = query([5, 6, 7, 8], [10, 11, 12, 13], torch.block_diag(causal(2), causal(2)))
    layout = ledger.canvas(first, 8, 99)
    ledger.keep(layout, first, Kept(0, ((0, 1, 0), (2, 1, 2))))  # each slot's first token, pending (tags 0 and 2)
    second = query([6, 8], [11, 13], torch.eye(2, dtype=torch.bool), pending_view=torch.tensor([[0, 2], [2, 4]]))
    layout = ledger.canvas(second, 8, 99)
    assert layout.mask[2:4, :2].tolist() == [[True, False], [False, True]]  # each sees its own slot's pending entry
    ledger.keep(layout, second, Kept(2, promote=True))
    assert all(entry.tag is None for entry in ledger.entries.values())
    assert ledger.close(4).tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, False, True, False],  # the second slot never saw the first: their KV was computed apart
        [False, False, True, True],
    ]


def test_a_hidden_range_keeps_a_revised_slot_out_of_its_own_re_score():
    ledger = BlockLedger(0)
    written = query([1, 2, 3, 4], [0, 1, 2, 3], causal(4))
    ledger.keep(ledger.canvas(written, 8, 99), written, Kept(4))
    rescore = query([99, 1], [0, 0], causal(2), hidden=torch.tensor([[0, 2], [0, 2]]))
    layout = ledger.canvas(rescore, 8, 99)
    assert layout.mask[4:6, :4].tolist() == [[False, False, True, True]] * 2


def test_discarded_and_invalidated_entries_leave_the_canvas():
    ledger = BlockLedger(0)
    fed = query([1, 2, 3], [0, 1, 2], causal(3))
    ledger.keep(ledger.canvas(fed, 8, 99), fed, Kept(1, ((1, 2, 5),)))  # one committed, two pending (tags 5, 6)
    ledger.keep(ledger.canvas(query([], [], causal(0)), 8, 99), query([], [], causal(0)), Kept(0, keep_below=6))
    assert sorted(entry.tag for entry in ledger.entries.values() if entry.tag is not None) == [5]
    ledger.keep(ledger.canvas(query([], [], causal(0)), 8, 99), query([], [], causal(0)), Kept(0, invalidate_from=1))
    assert [entry.position for entry in ledger.entries.values()] == [0]


def test_a_query_too_wide_for_the_canvas_is_refused():
    ledger = BlockLedger(0)
    with pytest.raises(RuntimeError, match="exceeds the canvas"):
        ledger.canvas(query(list(range(9)), list(range(9)), causal(9)), 8, 99)


def test_a_kept_token_that_saw_a_dropped_one_is_refused():
    """A kept entry whose KV depends on a query token the cache did not keep cannot be recomputed: never silently."""
    ledger = BlockLedger(0)
    fed = query([1, 2], [0, 1], causal(2))
    layout = ledger.canvas(fed, 8, 99)
    with pytest.raises(RuntimeError, match="not kept"):
        ledger.keep(layout, fed, Kept(0, ((1, 1, 0),)))


def test_the_context_mask_puts_each_finished_block_under_its_own_mask():
    """One block encoded (the usual case), and a request's whole answer encoded again (an engine that dropped its KV):
    the prompt causal, each block under its mask, later blocks seeing all of earlier ones."""
    first = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)  # two tokens that never saw each other
    second = torch.tensor([[1, 1], [0, 1]], dtype=torch.bool)  # the first saw the second (written before it)
    assert torch.equal(context_mask(3, [first, second], 5, 2), second)
    whole = context_mask(3, [first, second], 0, 7)
    assert torch.equal(whole[:3, :3], causal(3))
    assert torch.equal(whole[3:5, 3:5], first) and torch.equal(whole[5:, 5:], second)
    assert whole[5:, :5].all() and not whole[:5, 5:].any()
    with pytest.raises(RuntimeError, match="part of a finished block"):
        context_mask(3, [first, second], 4, 3)


def test_a_block_a_revision_dropped_and_closed_is_encoded_as_the_decoder_refeeds_it():
    """A revision that finds its cut complete drops every entry of the block and closes it: the decoder feeds the
    block again as the next forward's context, causally in position order, and so is it encoded."""
    ledger = BlockLedger(4)
    written = query([1, 2, 3, 4], [4, 5, 6, 7], causal(4))
    ledger.keep(ledger.canvas(written, 8, 99), written, Kept(4))
    ledger.keep(ledger.canvas(query([], [], causal(0)), 8, 99), query([], [], causal(0)), Kept(0, invalidate_from=4))
    assert torch.equal(ledger.close(4, [4, 5, 6, 7]), causal(4))
    with pytest.raises(RuntimeError, match="do not cover"):
        ledger.close(4, [5, 6, 7])


def test_the_held_out_answer_whose_block_a_revision_closed_is_generates(embedded):
    """The one such block in 1,000 held-out problems (hard tier, seed 550001, problem 346: found by the held-out
    check of benchmarks/engine_throughput.py, where SGLang's scheduler stopped on it before the fix)."""
    from transformers import AutoTokenizer

    from refusion_hf.evaluation.synthetic_tasks import generate_problems

    problem = generate_problems("test", 347, 550001, tier="hard")[346]
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    prompt = list(
        tokenizer.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    got, _ = decode_on_recomputed_canvas(embedded, embedded_model_path(), prompt, GOLDEN_DATA["max_new_tokens"])
    out = embedded.generate(torch.tensor([prompt]), max_new_tokens=GOLDEN_DATA["max_new_tokens"], do_sample=False)
    assert got == out[0, len(prompt) :].tolist()[: len(got)] and len(got) == GOLDEN_DATA["max_new_tokens"]
