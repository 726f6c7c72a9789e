"""Smoke tests of the benchmarks at tiny sizes (the GPU-readiness one at its CPU shape; the real run needs a GPU)."""

import argparse
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


def test_heldout_comparison_runs_end_to_end_on_the_fixture(tmp_path):
    """The held-out comparison at a tiny size: ReFusion decoding of a model beside a baseline model, plus a previous
    model, on two seeds; every row has what the summary needs."""
    fixture = BENCHMARKS.parent / "tests" / "data" / "tiny-qwen3-refusion"
    out = tmp_path / "heldout.json"
    command = [sys.executable, "heldout_comparison.py", "--model", str(fixture), "--baseline-model", str(fixture),
               "--previous-model", str(fixture), "--seeds", "1,2", "--limit", "2", "--num-threads", "1",
               "--out", str(out), "--", "--max-new-tokens", "6", "--timing-repeats", "1"]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [row["seed"] for row in results["seeds"]] == [1, 2]
    targets = results["targets"]
    for row in results["seeds"]:
        assert row["speedup"] > 0 and 0 <= row["refusion_accuracy"] <= 1 and "previous_accuracy" in row
        behind = 100 * (row["baseline_accuracy"] - row["refusion_accuracy"])
        assert row["points_behind"] == pytest.approx(behind, abs=0.01)
        assert row["speedup"] == pytest.approx(row["refusion_tokens_per_second"] / row["baseline_tokens_per_second"])
        close = row["points_behind"] <= targets["points_behind_at_most"]
        assert row["meets_targets"] is (close and row["speedup"] >= targets["speedup_at_least"])
    summary = results["summary"]
    assert summary["seeds_meeting_targets"] == sum(row["meets_targets"] for row in results["seeds"])
    assert summary["min_speedup"] == min(row["speedup"] for row in results["seeds"])


def _import_benchmark(name: str):
    """A module of benchmarks/ (they import each other as top-level modules)."""
    import importlib

    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def test_remasking_runs_end_to_end_on_the_fixture(tmp_path):
    """The remasking benchmark at a tiny size, revision off (what every checkout can run): each slot setting on
    each seed, side by side with the baseline; the multi-slot flags reach the decoder; no threshold is recommended
    when none was tried."""
    fixture = BENCHMARKS.parent / "tests" / "data" / "tiny-qwen3-refusion"
    out = tmp_path / "remasking.json"
    command = [sys.executable, "remasking.py", "--model", str(fixture), "--baseline-model", str(fixture),
               "--thresholds", "none", "--slot-settings", "installed,4x8", "--tuning-seeds", "1",
               "--heldout-seeds", "2", "--limit", "2", "--num-threads", "1", "--out", str(out), "--",
               "--max-new-tokens", "6", "--timing-repeats", "1"]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads(out.read_text())
    runs = results["runs"]
    assert [(r["group"], r["seed"], r["slots"]) for r in runs] == [
        ("tuning", 1, "installed"), ("tuning", 1, "4x8"), ("held_out", 2, "installed"), ("held_out", 2, "4x8")
    ]  # fmt: skip
    for run in runs:
        decoding = run["refusion_decoding"]
        assert (decoding["slot_size"], decoding["block_size"]) == ((4, 8) if run["slots"] == "4x8" else (32, None))
        assert run["remask_threshold"] is None and run["extra_forwards_per_answer"] == 0
        assert run["revised_tokens"] in (None, 0) and run["answers"] == 2
        assert run["speedup"] == pytest.approx(run["refusion_tokens_per_second"] / run["baseline_tokens_per_second"])
    off = results["summary"]["held_out"]["4x8"]["off"]
    assert off["seeds"] == [2] and off["min_speedup"] == runs[3]["speedup"]
    assert off["gap_closed"] is None and off["gap_closed_vs_installed_off"] is None  # no gap: the fixture scores 0
    assert results["recommended_remask_threshold"] is None and results["install"] is False


def test_remasking_chooses_the_threshold_on_tuning_seeds_by_accuracy_at_twice_the_baseline_speed():
    remasking = _import_benchmark("remasking")

    def summary(accuracy, min_speedup, median_speedup=3.0):
        return {"mean_accuracy": accuracy, "min_speedup": min_speedup, "median_speedup": median_speedup}

    tuning = {None: summary(0.85, 3.6), 0.1: summary(0.90, 3.0), 0.2: summary(0.95, 1.9), 0.3: summary(0.90, 3.2, 3.3)}
    assert remasking.recommend(tuning) == 0.3  # 0.2 is the most accurate but below 2x on a seed; 0.3 ties 0.1, faster
    assert remasking.recommend({None: summary(0.90, 3.6), 0.1: summary(0.90, 3.0)}) is None  # not more accurate
    assert remasking.recommend({0.1: summary(0.95, 3.0)}) is None  # nothing to compare with
    # The same correct answers in another order of seeds: means that differ in the last bit are a tie, not a gain.
    tie = {None: summary((0.875 + 0.95) / 2, 3.6), 0.1: summary((0.9 + 0.925) / 2, 3.0)}
    assert tie[0.1]["mean_accuracy"] > tie[None]["mean_accuracy"] and remasking.recommend(tie) is None

    def row(seed, accuracy, baseline=1.0):
        return {"seed": seed, "refusion_accuracy": accuracy, "baseline_accuracy": baseline}

    off = [row(3, 0.8), row(5, 0.9)]
    assert remasking.gap_closed([row(3, 0.9), row(5, 0.95)], off) == pytest.approx(0.15 / 0.3)
    assert remasking.gap_closed([row(3, 0.7), row(5, 0.9)], off) == pytest.approx(-0.1 / 0.3)
    assert remasking.gap_closed([row(3, 1.0, 0.8)], [row(3, 0.8, 0.8)]) is None  # no gap to close


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--thresholds", "none", "--tuning-seeds", "7", "--heldout-seeds", "7,11"], "seeds [7] are both tuning"),
        (["--thresholds", "none,1.5"], "a remask threshold lies in (0, 1], got 1.5"),
        (["--slot-settings", "8x12"], "8x12: the block size must be a multiple of the slot size"),
    ],
)
def test_remasking_refuses_a_bad_grid_before_running_anything(arguments, message, monkeypatch, capsys):
    remasking = _import_benchmark("remasking")
    monkeypatch.setattr(sys, "argv", ["remasking.py", *arguments])
    with pytest.raises(SystemExit) as exit_info:
        remasking.main()
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_remasking_refuses_thresholds_where_the_decoder_cannot_revise(monkeypatch, capsys):
    """Run against a checkout whose decoder has no knob (as before issue 31), the grid is refused in one line."""
    remasking = _import_benchmark("remasking")
    assert remasking.revision_available()  # this checkout's decoder has it
    monkeypatch.setattr(remasking, "revision_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["remasking.py", "--thresholds", "none,0.2"])
    with pytest.raises(SystemExit) as exit_info:
        remasking.main()
    assert exit_info.value.code == 2 and "no remask_threshold knob yet" in capsys.readouterr().err


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


def test_parallel_slots_runs_end_to_end_on_the_fixture_and_resumes(tmp_path):
    """Issue 41's grid at a tiny size: every multi-slot decoding on the tuning seed side by side with the baseline
    (its flags reach the decoder), the choice on the held-out seed, the plot; a second invocation with a wider grid
    measures only what the first did not."""
    fixture = BENCHMARKS.parent / "tests" / "data" / "tiny-qwen3-refusion"
    out = tmp_path / "parallel_slots.json"

    def invoke(remask: str) -> dict:
        command = [sys.executable, "parallel_slots.py", "--model", str(fixture), "--baseline-model", str(fixture),
                   "--slot-settings", "2x4", "--thresholds", "0.9/0.5", "--remask", remask, "--tuning-seeds", "1",
                   "--heldout-seeds", "2", "--limit", "2", "--out", str(out), "--",
                   "--max-new-tokens", "6", "--timing-repeats", "1"]  # fmt: skip
        completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
        assert completed.returncode == 0, completed.stderr[-2000:]
        return json.loads(out.read_text())

    first = invoke("none")
    [run] = [r for r in first["runs"] if r["group"] == "tuning"]
    decoding = run["refusion_decoding"]
    assert (decoding["slot_size"], decoding["block_size"], decoding["slot_threshold"]) == (2, 4, 0.9)
    assert decoding["token_threshold"] == 0.5 and decoding["remask_threshold"] is None
    assert run["speedup"] == pytest.approx(run["refusion_tokens_per_second"] / run["baseline_tokens_per_second"])
    assert (tmp_path / "parallel_slots.png").stat().st_size > 0
    choice = first["choice_on_tuning_seeds"]
    held_out = [r["seed"] for r in first["runs"] if r["group"] == "held_out"]
    if choice is None:  # the fixture's speed ratio decides whether anything is fast enough to be chosen
        assert held_out == [] and first["held_out"] == {} and first["goal_met"] is False
    else:
        assert held_out == [2] and first["held_out"][choice]["seeds"] == [2]
    second = invoke("none,0.5")
    assert second["runs"][: len(first["runs"])] == first["runs"]  # measured once, kept
    assert {r["decoding"] for r in second["runs"] if r["group"] == "tuning"} == set(second["tuning"])
    assert len(second["tuning"]) == 2 and second["installed"] is False


def test_parallel_slots_chooses_the_most_accurate_setting_at_twice_the_baseline_speed():
    parallel_slots = _import_benchmark("parallel_slots")

    def summary(accuracy: float, min_speedup: float, median: float | None = None) -> dict:
        return {"mean_accuracy": accuracy, "mean_points_behind": round(100 * (1 - accuracy), 2),
                "min_speedup": min_speedup, "median_speedup": median or min_speedup}  # fmt: skip

    grid = {"a": summary(0.99, 1.9), "b": summary(0.98, 2.1, 2.5), "c": summary(0.98, 2.2, 2.4)}
    assert parallel_slots.choose(grid) == ("b", True)  # a is below 2x; b ties c, faster at the median
    assert parallel_slots.choose({"a": summary(0.95, 3.0)}) == ("a", False)  # the best there is, 5 points behind
    assert parallel_slots.choose({"a": summary(1.0, 1.5)}) == (None, False)
    with pytest.raises(argparse.ArgumentTypeError, match="at least two slots per block"):
        parallel_slots._slot_settings("8x8")  # one slot per block is not what issue 41 measures


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


def test_accuracy_frontier_sweeps_the_decodings_on_one_problem(tmp_path):
    """The accuracy-against-speed sweep at a tiny size (the embedded model, which has a chat template; one problem):
    every curve's every threshold pair, beside autoregressive decoding of the same weights, written with its plot."""
    out = tmp_path / "frontier.json"
    command = [sys.executable, "accuracy_frontier.py", "--ar-baseline", "none", "--limit", "1", "--max-new-tokens",
               "6", "--out", str(out)]  # fmt: skip
    completed = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-2000:]
    frontier = _import_benchmark("accuracy_frontier")
    results = json.loads(out.read_text())
    assert len(results["runs"]) == len(frontier.CURVES) * len(frontier.THRESHOLDS)
    for run in results["runs"]:
        assert 0 <= run["refusion"]["accuracy"] <= 1 and run["refusion"]["num_forward_passes"] > 0
    assert "accuracy" in results["autoregressive_same_weights"] and out.with_suffix(".png").stat().st_size > 0
