"""The side-by-side harness on lm-eval's real evaluator, with generation scripted at the one call it times: ReFusion
answers every synthetic problem correctly, autoregressive decoding only the arithmetic ones. Checks that lm-eval
scores right answers right on every family (code through the sandbox), that counts and speeds add up, that the
decodings alternate batch by batch, and that repeats time the fastest run."""

import itertools
import math

import pytest
import torch

from refusion_hf.evaluation import harness
from refusion_hf.evaluation.harness import EvalSettings, evaluate_decodings, markdown_table, throughput
from refusion_hf.evaluation.lm_eval_model import GenerateRecord
from refusion_hf.evaluation.synthetic_tasks import generate_problems
from refusion_hf.evaluation.tasks import load_task
from refusion_hf.generation.refusion_generate import answer_lengths
from refusion_hf.modeling.loading import load_model_and_tokenizer


@pytest.fixture(scope="module")
def embedded():
    return load_model_and_tokenizer(None, "float32")


def synthetic_task(seed, n, families=("arithmetic", "code", "listing")):
    metadata = {"seed": seed, "num_problems": n, "families": list(families)}
    task = load_task("refusion_synthetic", metadata=metadata)
    return task, {p.prompt: p for p in generate_problems("test", n, seed, list(families))}


class Script:
    """Stands in for `SideBySideLM.timed_generate`: answers by prompt, records calls, chosen durations."""

    def __init__(self, answers, durations=None):
        self.answers = answers  # decoding -> prompt text -> answer
        self.durations = durations
        self.calls = []  # (decoding, rows, max_new_tokens)
        self.kwargs = []

    def __call__(self, lm, context, max_length, stop, kwargs):
        decoding = kwargs.get("decoding", "refusion")
        self.calls.append((decoding, context.shape[0], max_length - context.shape[1]))
        self.kwargs.append(kwargs)
        rows = []
        for row, mask in zip(context, lm._context_mask.bool()):
            text = lm.tokenizer.decode(row[mask])
            [prompt] = [p for p in self.answers[decoding] if p in text]
            answer = lm.tokenizer.encode(self.answers[decoding][prompt], add_special_tokens=False)
            rows.append((answer + [lm.tokenizer.eos_token_id])[: max_length - context.shape[1]])
        width = max(len(r) for r in rows)
        new = torch.full((len(rows), width), lm.tokenizer.pad_token_id)
        for i, r in enumerate(rows):
            new[i, : len(r)] = torch.tensor(r)
        lengths = [len(r) for r in rows]
        passes = [math.ceil(n / 2) for n in lengths] if decoding == "refusion" else lengths  # "2 tokens/forward"
        seconds = next(self.durations) if self.durations is not None else 0.01
        return GenerateRecord(torch.cat([context, new], 1), lengths, passes, max(passes), seconds)


def install(monkeypatch, script):
    monkeypatch.setattr(harness.SideBySideLM, "timed_generate", lambda lm, *args: script(lm, *args))


@pytest.mark.parametrize("batch_size", [1, 4])
def test_right_answers_score_right_and_the_numbers_add_up(embedded, monkeypatch, batch_size):
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    model, tokenizer = embedded
    task, problems = synthetic_task(11, 9)
    truth = {prompt: p.answer for prompt, p in problems.items()}
    ar = {prompt: (p.answer if p.family == "arithmetic" else "no idea") for prompt, p in problems.items()}
    script = Script({"refusion": truth, "autoregressive": ar})
    install(monkeypatch, script)
    reported = []
    settings = EvalSettings(batch_size=batch_size)
    results = evaluate_decodings(model, tokenizer, task, settings, progress=reported.append)

    refusion, autoregressive = results["refusion"], results["autoregressive"]
    assert refusion["accuracy"] == 1.0 and refusion["num_correct"] == 9
    assert refusion["per_family"] == {
        f: {"accuracy": 1.0, "num_problems": 3} for f in ("arithmetic", "code", "listing")
    }
    assert autoregressive["accuracy"] == pytest.approx(3 / 9)
    assert autoregressive["per_family"]["arithmetic"]["accuracy"] == 1.0
    assert autoregressive["per_family"]["code"]["accuracy"] == 0.0
    assert results["accuracy_difference"] == pytest.approx(6 / 9)
    # paired over the 9 problems: differences six 1s and three 0s, mean 2/3, sample variance (6 * (1/3)^2 + 3 *
    # (2/3)^2) / 8 = 0.25, standard error 0.5 / 3; the table says so
    interval = results["accuracy_difference_interval"]
    assert interval["standard_error"] == pytest.approx(0.5 / 3)
    assert (interval["low"], interval["high"]) == pytest.approx((2 / 3 - 1.959964 / 6, 2 / 3 + 1.959964 / 6))
    assert (interval["first_better"], interval["second_better"], interval["num_problems"]) == (6, 0, 9)
    assert "accuracy difference +66.7 points (95% interval +34.0 to +99.3, paired over 9 problems" in markdown_table(
        results
    )
    assert refusion["lm_eval_metrics"] == {"exact_match,none": 1.0}

    lengths = {prompt: len(tokenizer.encode(answer, add_special_tokens=False)) + 1 for prompt, answer in truth.items()}
    assert refusion["num_tokens"] == sum(lengths.values())
    assert refusion["num_sequences"] == autoregressive["num_sequences"] == 9
    assert refusion["tokens_per_forward"] == pytest.approx(
        sum(lengths.values()) / sum(math.ceil(n / 2) for n in lengths.values())
    )
    assert autoregressive["tokens_per_forward"] == 1.0
    assert refusion["tokens_per_second"] > 0 and results["speedup"] > 0

    for entry in results["problems"]:
        [prompt] = [p for p in problems if p in entry["prompt"]]
        family = problems[prompt].family
        assert entry["refusion"]["answer"] == truth[prompt] and entry["refusion"]["correct"] is True
        assert entry["autoregressive"]["correct"] is (family == "arithmetic")
        assert entry["refusion"]["num_tokens"] == lengths[prompt]
        assert entry["family"] == family

    # a warm-up of each decoding (8 tokens), then every batch with both, alternating which goes first
    assert script.calls[:2] == [("refusion", script.calls[0][1], 8), ("autoregressive", script.calls[0][1], 8)]
    timed = script.calls[2:]
    batches = math.ceil(9 / batch_size)
    assert len(timed) == 2 * batches
    for index in range(batches):
        assert timed[2 * index][0] == ("refusion" if index % 2 == 0 else "autoregressive")
        assert {timed[2 * index][0], timed[2 * index + 1][0]} == {"refusion", "autoregressive"}
        assert timed[2 * index][2] == 64  # the task's max_gen_toks
    assert reported[-1] == 9 and len(reported) == batches

    table = markdown_table(results)
    assert "| refusion | 1.000 (9/9) |" in table
    assert "| autoregressive | 0.333 (3/9) |" in table
    assert "| code | 3 | 1.000 | 0.000 |" in table
    assert "lm-eval task refusion_synthetic, exact_match,none" in table


def test_code_problems_need_the_opt_in(embedded, monkeypatch):
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    model, tokenizer = embedded
    task, problems = synthetic_task(0, 3)
    script = Script({d: {p: "x" for p in problems} for d in ("refusion", "autoregressive")})
    install(monkeypatch, script)
    with pytest.raises(PermissionError, match="HF_ALLOW_CODE_EVAL=1"):
        evaluate_decodings(model, tokenizer, task, EvalSettings())
    assert script.calls == []  # refused before decoding anything


def test_one_decoding_alone_for_a_baseline_model(embedded, monkeypatch):
    """`decodings=("autoregressive",)` evaluates a model that cannot decode with ReFusion: it is never asked to,
    and the results have no comparison fields."""
    model, tokenizer = embedded
    task, problems = synthetic_task(3, 4, families=("arithmetic", "listing"))
    script = Script({"autoregressive": {prompt: p.answer for prompt, p in problems.items()}})
    install(monkeypatch, script)
    settings = EvalSettings(batch_size=3, max_new_tokens=400)
    results = evaluate_decodings(model, tokenizer, task, settings, decodings=("autoregressive",))
    assert {call[0] for call in script.calls} == {"autoregressive"}
    assert {call[2] for call in script.calls[1:]} == {400}  # --max-new-tokens overrides the task's length
    assert results["autoregressive"]["accuracy"] == 1.0
    assert "refusion" not in results and "speedup" not in results and "accuracy_difference" not in results
    assert results["settings"]["decodings"] == ["autoregressive"]
    assert all("autoregressive" in entry and "refusion" not in entry for entry in results["problems"])
    table = markdown_table(results)
    assert "| autoregressive | 1.000 (4/4) |" in table and "| refusion |" not in table
    assert "| family | problems | autoregressive accuracy |" in table


def test_a_baseline_model_runs_the_autoregressive_decoding(embedded):
    """With `baseline_model`, autoregressive answers are the baseline's own (as evaluated alone) and ReFusion answers
    the model's own; real decoding, the baseline being the embedded weights with noise added."""
    import copy

    model, tokenizer = embedded
    baseline = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in baseline.parameters():
            parameter.add_(2.0 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    task, _ = synthetic_task(5, 4, families=("arithmetic", "listing"))
    settings = EvalSettings(batch_size=2, max_new_tokens=12)

    def answers(results, decoding):
        return [entry[decoding]["answer"] for entry in results["problems"]]

    both = evaluate_decodings(model, tokenizer, task, settings, baseline_model=baseline)
    alone = evaluate_decodings(baseline, tokenizer, task, settings, decodings=("autoregressive",))
    own = evaluate_decodings(model, tokenizer, task, settings)
    assert answers(own, "autoregressive") != answers(alone, "autoregressive"), "the two models must differ"
    assert answers(both, "autoregressive") == answers(alone, "autoregressive")
    assert answers(both, "refusion") == answers(own, "refusion")
    with pytest.raises(ValueError, match="baseline model runs the autoregressive decoding"):
        evaluate_decodings(model, tokenizer, task, settings, decodings=("refusion",), baseline_model=baseline)


@pytest.mark.parametrize("decodings", [(), ("beam",), ("refusion", "refusion")])
def test_bad_decodings_are_refused(embedded, decodings):
    model, tokenizer = embedded
    task, _ = synthetic_task(0, 1, families=("arithmetic",))
    with pytest.raises(ValueError, match="--decodings must be a non-empty subset of refusion,autoregressive"):
        evaluate_decodings(model, tokenizer, task, EvalSettings(), decodings=decodings)


def test_timing_repeats_time_the_fastest_run_and_keep_one_answer(embedded, monkeypatch):
    model, tokenizer = embedded
    task, problems = synthetic_task(2, 3, families=("arithmetic",))
    truth = {prompt: p.answer for prompt, p in problems.items()}
    durations = iter([5.0, 5.0, 1.0, 1.0, 3.0, 3.0] * 3)  # per problem, repeat r of both decodings
    script = Script({"refusion": truth, "autoregressive": truth}, durations)
    install(monkeypatch, script)
    settings = EvalSettings(timing_repeats=3, warmup=False)
    results = evaluate_decodings(model, tokenizer, task, settings)
    assert len(script.calls) == 3 * 2 * 3  # problems x decodings x repeats
    assert results["refusion"]["seconds"] == results["autoregressive"]["seconds"] == 3 * 1.0
    assert results["refusion"]["accuracy"] == 1.0 and results["settings"]["timing_repeats"] == 3
    assert "fastest of 3 interleaved runs" in markdown_table(results)


def test_timing_repeats_refuse_a_decoding_that_changes_between_runs(embedded, monkeypatch):
    model, tokenizer = embedded
    task, problems = synthetic_task(2, 1, families=("arithmetic",))
    answers = itertools.count()

    class Flaky(dict):
        def __getitem__(self, prompt):
            return str(next(answers))

    flaky = Flaky({prompt: "" for prompt in problems})
    install(monkeypatch, Script({"refusion": flaky, "autoregressive": flaky}))
    with pytest.raises(RuntimeError, match="different tokens when repeated with the same seed"):
        evaluate_decodings(model, tokenizer, task, EvalSettings(timing_repeats=2))


def test_throughput_adds_calls_up():
    records = [
        GenerateRecord(torch.zeros(2, 1), [10, 6], [5, 3], 5, 0.5),
        GenerateRecord(torch.zeros(1, 1), [8], [8], 8, 1.5),
    ]
    speed = throughput(records)
    assert speed["tokens_per_second"] == pytest.approx(24 / 2.0)
    assert speed["median_call_tokens_per_second"] == pytest.approx((16 / 0.5 + 8 / 1.5) / 2)
    assert speed["tokens_per_forward"] == pytest.approx(24 / 16)
    assert speed["mean_tokens_per_forward"] == pytest.approx((2 + 2 + 1) / 3)
    assert (speed["num_forward_passes"], speed["num_tokens"], speed["num_sequences"]) == (13, 24, 3)


def test_answer_lengths_stop_after_the_first_eos():
    new = torch.tensor([[5, 6, 1, 0, 0], [5, 6, 7, 8, 9], [1, 0, 0, 0, 0]])
    assert answer_lengths(new, {1}) == [3, 5, 1]
    assert answer_lengths(torch.tensor([[5, 9, 1]]), {1, 9}) == [2]


def test_a_preset_sets_the_knobs_and_the_task_the_length(embedded, monkeypatch):
    from refusion_hf.generation.refusion_generation_config import preset_settings

    model, tokenizer = embedded
    task, problems = synthetic_task(5, 2, families=("listing",))
    truth = {prompt: p.answer for prompt, p in problems.items()}
    script = Script({"refusion": truth, "autoregressive": truth})
    install(monkeypatch, script)
    evaluate_decodings(model, tokenizer, task, EvalSettings(preset="gsm8k_cot", knobs=dict(slot_size=4), warmup=False))
    preset = preset_settings("gsm8k_cot")
    refusion = [kw for kw, call in zip(script.kwargs, script.calls) if call[0] == "refusion"]
    assert all(kw["slot_size"] == 4 and kw["block_size"] == preset["block_size"] for kw in refusion)
    assert all(kw["token_threshold"] == preset["token_threshold"] and "max_new_tokens" not in kw for kw in refusion)
    assert {call[2] for call in script.calls} == {64}  # the task's max_gen_toks, not the preset's 512
    autoregressive = [kw for kw, call in zip(script.kwargs, script.calls) if call[0] == "autoregressive"]
    assert all("slot_size" not in kw for kw in autoregressive)


def test_continuous_batching_gives_the_answers_of_fixed_batches(embedded):
    """`--continuous-batching`: the problems stream through `generate_batch` (3 at once, a finished one replaced at
    once) with each decoding in turn; every answer and its token count are those of fixed batches, and lm-eval's
    second run scores the autoregressive answers from the record."""
    model, tokenizer = embedded
    task, _ = synthetic_task(5, 5, families=("arithmetic", "listing"))
    runs = {}
    for continuous in (False, True):
        settings = EvalSettings(batch_size=3, max_new_tokens=24, continuous_batching=continuous, warmup=False)
        runs[continuous] = evaluate_decodings(model, tokenizer, task, settings)
    fixed, streamed = runs[False], runs[True]
    for decoding in ("refusion", "autoregressive"):
        for alone, together in zip(fixed["problems"], streamed["problems"]):
            assert together[decoding]["answer"] == alone[decoding]["answer"]
            assert together[decoding]["num_tokens"] == alone[decoding]["num_tokens"] is not None
        assert streamed[decoding]["accuracy"] == fixed[decoding]["accuracy"]
        assert streamed[decoding]["num_tokens"] == fixed[decoding]["num_tokens"]
        assert streamed[decoding]["num_sequences"] == 5
    # A continuous batch's rows share its forwards: fewer forwards than the rows' own passes added up (each row decodes
    # as it would alone, in as many passes as in the fixed batches, and every forward advances at least one row).
    # Not fewer than the fixed batches' forwards: each group of rows that joins costs a prefill forward of its own.
    row_passes = round(fixed["refusion"]["num_tokens"] / fixed["refusion"]["tokens_per_forward"])
    assert streamed["refusion"]["num_forward_passes"] < row_passes
    table = markdown_table(streamed)
    assert streamed["settings"]["continuous_batching"] and "Continuous batching: at most 3" in table
    assert "transformers' own continuous batching" in table and "own continuous" not in markdown_table(fixed)


def test_continuous_batching_refuses_generation_arguments_it_would_ignore(embedded):
    from types import SimpleNamespace

    from refusion_hf.evaluation.lm_eval_model import RefusionLM

    model, tokenizer = embedded
    lm = RefusionLM(pretrained=model, tokenizer=tokenizer, batch_size=2, continuous_batching=True)
    request = SimpleNamespace(args=("2 + 2 =", {"until": ["\n"], "max_gen_toks": 8, "no_such_argument": 1}))
    with pytest.raises(ValueError, match=r"\['no_such_argument'\].*generate_batch would ignore them"):
        lm.stream_requests([request])
    answers, lengths, forwards = lm.stream_requests([SimpleNamespace(args=("2 + 2 =", {"max_gen_toks": 8}))])
    assert len(answers) == 1 and 1 <= lengths[0] <= 8 and forwards >= 1
