"""The one writer of `benchmarks/results/`: every benchmark's JSON goes through `write_results`, which puts in front
of the figures where they came from (`provenance`): the command as run, the commit and whether the tree was clean,
the machine (CPU and its vector instruction sets, GPU, cores, load, library versions) and the date (UTC).
tests/test_benchmarks.py holds every committed JSON to it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROVENANCE_KEYS = ("command", "commit", "tree_clean", "machine", "date")


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _command(argv: list[str]) -> str:
    """`python benchmarks/NAME.py FLAGS...` as run, paths inside the checkout relative to its root."""
    script = Path(argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *argv[1:]])


def machine() -> dict:
    """The machine: CPU model, its vector instruction sets (numerics differ between AVX2 and AVX-512/AMX kernels),
    cores, load average, GPU if any, OS, Python / torch / transformers versions."""
    model, flags = platform.processor() or "unknown", []
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
        model = found.group(1).strip() if found else model
        first = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
        flags = sorted(f for f in (first.group(1).split() if first else []) if re.match(r"avx2$|avx512|amx", f))
    except OSError:
        pass
    described = {
        "cpu": model,
        "cpu_vector_flags": flags,
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "os": platform.platform(),
        "python": platform.python_version(),
    }
    for library in ("torch", "transformers"):
        module = sys.modules.get(library)
        described[library] = getattr(module, "__version__", None) if module else None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        described["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return described


def provenance(argv: list[str] | None = None) -> dict:
    """Where a result comes from: command, commit, tree_clean (no uncommitted change to tracked files, nor an
    untracked file outside benchmarks/results/), machine, date."""
    status = _git("status", "--porcelain", "--untracked-files=all")
    changed = [line for line in status.splitlines() if not line[3:].startswith("benchmarks/results/")]
    return {
        "command": _command(list(sys.argv if argv is None else argv)),
        "commit": _git("rev-parse", "HEAD"),
        "tree_clean": not changed,
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_results(results: dict, out: str | Path, argv: list[str] | None = None) -> Path:
    """Write `results` as indented JSON to `out` (creating its folder), `provenance` first, print it, and return the
    path. `argv`: the command, script first (default `sys.argv`: a script's `main(argv)` called in-process passes
    its own). A `provenance` key of `results` itself is refused: it is this function's to write."""
    if "provenance" in results:
        raise ValueError("results carry their own 'provenance'; write_results records it")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"provenance": provenance(argv), **results}, indent=2) + "\n"
    path.write_text(text)
    print(text, end="")
    return path


def provenance_problems(data: object) -> list[str]:
    """What a results JSON lacks of its provenance (empty when it has it all)."""
    record = data.get("provenance") if isinstance(data, dict) else None
    if not isinstance(record, dict):
        return ["no 'provenance' object"]
    problems = [f"no {key!r}" for key in PROVENANCE_KEYS if key not in record]
    if not str(record.get("command", "")).startswith("python benchmarks/"):
        problems.append("'command' is not `python benchmarks/SCRIPT ...`")
    if not re.fullmatch(r"[0-9a-f]{40}", str(record.get("commit", ""))):
        problems.append("'commit' is not a full commit hash")
    if not isinstance(record.get("tree_clean"), bool):
        problems.append("'tree_clean' is not true or false")
    described = record.get("machine")
    if not isinstance(described, dict) or not described.get("cpu"):
        problems.append("'machine' does not name the CPU")
    try:
        datetime.datetime.fromisoformat(str(record.get("date")))
    except ValueError:
        problems.append("'date' is not an ISO date")
    return problems


# The results page (benchmarks/README.md), rendered from the JSONs by `python benchmarks/results_file.py`: per claim,
# the tool that measures it, how to rerun it, and its current result's table with its provenance.
PAGE = ROOT / "benchmarks" / "README.md"
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Claim:
    title: str
    result: str  # its JSON in benchmarks/results/
    table: str  # the key of the JSON's list of rows
    what: str
    rerun: str


ENGINE_RUN = (
    "python benchmarks/engine_throughput.py --check-problems 500 --check-seed 550002 "
    "--out benchmarks/results/engine_throughput_cpu.json"
)

CLAIMS = (
    Claim(
        "Forward passes against the authors' decoder",
        "forward_passes_vs_authors.json",
        "rows",
        "The authors' golden cases (tests/data/oracle_cases.jsonl: their decoder's tokens and forward calls on the "
        "tiny checkpoint, float64, greedy): our forward passes over theirs, with planning ahead and without. The "
        "tokens are theirs on every case but the one where their decoder leaves a hole and ours decodes it "
        "(rf0302; tests/generation/test_oracle.py, exact). Counts, not times: any machine.",
        "python benchmarks/decoding_speed.py --baseline authors "
        "--out benchmarks/results/forward_passes_vs_authors.json",
    ),
    Claim(
        "Decoding speed against autoregressive decoding",
        "decoding_speed_vs_autoregressive.json",
        "rows",
        "The embedded model's whole `generate()` with its installed ReFusion decoding over the same call with "
        '`decoding="autoregressive"` (stock greedy on the same weights), fresh processes alternating, batch 1 / 4 / '
        "16 (bfloat16) and 1 (float32): wall time ratio (below 1: ReFusion faster) and each side's forward passes.",
        "python benchmarks/decoding_speed.py --baseline autoregressive "
        "--out benchmarks/results/decoding_speed_vs_autoregressive.json",
    ),
    Claim(
        "Decoding speed against an earlier commit",
        "decoding_speed_vs_commit.json",
        "rows",
        "This checkout's whole `generate()` over a commit's, each side importing its own package in fresh processes, "
        "the same weights, identical tokens and forward passes required: wall time ratio per batch size (each batch "
        "at its fastest call in any round; `seconds_every_round` in the JSON shows the round-to-round spread, the "
        "harness's resolution). `goal_at_most` is issue 28's speed goal for the decoder, kept by the tool; against "
        "7247c5f (before the house was rebuilt: errors, stage registry, one argument checker) the goal is the same "
        "time within that resolution.",
        "python benchmarks/decoding_speed.py --baseline 7247c5f --out benchmarks/results/decoding_speed_vs_commit.json",
    ),
    Claim(
        "ReFusion on SGLang against stock Qwen3 on SGLang and generate()",
        "engine_throughput_cpu.json",
        "results",
        "Tokens/s of three engines side by side in one run, on this CPU: ReFusion on SGLang (`refusion serve --engine "
        "sglang`, the embedded model's installed decoding: block 16, two slots of 8, remasking 0.1), the same weights "
        "saved as a stock Qwen3 and decoded autoregressively by SGLang, and this package's `generate()` / "
        "`generate_batch()` in the same decoding; 96 greedy chat requests at 1, 4 and 16 at once; ReFusion on "
        "SGLang's answers checked equal to `generate()`'s (`answers_equal_to_generate`). The JSON's `ratios` divide "
        "the engines' tokens/s. A 3M-parameter model: SGLang's scheduling between its processes and the canvas's "
        "recomputation, not the model, set its speed here. Run it with the python of SGLang's environment (`make "
        "sglang`: .venv-sglang/bin/python).",
        ENGINE_RUN,
    ),
    Claim(
        "ReFusion on SGLang: the held-out check",
        "engine_throughput_cpu.json",
        "check",
        "The same run's check on problems of both tiers at a seed outside benchmarks/decision_seeds.json: each "
        "answer of ReFusion on SGLang (all sent at once) against `generate()`'s alone, token for token "
        "(`answers_equal_to_generate`: equal answers mean equal accuracy, so SGLang's decoding costs no accuracy "
        "where they all are), and the forward passes: `generate()`'s (planning ahead) and SGLang's (the same "
        "decoder without planning ahead, plus SGLang's encoding of the prompt and of each finished block).",
        ENGINE_RUN,
    ),
    Claim(
        "Evidence on seeds nothing was chosen on: the installed decoding, standard tier",
        "evidence_installed_standard.json",
        "seeds",
        "ReFusion decoding of the embedded model beside autoregressive decoding of its controlled AR baseline (trained "
        "from the same AR model on the same data for the same steps), batch by batch in one `refusion eval` process, "
        "batch 1, 500 problems of a seed outside benchmarks/decision_seeds.json (every seed any choice was made on; "
        "`--decision-seeds` refuses a listed one): accuracy, points behind with the paired 95% interval "
        "(difference_interval_points, ReFusion minus AR), tokens/s ratio (one timed run, side by side). "
        "The goal: within 3 points at >= 2x.",
        "python benchmarks/accuracy_speed.py --model src/refusion_hf/assets/default_model "
        "--baseline-model benchmarks/models/ar_baseline --suite synthetic --seeds 540201 --limit 500 "
        "--num-threads 1 --decision-seeds benchmarks/decision_seeds.json "
        "--out benchmarks/results/evidence_installed_standard.json -- --timing-repeats 1",
    ),
    Claim(
        "Evidence: the installed decoding, hard tier",
        "evidence_installed_hard.json",
        "seeds",
        "The same on `--suite synthetic-hard` (the longest problems of the training range with numbers beyond it: "
        "the AR baseline off its ceiling), seed 540202.",
        "python benchmarks/accuracy_speed.py --model src/refusion_hf/assets/default_model "
        "--baseline-model benchmarks/models/ar_baseline --suite synthetic-hard --seeds 540202 --limit 500 "
        "--num-threads 1 --decision-seeds benchmarks/decision_seeds.json "
        "--out benchmarks/results/evidence_installed_hard.json -- --timing-repeats 1",
    ),
    Claim(
        "Evidence: the frontier of decoding settings, both tiers",
        "evidence_frontier.json",
        "seeds",
        "The installed decoding beside a stricter one (token threshold 0.9) and the block-8 trade (one slot per "
        "block; chosen as the trade on decision seeds 540001 / 540002, see benchmarks/decision_seeds.json), each "
        "over the installed generation config and beside the AR baseline as above, on both tiers, on a fresh seed "
        "outside benchmarks/decision_seeds.json, 500 problems: accuracy, points behind with the paired 95% interval "
        "and tokens/s ratio of each (side by side in one process; the load is recorded); the JSON's `frontier` "
        "names the settings no other is both nearer the baseline and faster than. Choosing a setting on this seed "
        "makes it a decision seed.",
        "python benchmarks/accuracy_speed.py --model src/refusion_hf/assets/default_model "
        "--baseline-model benchmarks/models/ar_baseline --suite synthetic,synthetic-hard --seeds 540203 "
        "--limit 500 --num-threads 1 --setting installed --setting token_threshold=0.9 --setting block_size=8 "
        "--decision-seeds benchmarks/decision_seeds.json "
        "--out benchmarks/results/evidence_frontier.json -- --timing-repeats 1",
    ),
    Claim(
        "Long prompts against stock generate",
        "long_context.json",
        "rows",
        "A Qwen3-shaped random model (40,960 positions), prompts of 16k and 32k tokens, batch 1 and 4, float32, each "
        "call in a fresh process: ReFusion's peak memory growth, time to its first committed token and wall time over "
        "stock `generate()`'s (medians of the repeats; `goal_met`: issue 38's goal, growth at most 1.25x).",
        "python benchmarks/long_context.py --lengths 16384,32768 --batch-sizes 1,4 --dtypes float32 --repeats 3 "
        "--out benchmarks/results/long_context.json",
    ),
    Claim(
        "Long prompts through refusion serve",
        "long_context_serve.json",
        "rows",
        "A 16k / 32k chat request to `refusion serve` against stock `generate()`: peak memory growth ratios.",
        "python benchmarks/long_context.py --through serve --repeats 3 "
        "--out benchmarks/results/long_context_serve.json",
    ),
    Claim(
        "Serving load",
        "serve_load.json",
        "checks_table",
        "`refusion serve` under well-behaved and abusive clients at once: answers equal `generate()`'s, no 5xx, "
        "/health p99, memory growth.",
        "python benchmarks/serve_load.py --out benchmarks/results/serve_load.json",
    ),
    Claim(
        "The model recipe",
        "recipe_run.json",
        "stages",
        "`train_default_model.py`: AR pretraining to a plateau, then ReFusion and its controlled AR baseline the same "
        "steps from it; stage times.",
        "python benchmarks/train_default_model.py --work-dir out/recipe --install",
    ),
    Claim(
        "The GPU run (Qwen3-8B shape)",
        "gpu_readiness_8b_cuda.json",
        "long_prompts",
        "On one GPU at the Qwen3-8B shape (random weights): forward latency, end-to-end decoding, long prompts against "
        "HF greedy.",
        "python benchmarks/gpu_readiness.py --shape 8b --device cuda "
        "--out benchmarks/results/gpu_readiness_8b_cuda.json",
    ),
)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(map(_cell, value)) if len(value) <= 4 else f"{len(value)} items"
    return "" if value is None else str(value).replace("|", "\\|")


def _flat(row: dict) -> dict:
    """A row's scalar cells, one level of nested dicts flattened (`forward_passes.current`)."""
    cells = {}
    for key, value in row.items():
        if isinstance(value, dict):
            cells.update({f"{key}.{k}": v for k, v in value.items() if not isinstance(v, (dict, list))})
        elif not isinstance(value, list) or len(value) <= 4:
            cells[key] = value
    return cells


def table(rows: list[dict]) -> list[str]:
    """A markdown table of `rows`' scalar cells (columns in first-seen order)."""
    flat = [_flat(row) for row in rows]
    columns = list(dict.fromkeys(key for row in flat for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(key)) for key in columns) + " |" for row in flat]
    return lines


def _removed_tool_note(record: dict) -> str:
    """A sentence for a result whose recorded command runs a script benchmarks/ no longer has (git keeps it at the
    recorded commit; the claim's rerun command measures it with the tool that replaced it), else nothing."""
    words = shlex.split(record["command"])
    script = words[1] if len(words) > 1 else ""
    if script and (ROOT / script).is_file():
        return ""
    commit = record["commit"][:12]
    return f" `{script}` is no longer in benchmarks/ (git has it at {commit}): rerun with the command below."


def render_page() -> str:
    """benchmarks/README.md from the JSONs in benchmarks/results/."""
    lines = [
        "# Benchmarks: the results page",
        "",
        "Rendered from `benchmarks/results/*.json` by `python benchmarks/results_file.py` (do not edit by hand; "
        "tests/test_benchmarks.py checks that this page and the JSONs agree). Each claim: what it measures, its "
        "current result with the command, commit and machine that produced it, and how to rerun it. Every JSON is "
        "written by `results_file.write_results`, which records that provenance; superseded results are in git's "
        "history, not here. Timings are ratios measured side by side in one run; rerun them on a quiet machine.",
        "",
        "The tools: `decoding_speed.py` (against autoregressive decoding, the authors' decoder or a commit), "
        "`long_context.py` (long prompts, through `generate()` or `refusion serve`), `serve_load.py` (serving), "
        "`engine_throughput.py` (ReFusion on SGLang beside stock Qwen3 on SGLang and `generate()`), "
        "`accuracy_speed.py` (accuracy and speed beside the AR baseline: the evidence, the frontier of decoding "
        "settings, the decoding choice), `train_default_model.py` (the model recipe), `gpu_readiness.py` (the GPU "
        "run). Each one's docstring (`--help`) gives its flags.",
    ]
    for claim in CLAIMS:
        lines += ["", f"## {claim.title}", "", claim.what, ""]
        path = RESULTS / claim.result
        if not path.exists():
            lines += ["No current result (earlier figures recorded no commit or machine and were removed). Run:", ""]
            lines += [f"    {claim.rerun}"]
            continue
        data = json.loads(path.read_text())
        record = data["provenance"]
        described = record["machine"]
        machine_text = f"{described.get('cpu')} ({' '.join(described.get('cpu_vector_flags') or []) or 'no AVX2'})"
        machine_text += f", {described.get('cpu_count')} CPUs, load {described.get('load_average_1_5_15')}"
        if described.get("gpu"):
            machine_text += f", GPU {', '.join(described['gpu'])}"
        clean = "clean tree" if record["tree_clean"] else "tree with uncommitted changes"
        lines += [
            f"`benchmarks/results/{claim.result}`: `{record['command']}` at {record['commit'][:12]} ({clean}), "
            f"{record['date']}; {machine_text}; torch {described.get('torch')}, transformers "
            f"{described.get('transformers')}.{_removed_tool_note(record)}",
            "",
        ]
        rows = data.get(claim.table)
        lines += table(rows) if isinstance(rows, list) and rows else [f"(no `{claim.table}` rows in the JSON)"]
        lines += ["", "Rerun:", "", f"    {claim.rerun}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Render benchmarks/README.md from benchmarks/results/*.json.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from its rendering")
    if parser.parse_args().check:
        sys.exit(0 if PAGE.read_text() == render_page() else 1)
    PAGE.write_text(render_page())
