"""`refusion serve` under concurrent clients: N clients at once against the same N requests one after another.

For each server mode (one request at a time, the default; `--continuous-batching`), the real command runs in a
subprocess on 127.0.0.1 and the `openai` client sends N chat requests (synthetic test questions through the chat
template, greedy, `--max-tokens`): first one after another from one client, then all at once from N threads. Reported
per mode: wall time, answer tokens (the responses' `usage.completion_tokens`), tokens/s, the concurrent / sequential
tokens/s ratio, and whether each concurrent answer equals the sequential answer to the same question. The two arms
alternate `--repeats` times and each is timed by its fastest run. The machine's load average before and after is
recorded: the numbers are only comparable on a quiet machine (on a busy one, `--threads 1` keeps the server's torch
from fighting other processes for the cores).

    .venv/bin/python benchmarks/serve_concurrency.py --out benchmarks/results/serve_concurrency.json
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import torch
from results_file import write_results

from refusion_hf.evaluation.synthetic_tasks import generate_problems
from refusion_hf.modeling.loading import default_model_path

MODES = {"one_at_a_time": [], "continuous_batching": ["--continuous-batching"]}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(
    model: str,
    dtype: str,
    flags: list[str],
    threads: int | None,
    timeout: float = 180,
    api_key: str = "-",
    env: dict[str, str] | None = None,
):
    """`refusion serve` in a subprocess; returns (process, client, served model name) once it answers (the client
    sends `api_key`: the one `flags` give with `--api-key`, if any; `env`: more environment variables)."""
    port = free_port()
    command = [sys.executable, "-m", "refusion_hf.cli", "serve", model, "--port", str(port), "--dtype", dtype, *flags]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}), **(env or {})}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, timeout=600, max_retries=0)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return process, client, client.models.list().data[0].id
        except openai.APIConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"refusion serve did not start: {process.communicate()[1][-2000:]}") from None
            time.sleep(0.2)


def ask(client, name: str, question: str, max_tokens: int) -> tuple[str, int]:
    reply = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].message.content, reply.usage.completion_tokens


def measure(client, name: str, questions: list[str], max_tokens: int, repeats: int) -> dict:
    ask(client, name, questions[0], max_tokens)  # warm-up (first-call costs)
    sequential_s = concurrent_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        sequential = [ask(client, name, q, max_tokens) for q in questions]
        sequential_s = min(sequential_s, time.perf_counter() - start)
        start = time.perf_counter()
        with ThreadPoolExecutor(len(questions)) as pool:
            concurrent = list(pool.map(lambda q: ask(client, name, q, max_tokens), questions))
        concurrent_s = min(concurrent_s, time.perf_counter() - start)
    tokens = sum(n for _, n in sequential)
    concurrent_tokens = sum(n for _, n in concurrent)
    return {
        "sequential": {
            "wall_s": round(sequential_s, 3),
            "tokens": tokens,
            "tokens_per_s": round(tokens / sequential_s, 1),
        },
        "concurrent": {
            "wall_s": round(concurrent_s, 3),
            "tokens": concurrent_tokens,
            "tokens_per_s": round(concurrent_tokens / concurrent_s, 1),
        },
        "concurrent_over_sequential_tokens_per_s": round(
            (concurrent_tokens / concurrent_s) / (tokens / sequential_s), 2
        ),
        "same_answers": sum(a == b for a, b in zip(sequential, concurrent)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--dtype", default="auto", help="refusion serve --dtype (default: the checkpoint's own)")
    parser.add_argument("--clients", type=positive, default=16, help="requests, sent one after another then at once")
    parser.add_argument("--max-tokens", type=positive, default=64)
    parser.add_argument("--seed", type=int, default=7, help="synthetic test questions of this seed")
    parser.add_argument("--repeats", type=positive, default=3, help="alternations of the two arms (fastest kept)")
    parser.add_argument("--threads", type=positive, default=None, help="the server's torch threads (OMP_NUM_THREADS)")
    parser.add_argument("--out", default="results/serve_concurrency.json")
    args = parser.parse_args()

    questions = [problem.prompt for problem in generate_problems("test", args.clients, args.seed)]
    results = {
        "command": " ".join(["benchmarks/serve_concurrency.py", *sys.argv[1:]]),
        "model": args.model,
        "dtype": args.dtype,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "cpu_count": os.cpu_count(),
        "repeats": args.repeats,
        "server_torch_threads": args.threads or torch.get_num_threads(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "modes": {},
    }
    for mode, flags in MODES.items():
        process, client, name = start_server(args.model, args.dtype, flags, args.threads)
        try:
            results["modes"][mode] = measure(client, name, questions, args.max_tokens, args.repeats)
        finally:
            process.terminate()
            process.wait(timeout=60)
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    write_results(results, args.out)


if __name__ == "__main__":
    main()
