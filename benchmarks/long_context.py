"""Long prompts: peak memory and time of ReFusion decoding against stock `generate()` on the same weights, through
`generate()` or through `refusion serve` (`--through serve`).

A Qwen3-shaped model with random weights (memory and time do not depend on them) and a context of 40,960 positions
(the official checkpoint's): hidden 128, 2 layers, 2 query heads and 1 key/value head of 64, MLP 384, a 2,048-token
vocabulary. For every prompt length, batch size and dtype, each way runs in a fresh process (so the peak is the
call's own): the model is built, one short call warms it up, then one `generate()` of `--max-new-tokens` is timed.

* `stock`: transformers' `Qwen3ForCausalLM.generate` (greedy; its prefill is sdpa's causal kernel);
* `refusion`: `RefusionForCausalLM.generate` of this checkout (ReFusion decoding, greedy, `--slot-size`,
  `--block-size`);
* `refusion_baseline` (with `--baseline COMMIT`, at the `--baseline-lengths` only): the same from that commit's
  `src/`, extracted with `git archive` (before issue 38 its masks grew with the square of the prompt), repeated and
  alternating with the other two; `against_baseline` gives this checkout's time to the first token and wall time
  over the baseline's.

Per call: the peak resident memory above the memory held just before it (`peak_growth_mib`) and the whole
process's peak (`peak_rss_mib`), the time to the first committed token (stock: when its stopping criteria are first
called, once its first token exists; ReFusion: its first commit, which writes the first verified slot, after the
prompt's prefill and one verification forward) and the total wall time, with the forward passes. With random weights
ReFusion accepts no draft beyond each round's first token, so its forward count (and so its wall time after the first
token) is its worst case, not what a trained model does. The ratios refusion / stock are the issue's goals: peak
growth at most 1.25x and time to the first token at most 1.1x at 16k and 32k. Prompts of one batch have the same
length (no padding), as stock's causal prefill then needs no mask either. With `--repeats R` each way runs R times
per setting, the ways alternating, and each measure is the median of its R calls (all kept under `runs`). Each
process is capped at `--memory-cap-gib` of address space, so a way that would need more fails with a MemoryError
(reported) instead of filling the machine.

`--through serve`: the same check from outside, through the real server. The model is this Qwen3 shape with the
embedded model's tokenizer and vocabulary, saved twice in a temporary folder: as a ReFusion checkpoint
(`save_pretrained`, which also writes its remote code) and, with the same weights, as a stock `Qwen3ForCausalLM`.
The prompt is one chat message ("apples " repeated) rendered by the tokenizer's chat template to about `--lengths`
tokens, batch 1, float32. Each way runs in a fresh process:

* `stock` and `refusion`: `from_pretrained(...).generate` of the rendered prompt (greedy; ReFusion with its saved
  generation config), the growth measured as above;
* `serve`: `refusion serve FOLDER --max-model-len 40960` as a subprocess; one short chat request warms it up, then
  the server's peak resident memory is reset (`/proc/PID/clear_refs`, 5) and the long chat request is sent with the
  `openai` client over 127.0.0.1 (temperature 0); its growth is the server's `VmHWM` after the request minus its
  `VmRSS` before it;
* `serve_default_arenas`: the same server with glibc's own arena limit in its environment (`MALLOC_ARENA_MAX`, 8
  per core), which `refusion serve` leaves alone: what the server cost before it limited malloc to one arena
  (serving/malloc_arenas.py).

With `--repeats R` every way runs R times per length, each time in a fresh process (a fresh server), the ways
alternating; each reports the median of its calls and keeps every call under `calls` (one call is noisy: two calls
of one way at 16k once grew by 151 and 203 MiB). The goal: `refusion` and `serve` at most 1.25x stock's growth.
The flags of the generate comparison's grid (batch sizes, dtypes, slot and block size, a baseline commit, the
memory cap) do not apply to it and are refused.

    nice -n 0 .venv/bin/python benchmarks/long_context.py --baseline 54d7d0c --out benchmarks/results/long_context.json
    nice -n 0 .venv/bin/python benchmarks/long_context.py --through serve --repeats 3 \\
        --out benchmarks/results/long_context_serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, max_position_embeddings=40960,
)  # fmt: skip
WAYS = ("stock", "refusion")


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class FirstTokenClock:
    """When a `generate()` call's first token is committed. Stock's: when its stopping criteria are first called
    (pass `criteria()`), once its first token exists. ReFusion's, which commits out of order: at its first commit
    (the state's writer is wrapped in this process; the newest clock reads it). `synchronize` runs before the clock
    is read (a GPU's queue). `at` is that `time.perf_counter()` reading, None until then: reset it before a call."""

    def __init__(self, way: str, synchronize=lambda: None):
        self.at, self.way, self.synchronize = None, way, synchronize
        if way == "refusion":
            self._wrap_first_commit()

    def note(self) -> None:
        if self.at is None:
            self.synchronize()
            self.at = time.perf_counter()

    def criteria(self):
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        note = self.note

        class FirstToken(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                note()
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        return StoppingCriteriaList([] if self.way == "refusion" else [FirstToken()])

    def _wrap_first_commit(self) -> None:
        from refusion_hf.generation.sequence_state import SequenceState

        name = "_commit" if hasattr(SequenceState, "_commit") else "commit"  # `apply`'s writer since issue 40
        commit = getattr(SequenceState, name)
        original = getattr(commit, "unwrapped", commit)
        clock = self

        def timed_commit(state, *arguments, **keywords):
            clock.note()
            return original(state, *arguments, **keywords)

        timed_commit.unwrapped = original
        setattr(SequenceState, name, timed_commit)


def measure_one(way: str, length: int, batch_size: int, dtype_name: str, args) -> dict:
    """Runs in its own process: build the model, warm up, then one timed `generate()`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, dtype_name)
    vocab = SHAPE["vocab_size"]
    special = dict(mask_token_id=vocab - 1, eos_token_id=vocab - 2, pad_token_id=vocab - 2, tie_word_embeddings=False)
    torch.manual_seed(0)
    if way == "stock":
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, **special))
        knobs = {}
    else:
        from refusion_hf import RefusionConfig, RefusionForCausalLM

        model = RefusionForCausalLM(RefusionConfig(**SHAPE, **special))
        knobs = dict(slot_size=args.slot_size, block_size=args.block_size)
    model = model.to(dtype).eval()
    prompts = torch.randint(0, vocab - 2, (batch_size, length), generator=torch.Generator().manual_seed(1))

    first = FirstTokenClock(way)
    model.generate(prompts[:, :16], max_new_tokens=4, do_sample=False, **knobs)  # warm-up: lazy allocations
    first.at = None
    criteria = first.criteria()
    before, peak_before = current_rss_bytes(), peak_rss_bytes()
    start = time.perf_counter()
    out = model.generate(
        prompts, max_new_tokens=args.max_new_tokens, do_sample=False, stopping_criteria=criteria,
        return_dict_in_generate=True, **knobs,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    import refusion_hf

    return {
        "peak_growth_mib": round((max(peak, peak_before) - before) / 2**20, 1),
        "peak_rss_mib": round(max(peak, peak_before) / 2**20, 1),
        "seconds_to_first_token": round(first.at - start, 3) if first.at else None,
        "seconds": round(seconds, 3),
        "new_tokens": int(out.sequences.shape[1] - length),
        "forward_passes": getattr(out, "num_forward_passes", None) or int(out.sequences.shape[1] - length),
        "refusion_hf": str(Path(refusion_hf.__file__).parent),
    }


def run_one(way: str, length: int, batch_size: int, dtype: str, args, src: Path) -> dict:
    command = [sys.executable, __file__, "--one", way, "--lengths", str(length), "--batch-sizes", str(batch_size),
               "--dtypes", dtype, "--max-new-tokens", str(args.max_new_tokens), "--slot-size", str(args.slot_size),
               "--block-size", str(args.block_size), "--threads", str(args.threads),
               "--memory-cap-gib", str(args.memory_cap_gib)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(src)}
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    if completed.returncode != 0:
        last = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        return {"failed": last[:300]}
    return json.loads(completed.stdout.strip().splitlines()[-1])


MEASURES = ("peak_growth_mib", "peak_rss_mib", "seconds_to_first_token", "seconds")


def median_run(runs: list[dict], measures=MEASURES, listed_as: str = "runs") -> dict:
    """One way's repeated calls as one: the median of each of `measures` (the first failure, if any call failed),
    and every call's measures under `listed_as` when there were several."""
    failed = next((run for run in runs if "failed" in run), None)
    if failed is not None:
        return failed
    summary = {**runs[0], **{key: statistics.median(run[key] for run in runs) for key in measures}}
    if len(runs) > 1:
        summary[listed_as] = [{key: run[key] for key in measures} for run in runs]
    return summary


SERVE_WAYS = ("stock", "refusion", "serve", "serve_default_arenas")
# glibc's own arena limit (8 per core on 64-bit), given as an operator would: `refusion serve` then leaves it alone
DEFAULT_ARENAS = {"MALLOC_ARENA_MAX": str(8 * (os.cpu_count() or 1))}
SERVE_GOAL = 1.25
SERVE_MEASURES = ("peak_growth_mib", "seconds")  # per call; each way reports their medians


def save_models(folder: Path) -> None:
    """The ReFusion checkpoint (folder/refusion) and the same weights as stock Qwen3 (folder/stock)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from refusion_hf import RefusionConfig, RefusionForCausalLM
    from refusion_hf.modeling.loading import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    embedded = RefusionConfig.from_pretrained(default_model_path())
    special = {key: getattr(embedded, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id")}
    shape = {**SHAPE, "vocab_size": embedded.vocab_size, "tie_word_embeddings": False}
    torch.manual_seed(0)
    model = RefusionForCausalLM(RefusionConfig(**shape, **special)).eval()
    model.save_pretrained(folder / "refusion")
    tokenizer.save_pretrained(folder / "refusion")
    stock_special = {key: value for key, value in special.items() if key != "mask_token_id"}
    stock = Qwen3ForCausalLM(Qwen3Config(**shape, **stock_special))
    stock.load_state_dict(model.state_dict())
    stock.save_pretrained(folder / "stock")
    tokenizer.save_pretrained(folder / "stock")


def message(tokenizer, length: int) -> str:
    """A user message whose chat-templated prompt has about `length` tokens."""
    overhead = len(tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True))
    per_word = len(tokenizer("apples " * 100)["input_ids"]) / 100
    return "apples " * int((length - overhead) / per_word)


def chat_inputs(tokenizer, length: int):
    chat = [{"role": "user", "content": message(tokenizer, length)}]
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def measure_generate(way: str, folder: Path, length: int, max_new_tokens: int, threads: int) -> dict:
    """`--through serve`'s generate ways; runs in its own process."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from refusion_hf import RefusionForCausalLM

    torch.set_num_threads(threads)
    model_class = Qwen3ForCausalLM if way == "stock" else RefusionForCausalLM
    model = model_class.from_pretrained(folder / way, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder / way)
    inputs = chat_inputs(tokenizer, length)
    model.generate(**chat_inputs(tokenizer, 64), max_new_tokens=4, do_sample=False)  # warm-up: lazy allocations
    before, peak_before = current_rss_bytes(), peak_rss_bytes()
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    return {
        "prompt_tokens": int(inputs["input_ids"].shape[1]),
        "new_tokens": int(out.shape[1] - inputs["input_ids"].shape[1]),
        "peak_growth_mib": round((max(peak_rss_bytes(), peak_before) - before) / 2**20, 1),
        "seconds": round(seconds, 3),
    }


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure_serve(folder: Path, length: int, args, env: dict[str, str] | None = None) -> dict:
    from serve_load import start_server
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder / "refusion")
    flags = ["--max-model-len", str(SHAPE["max_position_embeddings"])]
    process, client, name = start_server(str(folder / "refusion"), "float32", flags, threads=args.threads, env=env)
    try:

        def ask(content: str, tokens: int):
            return client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": content}], max_tokens=tokens, temperature=0
            )

        ask(message(tokenizer, 64), 4)  # warm-up, as the generate ways
        before = status_kib(process.pid, "VmRSS")
        Path(f"/proc/{process.pid}/clear_refs").write_text("5")  # reset VmHWM to the current resident size
        start = time.perf_counter()
        reply = ask(message(tokenizer, length), args.max_new_tokens)
        seconds = time.perf_counter() - start
        peak = status_kib(process.pid, "VmHWM")
    finally:
        process.terminate()
        process.wait(timeout=60)
    return {
        "prompt_tokens": reply.usage.prompt_tokens,
        "new_tokens": reply.usage.completion_tokens,
        "peak_growth_mib": round((peak - before) / 1024, 1),
        "seconds": round(seconds, 3),
    }


def run_serve_way(way: str, folder: Path, length: int, args) -> dict:
    """One call of a `--through serve` way (the generate ways in a fresh process)."""
    if way.startswith("serve"):
        return measure_serve(folder, length, args, DEFAULT_ARENAS if way != "serve" else None)
    command = [sys.executable, __file__, "--through", "serve", "--one", way, "--folder", str(folder), "--lengths",
               str(length), "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    completed = subprocess.run(command, capture_output=True, text=True, env=env)
    if completed.returncode != 0:
        return {"failed": (completed.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(completed.stdout.strip().splitlines()[-1])


def serve_rows(args) -> list[dict]:
    """`--through serve`: per length, every way's median call and the ratios to stock."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        save_models(Path(folder))
        for length in args.lengths:
            calls = {way: [] for way in SERVE_WAYS}
            for repeat in range(args.repeats):  # the ways alternate: drift in the machine's speed hits each alike
                for way in SERVE_WAYS if repeat % 2 == 0 else SERVE_WAYS[::-1]:
                    calls[way].append(run_serve_way(way, Path(folder), length, args))
            row = {"prompt_length": length}
            row.update({way: median_run(calls[way], SERVE_MEASURES, "calls") for way in SERVE_WAYS})
            if not any("failed" in row[way] for way in SERVE_WAYS):
                for way in SERVE_WAYS[1:]:
                    row[f"{way}_peak_growth_ratio"] = round(
                        row[way]["peak_growth_mib"] / row["stock"]["peak_growth_mib"], 3
                    )
                row["goal_met"] = max(row["refusion_peak_growth_ratio"], row["serve_peak_growth_ratio"]) <= SERVE_GOAL
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
    return rows


def write_serve_results(args) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from decoding_speed import git
    from results_file import write_results

    head = git("rev-parse", "--short", "HEAD")
    rows = serve_rows(args)
    write_results(
        {
            "command": " ".join(sys.argv),
            "head": head,
            "through": "serve",
            "shape": SHAPE,
            "max_new_tokens": args.max_new_tokens,
            "threads": args.threads,
            "repeats": args.repeats,
            "goal": f"refusion and serve peak growth at most {SERVE_GOAL}x stock generate's",
            "load_average": [round(load, 2) for load in os.getloadavg()],
            "rows": rows,
        },
        args.out,
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive integer")
    return value


def csv_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",")]
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, comma-separated")
    return values


# The generate comparison's own flags and their defaults (None in the parser: `--through serve` refuses them given)
GENERATE_ONLY = dict(
    batch_sizes=[1, 4], dtypes="float32,bfloat16", slot_size=8, block_size=32, memory_cap_gib=16.0, baseline=None,
    baseline_lengths=[1024, 4096, 16384],
)  # fmt: skip
DEFAULT_LENGTHS = {"generate": [1024, 4096, 16384, 32768], "serve": [16384, 32768]}
DEFAULT_OUT = {"generate": "long_context.json", "serve": "long_context_serve.json"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--through", choices=("generate", "serve"), default="generate",
                        help="compare through generate() (default) or through refusion serve")  # fmt: skip
    parser.add_argument("--lengths", type=csv_ints, default=None,
                        help="prompt lengths (default: 1024,4096,16384,32768; through serve 16384,32768)")  # fmt: skip
    parser.add_argument("--batch-sizes", type=csv_ints, default=None, help="default 1,4")
    parser.add_argument("--dtypes", default=None, help="default float32,bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--slot-size", type=int, default=None, help="default 8")
    parser.add_argument("--block-size", type=int, default=None, help="default 32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-cap-gib", type=float, default=None, help="default 16")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="calls per way and setting, alternating; each measure is their median")  # fmt: skip
    parser.add_argument("--baseline", help="also run ReFusion decoding of this commit (`git archive`)")
    parser.add_argument("--baseline-lengths", type=csv_ints, default=None, help="default 1024,4096,16384")
    parser.add_argument("--out", default=None, help="default benchmarks/results/long_context.json "
                        "(through serve: long_context_serve.json)")  # fmt: skip
    parser.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)  # internal: one measurement in this process
    parser.add_argument("--folder", help=argparse.SUPPRESS)  # internal, through serve: the saved models
    args = parser.parse_args()
    if args.through == "serve":
        given = [name for name in GENERATE_ONLY if getattr(args, name) is not None]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            parser.error(f"{flags}: not used --through serve (batch 1, float32, the saved generation config)")
    for name, default in GENERATE_ONLY.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.lengths = args.lengths or DEFAULT_LENGTHS[args.through]
    args.out = args.out or str(ROOT / "benchmarks" / "results" / DEFAULT_OUT[args.through])
    if args.through == "serve":
        if args.one:
            result = measure_generate(args.one, Path(args.folder), args.lengths[0], args.max_new_tokens, args.threads)
            print(json.dumps(result))
            return
        return write_serve_results(args)
    dtypes = args.dtypes.split(",")
    if any(dtype not in ("float32", "bfloat16", "float16") for dtype in dtypes):
        parser.error(f"--dtypes: float32, bfloat16 or float16, comma-separated; got {args.dtypes!r}")
    if args.one:
        cap = int(args.memory_cap_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
        print(json.dumps(measure_one(args.one, args.lengths[0], args.batch_sizes[0], dtypes[0], args)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from decoding_speed import extract_baseline, git
    from results_file import write_results

    head, load_before = git("rev-parse", "--short", "HEAD"), os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        baseline_src = extract_baseline(args.baseline, Path(folder)) if args.baseline else None
        for dtype in dtypes:
            for batch_size in args.batch_sizes:
                for length in args.lengths:
                    row = {"dtype": dtype, "batch_size": batch_size, "prompt_length": length}
                    ways = {way: (way, ROOT / "src") for way in WAYS}  # name -> (what runs, from which src/)
                    if baseline_src is not None and length in args.baseline_lengths:
                        ways["refusion_baseline"] = ("refusion", baseline_src)
                    runs = {way: [] for way in ways}
                    for _ in range(args.repeats):  # the ways alternate, so a drift of the machine hits all
                        for way, (runs_as, src) in ways.items():
                            runs[way].append(run_one(runs_as, length, batch_size, dtype, args, src))
                    for way in runs:
                        row[way] = median_run(runs[way])
                    baseline = row.get("refusion_baseline", {})
                    if "seconds" in baseline and "seconds" in row["refusion"]:
                        row["against_baseline"] = {
                            f"{key}_ratio": round(row["refusion"][key] / baseline[key], 3)
                            for key in ("seconds_to_first_token", "seconds")
                        }
                    stock, refusion = row["stock"], row["refusion"]
                    if "failed" not in stock and "failed" not in refusion:
                        row["peak_growth_ratio"] = round(refusion["peak_growth_mib"] / stock["peak_growth_mib"], 3)
                        row["first_token_ratio"] = round(
                            refusion["seconds_to_first_token"] / stock["seconds_to_first_token"], 3
                        )
                        row["wall_time_ratio"] = round(refusion["seconds"] / stock["seconds"], 3)
                        if length >= 16384:
                            row["goal_met"] = row["peak_growth_ratio"] <= 1.25 and row["first_token_ratio"] <= 1.1
                    print(json.dumps(row), file=sys.stderr)
                    rows.append(row)
    write_results(
        {
            "command": " ".join(sys.argv),
            "head": head,
            "through": "generate",
            "shape": SHAPE,
            "max_new_tokens": args.max_new_tokens,
            "slot_size": args.slot_size,
            "block_size": args.block_size,
            "threads": args.threads,
            "repeats": args.repeats,
            "load_average_before": [round(load, 2) for load in load_before],
            "load_average_after": [round(load, 2) for load in os.getloadavg()],
            "goals": "at 16k and 32k: peak_growth_ratio <= 1.25 and first_token_ratio <= 1.1 (refusion / stock)",
            "rows": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
