"""`/metrics` over 127.0.0.1, read with prometheus-client's own parser: requests running and waiting while two
requests are in flight (one decodes, one waits: forwards slowed by a hook of the test), then prompt and generated
tokens equal to the answers' `usage`, forward passes equal to the model's forwards counted from outside, time to
first token for every answered request (streamed or not), end-to-end latency for every completion request, answers
by status class. Model: the official-layout folder built from the tiny fixture."""

import json
import threading
import time

import httpx2
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from refusion_hf.modeling.modeling_refusion import RefusionForCausalLM
from refusion_hf.serving.app import build_app
from tests.official_layout import build_official_layout
from tests.serving.servers import running, slowed_forwards

TIMEOUT = 60


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build_official_layout(tmp_path_factory.mktemp("official") / "model"))


def scrape(http) -> dict[str, float]:
    """Every sample of `/metrics`, by name (with its labels, if any, as `name{label=value}`)."""
    text = http.get("/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                continue
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def test_metrics(folder):
    forwards = []
    counting = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: forwards.append(1) if isinstance(module, RefusionForCausalLM) else None
    )
    app, state = build_app(folder, dtype="float32", device="cpu")
    try:
        with running(app) as url, httpx2.Client(base_url=url, timeout=TIMEOUT) as http:
            # two requests in flight, decoding one at a time: one runs, the other waits
            with slowed_forwards(RefusionForCausalLM, 0.05):
                replies = []
                clients = [
                    threading.Thread(
                        target=lambda: replies.append(
                            httpx2.post(
                                f"{url}/v1/completions", json={"prompt": "t9 t10", "max_tokens": 24}, timeout=TIMEOUT
                            )
                        )
                    )
                    for _ in range(2)
                ]
                for client in clients:
                    client.start()
                deadline = time.monotonic() + 30
                while (busy := scrape(http))["refusion_requests_waiting"] == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert (busy["refusion_requests_running"], busy["refusion_requests_waiting"]) == (1, 1), busy
                for client in clients:
                    client.join(TIMEOUT)
            usages = [reply.json()["usage"] for reply in replies]

            streamed = []
            with http.stream(
                "POST",
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "t9"}], "max_tokens": 8, "stream": True},
            ) as reply:
                streamed = [line for line in reply.iter_lines() if '"usage"' in line]
            usages.append(json.loads(streamed[-1].removeprefix("data: "))["usage"])
            assert http.post("/v1/completions", json={"prompt": "t9", "max_tokens": 9999}).status_code == 400
            assert http.post("/v1/completions", json={"model": "other", "prompt": "t9"}).status_code == 404
            seen = scrape(http)
    finally:
        counting.remove()
    state.shutdown()

    assert seen["refusion_prompt_tokens_total"] == sum(usage["prompt_tokens"] for usage in usages)
    assert seen["refusion_generation_tokens_total"] == sum(usage["completion_tokens"] for usage in usages)
    assert seen["refusion_forward_passes_total"] == len(forwards) > 0
    assert (seen["refusion_requests_running"], seen["refusion_requests_waiting"]) == (0, 0)
    assert seen["refusion_time_to_first_token_seconds_count"] == 3  # the answered requests, streamed or not
    assert seen["refusion_e2e_request_latency_seconds_count"] == 5  # every completion request, refused ones too
    # the answers before this scrape: 3 completions and the scrapes in flight (2xx), a 400 and a 404 (4xx)
    assert seen["refusion_http_responses_total{status=4xx}"] == 2
    assert "refusion_http_responses_total{status=5xx}" not in seen
