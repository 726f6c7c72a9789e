"""Tokens/s of one model served three ways, at several numbers of concurrent requests, side by side in one run:

* `refusion-sglang`: ReFusion decoding on SGLang (`refusion serve --engine sglang`, a subprocess on 127.0.0.1,
  `--continuous-batching --max-num-seqs` the largest concurrency), the `openai` client's greedy completions;
* `qwen3-sglang`: the same weights saved as a stock Qwen3 folder (`Qwen3ForCausalLM`, no mask token, a plain
  generation config), served by SGLang's own `sglang serve` and decoded autoregressively, the same client;
* `generate`: this package's `generate()` in this process (one request at a time at concurrency 1, else
  `generate_batch()` with `max_requests_per_batch` the concurrency: what `refusion serve --continuous-batching` runs).

Every engine gets the same prompts (the synthetic suite's test problems through the model's chat template, as token
ids), greedy, `--max-tokens` new tokens at most (answers end at their EOS: the answer lengths of the autoregressive
engine differ, so tokens/s is completion tokens over the wall time of all `--requests` requests at that
concurrency, each client sending its next request when its answer is back). ReFusion runs in the one configuration
SGLang decodes exactly (`ONE_SLOT`: slot = block = 8, no sub-slot remasking; docs/serving.md), for both
`refusion-sglang` and `generate`, and the JSON records whether their answers are the same tokens. One warm-up
request per engine and concurrency first (not timed). Servers are started and stopped here, one at a time.

Runs in `.venv-sglang` (`make sglang`). On this 2-core CPU (the embedded model; a quiet machine: the load average is
recorded with the results, and a measurement beside other work says little):

    .venv-sglang/bin/python benchmarks/engine_throughput.py --out benchmarks/results/engine_throughput_cpu.json

On one GPU, a Qwen3-8B-shaped model with random weights: `benchmarks/gpu_readiness.py --sections sglang_engines`
(which calls `measure_engines` here with `--device cuda`). Smoke test (tests/benchmarks, in `make test-sglang`):
`--engines generate --concurrency 1 2 --requests 2 --max-tokens 8`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from results_file import write_results

ENGINES = ("refusion-sglang", "qwen3-sglang", "generate")
ONE_SLOT = {"slot_size": 8, "block_size": 8, "remask_threshold": None}
DECODINGS = {"installed": {}, "one-slot": ONE_SLOT}  # over the checkpoint's own settings
START_SECONDS = 900  # SGLang's start-up: 30-70 s on the 2-core CPU; an 8B model's weights on a GPU take longer
REQUEST_SECONDS = 600


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def chat_prompts(model_dir: str, count: int, seed: int = 0, tier: str = "standard") -> list[list[int]]:
    """`count` synthetic test problems of `tier` at `seed` through the model's chat template, as token ids."""
    from transformers import AutoTokenizer

    from refusion_hf.evaluation.synthetic_tasks import generate_problems

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = generate_problems("test", count, seed, tier=tier)
    messages = [[{"role": "user", "content": problem.prompt}] for problem in problems]
    return [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"]) for m in messages
    ]


def save_stock_qwen3(model_dir: str, out: Path) -> Path:
    """The ReFusion checkpoint's weights as a stock Qwen3 folder (transformers' `Qwen3ForCausalLM`, its config
    without ReFusion's fields, a plain generation config), with the tokenizer: what an autoregressive engine loads."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from refusion_hf import RefusionForCausalLM

    refusion = RefusionForCausalLM.from_pretrained(model_dir, dtype="auto")
    fields = {
        k: v for k, v in refusion.config.to_dict().items() if k not in ("model_type", "auto_map", "mask_token_id")
    }
    config = Qwen3Config(**{**fields, "architectures": ["Qwen3ForCausalLM"]})
    stock = Qwen3ForCausalLM(config).to(refusion.dtype)
    stock.load_state_dict(refusion.state_dict(), strict=True)
    stock.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    stock.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running(command: list[str], port: int, log_path: Path, env: dict | None = None):
    """`command` (a server on 127.0.0.1:`port`) in a process group of its own until /health answers; yields its base
    URL; SIGTERM on exit, then the group killed if anything of it is left (SGLang's scheduler, detokenizer)."""
    import httpx

    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_SECONDS
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{command[:4]} exited {process.returncode}: {log_path.read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{command[:4]} not up after {START_SECONDS} s")
                time.sleep(1)
            yield url
        finally:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=60)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def server_command(engine: str, folder: str, port: int, rows: int, args, work: Path) -> tuple[list[str], dict]:
    """The launch command of `engine` and its environment."""
    from refusion_hf.serving.sglang_launch import device_arguments

    env = dict(os.environ)
    if engine == "refusion-sglang":
        command = [sys.executable, "-m", "refusion_hf.cli", "serve", "--engine", "sglang", folder, "--port", str(port),
                   "--dtype", args.dtype, "--device", args.device, "--continuous-batching", "--max-num-seqs", str(rows),
                   "--served-model-name", "model"]  # fmt: skip
        if DECODINGS[args.decoding]:
            import yaml

            settings = work / f"{args.decoding}.yaml"
            settings.write_text(yaml.safe_dump(DECODINGS[args.decoding]))
            command += ["--dllm-algorithm-config", str(settings)]
        if args.tp_size > 1:
            command.append(f"--engine-args=--tp-size {args.tp_size}")
        return command, env
    # stock SGLang, the same CPU arguments `refusion serve --engine sglang` gives it
    from transformers import AutoConfig

    context = AutoConfig.from_pretrained(folder).max_position_embeddings
    device = device_arguments(args.device, gpu=args.device != "cpu", kv_tokens=context * rows)
    if "cpu" in device:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    command = [str(Path(sys.executable).parent / "sglang"), "serve", "--model-path", folder, "--port", str(port),
               "--dtype", args.dtype, "--max-running-requests", str(rows), "--served-model-name", "model",
               "--tp-size", str(args.tp_size), "--log-level", "warning", *device]  # fmt: skip
    return command, env


def client_load(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """`prompts` sent as greedy completions by `concurrency` clients; wall time and completion tokens."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_SECONDS)

    def complete(prompt):
        reply = client.completions.create(model="model", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body={"return_token_ids": True})  # fmt: skip
        return reply.choices[0].model_extra["token_ids"]

    complete(prompts[0])  # warm-up
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(complete, prompts))
    return {"seconds": time.perf_counter() - start, "answers": answers}


def decode_with(model, decoding: str, max_tokens: int) -> None:
    """Make `decoding`'s settings the model's own generation config, greedy, `max_tokens` new tokens at most: a config
    passed to generate() is merged with the model's the stock way, where a field at its default (remask_threshold
    None) takes the model's value (0.1)."""
    import copy

    config = copy.deepcopy(model.generation_config)
    config.update(**DECODINGS[decoding], do_sample=False, max_new_tokens=max_tokens)
    model.generation_config = config


def generate_load(model, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """`prompts` through `generate()` one at a time (concurrency 1) or `generate_batch()` with `concurrency` rows, with
    the model's generation config (`decode_with`)."""
    import torch
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    eos = model.generation_config.eos_token_id

    def one(prompt):
        ids = torch.tensor([prompt], device=model.device)  # no padding (a prompt may hold the pad id)
        out = model.generate(ids, attention_mask=torch.ones_like(ids))[0, len(prompt) :]
        out = out.tolist()
        return out[: out.index(eos) + 1] if eos in out else out

    one(prompts[0])  # warm-up
    start = time.perf_counter()
    if concurrency == 1:
        answers = [one(prompt) for prompt in prompts]
    else:
        rows = ContinuousBatchingConfig(max_requests_per_batch=concurrency)
        results = model.generate_batch(prompts, continuous_batching_config=rows)
        answers = [list(results[f"req_{i}"].generated_tokens) for i in range(len(prompts))]
    return {"seconds": time.perf_counter() - start, "answers": answers}


def measure_engines(model_dir: str, args) -> dict:
    """Every engine of `args.engines` at every concurrency of `args.concurrency`: tokens/s, and the ratios."""
    import torch

    prompts = chat_prompts(model_dir, args.requests)
    rows = max(args.concurrency)
    runs: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="engine-throughput-") as scratch:
        work = Path(scratch)
        for engine in args.engines:
            loads = {}
            if engine == "generate":
                from refusion_hf import RefusionForCausalLM

                dtype = torch.float32 if args.dtype == "float32" else "auto"
                model = RefusionForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
                decode_with(model, args.decoding, args.max_tokens)
                for concurrency in args.concurrency:
                    loads[concurrency] = generate_load(model, prompts, concurrency, args.max_tokens)
                del model
            else:
                folder = model_dir if engine == "refusion-sglang" else str(save_stock_qwen3(model_dir, work / "qwen3"))
                port = free_port()
                command, env = server_command(engine, folder, port, rows, args, work)
                with running(command, port, work / f"{engine}.log", env) as url:
                    for concurrency in args.concurrency:
                        loads[concurrency] = client_load(url, prompts, concurrency, args.max_tokens)
            runs[engine] = loads
    results = []
    for engine, loads in runs.items():
        for concurrency, load in loads.items():
            tokens = sum(len(answer) for answer in load["answers"])
            row = {"engine": engine, "concurrency": concurrency, "requests": len(prompts),
                   "completion_tokens": tokens, "seconds": round(load["seconds"], 3),
                   "tokens_per_s": round(tokens / load["seconds"], 2)}  # fmt: skip
            if engine == "refusion-sglang" and "generate" in runs:  # the same decoding: the same tokens
                same = sum(a == b for a, b in zip(load["answers"], runs["generate"][concurrency]["answers"]))
                row["answers_equal_to_generate"] = same
            results.append(row)
    by_key = {(row["engine"], row["concurrency"]): row["tokens_per_s"] for row in results}
    ratios = {
        f"{engine}/{base}@{c}": round(by_key[(engine, c)] / by_key[(base, c)], 3)
        for c in args.concurrency
        for engine, base in (("refusion-sglang", "qwen3-sglang"), ("refusion-sglang", "generate"))
        if (engine, c) in by_key and (base, c) in by_key
    }
    settings = {"decoding": args.decoding, "refusion": DECODINGS[args.decoding], "max_tokens": args.max_tokens,
                "dtype": args.dtype, "device": args.device, "tp_size": args.tp_size}  # fmt: skip
    return {"settings": settings, "results": results, "ratios": ratios}


def check_held_out(model_dir: str, args) -> list[dict]:
    """The held-out check (module docstring): a row per tier, answers equal and forward passes."""
    import torch

    from refusion_hf import RefusionForCausalLM

    dtype = torch.float32 if args.dtype == "float32" else "auto"
    model = RefusionForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    decode_with(model, args.decoding, args.max_tokens)
    eos = model.generation_config.eos_token_id
    prompts = {tier: chat_prompts(model_dir, args.check_problems, args.check_seed, tier) for tier in args.check_tiers}
    expected, forwards, sglang_forwards = {}, {}, {}
    with torch.inference_mode():
        for tier, tier_prompts in prompts.items():
            expected[tier], forwards[tier], sglang_forwards[tier] = [], 0, 0
            for prompt in tier_prompts:
                ids = torch.tensor([prompt], device=model.device)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True)
                answer = out.sequences[0, len(prompt) :].tolist()
                expected[tier].append(answer[: answer.index(eos) + 1] if eos in answer else answer)
                forwards[tier] += out.num_forward_passes
                alone = model.generate(ids, attention_mask=torch.ones_like(ids), plan_ahead=False,
                                       return_dict_in_generate=True)  # fmt: skip
                if not torch.equal(alone.sequences, out.sequences):
                    raise RuntimeError("planning ahead changed an answer: the forward count below would not hold")
                # SGLang's prompt encoding, then one encoding per block before the answer's last
                blocks = -(-len(expected[tier][-1]) // model.generation_config.block_size)
                sglang_forwards[tier] += alone.num_forward_passes + blocks
    del model
    rows = max(args.concurrency)
    check = []
    with tempfile.TemporaryDirectory(prefix="engine-check-") as scratch:
        port = free_port()
        command, env = server_command("refusion-sglang", model_dir, port, rows, args, Path(scratch))
        with running(command, port, Path(scratch) / "check.log", env) as url:
            for tier, tier_prompts in prompts.items():
                answers = client_load(url, tier_prompts, rows, args.max_tokens)["answers"]
                check.append({
                    "tier": tier,
                    "held_out": True,  # tests/test_decision_seeds.py: its seed is not a decision seed
                    "seed": args.check_seed,
                    "problems": len(tier_prompts),
                    "answers_equal_to_generate": sum(a == b for a, b in zip(answers, expected[tier], strict=True)),
                    "generate_forwards": forwards[tier],
                    "sglang_forwards": sglang_forwards[tier],
                    "forwards_ratio": round(sglang_forwards[tier] / forwards[tier], 3),
                    "concurrency": rows,
                })  # fmt: skip
    return check


def add_arguments(parser) -> None:
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--concurrency", nargs="+", type=positive, default=[1, 4, 16])
    parser.add_argument("--requests", type=positive, default=96, help="requests at each concurrency (default 96)")
    parser.add_argument("--max-tokens", type=positive, default=48)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--tp-size", type=positive, default=1, help="SGLang's tensor parallelism (GPUs)")
    parser.add_argument("--decoding", choices=sorted(DECODINGS), default="installed",
                        help="ReFusion's settings on both of its engines (default: the checkpoint's own)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a ReFusion folder (default: the embedded model)")
    add_arguments(parser)
    parser.add_argument("--out", default="benchmarks/results/engine_throughput_cpu.json")
    parser.add_argument("--check-problems", type=positive, default=None,
                        help="add the held-out check: this many problems of each tier (module docstring)")  # fmt: skip
    parser.add_argument("--check-seed", type=int, default=None, help="the held-out check's seed (not a decision seed)")
    parser.add_argument("--check-tiers", nargs="+", default=["standard", "hard"])
    args = parser.parse_args()
    from refusion_hf.modeling.loading import default_model_path

    if args.check_problems is not None:
        check_seed_is_held_out(args.check_seed)
    model_dir = args.model or str(default_model_path())
    results = {"model": model_dir, **measure_engines(model_dir, args)}
    if args.check_problems is not None:
        results["check"] = check_held_out(model_dir, args)
    write_results(results, args.out)


def check_seed_is_held_out(seed: int | None) -> None:
    """The check's seed must be given, and no decision may have used it (benchmarks/decision_seeds.json)."""
    import json

    if seed is None:
        raise SystemExit("engine_throughput.py: error: --check-problems needs --check-seed (a held-out seed)")
    listed = json.loads((Path(__file__).parent / "decision_seeds.json").read_text())["seeds"]
    if any(entry["seed"] == seed for entry in listed):
        raise SystemExit(f"engine_throughput.py: error: --check-seed {seed} is a decision seed (decision_seeds.json)")


if __name__ == "__main__":
    main()
