import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refusion_hf.evaluation.extraction import extract_numeric_answer, normalize_listing
from refusion_hf.evaluation.synthetic_tasks import (
    FAMILIES,
    TIER_SHAPES,
    SyntheticProblem,
    generate_problem,
    generate_problems,
    is_test_key,
    write_jsonl,
)

seeds = st.integers(min_value=-(2**40), max_value=2**40)
indices = st.integers(min_value=0, max_value=10_000)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split=st.sampled_from(["train", "test"]), seed=seeds, index=indices)
def test_a_problem_is_a_pure_function_of_split_seed_and_index(split, seed, index):
    first = generate_problem(split, seed, index)
    again = generate_problem(split, seed, index)
    assert first == again
    assert first.family == FAMILIES[index % len(FAMILIES)]
    # its position in a list does not matter either
    assert generate_problems(split, 1, seed, start=index)[0] == first


@settings(max_examples=40, deadline=None)
@given(train_seed=seeds, test_seed=seeds, index=indices)
def test_a_test_problem_is_never_a_training_problem(train_seed, test_seed, index):
    test_problem = generate_problem("test", test_seed, index)
    train_problem = generate_problem("train", train_seed, index)
    assert is_test_key(test_problem.split_key)
    assert not is_test_key(train_problem.split_key)
    assert test_problem.prompt != train_problem.prompt


def test_train_and_test_sets_are_disjoint_in_bulk():
    train = generate_problems("train", 3000, seed=0) + generate_problems("train", 1500, seed=1)
    test = generate_problems("test", 600, seed=0) + generate_problems("test", 600, seed=12345)
    train_prompts, test_prompts = {p.prompt for p in train}, {p.prompt for p in test}
    train_keys, test_keys = {p.split_key for p in train}, {p.split_key for p in test}
    assert not train_prompts & test_prompts
    assert not train_keys & test_keys
    # code problems are split by function identity (description, name, constant), not just by prompt text
    code_keys = {p.split_key for p in train if p.family == "code"}
    assert all(key.startswith("code|") for key in code_keys)
    assert not {p.split_key for p in test if p.family == "code"} & code_keys
    # the test split is a sizeable, varied set
    assert len(test_prompts) > 1100


def test_the_seed_changes_the_problems_and_the_families_are_balanced():
    a = generate_problems("test", 30, seed=1)
    b = generate_problems("test", 30, seed=2)
    assert [p.prompt for p in a] != [p.prompt for p in b]
    assert len({p.prompt for p in a} & {p.prompt for p in b}) < 5
    assert [p.family for p in a].count("code") == 10
    only = generate_problems("test", 6, seed=1, families=["listing"])
    assert {p.family for p in only} == {"listing"}


def _check_arithmetic(problem: SyntheticProblem) -> None:
    # every equation in the worked answer is right, each step uses the previous result, and #### is the target
    equations = re.findall(r"(\d+) ([+\-*]) (\d+) = (\d+)", problem.answer)
    assert len(equations) >= 2
    for left, op, right, result in equations:
        value = {"+": int(left) + int(right), "-": int(left) - int(right), "*": int(left) * int(right)}[op]
        assert value == int(result), problem.answer
    assert int(equations[-1][3]) == int(problem.target)
    assert extract_numeric_answer(problem.answer, mode="strict") == problem.target
    assert int(problem.target) >= 0
    assert problem.prompt.endswith("have now?")


def _check_code(problem: SyntheticProblem) -> None:
    # the reference solution passes the hidden tests (trusted code: our own template output)
    namespace: dict = {}
    exec(problem.answer + "\n" + problem.target, namespace)
    assert problem.entry_point in namespace
    assert problem.target.count("assert ") == 4
    assert problem.visible_tests[0] in problem.target
    assert problem.visible_tests[0].removeprefix("assert ") in problem.prompt
    # a wrong solution fails them
    wrong = problem.answer.replace("return ", "return None and ")
    with pytest.raises(AssertionError):
        exec(wrong + "\n" + problem.target, {})


def _check_listing(problem: SyntheticProblem, lengths: tuple[int, int] = (3, 5)) -> None:
    lines = normalize_listing(problem.answer)
    assert lengths[0] <= len(lines) <= lengths[1]
    assert problem.target == problem.answer
    if problem.prompt.startswith("For the numbers"):
        numbers = re.match(r"For the numbers ([\d, ]+?), (add|multiply|subtract)", problem.prompt).group(1)
        assert [line.split()[0] for line in lines] == numbers.split(", ")
        for line in lines:
            n, word, c, _is, r = line.split()
            expected = {"plus": int(n) + int(c), "times": int(n) * int(c), "minus": int(n) - int(c)}[word]
            assert int(r) == expected
    else:
        for line in lines:
            key, value = line.split(": ")
            assert f"{key} {value}" in problem.prompt


def test_reference_answers_are_correct_and_short():
    for problem in generate_problems("test", 60, seed=7) + generate_problems("train", 60, seed=7):
        {"arithmetic": _check_arithmetic, "code": _check_code, "listing": _check_listing}[problem.family](problem)
        # short enough for a small model trained on a CPU (whitespace words as a proxy for tokens)
        assert len(problem.prompt.split()) <= 60
        assert 4 <= len(problem.answer.split()) <= 60
        assert problem.messages == [{"role": "user", "content": problem.prompt}]


def test_write_jsonl_writes_training_records(tmp_path):
    path = write_jsonl(tmp_path / "sub" / "train.jsonl", "train", 9, seed=3)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    expected = generate_problems("train", 9, seed=3)
    assert len(records) == 9
    for record, problem in zip(records, expected):
        assert record == {
            "messages": [
                {"role": "user", "content": problem.prompt},
                {"role": "assistant", "content": problem.answer},
            ]
        }
    query = write_jsonl(tmp_path / "q.jsonl", "test", 3, seed=3, record_format="query")
    rows = [json.loads(line) for line in query.read_text().splitlines()]
    assert rows == [{"query": p.prompt, "response": p.answer} for p in generate_problems("test", 3, seed=3)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "validation", "seed": 0, "index": 0}, "`split` must be one of"),
        ({"split": "test", "seed": 0, "index": -1}, "`index` must be >= 0"),
        ({"split": "test", "seed": "0", "index": 0}, "`seed` and `index` must be integers"),
        ({"split": "test", "seed": 0, "index": 0, "families": ["poetry"]}, "`families` must be a non-empty subset"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate_problem(**kwargs)


def test_bad_write_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="`record_format` must be"):
        write_jsonl(tmp_path / "x.jsonl", "train", 2, 0, record_format="chatml")
    with pytest.raises(ValueError, match="`n` must be an integer >= 0"):
        generate_problems("train", -1, 0)


def test_the_suites_code_metric_scores_an_early_exit_as_wrong(monkeypatch):
    """The lm-eval task's metric runs the answer and the hidden tests in the sandbox as two programs: the reference
    passes, a wrong answer that leaves before the tests (exit status 0) does not."""
    pytest.importorskip("lm_eval")
    from refusion_hf.evaluation.lm_eval_tasks.synthetic_suite import is_correct
    from refusion_hf.evaluation.sandbox import ALLOW_ENV_VAR

    monkeypatch.setenv(ALLOW_ENV_VAR, "1")
    problem = next(p for p in generate_problems("test", 3, seed=7) if p.family == "code")
    wrong = problem.answer.replace("return ", "return None and ")
    assert is_correct("code", problem.answer, problem.target)
    assert not is_correct("code", wrong, problem.target)
    assert not is_correct("code", wrong + "\nimport sys\nsys.exit(0)\n", problem.target)


# ------------------------------------------------------------------------------------------------- the hard tier
def test_standard_problems_are_the_ones_drawn_before_the_tiers_existed():
    """Golden problems recorded from the suite before the hard tier was added: the installed model's training data,
    its validation and every earlier result stay the same problems."""
    first = generate_problem("test", 7, 0)
    assert first.prompt == (
        "Jack has 27 cards. He gives away 9. Then he buys 2 jars with 3 cards in each. How many cards does Jack "
        "have now?"
    )
    assert first.answer == "Jack starts with 27. 27 - 9 = 18. 2 * 3 = 6. 18 + 6 = 24. #### 24"
    assert first.id == "synthetic/test/7/0"
    assert generate_problem("test", 7, 2).prompt == (
        "For the numbers 6, 26, 4, 24, 23, multiply each number by 9. Write one line each."
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split=st.sampled_from(["train", "test"]), seed=seeds, index=indices)
def test_a_hard_problem_is_a_pure_function_of_split_seed_and_index(split, seed, index):
    first = generate_problem(split, seed, index, tier="hard")
    assert first == generate_problem(split, seed, index, tier="hard")
    assert first == generate_problems(split, 1, seed, start=index, tier="hard")[0]
    assert first.id == f"synthetic-hard/{split}/{seed}/{index}"
    assert first.family == ("arithmetic", "listing")[index % 2]
    assert is_test_key(first.split_key) == (split == "test")
    # its own random stream: not the standard problem of the same coordinates lengthened
    assert first.prompt != generate_problem(split, seed, index, families=["arithmetic", "listing"]).prompt


def test_hard_problems_are_right_and_the_longest_of_the_training_range_with_larger_numbers():
    hard = generate_problems("test", 200, seed=3, tier="hard")
    standard, shape = TIER_SHAPES["standard"], TIER_SHAPES["hard"]
    starts, listed = [], []
    for problem in hard:
        if problem.family == "arithmetic":
            _check_arithmetic(problem)
            # "X has N items." then one sentence a step, then the question
            assert problem.prompt.count(".") - 1 == standard.arithmetic_steps[1] == shape.arithmetic_steps[0]
            starts.append(int(re.match(r"\w+ has (\d+) ", problem.prompt).group(1)))
        else:
            _check_listing(problem, (standard.listed_numbers[1], standard.record_fields[1]))
            if problem.prompt.startswith("For the numbers"):
                listed += [int(line.split()[0]) for line in normalize_listing(problem.answer)]
    assert min(starts) >= shape.arithmetic_start[0] and max(starts) <= shape.arithmetic_start[1]
    assert sum(start > standard.arithmetic_start[1] for start in starts) > len(starts) / 2
    assert max(listed) <= shape.listed_values[1] and any(value > standard.listed_values[1] for value in listed)


def test_the_hard_tier_is_harder_for_the_ar_baseline():
    """The controlled AR baseline (greedy, float32, batches of 10) is right on nearly every standard problem and on
    clearly fewer hard ones (at 60 problems a seed: 1.000 against 0.73 / 0.72 when the tier was tuned); a margin
    wide enough for a near-tie flipped by another CPU's kernels."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from refusion_hf.evaluation.lm_eval_tasks.synthetic_suite import is_correct

    folder = Path(__file__).resolve().parents[2] / "benchmarks" / "models" / "ar_baseline"
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def accuracy(problems):
        texts = [
            tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True) for p in problems
        ]
        right = 0
        for start in range(0, len(texts), 10):
            batch = tokenizer(texts[start : start + 10], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(**batch, max_new_tokens=64, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            answers = tokenizer.batch_decode(out[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
            right += sum(is_correct(p.family, a, p.target) for p, a in zip(problems[start:], answers))
        return right / len(problems)

    standard = accuracy(generate_problems("test", 30, seed=540001, families=["arithmetic", "listing"]))
    hard = accuracy(generate_problems("test", 30, seed=540001, tier="hard"))
    assert standard >= 0.9
    assert hard <= 0.85 and hard <= standard - 0.1


def test_the_hard_tier_has_no_code_family():
    with pytest.raises(ValueError, match=r"`families` must be a non-empty subset of \('arithmetic', 'listing'\)"):
        generate_problem("test", 0, 0, families=["code"], tier="hard")
    with pytest.raises(ValueError, match="`tier` must be one of"):
        generate_problem("test", 0, 0, tier="expert")
