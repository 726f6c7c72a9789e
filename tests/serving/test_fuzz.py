"""Request bodies from schemathesis, over 127.0.0.1: `refusion serve`'s OpenAPI document describes its two completion
routes with OpenAI's request schemas (serve's types, the ones requests are validated against); schemathesis draws
bodies that follow them and bodies that break them (a fixed number per route, derandomized), and every answer must
be a non-5xx whose 4xx names what it refuses. First, wrong-type bodies that transformers serve answered 500 or took.
Model: the official-layout folder built from the tiny fixture, with a 24-token context so that accepted bodies
decode briefly."""

import httpx2
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from refusion_hf.serving.app import build_app
from tests.official_layout import build_official_layout
from tests.serving.servers import running

TIMEOUT = 60  # seconds, per request
MESSAGES = [{"role": "user", "content": "t9"}]
# Bodies of the right shape with one field of a wrong type (or value), each a 500 from transformers serve.
WRONG_TYPES = [
    ("/v1/chat/completions", {"messages": 5}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "t9"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "t9"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": "many"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/v1/completions", {"prompt": "t9", "top_p": "x"}, "top_p"),
    ("/v1/completions", {"prompt": "t9", "max_tokens": [1]}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [5]}, "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": 5}, "stop"),
]
# Wrong types that transformers serve silently takes (200): refused here too, by OpenAI's request schema.
SILENTLY_TAKEN = [
    ("/v1/chat/completions", {"messages": [{"role": 5, "content": "t9"}], "max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": "yes", "max_tokens": 2}, "stream"),
    ("/v1/completions", {"prompt": "t9", "seed": "7", "max_tokens": 2}, "seed"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build_official_layout(tmp_path_factory.mktemp("official") / "model"))


def test_wrong_types_are_4xx_naming_the_field(folder):
    app, state = build_app(folder, dtype="float32", device="cpu")
    with running(app) as url, httpx2.Client(base_url=url, timeout=TIMEOUT) as http:
        for path, body, field in WRONG_TYPES + SILENTLY_TAKEN:
            refused = http.post(path, json=body)
            assert 400 <= refused.status_code < 500 and field in refused.json()["detail"], (body, refused.text)
    state.shutdown()


def test_an_empty_logit_bias_is_no_bias(folder):
    """`logit_bias: {}` biases nothing (OpenAI's meaning): the answer without it (serve's own config refused it with
    a message naming `sequence_bias`, which schemathesis found)."""
    app, state = build_app(folder, dtype="float32", device="cpu")
    with running(app) as url, httpx2.Client(base_url=url, timeout=TIMEOUT) as http:
        body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}
        plain, empty = (http.post("/v1/chat/completions", json={**body, **extra}) for extra in ({}, {"logit_bias": {}}))
        assert plain.status_code == empty.status_code == 200, (plain.text, empty.text)
        assert empty.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    state.shutdown()


def test_stop_strings_the_tokenizer_cannot_match_are_a_4xx_naming_stop(folder):
    """The fixture's word-level vocabulary is one transformers' StopStringCriteria cannot read (schemathesis found
    the bare "substring not found" it raised): a 400 naming the field, and the server answers the next request."""
    app, state = build_app(folder, dtype="float32", device="cpu")
    with running(app) as url, httpx2.Client(base_url=url, timeout=TIMEOUT) as http:
        refused = http.post("/v1/completions", json={"prompt": "t9", "stop": ["t9"], "max_tokens": 2})
        assert refused.status_code == 400 and "stop_strings" in refused.json()["detail"], refused.text
        assert "StopStringCriteria cannot read" in refused.json()["detail"], refused.text
        assert http.post("/v1/completions", json={"prompt": "t9", "max_tokens": 2}).status_code == 200
    state.shutdown()


@pytest.fixture(scope="module")
def served_schema(folder):
    app, state = build_app(folder, dtype="float32", device="cpu", max_model_len=24)
    with running(app) as url:
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")
    state.shutdown()


def names_what_it_refuses(body, text: str) -> bool:
    """A 4xx names a field of the body (or, for a body that is not an object, the body itself)."""
    if isinstance(body, dict) and body:
        return any(str(key) in text for key in body) or "messages" in text or "prompt" in text
    return "body" in text or "messages" in text or "prompt" in text


@pytest.mark.parametrize("mode", list(GenerationMode), ids=str)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_generated_bodies_get_no_server_error(served_schema, path, mode):
    """schemathesis' strategy for the route's request, driven by hypothesis (30 bodies, derandomized); schemathesis'
    own pytest plugin is not used (it does not run under this pytest)."""
    operation = served_schema[path]["POST"]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=30,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def answers(case):
        response = case.call(timeout=TIMEOUT)
        assert response.status_code < 500, (case.body, response.text[:500])
        if response.status_code >= 400:
            assert names_what_it_refuses(case.body, response.text), (case.body, response.text[:500])

    answers()
