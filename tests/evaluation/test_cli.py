"""`refusion eval` end to end on the tiny fixture checkpoint (random weights: accuracy is ~0, so the checks are on
structure and on numbers that must agree with each other)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refusion_hf.cli import main
from tests.cli_errors import user_error

TINY = str(Path(__file__).resolve().parents[1] / "data" / "tiny-qwen3-refusion")
FAST = ["--model", TINY, "--max-new-tokens", "8", "--slot-size", "4", "--timing-repeats", "1"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)


def run_eval(tmp_path, *args):
    out = tmp_path / "out.json"
    assert main(["eval", *FAST, *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def check_consistent(results, num_problems, max_new_tokens=8):
    for decoding in ("refusion", "autoregressive"):
        r = results[decoding]
        assert set(r) >= {"accuracy", "tokens_per_second", "tokens_per_forward", "num_forward_passes"}
        assert r["num_problems"] == r["num_sequences"] == num_problems
        flags = [entry[decoding]["correct"] for entry in results["problems"]]
        assert r["num_correct"] == sum(flags)
        assert r["accuracy"] == pytest.approx(sum(flags) / num_problems)
        assert sum(f["num_problems"] for f in r["per_family"].values()) == num_problems
        tokens = [entry[decoding]["num_tokens"] for entry in results["problems"]]
        assert r["num_tokens"] == sum(tokens)
        assert all(1 <= t <= max_new_tokens for t in tokens)
        assert r["tokens_per_second"] > 0 and r["seconds"] > 0
        assert 1.0 <= r["tokens_per_forward"] <= max_new_tokens
        assert 1 <= r["num_forward_passes"] <= r["num_tokens"]
    assert results["autoregressive"]["tokens_per_forward"] == 1.0
    assert results["speedup"] == pytest.approx(
        results["refusion"]["tokens_per_second"] / results["autoregressive"]["tokens_per_second"]
    )
    assert len(results["problems"]) == results["settings"]["num_problems"] == num_problems


def test_synthetic_end_to_end_with_code_execution(tmp_path, capsys):
    results = run_eval(tmp_path, "--seed", "5", "--limit", "5", "--batch-size", "2", "--allow-code-execution")
    check_consistent(results, 5)
    settings = results["settings"]
    assert settings["suite"] == "synthetic" and settings["seed"] == 5 and settings["batch_size"] == 2
    assert settings["families"] == ["arithmetic", "code", "listing"]
    assert settings["max_new_tokens"] == 8
    assert settings["refusion_decoding"]["slot_size"] == 4
    assert settings["refusion_decoding"]["mask_token_id"] == 3
    assert settings["allow_code_execution"] is True
    assert settings["code_sandbox"]["tool"].startswith("bubblewrap"), "the isolation used is recorded"
    assert settings["torch_threads"] == 1  # the package fixture's setting, recorded
    assert settings["timing_repeats"] == 1
    families = [entry["family"] for entry in results["problems"]]
    assert families == ["arithmetic", "code", "listing", "arithmetic", "code"]
    code = [entry for entry in results["problems"] if entry["family"] == "code"]
    assert code and not any(entry["refusion"]["correct"] for entry in code)  # noise does not pass asserts
    captured = capsys.readouterr()
    printed = captured.out
    assert "| decoding | accuracy | tokens/s | tokens/forward |" in printed
    assert "| refusion |" in printed and "| autoregressive |" in printed
    assert "generated code runs in: bubblewrap" in captured.err, "... and printed"
    assert "nested user namespaces disabled, libseccomp filter" in captured.err and "verdict: passed =" in captured.err


@pytest.fixture
def ar_baseline(tmp_path):
    """The fixture as a plain autoregressive checkpoint: no mask token in its config."""
    folder = tmp_path / "ar_baseline"
    folder.mkdir()
    for item in Path(TINY).iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    del config["mask_token_id"]
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_an_autoregressive_baseline_is_evaluated_with_its_decoding_alone(tmp_path, ar_baseline, capsys):
    out = tmp_path / "ar.json"
    args = ["eval", "--model", ar_baseline, "--max-new-tokens", "8", "--limit", "3", "--json", str(out)]
    assert main([*args, "--decodings", "autoregressive"]) == 0
    results = json.loads(out.read_text())
    assert "refusion" not in results and "speedup" not in results
    assert results["autoregressive"]["tokens_per_forward"] == 1.0
    assert results["settings"]["decodings"] == ["autoregressive"]
    assert results["settings"]["refusion_decoding"] is None
    assert "| autoregressive |" in capsys.readouterr().out
    message = user_error(capsys, args)
    assert "has no mask token" in message and "--decodings autoregressive" in message
    message = user_error(capsys, [*args, "--decodings", "autoregressive", "--slot-size", "4"])
    assert "--slot-size set ReFusion decoding, which --decodings leaves out" in message


def test_a_baseline_model_decodes_autoregressively_beside_the_model(tmp_path, ar_baseline, capsys):
    results = run_eval(tmp_path, "--limit", "3", "--baseline-model", ar_baseline)
    check_consistent(results, 3)
    assert results["settings"]["baseline_model"] == ar_baseline
    assert len(results["settings"]["baseline_model_sha256"]) == 64
    assert f"Autoregressive decoding ran on the baseline model {ar_baseline}." in capsys.readouterr().out
    message = user_error(capsys, ["eval", *FAST, "--baseline-model", ar_baseline, "--decodings", "refusion"])
    assert "--baseline-model runs the autoregressive decoding, which --decodings leaves out" in message
    from refusion_hf.modeling.loading import default_model_path

    message = user_error(capsys, ["eval", *FAST, "--baseline-model", str(default_model_path())])
    assert "--baseline-model: its tokenizer encodes differently from the model's" in message
    message = user_error(capsys, ["eval", *FAST, "--baseline-model", str(tmp_path / "missing")])
    assert message.startswith(f"--baseline-model {tmp_path / 'missing'}: no such folder")


def test_the_hard_tier_end_to_end_with_a_paired_interval(tmp_path, capsys):
    results = run_eval(tmp_path, "--suite", "synthetic-hard", "--seed", "3", "--limit", "4")
    check_consistent(results, 4)
    settings = results["settings"]
    assert (settings["suite"], settings["tier"], settings["lm_eval_task"]) == ("synthetic-hard", "hard",
                                                                             "refusion_synthetic_hard")  # fmt: skip
    assert settings["families"] == ["arithmetic", "listing"]
    from refusion_hf.evaluation.synthetic_tasks import generate_problems

    hard = generate_problems("test", 4, seed=3, tier="hard")
    assert [entry["id"] for entry in results["problems"]] == [p.id for p in hard]
    assert all(p.prompt in entry["prompt"] for p, entry in zip(hard, results["problems"]))
    # the interval is over the same problems' per-problem scores, as the JSON records them
    from refusion_hf.evaluation.paired_difference import paired_difference

    scores = [[entry[d]["score"] for entry in results["problems"]] for d in ("refusion", "autoregressive")]
    assert results["accuracy_difference_interval"] == paired_difference(*scores)
    assert "95% interval" in capsys.readouterr().out
    assert len(settings["load_average"]["before"]) == 3 and settings["command"] is None  # run in-process


def test_a_decision_seed_is_refused_and_an_unlisted_one_recorded(tmp_path, capsys):
    listing = tmp_path / "decision_seeds.json"
    listing.write_text(json.dumps({"seeds": [{"seed": 7, "used_for": "tuning"}, 11]}))
    for seed in ("7", "11"):
        message = user_error(capsys, ["eval", *FAST, "--seed", seed, "--decision-seeds", str(listing)])
        assert f"--seed {seed} is listed in --decision-seeds {listing}: it informed a decision" in message
    results = run_eval(tmp_path, "--seed", "8", "--limit", "2", "--decision-seeds", str(listing))
    assert results["settings"]["seed_checked_against"] == str(listing)
    listing.write_text(json.dumps({"seeds": ["7"]}))
    message = user_error(capsys, ["eval", *FAST, "--seed", "8", "--decision-seeds", str(listing)])
    assert message == f"--decision-seeds {listing}: '7' is not an integer seed or {{\"seed\": N, ...}}."
    message = user_error(capsys, ["eval", *FAST, "--decision-seeds", str(tmp_path / "none.json")])
    assert message.startswith(f"--decision-seeds {tmp_path / 'none.json'}: not a readable JSON file")


def test_the_repository_decision_list_refuses_its_seeds(capsys):
    listing = Path(__file__).resolve().parents[2] / "benchmarks" / "decision_seeds.json"
    message = user_error(capsys, ["eval", *FAST, "--seed", "31337", "--decision-seeds", str(listing)])
    assert "--seed 31337 is listed in --decision-seeds" in message


def test_planning_ahead_can_be_switched_off(tmp_path):
    ahead = run_eval(tmp_path, "--seed", "4", "--limit", "4", "--max-new-tokens", "24")
    alone = run_eval(tmp_path, "--seed", "4", "--limit", "4", "--max-new-tokens", "24", "--no-plan-ahead")
    assert ahead["settings"]["refusion_decoding"]["plan_ahead"] is True
    assert alone["settings"]["refusion_decoding"]["plan_ahead"] is False
    answers = [[entry["refusion"]["answer"] for entry in r["problems"]] for r in (ahead, alone)]
    assert answers[0] == answers[1]
    assert ahead["refusion"]["num_forward_passes"] < alone["refusion"]["num_forward_passes"]


def test_the_seed_changes_the_problems_drawn(tmp_path):
    first = run_eval(tmp_path, "--seed", "1", "--limit", "2")
    second = run_eval(tmp_path, "--seed", "2", "--limit", "2")
    again = run_eval(tmp_path, "--seed", "1", "--limit", "2")
    prompts = [[entry["prompt"] for entry in r["problems"]] for r in (first, second, again)]
    assert prompts[0] != prompts[1]
    assert prompts[0] == prompts[2]
    # greedy decoding of the same problems gives the same answers
    assert [e["refusion"]["answer"] for e in first["problems"]] == [e["refusion"]["answer"] for e in again["problems"]]


def test_without_opt_in_the_code_family_is_left_out(tmp_path, capsys):
    results = run_eval(tmp_path, "--limit", "4")
    check_consistent(results, 4)
    assert results["settings"]["families"] == ["arithmetic", "listing"]
    assert {entry["family"] for entry in results["problems"]} == {"arithmetic", "listing"}
    assert "--allow-code-execution" in capsys.readouterr().err


@pytest.mark.parametrize("suite", ["humaneval", "mbpp"])
def test_code_suites_refuse_without_opt_in(suite, capsys):
    message = user_error(capsys, ["eval", "--suite", suite, "--model", TINY])
    assert "--allow-code-execution" in message and "HF_ALLOW_CODE_EVAL=1" in message


def test_explicit_code_family_without_opt_in_is_an_error(capsys):
    message = user_error(capsys, ["eval", "--families", "code,listing", "--model", TINY])
    assert "--allow-code-execution" in message


def test_gsm8k_offline_without_data_file_says_what_to_pass(capsys):
    message = user_error(capsys, ["eval", "--suite", "gsm8k", "--model", TINY])
    assert "--data-file" in message and "offline" in message


def test_gsm8k_from_a_local_file(tmp_path):
    data = tmp_path / "gsm8k_test.jsonl"
    rows = [
        {"question": "Tom has 3 apples and buys 2. How many?", "answer": "3 + 2 = 5\n#### 5"},
        {"question": "Sue has 10 pens and loses 4. How many?", "answer": "10 - 4 = 6\n#### 6"},
        {"question": "unused third row", "answer": "#### 1"},
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    try:
        results = run_eval(tmp_path, "--suite", "gsm8k", "--data-file", str(data), "--limit", "2", "--num-threads", "2")
    finally:
        torch.set_num_threads(1)
    check_consistent(results, 2)
    assert results["settings"]["torch_threads"] == 2
    assert [rows[i]["question"] in entry["prompt"] for i, entry in enumerate(results["problems"])] == [True, True]
    assert results["refusion"]["per_family"]["gsm8k_cot"]["num_problems"] == 2
    assert results["settings"]["lm_eval_task"] == "gsm8k_cot"
    assert set(results["refusion"]["lm_eval_metrics"]) == {"exact_match,strict-match", "exact_match,flexible-extract"}
    assert results["settings"]["data_file"] == str(data)


def test_mbpp_from_a_local_file(tmp_path):
    data = tmp_path / "mbpp.jsonl"
    row = {
        "task_id": 11,
        "text": "Write a function to add two numbers.",
        "code": "def add(a, b):\n    return a + b",
        "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
        "test_setup_code": "",
    }
    data.write_text(json.dumps(row) + "\n")
    results = run_eval(tmp_path, "--suite", "mbpp", "--data-file", str(data), "--allow-code-execution")
    check_consistent(results, 1)
    entry = results["problems"][0]
    assert entry["id"] == "11"
    assert "assert add(1, 2) == 3" in entry["prompt"] and entry["reference"].startswith("assert add(1, 2) == 3")


def test_humaneval_from_the_installed_package(tmp_path):
    results = run_eval(tmp_path, "--suite", "humaneval", "--limit", "1", "--allow-code-execution")
    check_consistent(results, 1)
    entry = results["problems"][0]
    assert entry["id"] == "HumanEval/0" and "check(has_close_elements)" in entry["reference"]
    assert entry["refusion"]["correct"] is False


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "0"], "--limit: expected an integer >= 1"),
        (["--batch-size", "-2"], "--batch-size: expected an integer >= 1"),
        (["--slot-threshold", "-1"], "--slot-threshold: expected a number >= 0"),
        (["--families", "poems"], "--families: expected a comma-separated subset"),
        (["--decodings", "refusion,beam"], "--decodings: expected a comma-separated subset"),
    ],
)
def test_bad_arguments_name_the_option(args, message, capsys):
    with pytest.raises(SystemExit) as raised:
        main(["eval", *args])
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data-file", "x.jsonl"], "--data-file is for public tasks"),
        (["--suite", "squad"], "unknown lm-eval task 'squad'"),
        (["--suite", "hellaswag"], "is a multiple_choice task: refusion eval compares generation"),
        (["--suite", "gsm8k", "--data-file", "/nonexistent/gsm8k.jsonl"], "does not exist"),
        (["--suite", "gsm8k", "--data-file", __file__], "unsupported file type '.py'"),
        (["--suite", "gsm8k", "--families", "listing"], "apply to --suite synthetic and synthetic-hard only"),
        (["--suite", "synthetic-hard", "--families", "code"], "--suite synthetic-hard draws arithmetic,listing only"),
        (["--suite", "gsm8k", "--decision-seeds", "x.json"], "--decision-seeds applies to the seeded suites"),
        (["--slot-size", "4", "--block-size", "6"], "`block_size` must be a positive multiple of `slot_size`"),
    ],
)
def test_bad_combinations_are_explained(args, message, capsys):
    got = user_error(capsys, ["eval", "--model", TINY, *args])
    assert message in got


def test_the_console_command_refuses_code_suites_without_opt_in():
    env = {k: v for k, v in os.environ.items() if k != "HF_ALLOW_CODE_EVAL"}
    completed = subprocess.run(
        [sys.executable, "-m", "refusion_hf.cli", "eval", "--suite", "humaneval", "--limit", "1"],
        capture_output=True,
        text=True,
        env={**env, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert completed.returncode == 2
    assert "--allow-code-execution" in completed.stderr
