"""Fuzzing Ollama's request parsers and routes: hostile JSON ends in an answer, never a 5xx.

The parsers (``server/ollama/request.py``): any JSON value for any field they read, the options'
included (NaN, the infinities, huge integers, wrong types, nesting) gives a checked request or
Ollama's error, a 4xx with a one-line message, quickly. The routes (FastAPI's test client on a
tiny model and the real engine): near-valid bodies with one field replaced, each answered 2xx or
4xx in Ollama's shape within a time bound. ``MLXINFER_FUZZ_EXAMPLES`` sets the examples per
target, as tests/hostile/test_fuzz_api.py's."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_toolcalls import _tiny
from tool_templates import HERMES

pytest.importorskip("fastapi", reason="the server extra (FastAPI) is not installed")
from fastapi.testclient import TestClient  # noqa: E402

from mlxinfer.server import make_app  # noqa: E402
from mlxinfer.server.ollama import request as ollama_request  # noqa: E402
from mlxinfer.server.ollama.request import OllamaError  # noqa: E402

EXAMPLES = int(os.environ.get("MLXINFER_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("MLXINFER_FUZZ_RANDOM") != "1",
    database=None,
    suppress_health_check=list(HealthCheck),
)
PARSE_S, ANSWER_S = 2.0, 20.0
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, -2, 2**31, 2**63, 10**400, "", "json", "5m", "-1", "low"])
    | st.floats()
    | st.text(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
WIRE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "stream": False, "options": {"num_predict": 2}}
GENERATE = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
FIELDS = ["model", "messages", "prompt", "system", "raw", "images", "stream", "format", "options",
          "keep_alive", "think", "tools", "suffix", "template", "context", "logprobs"]  # fmt: skip
OPTIONS = ["temperature", "top_p", "top_k", "min_p", "seed", "stop", "num_predict", "num_ctx",
           "repeat_penalty", "repeat_last_n", "presence_penalty", "typical_p", "num_gpu"]  # fmt: skip
TOOL_CALL = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}


def _parsed_or_refused(parse, body) -> None:
    t0 = time.perf_counter()
    try:
        parse(body)
    except OllamaError as e:
        assert 400 <= e.status < 500 and "\n" not in e.message and e.body() == {"error": e.message}
    assert time.perf_counter() - t0 < PARSE_S


@FUZZ
@given(st.sampled_from(FIELDS), VALUES, st.sampled_from(OPTIONS), VALUES)
@example("keep_alive", 10**400, "temperature", 10**400)  # past float range: no OverflowError
@example("keep_alive", float("nan"), "seed", -(10**400))
@example("keep_alive", "1h30m5x", "num_ctx", 0.5)
@example("format", {"type": "nonsense"}, "stop", [None])
@example("messages", [{"role": "tool", "tool_name": 5}], "repeat_last_n", -2)
def test_the_parsers_check_any_value_of_any_field(field, value, option, option_value):
    for parse, base in (
        (ollama_request.parse_chat, CHAT),
        (ollama_request.parse_generate, GENERATE),
    ):
        _parsed_or_refused(parse, {**base, field: value})
        _parsed_or_refused(parse, {**base, "options": {option: option_value}})
    _parsed_or_refused(ollama_request.parse_chat, {**CHAT, "messages": [TOOL_CALL, value]})
    _parsed_or_refused(ollama_request.parse_embed, {"model": "e", "input": value, field: value})
    _parsed_or_refused(lambda b: ollama_request.parse_keep_alive(b["k"]), {"k": value})


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = make_app(*_tiny(tmp_path_factory.mktemp("ollama-fuzz"), HERMES), "tiny", max_batch=4)
    with TestClient(app) as c:
        yield c


@FUZZ
@given(
    st.sampled_from(["/api/chat", "/api/generate", "/api/embed", "/api/show"]),
    st.sampled_from(FIELDS + ["input", "name"]),
    WIRE,
    st.sampled_from(OPTIONS),
    WIRE,
)
def test_the_routes_answer_hostile_bodies_in_ollamas_shape(client, path, field, value, option, opt):
    base = GENERATE if path == "/api/generate" else CHAT
    for body in ({**base, field: value}, {**base, "options": {"num_predict": 2, option: opt}}):
        t0 = time.perf_counter()
        r = client.post(path, json=body)
        assert time.perf_counter() - t0 < ANSWER_S
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str), r.text
        elif path in ("/api/chat", "/api/generate"):
            lines = [line for line in r.text.splitlines() if line]
            assert '"done": true' in lines[-1] or '"done":true' in lines[-1], r.text
