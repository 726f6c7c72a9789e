"""Smoke tests of the benchmarks at tiny sizes (the GPU-readiness one at its CPU shape; the real run needs a GPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_gpu_readiness_runs_end_to_end_at_the_tiny_shape(tmp_path):
    out = tmp_path / "gpu_readiness.json"
    command = [sys.executable, "gpu_readiness.py", "--shape", "tiny", "--device", "cpu", "--repeats", "1", "--out",
               str(out)]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads(out.read_text())
    kinds = {(row["cache"], row["query"]) for row in results["forward_latency"]}
    assert {(64, 1), (256, 128)} <= kinds
    decodings = {(row["batch"], row["decoding"]) for row in results["end_to_end"]}
    assert (8, "HF greedy") in decodings and (1, "ReFusion, forced: all accepted") in decodings
    assert results["overhead"]["forward_passes"] > 0 and 0 <= results["overhead"]["share_outside_forward"] < 1
    calls = [row for row in results["long_prompts"] if not row["decoding"].startswith("ratio")]
    assert {(row["prompt"], row["decoding"]) for row in calls} >= {(256, "HF greedy"), (1024, "ReFusion")}
    for row in calls:  # the first committed token is timed inside the call, after the prompt was read
        assert 0 < row["seconds_to_first_token"] <= row["seconds"]
    forced = {row["prompt"]: row["forward_passes"] for row in calls if row["decoding"].endswith("all accepted")}
    assert forced == {256: 2, 1024: 2}  # every draft accepted: one plan and one verification for the 32 tokens


def test_decoding_speed_compares_against_a_commit_in_fresh_processes(tmp_path):
    """The A/B of this checkout's `generate()` against a commit's (here HEAD's, the one commit a clone surely has):
    each side's worker imports its own package and loads this checkout's weights with it, tokens and forward passes
    agree, setup times are reported."""
    out = tmp_path / "generate_ab.json"
    command = [sys.executable, "decoding_speed.py", "--baseline", "HEAD", "--rounds", "1", "--runs", "float32:1,2",
               "--prompts", "2", "--repeats", "1", "--max-new-tokens", "8", "--out", str(out)]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["packages"]["current"] == str(BENCHMARKS.parent / "src" / "refusion_hf" / "__init__.py")
    assert "/baseline/src/refusion_hf/" in results["packages"]["baseline"]
    weights = str(BENCHMARKS.parent / "src" / "refusion_hf" / "assets" / "default_model")
    assert results["weights"] == "current" and results["model_paths"] == {"baseline": weights, "current": weights}
    assert [(row["dtype"], row["batch_size"]) for row in results["rows"]] == [("float32", 1), ("float32", 2)]
    for row in results["rows"]:
        assert row["same_tokens_and_forward_passes"] and row["forward_passes"]["current"] > 0
        assert row["forward_passes"]["current"] == row["forward_passes"]["baseline"]
        assert row["current_over_baseline_wall_time"] > 0
        for side in ("baseline", "current"):
            setup = row["setup_ms_per_call_best_of_rounds"][side]
            assert setup["before_first_forward"] > 0 and setup["after_last_forward"] > 0


def _import_benchmark(name: str):
    """A module of benchmarks/ (they import each other as top-level modules)."""
    import importlib

    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


FIXTURE = BENCHMARKS.parent / "tests" / "data" / "tiny-qwen3-refusion"


def _accuracy_speed(tmp_path, *arguments: str) -> dict:
    """`accuracy_speed.py` on the fixture (as model and as baseline), two problems a seed, six tokens, one timing."""
    out = tmp_path / "accuracy_speed.json"
    command = [sys.executable, "accuracy_speed.py", "--model", str(FIXTURE), "--baseline-model", str(FIXTURE),
               "--limit", "2", "--num-threads", "1", *arguments, "--out", str(out), "--",
               "--max-new-tokens", "6", "--timing-repeats", "1"]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return json.loads(out.read_text())


def test_accuracy_speed_reports_every_setting_beside_the_baseline_on_unlisted_seeds(tmp_path):
    """The evidence / frontier form: each setting (the installed config and one over it) on each seed, side by side
    with the baseline; the setting reaches the decoder; every row has what its summary is made of; the full eval
    results are kept, each checked against the decision seeds."""
    listed = tmp_path / "decision_seeds.json"
    listed.write_text(json.dumps({"seeds": [{"seed": 1, "used_for": "a test"}]}))
    results = _accuracy_speed(tmp_path, "--setting", "installed", "--setting", "slot_size=2,block_size=4",
                              "--seeds", "2,3", "--decision-seeds", str(listed))  # fmt: skip
    assert results["provenance"]["command"].startswith("python benchmarks/accuracy_speed.py --model")
    rows = results["seeds"]
    assert [(r["setting"], r["seed"]) for r in rows] == [
        ("installed", 2), ("installed", 3), ("slot_size=2,block_size=4", 2), ("slot_size=2,block_size=4", 3)
    ]  # fmt: skip
    for row in rows:
        decoding = row["refusion_decoding"]
        assert (decoding["slot_size"], decoding["block_size"]) == (
            (2, 4) if row["setting"] != "installed" else (32, None)
        )
        assert row["speedup"] == pytest.approx(row["refusion_tokens_per_second"] / row["baseline_tokens_per_second"])
        assert row["points_behind"] == pytest.approx(100 * (row["baseline_accuracy"] - row["refusion_accuracy"]))
        assert row["num_problems"] == 2 and row["meets_targets"] is False  # the fixture scores 0 and is slow
    summary = results["summary"]["reported"]["synthetic"]["slot_size=2,block_size=4"]
    assert summary["seeds"] == [2, 3] and summary["min_speedup"] == min(r["speedup"] for r in rows[2:])
    assert set(results["frontier"]["synthetic"]) <= set(results["settings"]) and results["frontier"]["synthetic"]
    evaluations = results["evaluations"]
    assert [e["settings"]["seed"] for e in evaluations] == [2, 3, 2, 3]
    assert {e["settings"]["seed_checked_against"] for e in evaluations} == {str(listed)}


def test_accuracy_speed_chooses_on_decision_seeds_and_judges_the_choice_on_another(tmp_path):
    """The choice form on both tiers: the grid's product on the --choose-on seed, the rule's choice (over both
    suites) alone on the reported seed."""
    accuracy_speed = _import_benchmark("accuracy_speed")
    listed = tmp_path / "decision_seeds.json"
    listed.write_text(json.dumps({"seeds": [1]}))
    results = _accuracy_speed(tmp_path, "--suite", "synthetic,synthetic-hard", "--grid", "token_threshold=0.5,0.9",
                              "--choose-on", "1", "--seeds", "2", "--decision-seeds", str(listed),
                              "--target-ratio", "0")  # fmt: skip
    choice_rows = [r for r in results["seeds"] if r["group"] == "choice"]
    assert {(r["suite"], r["setting"], r["seed"]) for r in choice_rows} == {
        (suite, f"token_threshold={t}", 1) for suite in ("synthetic", "synthetic-hard") for t in (0.5, 0.9)
    }
    pooled = {name: accuracy_speed.summarize([r for r in choice_rows if r["setting"] == name])
              for name in results["settings"]}  # fmt: skip
    chosen = results["choice"]["setting"]
    assert chosen == accuracy_speed.choose(pooled, 0.0) and results["choice"]["knobs"] == results["settings"][chosen]
    reported = [r for r in results["seeds"] if r["group"] == "reported"]
    assert {(r["suite"], r["setting"], r["seed"]) for r in reported} == {
        ("synthetic", chosen, 2),
        ("synthetic-hard", chosen, 2),
    }
    assert [e["settings"]["seed"] for e in results["evaluations"]] == [2, 2]  # the reported runs' only
    assert results["choice"]["goal_met"] is True  # 0 points behind (the fixture scores 0 on both) at >= 0x


def test_accuracy_speed_choice_rule_and_frontier():
    accuracy_speed = _import_benchmark("accuracy_speed")

    def summary(accuracy: float, min_speedup: float, median: float | None = None) -> dict:
        return {"mean_accuracy": accuracy, "mean_points_behind": round(100 * (1 - accuracy), 2),
                "min_speedup": min_speedup, "median_speedup": median or min_speedup}  # fmt: skip

    grid = {"a": summary(0.99, 1.9), "b": summary(0.98, 2.1, 2.5), "c": summary(0.98, 2.2, 2.4)}
    assert accuracy_speed.choose(grid, 2.0) == "b"  # a is below 2x; b ties c, faster at the median
    assert accuracy_speed.choose({"a": summary(1.0, 1.5)}, 2.0) is None
    assert accuracy_speed.meets(summary(0.98, 2.0), 3.0, 2.0) and not accuracy_speed.meets(summary(0.96, 3), 3, 2)
    # c is as accurate as b and faster: b is behind the frontier; a is the most accurate; d is slower and worse
    assert accuracy_speed.frontier({**grid, "d": summary(0.9, 1.0)}) == ["c", "a"]


@pytest.mark.parametrize(
    "arguments, message",
    [
        ([], "the following arguments are required: --seeds"),  # no default: a default seed would be reused
        (["--seeds", "1"], "--seeds [1]: listed in"),
        (["--seeds", "5", "--choose-on", "6"], "--choose-on [6]: not listed in"),
        (["--seeds", "5", "--choose-on", "1,5"], "seeds [5] are in both --choose-on and --seeds"),
        (["--seeds", "5", "--setting", "slot_size=8,block_size=12"], "setting slot_size=8,block_size=12: `block_size`"),
        (["--seeds", "5", "--setting", "slot_size=0"], "slot_size: expected an integer >= 1, got 0"),
        (["--seeds", "5", "--setting", "window=4"], "unknown decoding knob 'window'"),
        (
            ["--seeds", "5", "--setting", "block_size=8", "--grid", "block_size=8"],
            "settings listed twice: block_size=8",
        ),
        (["--seeds", "5", "--grid", "plan_ahead=yes"], "plan_ahead: expected true or false"),
        (["--seeds", "5", "--suite", "gsm8k"], "expected distinct seeded suites"),
        (["--seeds", "5", "--", "--slot-size", "4"], "--slot-size after --: this tool sets it"),
        (["--seeds", "5", "--", "--seed=3"], "--seed after --: this tool sets it"),
        (["--seeds", "5", "--timing-repeats", "1"], "unrecognized arguments: --timing-repeats 1"),  # eval's: after --
        (
            ["--seeds", "5", "--setting", "slot_size=4,block_size=8", "--setting", "block_size=8,slot_size=4"],
            "settings listed twice: block_size=8,slot_size=4, slot_size=4,block_size=8",
        ),  # fmt: skip
    ],
)
def test_accuracy_speed_refuses_what_it_cannot_honour_before_any_evaluation(arguments, message, tmp_path,
                                                                            monkeypatch, capsys):  # fmt: skip
    accuracy_speed = _import_benchmark("accuracy_speed")
    monkeypatch.setattr(accuracy_speed, "side_by_side", lambda *a, **k: pytest.fail("evaluated"))
    listed = tmp_path / "decision_seeds.json"
    listed.write_text(json.dumps({"seeds": [1]}))
    with pytest.raises(SystemExit) as exit_info:
        accuracy_speed.main(["--model", str(FIXTURE), "--decision-seeds", str(listed), *arguments])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_decoding_speed_passes_its_generate_kwargs_to_generate(tmp_path):
    """`--generate-kwargs` reaches `generate()` (a knob value it refuses makes the A/B fail, naming the knob; which
    side fails first is not observed), and anything but a JSON object is refused by the argument parser."""
    command = [sys.executable, "decoding_speed.py", "--baseline", "HEAD", "--runs", "float32:1", "--prompts", "1",
               "--repeats", "1", "--rounds", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "ab.json"),
               "--generate-kwargs"]  # fmt: skip
    completed = subprocess.run([*command, '{"slot_size": -1}'], cwd=BENCHMARKS, capture_output=True, text=True,
                               timeout=300)  # fmt: skip
    assert completed.returncode != 0 and "`slot_size`" in completed.stderr
    refused = subprocess.run([*command, "[1]"], cwd=BENCHMARKS, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "not a JSON object" in refused.stderr
    assert not (tmp_path / "ab.json").exists()


def test_decoding_speed_against_autoregressive_decoding_of_the_same_weights(tmp_path):
    """`--baseline autoregressive`: both sides this checkout, the baseline's generate() with
    decoding="autoregressive"; each side's forward passes reported (autoregressive: one per token), no goal."""
    out = tmp_path / "ar.json"
    command = [sys.executable, "decoding_speed.py", "--baseline", "autoregressive", "--rounds", "1", "--runs",
               "float32:1", "--prompts", "1", "--repeats", "1", "--max-new-tokens", "8", "--out", str(out)]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["baseline_generate_kwargs"] == {"decoding": "autoregressive"}
    (row,) = results["rows"]
    assert row["goal_at_most"] is None and not row["same_tokens_and_forward_passes"]
    assert 0 < row["forward_passes"]["current"] <= row["forward_passes"]["baseline"] <= 8
    assert row["current_over_baseline_wall_time"] > 0


def test_decoding_speed_counts_forward_passes_against_the_authors_decoder(tmp_path):
    """`--baseline authors` on the first golden cases: the authors' counts are the cases' own, ours never more
    without planning ahead (tests/generation/test_oracle.py holds each case), fewer or equal with it."""
    out = tmp_path / "authors.json"
    command = [sys.executable, "decoding_speed.py", "--baseline", "authors", "--cases", "3", "--out", str(out)]
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    cases = (BENCHMARKS.parent / "tests" / "data" / "oracle_cases.jsonl").read_text().splitlines()[:3]
    authors = sum(json.loads(line)["forward_calls"] for line in cases)
    rows = json.loads(out.read_text())["rows"]
    assert [row["plan_ahead"] for row in rows] == [False, True]
    for row in rows:
        assert row["cases"] == 3 and row["forward_passes_authors"] == authors
        assert row["cases_fewer"] + row["cases_equal"] + len(row["cases_more"]) == 3
        assert row["ours_over_authors"] == round(row["forward_passes_ours"] / authors, 4)
    assert rows[1]["forward_passes_ours"] <= rows[0]["forward_passes_ours"]


def test_serve_load_runs_a_small_load_and_its_checks_can_fail(tmp_path):
    """The serving load test at a tiny size (40 requests, half abusive: every kind of abuse): it starts and stops
    `refusion serve`, every check passes and the JSON has what the README quotes; then its checks, fed an altered
    reference answer, a 5xx, a slow /health, a grown memory or a wrong status, each fail."""
    out = tmp_path / "serve_load.json"
    command = [sys.executable, "serve_load.py", "--requests", "40", "--clients", "4", "--abusive-clients", "2",
               "--questions", "4", "--max-tokens", "8", "--rss-after", "10", "--time-limit", "120",
               "--out", str(out)]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["passed"] and all(results["checks"].values()) and results["server_exit_status"] == 0
    serve_load = _import_benchmark("serve_load")
    assert set(results["statuses"]) == {"well_behaved", *serve_load.EXPECTED}
    assert results["well_behaved_answers"]["count"] == results["requests_by_kind"]["well_behaved"] == 20
    assert results["statuses"]["wrong_key"] == {"401": 4} and results["statuses"]["template_bomb"] == {"400": 4}
    assert results["health"]["probes"] > 0 and results["server_rss_mb"]["after_first"] > 0
    rows = results["checks_table"]  # the results page's table: every check, with the figure behind it
    assert [(row["check"], row["passed"]) for row in rows] == list(results["checks"].items())
    assert rows[0]["measured"] == "20 of 20 answers"

    def failed(change) -> set[str]:
        altered = json.loads(out.read_text())
        change(altered)
        return {name for name, passed in serve_load.evaluate(altered).items() if not passed}

    answers = [(0, "an answer"), (1, "another")]

    def mismatch(r):
        r["well_behaved_answers"] = serve_load.compare(answers, ["an answer", "altered"])
        r["requests_by_kind"]["well_behaved"] = 2

    assert failed(mismatch) == {"answers_equal_generate"}
    assert failed(lambda r: r["statuses"]["well_behaved"].update({"500": 1})) == {
        "no_5xx", "each_request_got_its_expected_status"
    }  # fmt: skip
    assert failed(lambda r: r["server_metrics_after"].update({"5xx": 1})) == {"no_5xx"}
    assert failed(lambda r: r["statuses"]["wrong_key"].update({"200": 1})) == {"each_request_got_its_expected_status"}
    assert failed(lambda r: r["health"].update(p99_s=0.1)) == {"health_p99_under_100ms"}
    grown = results["server_rss_mb"]["after_first"] + 50.5
    assert failed(lambda r: r["server_rss_mb"].update(after_all=grown)) == {"rss_growth_within_50mb"}
    assert failed(lambda r: r["server_metrics_after"].update(running=1)) == {"nothing_left_running"}


def test_long_context_repeats_alternate_the_ways_and_report_medians(tmp_path):
    """`long_context.py --repeats 2` at a tiny prompt, with a baseline commit: each way (the baseline's too) runs
    twice, every call is kept, each measure is the median of the calls, and the ratios are taken from the medians."""
    out = tmp_path / "long_context.json"
    command = [sys.executable, "long_context.py", "--lengths", "64", "--batch-sizes", "1", "--dtypes", "float32",
               "--max-new-tokens", "8", "--repeats", "2", "--threads", "1", "--baseline", "HEAD",
               "--baseline-lengths", "64", "--out", str(out)]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads(out.read_text())
    (row,) = results["rows"]
    assert results["repeats"] == 2
    for way in ("stock", "refusion", "refusion_baseline"):
        calls = row[way]["runs"]
        assert len(calls) == 2
        for measure in ("peak_growth_mib", "seconds_to_first_token", "seconds"):
            assert row[way][measure] == pytest.approx(sum(call[measure] for call in calls) / 2)
    assert row["wall_time_ratio"] == pytest.approx(row["refusion"]["seconds"] / row["stock"]["seconds"], abs=1e-3)
    against = row["refusion"]["seconds"] / row["refusion_baseline"]["seconds"]
    assert row["against_baseline"]["seconds_ratio"] == pytest.approx(against, abs=1e-3)


def test_long_context_through_serve_sends_the_same_prompt_to_the_server_and_to_generate(tmp_path):
    """`long_context.py --through serve` at a short prompt: the real `refusion serve` (started and stopped by the
    tool, 127.0.0.1) and stock / ReFusion `generate()` each get the same chat-templated prompt; the growth ratios
    are taken against stock's, and the goal reads them."""
    out = tmp_path / "long_context_serve.json"
    command = [sys.executable, "long_context.py", "--through", "serve", "--lengths", "256", "--max-new-tokens", "4",
               "--threads", "1", "--out", str(out)]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["through"] == "serve" and results["provenance"]["command"].endswith(f"--out {out}")
    (row,) = results["rows"]
    ways = ("stock", "refusion", "serve", "serve_default_arenas")
    assert len({row[way]["prompt_tokens"] for way in ways}) == 1 and abs(row["stock"]["prompt_tokens"] - 256) < 16
    for way in ways[1:]:
        ratio = row[way]["peak_growth_mib"] / row["stock"]["peak_growth_mib"]
        assert row[f"{way}_peak_growth_ratio"] == pytest.approx(ratio, abs=1e-3)
    goal = max(row["refusion_peak_growth_ratio"], row["serve_peak_growth_ratio"]) <= 1.25
    assert row["goal_met"] is goal and all(0 < row[way]["new_tokens"] <= 4 for way in ways)


def test_long_context_through_serve_refuses_the_generate_comparisons_flags(capsys, monkeypatch):
    long_context = _import_benchmark("long_context")
    monkeypatch.setattr(sys, "argv", ["long_context.py", "--through", "serve", "--batch-sizes", "4", "--baseline",
                                      "HEAD"])  # fmt: skip
    monkeypatch.setattr(long_context, "write_serve_results", lambda args: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exit_info:
        long_context.main()
    assert (
        exit_info.value.code == 2 and "--batch-sizes, --baseline: not used --through serve" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--stop-after", "refusion", "--more-steps", "100"], "--stop-after refusion stops before the second phase"),
        (["--hidden-size", "96"], "'96': a positive multiple of 64"),  # was a ZeroDivisionError at 32
        (["--more-steps", "2000,-5"], "'2000,-5': 0, or positive numbers of steps"),
    ],
)
def test_the_recipe_refuses_flags_it_cannot_honour_before_any_stage(arguments, message, tmp_path, capsys):
    recipe = _import_benchmark("train_default_model")
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["--work-dir", str(tmp_path), *arguments])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any stage ran


def test_the_recipe_keeps_both_branches_stage_times_when_they_finish_at_once(tmp_path, monkeypatch):
    """Two processes training the branches side by side merge their stage times into one timings.json: the branch
    that read the file first must not write over the entry the other wrote meanwhile (here, deterministically: a
    reads, b finishes its stage while a holds its read, then a writes)."""
    import threading
    import time

    recipe = _import_benchmark("train_default_model")
    path = tmp_path / "timings.json"
    a_has_read = threading.Event()
    read = recipe.StageTimings._read

    def slow_read(self):
        report = read(self)
        if threading.current_thread().name == "a":
            a_has_read.set()
            time.sleep(0.5)
        return report

    monkeypatch.setattr(recipe.StageTimings, "_read", slow_read)
    a = threading.Thread(name="a", target=recipe.StageTimings(path, branch="refusion").run, args=("a_stage", dict))
    a.start()
    assert a_has_read.wait(30)
    recipe.StageTimings(path, branch="ar").run("b_stage", dict)
    a.join(30)
    report = json.loads(path.read_text())
    assert set(report["minutes"]) == {"a_stage", "b_stage"}
    assert report["stage_settings"]["b_stage"]["branch"] == "ar" and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "sections, message",
    [
        (
            "long_prompts,speed",
            "--sections: unknown speed; choose from forward_latency, end_to_end, overhead, long_prompts, "
            "sglang_engines",
        ),
        ("", "--sections: name at least one of forward_latency, end_to_end, overhead, long_prompts, sglang_engines"),
        (" , ", "--sections: name at least one of"),
    ],
)
def test_gpu_readiness_refuses_an_unknown_or_empty_section_list_before_building_the_model(
    monkeypatch, capsys, sections, message
):
    gpu_readiness = _import_benchmark("gpu_readiness")
    monkeypatch.setattr(gpu_readiness, "build_model", lambda *args: pytest.fail("built the model"))
    monkeypatch.setattr(sys, "argv", ["gpu_readiness.py", "--device", "cpu", "--sections", sections])
    with pytest.raises(SystemExit) as exit_info:
        gpu_readiness.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


TINY_RECIPE = ["--train-examples", "200", "--vocab-size", "300", "--hidden-size", "64", "--layers", "1",
               "--batch-size", "8", "--packing-length", "96", "--ar-max-steps", "20", "--ar-eval-every", "10",
               "--validation-problems", "4", "--finetune-steps", "10", "--threads", "1"]  # fmt: skip


def test_the_recipe_trains_installs_resumes_and_runs_a_second_phase_at_a_tiny_size(tmp_path, monkeypatch):
    """The embedded model's recipe end to end at a tiny size (seconds): both branches, `--install` (into temporary
    folders here, not the package), a rerun that reuses every stage, and two chained phases from the installed
    models."""
    import torch
    from safetensors import safe_open

    recipe = _import_benchmark("train_default_model")
    installed, baseline = tmp_path / "installed", tmp_path / "ar_baseline"
    monkeypatch.setattr(recipe, "PACKAGE_MODEL", installed)
    monkeypatch.setattr(recipe, "AR_BASELINE", baseline)
    work = tmp_path / "work"
    decoding = '{"decoding": "refusion", "slot_size": 8, "block_size": 16, "remask_threshold": 0.05}'
    threads = torch.get_num_threads()
    try:
        report = tmp_path / "recipe_run.json"
        recipe.main(["--work-dir", str(work), *TINY_RECIPE, "--install", "--decoding", decoding, "--results",
                     str(report)])  # fmt: skip
        written = json.loads(report.read_text())  # the stage times, through the one results writer
        assert written["provenance"]["command"].startswith("python benchmarks/train_default_model.py --work-dir")
        assert [row["stage"] for row in written["stages"]] == list(written["minutes"])
        generation = json.loads((installed / "generation_config.json").read_text())
        assert {key: generation[key] for key in json.loads(decoding)} == json.loads(decoding)
        with safe_open(installed / "model.safetensors", "pt") as weights:  # installed in bfloat16
            assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
        # with its remote code written again (the old folder's went with it), as trust_remote_code loads it
        assert (installed / "modeling_refusion.py").is_file()
        assert (installed / "custom_generate" / "generate.py").is_file()
        assert json.loads((baseline / "trainer_state.json").read_text())["global_step"] == 10
        timings = json.loads((work / "timings.json").read_text())["minutes"]
        stages = {"data", "tokenizer", "ar_base", "converted", "refusion_k4-8_ar0_steps10", "ar_continued_steps10"}
        assert set(timings) == stages

        model_mtime = (installed / "model.safetensors").stat().st_mtime
        trained = (work / "refusion_k4-8_ar0_steps10" / "model.safetensors").stat().st_mtime
        recipe.main(["--work-dir", str(work), *TINY_RECIPE, "--branch", "refusion"])  # everything is reused
        assert (work / "refusion_k4-8_ar0_steps10" / "model.safetensors").stat().st_mtime == trained
        assert json.loads((work / "timings.json").read_text())["minutes"] == timings

        second = tmp_path / "second"  # phases 2 and 3 of both branches, chained
        recipe.main(["--work-dir", str(second), *TINY_RECIPE, "--from-installed", "--more-steps", "3,2"])
        for branch in ("refusion_k4-8_ar0_steps10", "ar_continued_steps10"):
            for name, steps in ((f"{branch}_then3", 3), (f"{branch}_then3_then2", 2)):
                assert json.loads((second / name / "trainer_state.json").read_text())["global_step"] == steps, name
            assert (second / f"{branch}_then3_bf16" / "model.safetensors").exists()  # phase 3 starts there
        assert not (second / "ar_base").exists()  # phase 1 came from the installed models
        assert (installed / "model.safetensors").stat().st_mtime == model_mtime  # no --install: left alone
    finally:
        torch.set_num_threads(threads)


def test_write_results_records_command_commit_machine_and_date(tmp_path):
    """The one writer of benchmarks/results/: provenance first (command as run, commit, tree clean, machine with
    its CPU's vector instruction sets, UTC date), then the figures; a result cannot bring its own provenance."""
    import subprocess as sp

    results_file = _import_benchmark("results_file")
    argv = [str(BENCHMARKS / "decoding_speed.py"), "--baseline", "authors", "--out", "x y.json"]
    path = results_file.write_results({"rows": [{"a": 1}]}, tmp_path / "out.json", argv)
    data = json.loads(path.read_text())
    assert list(data) == ["provenance", "rows"] and results_file.provenance_problems(data) == []
    record = data["provenance"]
    assert record["command"] == "python benchmarks/decoding_speed.py --baseline authors --out 'x y.json'"
    head = sp.run(["git", "rev-parse", "HEAD"], cwd=BENCHMARKS, capture_output=True, text=True).stdout.strip()
    assert record["commit"] == head and isinstance(record["tree_clean"], bool)
    assert record["machine"]["cpu_count"] >= 1 and "cpu_vector_flags" in record["machine"]
    with pytest.raises(ValueError, match="provenance"):
        results_file.write_results({"provenance": {}}, tmp_path / "again.json", argv)
    for key in results_file.PROVENANCE_KEYS:  # the check names whatever is missing
        lacking = {"provenance": {k: v for k, v in record.items() if k != key}, "rows": []}
        assert f"no {key!r}" in results_file.provenance_problems(lacking)
    assert results_file.provenance_problems({"command": "benchmarks/x.py", "rows": []}) == ["no 'provenance' object"]


def test_every_committed_result_records_its_provenance():
    """Every JSON in benchmarks/results/ was written by `write_results`: command, full commit, tree clean or not,
    machine, date (a figure whose origin is unknown does not belong there)."""
    results_file = _import_benchmark("results_file")
    problems = {}
    for path in sorted((BENCHMARKS / "results").glob("*.json")):
        found = results_file.provenance_problems(json.loads(path.read_text()))
        if found:
            problems[path.name] = found
    assert not problems, problems


def test_the_results_page_is_rendered_from_the_results_and_names_each_of_them():
    """benchmarks/README.md is `results_file.render_page()` of the JSONs as committed (a changed JSON without the
    page rerendered, or a hand edit, fails here), under 300 lines, and every JSON is the current result of one
    claim on it (a plot beside it at most): no superseded or orphaned file."""
    results_file = _import_benchmark("results_file")
    page = (BENCHMARKS / "README.md").read_text()
    assert page == results_file.render_page(), "rerender it: python benchmarks/results_file.py"
    assert len(page.splitlines()) < 300
    claimed = {claim.result for claim in results_file.CLAIMS}
    assert {path.with_suffix(".json").name for path in (BENCHMARKS / "results").glob("*")} <= claimed  # PNG: its JSON's


def test_the_readme_quotes_only_rows_of_the_results_page():
    """README.md's "Measured, in brief" states no figure that the results page does not show: each decimal number
    in it appears on the page."""
    import re

    readme = (BENCHMARKS.parent / "README.md").read_text()
    section = readme.split("## Measured, in brief", 1)[1].split("\n## ", 1)[0]
    page = (BENCHMARKS / "README.md").read_text()
    figures = re.findall(r"\d+\.\d+", section)
    assert [figure for figure in figures if figure not in page] == []


def test_every_claim_is_rerun_by_a_tool_of_benchmarks():
    """Each claim's rerun command names a script benchmarks/ has, and where the script builds its parser apart
    (`build_parser`), the parser takes the command's flags (a tool removed or a flag renamed leaves no claim that
    cannot be rerun)."""
    import shlex

    results_file = _import_benchmark("results_file")
    for claim in results_file.CLAIMS:
        words = shlex.split(claim.rerun)
        script = BENCHMARKS.parent / words[1]
        assert words[0] == "python" and script.is_file(), claim.rerun
        if "def build_parser(" in script.read_text():
            flags = words[2 : words.index("--")] if "--" in words else words[2:]
            _import_benchmark(script.stem).build_parser().parse_args(flags)  # exits on an unknown or bad flag


def test_benchmarks_are_a_few_tools():
    """A handful of general tools with flags (issue 56: at most 8 scripts), not one script per experiment: an
    experiment is a flag of the tool that measures its kind of figure."""
    scripts = sorted(path.name for path in BENCHMARKS.glob("*.py"))
    assert len(scripts) <= 8, scripts
