"""`refusion serve`'s `/metrics`: Prometheus's text format, through prometheus-client (its metric types, registry and
exposition). One registry per app, so that several apps in one process (the tests) keep their own counts.

Where each is measured: requests running / waiting by the decoding worker (`decoding.py`: waiting from admission to
the start of their decoding); prompt tokens by the handler once a request is admitted; generated tokens when an
answer is complete; forward passes by a forward hook on the model (torch's `register_forward_hook`); time to first
token for every answered request (`handler.py`: from the request's arrival to its answer's first final piece,
streamed or not, with or without continuous batching); end-to-end latency and the answers by status class by the
app's ASGI gate (`app.py`: from the request's arrival to the last byte of its answer). Tokens per forward pass is
`refusion_generation_tokens_total / refusion_forward_passes_total`.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, float("inf"))


class ServerMetrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.running = Gauge("refusion_requests_running", "Requests decoding now.", registry=registry)
        self.waiting = Gauge("refusion_requests_waiting", "Requests waiting for their decoding.", registry=registry)
        self.prompt_tokens = Counter("refusion_prompt_tokens", "Prompt tokens of admitted requests.", registry=registry)
        self.generation_tokens = Counter(
            "refusion_generation_tokens", "Tokens of the answers completed.", registry=registry
        )
        self.forward_passes = Counter("refusion_forward_passes", "Forward passes of the model.", registry=registry)
        self.time_to_first_token = Histogram(
            "refusion_time_to_first_token_seconds",
            "From a request's arrival to its answer's first final token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "refusion_e2e_request_latency_seconds",
            "From a completion request's arrival to the last byte of its answer.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.responses = Counter(
            "refusion_http_responses", "Answers by status class (2xx, 4xx, 5xx).", ["status"], registry=registry
        )

    def count_forwards(self, model) -> None:
        model.register_forward_hook(lambda module, args, output: self.forward_passes.inc())

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
