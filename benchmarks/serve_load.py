"""`refusion serve` under a bounded load of well-behaved and abusive clients, with checks (exit status 1 if any fails).

The real command runs in a subprocess on 127.0.0.1 (`start_server`: the embedded model, a small
`--max-model-len`, an `--api-key`). First this process loads the same model (`load_model_and_tokenizer`) and
computes `generate()`'s greedy answer to each question (synthetic test questions through the tokenizer's chat
template, `--max-tokens` new tokens). Then, all at once on one asyncio loop: `--clients` well-behaved clients
(`openai.AsyncOpenAI`, greedy chat requests, half of them streamed) and `--abusive-clients` abusive ones (raw
`httpx2`, the HTTP client `openai` uses, and `AsyncOpenAI` for the streams they leave), kept interleaved with the
well-behaved ones over the whole run: streams left after their first chunk (`max_tokens` half the
`--max-model-len`), prompts past `--max-model-len` (alone, or with `max_tokens`), chat templates sent in
`chat_template_kwargs` (a template bomb, `tokenize: false`), wrong-type bodies (eight kinds, one of them not
JSON), and wrong or missing API keys. Meanwhile a thread GETs `/health` every 50 ms (its own
`httpx2.Client`) and records the latency. `--requests` in all (about `--abusive-share` of them abusive), the whole
load within `--time-limit` seconds; the server is stopped at the end whatever happens.

Checks (all written to the JSON): every well-behaved answer equals `generate()`'s; no 5xx (as the clients saw it,
and the server's own `/metrics` count); each abusive request got its expected status (a left stream: 200 and at
least one chunk); `/health` p99 under 100 ms and no failed probe; the server's resident memory (VmRSS of its
process) after all requests within 50 MB of after the first `--rss-after` (100); requests running and waiting
back to 0 on `/metrics` after the load (left streams freed their decoding); finished within the time limit.

    .venv/bin/python benchmarks/serve_load.py --out benchmarks/results/serve_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

import httpx2
import openai
from results_file import write_results

from refusion_hf.evaluation.synthetic_tasks import generate_problems
from refusion_hf.modeling.loading import default_model_path, load_model_and_tokenizer

HEALTH_PERIOD_S = 0.05
HEALTH_P99_LIMIT_S = 0.1
RSS_GROWTH_LIMIT_MB = 50
REQUEST_TIMEOUT_S = 120
BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# Each abuse, and the status it must get (a 4xx range for wrong-type bodies: 400 or 422 both name the field).
EXPECTED = {
    "disconnect_mid_stream": (200, 200),
    "prompt_past_limit": (400, 400),
    "template_bomb": (400, 400),
    "wrong_type": (400, 499),
    "wrong_key": (401, 401),
}


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


def schedule(requests: int, abusive_share: float) -> list[str]:
    """The kind of each request, abusive ones spread evenly (`well_behaved`, or a key of EXPECTED in turn)."""
    kinds, abuses = [], 0
    for index in range(requests):
        if int((index + 1) * abusive_share) > int(index * abusive_share):
            kinds.append(list(EXPECTED)[abuses % len(EXPECTED)])
            abuses += 1
        else:
            kinds.append("well_behaved")
    return kinds


def reference_answers(model_path: str, dtype: str, questions: list[str], max_tokens: int) -> list[str]:
    """generate()'s greedy answer to each question as a chat, decoded as the server decodes it."""
    model, tokenizer = load_model_and_tokenizer(model_path, dtype)
    answers = []
    for question in questions:
        messages = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        tokens = model.generate(ids, max_new_tokens=max_tokens)[0, ids.shape[1] :]
        answers.append(tokenizer.decode(tokens, skip_special_tokens=True))
    return answers


def resident_mb(pid: int) -> float | None:
    """VmRSS of process `pid`, in MB (from /proc/PID/status); None once the process has ended."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return None  # gone, or a zombie (no VmRSS)


def percentile(values: list[float], share: float) -> float | None:
    """The nearest-rank percentile (`share` in 0..1) of `values`; None if there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(share * len(ordered) + 0.999999) - 1))]


class HealthProber(threading.Thread):
    """GETs /health every HEALTH_PERIOD_S on its own thread and client until stopped; records each latency."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.latencies, self.failures, self.stopping = url, [], [], threading.Event()

    def run(self):
        with httpx2.Client(timeout=10) as http:
            while not self.stopping.is_set():
                start = time.perf_counter()
                try:
                    status = http.get(f"{self.url}/health").status_code
                    if status != 200:
                        self.failures.append(f"status {status}")
                except httpx2.HTTPError as error:
                    self.failures.append(f"{type(error).__name__}: {error}")
                self.latencies.append(time.perf_counter() - start)
                self.stopping.wait(HEALTH_PERIOD_S)


class Load:
    """The clients, the outcome of each request, and the server's memory after the first requests."""

    def __init__(self, url, key, name, questions, max_tokens, max_model_len, server_pid, rss_after):
        self.url, self.key, self.name, self.questions, self.rss_after = url, key, name, questions, rss_after
        self.max_tokens, self.max_model_len, self.server_pid = max_tokens, max_model_len, server_pid
        self.statuses = collections.defaultdict(collections.Counter)  # kind -> status (or error name) -> count
        self.answers = []  # (question index, text) of each well-behaved request
        self.latencies = []  # seconds, each well-behaved request that was answered
        self.failures = []  # the first few requests that did not get what they should, described
        self.done = 0
        self.rss_after_first_mb = None
        self.progress = asyncio.Condition()
        self.good_done = self.good_total = self.abusive_done = self.abusive_total = 0

    def chat(self, index: int, **fields) -> dict:
        return {"model": self.name, "messages": [{"role": "user", "content": self.questions[index]}], **fields}

    def record(self, kind: str, status, detail: str = "") -> None:
        self.statuses[kind][str(status)] += 1
        low, high = EXPECTED.get(kind, (200, 200))
        if not (isinstance(status, int) and low <= status <= high) and len(self.failures) < 20:
            self.failures.append({"kind": kind, "status": status, "detail": detail[:300]})
        self.done += 1
        if self.done == self.rss_after:
            self.rss_after_first_mb = resident_mb(self.server_pid)

    async def well_behaved(self, client, index: int, stream: bool) -> None:
        request = self.chat(index, max_tokens=self.max_tokens, temperature=0)
        start = time.perf_counter()
        try:
            if stream:
                pieces = []
                async for chunk in await client.chat.completions.create(stream=True, **request):
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces.append(chunk.choices[0].delta.content)
                text = "".join(pieces)
            else:
                text = (await client.chat.completions.create(**request)).choices[0].message.content
        except openai.APIStatusError as error:
            return self.record("well_behaved", error.status_code, str(error.body))
        except openai.APIError as error:
            return self.record("well_behaved", type(error).__name__, str(error))
        self.answers.append((index, text))
        self.latencies.append(time.perf_counter() - start)
        self.record("well_behaved", 200)

    async def abuse(self, client, http, kind: str, turn: int) -> None:
        index = turn % len(self.questions)
        headers = {"Authorization": f"Bearer {self.key}"}
        if kind == "disconnect_mid_stream":  # read the first chunk, then leave
            try:  # a budget its decoding would take a while to spend, if it went on
                request = self.chat(index, max_tokens=self.max_model_len // 2)
                stream = await client.chat.completions.create(stream=True, **request)
                async for _chunk in stream:
                    break
                else:
                    return self.record(kind, "no chunk")
                await stream.close()
                return self.record(kind, 200)
            except openai.APIStatusError as error:
                return self.record(kind, error.status_code, str(error.body))
            except openai.APIError as error:
                return self.record(kind, type(error).__name__, str(error))
        if kind == "prompt_past_limit":
            long_prompt = "apples " * 2 * self.max_model_len
            bodies = [
                {**self.chat(index, max_tokens=4), "messages": [{"role": "user", "content": long_prompt}]},
                self.chat(index, max_tokens=self.max_model_len),  # the prompt fits, not with max_tokens
            ]
        elif kind == "template_bomb":
            bodies = [
                self.chat(index, max_tokens=4, chat_template_kwargs={"chat_template": BOMB}),
                self.chat(index, max_tokens=4, chat_template_kwargs={"tokenize": False}),
            ]
        elif kind == "wrong_type":
            bodies = [
                {"model": self.name, "messages": "hello", "max_tokens": 4},
                self.chat(index, max_tokens="many"),
                self.chat(index, max_tokens=4, temperature=[0]),
                self.chat(index, max_tokens=4, stream="yes"),
                self.chat(index, max_tokens=4, chat_template_kwargs="x"),
                {"model": self.name, "messages": [{"role": 5, "content": self.questions[index]}], "max_tokens": 4},
                [1, 2],
                b"{not json",
            ]
        else:  # wrong_key
            headers = [{"Authorization": "Bearer wrong-" + self.key}, {}, {"Authorization": f"Basic {self.key}"}]
            headers = headers[turn % len(headers)]
            bodies = [self.chat(index, max_tokens=4)]
        body = bodies[turn % len(bodies)]
        if isinstance(body, bytes):
            content = dict(content=body, headers={**headers, "Content-Type": "application/json"})
        else:
            content = dict(json=body, headers=headers)
        try:
            reply = await http.post("/v1/chat/completions", **content)
        except httpx2.HTTPError as error:
            return self.record(kind, type(error).__name__, str(error))
        self.record(kind, reply.status_code, reply.text)

    async def run(self, kinds: list[str], clients: int, abusive_clients: int) -> None:
        good = asyncio.Queue()
        bad = asyncio.Queue()
        turns = collections.Counter()  # each abuse's variants in turn
        for position, kind in enumerate(kinds):
            if kind == "well_behaved":
                good.put_nowait(position)
            else:
                bad.put_nowait((kind, turns[kind]))
                turns[kind] += 1
        self.good_total, self.abusive_total = good.qsize(), bad.qsize()
        limits = httpx2.Limits(max_connections=clients + abusive_clients)
        options = dict(base_url=f"{self.url}/v1", api_key=self.key, timeout=REQUEST_TIMEOUT_S, max_retries=0)
        async with (
            openai.AsyncOpenAI(**options, http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client,
            httpx2.AsyncClient(base_url=self.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as http,
        ):

            async def good_client():
                while not good.empty():
                    position = good.get_nowait()
                    await self.well_behaved(client, position % len(self.questions), stream=position % 4 < 2)
                    async with self.progress:
                        self.good_done += 1
                        self.progress.notify_all()

            async def abusive_client():
                while not bad.empty():
                    kind, turn = bad.get_nowait()
                    await self.abuse(client, http, kind, turn)
                    async with self.progress:  # keep pace with the well-behaved clients over the whole run
                        self.abusive_done += 1
                        await self.progress.wait_for(
                            lambda: (
                                self.good_done >= self.good_total
                                or self.abusive_done / self.abusive_total <= self.good_done / max(1, self.good_total)
                            )
                        )

            everyone = [good_client() for _ in range(clients)] + [abusive_client() for _ in range(abusive_clients)]
            await asyncio.gather(*everyone)


def server_gauges(url: str) -> dict:
    """The server's own counts from /metrics: requests running and waiting, answers by status class."""
    text = httpx2.get(f"{url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        for name, key in (
            ("refusion_requests_running ", "running"),
            ("refusion_requests_waiting ", "waiting"),
            ('refusion_http_responses_total{status="2xx"} ', "2xx"),
            ('refusion_http_responses_total{status="4xx"} ', "4xx"),
            ('refusion_http_responses_total{status="5xx"} ', "5xx"),
        ):
            if line.startswith(name):
                values[key] = int(float(line.split()[-1]))
    return values


def compare(answers: list[tuple[int, str]], references: list[str]) -> dict:
    """How many well-behaved answers (question index, text) differ from generate()'s, with the first few."""
    mismatches = [(index, text) for index, text in answers if text != references[index]]
    return {
        "count": len(answers),
        "mismatches": len(mismatches),
        "first_mismatches": [
            {"question": index, "answer": text, "generate": references[index]} for index, text in mismatches[:5]
        ],
    }


def evaluate(results: dict) -> dict:
    """Each check of the module docstring, True or False, from what `results` recorded."""
    answers = results["well_behaved_answers"]
    statuses = results["statuses"]
    five_xx = sum(n for kind in statuses.values() for status, n in kind.items() if status.startswith("5"))
    expected = all(
        status.isdigit() and low <= int(status) <= high
        for kind, (low, high) in {"well_behaved": (200, 200), **EXPECTED}.items()
        for status in statuses.get(kind, {})
    )
    health = results["health"]
    rss = results["server_rss_mb"]
    after = results["server_metrics_after"]
    return {
        "answers_equal_generate": bool(answers["count"])
        and answers["mismatches"] == 0
        and answers["count"] == results["requests_by_kind"].get("well_behaved", 0),
        "no_5xx": five_xx == 0 and after.get("5xx", 0) == 0,
        "each_request_got_its_expected_status": expected,
        "health_p99_under_100ms": health["p99_s"] is not None and health["p99_s"] < HEALTH_P99_LIMIT_S,
        "health_never_failed": health["failures"] == 0,
        "rss_growth_within_50mb": None not in (rss["after_first"], rss["after_all"])
        and abs(rss["after_all"] - rss["after_first"]) <= RSS_GROWTH_LIMIT_MB,
        "nothing_left_running": after.get("running") == 0 and after.get("waiting") == 0,
        "finished_within_time_limit": results["finished_within_time_limit"],
    }


def check_rows(results: dict) -> list[dict]:
    """The results page's table: each check of `results["checks"]` with the figure it was decided on."""
    answers, health, rss = results["well_behaved_answers"], results["health"], results["server_rss_mb"]
    five_xx = sum(n for kind in results["statuses"].values() for status, n in kind.items() if status.startswith("5"))
    growth = None if None in (rss["after_first"], rss["after_all"]) else round(rss["after_all"] - rss["after_first"], 1)
    measured = {
        "answers_equal_generate": f"{answers['count'] - answers['mismatches']} of {answers['count']} answers",
        "no_5xx": f"{five_xx} answers 5xx",
        "each_request_got_its_expected_status": f"{len(results['unexpected'])} unexpected",
        "health_p99_under_100ms": f"p99 {health['p99_s']:.4f} s" if health["p99_s"] is not None else "no probe",
        "health_never_failed": f"{health['failures']} of {health['probes']} probes failed",
        "rss_growth_within_50mb": f"{growth} MB after request {rss['after_first_requests']}",
        "nothing_left_running": ", ".join(f"{k} {v}" for k, v in results["server_metrics_after"].items()),
        "finished_within_time_limit": f"{results['requests']} requests in {results['load_s']} s",
    }
    return [{"check": name, "passed": ok, "measured": measured[name]} for name, ok in results["checks"].items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--dtype", default="float32", help="the server's and the reference answers' dtype")
    parser.add_argument("--requests", type=positive, default=1000, help="requests in all, abusive ones included")
    parser.add_argument("--abusive-share", type=float, default=0.5, help="share of the requests that are abusive")
    parser.add_argument("--clients", type=positive, default=32, help="well-behaved clients at once")
    parser.add_argument("--abusive-clients", type=positive, default=8, help="abusive clients at once")
    parser.add_argument("--questions", type=positive, default=16, help="distinct synthetic test questions")
    parser.add_argument("--seed", type=int, default=7, help="synthetic test questions of this seed")
    parser.add_argument("--max-tokens", type=positive, default=24)
    parser.add_argument("--max-model-len", type=positive, default=192, help="the server's --max-model-len")
    parser.add_argument("--threads", type=positive, default=1, help="the server's torch threads (OMP_NUM_THREADS)")
    parser.add_argument("--rss-after", type=positive, default=100, help="first memory reading after this many requests")
    parser.add_argument("--time-limit", type=positive, default=900, help="seconds the load may take at most")
    parser.add_argument("--out", default="results/serve_load.json")
    args = parser.parse_args()
    if not 0 <= args.abusive_share < 1:
        parser.error(f"--abusive-share must be in [0, 1), got {args.abusive_share}")
    if args.rss_after >= args.requests:
        parser.error(f"--rss-after ({args.rss_after}) must be under --requests ({args.requests})")

    questions = [problem.prompt for problem in generate_problems("test", args.questions, args.seed)]
    kinds = schedule(args.requests, args.abusive_share)
    results = {
        "command": " ".join(["benchmarks/serve_load.py", *sys.argv[1:]]),
        "model": args.model,
        "dtype": args.dtype,
        "requests": args.requests,
        "requests_by_kind": dict(collections.Counter(kinds)),
        "clients": args.clients,
        "abusive_clients": args.abusive_clients,
        "questions": args.questions,
        "max_tokens": args.max_tokens,
        "max_model_len": args.max_model_len,
        "server_torch_threads": args.threads,
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }
    start = time.perf_counter()
    references = reference_answers(args.model, args.dtype, questions, args.max_tokens)
    results["reference_s"] = round(time.perf_counter() - start, 1)

    key = secrets.token_urlsafe(16)
    flags = ["--max-model-len", str(args.max_model_len), "--api-key", key]
    process, sync_client, name = start_server(args.model, args.dtype, flags, args.threads, api_key=key)
    errors = collections.deque(maxlen=50)  # the server's last stderr lines (read, so its pipe never fills)
    drain = threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True)
    drain.start()
    url = str(sync_client.base_url).rstrip("/").removesuffix("/v1")
    prober = HealthProber(url)
    load = Load(url, key, name, questions, args.max_tokens, args.max_model_len, process.pid, args.rss_after)
    try:
        rss_idle = resident_mb(process.pid)
        prober.start()
        start = time.perf_counter()
        try:
            asyncio.run(asyncio.wait_for(load.run(kinds, args.clients, args.abusive_clients), args.time_limit))
            results["finished_within_time_limit"] = True
        except TimeoutError:
            results["finished_within_time_limit"] = False
        results["load_s"] = round(time.perf_counter() - start, 1)
        rss_after_all = resident_mb(process.pid)
        prober.stopping.set()
        prober.join(timeout=30)
        deadline = time.monotonic() + 10  # a left stream's decoding ends within a forward pass
        try:
            while (gauges := server_gauges(url)).get("running") or gauges.get("waiting"):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except httpx2.HTTPError as error:
            gauges = {"error": f"{type(error).__name__}: {error}"}
        results["server_metrics_after"] = gauges
    finally:
        prober.stopping.set()
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=60)
    results["server_exit_status"] = process.returncode
    results["well_behaved_answers"] = compare(load.answers, references)
    results["well_behaved_latency"] = {
        "p50_s": percentile(load.latencies, 0.5),
        "p99_s": percentile(load.latencies, 0.99),
        "max_s": max(load.latencies, default=None),
    }
    results["statuses"] = {kind: dict(counts) for kind, counts in load.statuses.items()}
    results["unexpected"] = load.failures
    results["health"] = {
        "probes": len(prober.latencies),
        "failures": len(prober.failures),
        "first_failures": prober.failures[:5],
        "p50_s": percentile(prober.latencies, 0.5),
        "p99_s": percentile(prober.latencies, 0.99),
        "max_s": max(prober.latencies, default=None),
    }
    results["server_rss_mb"] = {
        "idle": rss_idle and round(rss_idle, 1),
        "after_first": load.rss_after_first_mb and round(load.rss_after_first_mb, 1),
        "after_first_requests": args.rss_after,
        "after_all": rss_after_all and round(rss_after_all, 1),
    }
    results["server_stderr_tail"] = [line.rstrip() for line in errors][-10:]
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    results["checks"] = evaluate(results)
    results["passed"] = all(results["checks"].values())
    results["checks_table"] = check_rows(results)
    write_results(results, args.out)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
