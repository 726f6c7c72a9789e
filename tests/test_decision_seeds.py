"""The evidence comes from seeds nothing was chosen on: benchmarks/decision_seeds.json lists every seed of the
synthetic suite that informed a decision; every committed results JSON that ran on a seed ran on a listed one
(tuning, judging, training), except the reported comparisons (`benchmarks/results/evidence_*.json`), which ran on
unlisted seeds, checked by `refusion eval --decision-seeds` (benchmarks/accuracy_speed.py keeps each run's full
eval results under "evaluations"), with at least 500 problems and a paired interval, and the held-out checks
(rows marked `"held_out": true`: benchmarks/engine_throughput.py's check of ReFusion on SGLang against generate(),
whose `--check-seed` it refuses when listed), which ran on unlisted seeds too; and the seeds README's evidence
paragraph and benchmarks/README's evidence section quote are unlisted."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DECISIONS = ROOT / "benchmarks" / "decision_seeds.json"
RESULTS = ROOT / "benchmarks" / "results"
SEED_KEYS = re.compile(r"^(seed|seeds|validation_seed|\w+_seeds)$")


def decision_seeds() -> set[int]:
    entries = json.loads(DECISIONS.read_text())["seeds"]
    seeds = [entry["seed"] for entry in entries]
    assert all(isinstance(seed, int) and entry["used_for"] for seed, entry in zip(seeds, entries))
    assert len(seeds) == len(set(seeds)), "a seed is listed twice"
    return set(seeds)


def seeds_in(value, key=None, held_out=False) -> set[int]:
    """Integer seeds under keys named seed / seeds / *_seeds / validation_seed, anywhere in a JSON value: outside
    held-out rows (`"held_out": true`), or only in them (`held_out`)."""
    found = set()
    if isinstance(value, dict):
        if value.get("held_out") is True and not held_out:
            return found
        if held_out and value.get("held_out") is not True:
            return set().union(*(seeds_in(item, name, held_out) for name, item in value.items()))
        for name, item in value.items():
            if SEED_KEYS.match(name):
                found |= {s for s in (item if isinstance(item, list) else [item]) if type(s) is int}
            found |= seeds_in(item, name, held_out)
    elif isinstance(value, list):
        for item in value:
            found |= seeds_in(item, key, held_out)
    return found


def evidence_files() -> list[Path]:
    return sorted(RESULTS.glob("evidence_*.json"))


def test_every_seed_a_committed_result_was_chosen_on_is_listed():
    listed = decision_seeds()
    for path in sorted(RESULTS.glob("*.json")):
        if path.name.startswith("evidence_"):
            continue
        unlisted = seeds_in(json.loads(path.read_text())) - listed
        assert not unlisted, f"{path.name} ran on seeds {sorted(unlisted)} that benchmarks/decision_seeds.json lacks"


def test_held_out_checks_ran_on_unlisted_seeds():
    listed = decision_seeds()
    checked = {}
    for path in sorted(RESULTS.glob("*.json")):
        held_out = seeds_in(json.loads(path.read_text()), held_out=True)
        assert not held_out & listed, f"{path.name}: a held-out check ran on decision seeds {sorted(held_out & listed)}"
        checked[path.name] = held_out
    assert checked["engine_throughput_cpu.json"], "the SGLang check is marked held out, with its seed"


def test_seeds_in_tells_held_out_rows_apart():
    result = {"seed": 0, "check": [{"held_out": True, "seed": 9, "tier": "hard"}], "rows": [{"seeds": [1, 2]}]}
    assert seeds_in(result) == {0, 1, 2}
    assert seeds_in(result, held_out=True) == {9}


def evaluations() -> list[tuple[str, dict]]:
    """(file name, one seed's full `refusion eval` results) for every reported comparison."""
    return [(p.name, run) for p in evidence_files() for run in json.loads(p.read_text())["evaluations"]]


def test_the_reported_comparisons_use_unlisted_seeds_with_power():
    listed = decision_seeds()
    runs = evaluations()
    assert {results["settings"]["suite"] for _, results in runs} >= {"synthetic", "synthetic-hard"}
    for name, results in runs:
        path = Path(name)
        settings = results["settings"]
        assert settings["seed"] not in listed, f"{path.name}: seed {settings['seed']} informed a decision"
        assert settings["seed_checked_against"] == "benchmarks/decision_seeds.json", path.name
        assert settings["num_problems"] >= 500, path.name
        interval = results["accuracy_difference_interval"]
        assert interval["num_problems"] == settings["num_problems"] and interval["level"] == 0.95
        assert interval["low"] <= results["accuracy_difference"] <= interval["high"]
        assert settings["load_average"]["before"] is not None  # a shared machine: how loaded it was


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start : end if end != -1 else None]


@pytest.mark.parametrize(
    ("document", "heading"),
    [("README.md", "## Measured, in brief"), ("benchmarks/README.md", "## Evidence on seeds nothing was chosen on")],
)
def test_the_evidence_paragraphs_quote_unlisted_seeds_and_their_json(document, heading):
    section = _section((ROOT / document).read_text(), heading)
    quoted = {int(s) for group in re.findall(r"\bseeds? ([\d, and]+)", section) for s in re.findall(r"\d+", group)}
    assert quoted, f"{document}'s evidence names no seed"
    evidence_seeds = {results["settings"]["seed"] for _, results in evaluations()}
    assert quoted <= evidence_seeds, f"{document} quotes seeds {sorted(quoted - evidence_seeds)} with no evidence JSON"
    assert not quoted & decision_seeds()
    assert "95%" in section
