"""Fuzzing both APIs' request parsers: hostile JSON bodies end in an answer, never a 5xx.

Two levels. The parsers themselves (``parse`` of ``server/openai/request.py`` and
``server/anthropic/request.py``): any JSON value for any field they use (NaN, Infinity, huge
integers, wrong types, nesting) returns a checked request or raises the API's error, a 4xx with
a one-line message, quickly. The whole app (FastAPI's test client on a tiny model and the real
batching engine): near-valid bodies with fields replaced, and raw bytes, on every POST route:
each answered 2xx or 4xx in the route's API shape within a time bound, and a 2xx is a
well-formed reply.

``MLXINFER_FUZZ_EXAMPLES`` sets the examples per target (default 100; ``tools/fuzz.py`` runs
thousands), ``MLXINFER_FUZZ_RANDOM=1`` draws new ones instead of the suite's fixed set.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from hf_models import add_tokenizer, make_tiny
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi", reason="the server extra (FastAPI) is not installed")
pytest.importorskip("httpx", reason="httpx (FastAPI's test client) is not installed")

from fastapi.testclient import TestClient  # noqa: E402

from mlxinfer import load  # noqa: E402
from mlxinfer.server import make_app  # noqa: E402
from mlxinfer.server.anthropic import request as anthropic_request  # noqa: E402
from mlxinfer.server.openai import request as openai_request  # noqa: E402

EXAMPLES = int(os.environ.get("MLXINFER_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("MLXINFER_FUZZ_RANDOM") != "1",
    database=None,
    suppress_health_check=list(HealthCheck),
)
PARSE_S = 2.0  # most seconds a parser may take on one body
ANSWER_S = 20.0  # most seconds the app may take to answer one request (a tiny model, 4 tokens)
NAME = "tiny"

# --- JSON values ---------------------------------------------------------------------------------

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**400])
    | st.floats()  # NaN and the infinities too: a parser called directly may be given them
    | st.text(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
# What JSON can carry over HTTP: no NaN or Infinity (the app's own parser refuses them).
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


# Values of the right type, edges included, as often as any value: they take a body past its
# first field, to the checks behind it.
COUNTS = st.integers(0, 8) | st.sampled_from([2**31 - 1, 2**31])
SEEDS = st.integers(0, 2**64)
STOPS = st.lists(st.text(max_size=4), max_size=5) | st.text(max_size=4)


def _messages(values, roles, blocks):
    block = st.fixed_dictionaries(
        {"type": st.sampled_from(blocks)},
        optional={
            "text": st.text(max_size=20) | values,
            "id": values,
            "name": st.text(max_size=8) | values,
            "input": values,
            "content": st.text(max_size=12) | values,
            "tool_use_id": values,
        },
    )
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(roles[:2]) | st.sampled_from(roles),
            "content": st.text(max_size=30) | st.lists(block, max_size=3) | values,
        },
        optional={
            "tool_calls": values
            | st.lists(st.dictionaries(st.text(max_size=8), values, max_size=3), max_size=2),
            "tool_call_id": values,
        },
    )
    return st.lists(message, max_size=3) | values


def _schema(values):
    return st.fixed_dictionaries(
        {"type": st.sampled_from(["object", "string", "integer", "array", "x"]) | values},
        optional={
            "properties": st.dictionaries(st.text(max_size=6), values, max_size=3) | values,
            "required": values,
            "items": values,
            "enum": values,
        },
    )


def _openai_fields(values, chat: bool = True):
    tools = (
        st.lists(
            st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["function", "x"]),
                    "function": st.fixed_dictionaries(
                        {"name": st.text(max_size=8) | values},
                        optional={"parameters": _schema(values) | values, "description": values},
                    ),
                },
            ),
            max_size=2,
        )
        | values
    )
    return {
        "model": st.just(NAME) | values,
        ("messages" if chat else "prompt"): _messages(
            values, ["user", "system", "developer", "assistant", "tool", "x"], ["text", "image_url"]
        )
        if chat
        else st.text(max_size=30) | values,
        "max_tokens": COUNTS | values,
        "max_completion_tokens": COUNTS | values,
        "temperature": st.floats(0, 2) | values,
        "top_p": st.floats(0, 1) | values,
        "top_k": st.integers(0, 400) | values,
        "min_p": st.floats(0, 1) | values,
        "seed": SEEDS | values,
        "n": st.integers(-2, 20) | values,
        "stop": STOPS | values,
        "stream": st.booleans() | values,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": values}) | values,
        "logprobs": st.booleans() | st.integers(0, 6) | values,
        "top_logprobs": st.integers(0, 21) | values,
        "tools": tools,
        "tool_choice": st.sampled_from(["auto", "none", "required"])
        | st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries({"name": st.text(max_size=8) | values}),
            }
        )
        | values,
        "parallel_tool_calls": values,
        "response_format": st.fixed_dictionaries(
            {"type": st.sampled_from(["json_object", "json_schema", "text", "x"]) | values},
            optional={
                "json_schema": st.fixed_dictionaries(
                    {"name": values},
                    optional={"schema": _schema(values) | values, "strict": values},
                )
                | values
            },
        )
        | values,
        "reasoning_effort": st.sampled_from(["low", "high", "x"]) | values,
        "chat_template_kwargs": values,
        "user": values,
        "logit_bias": values,
    }


def _anthropic_fields(values):
    tools = (
        st.lists(
            st.fixed_dictionaries(
                {"name": st.text(max_size=8) | values},
                optional={"description": values, "input_schema": _schema(values) | values},
            ),
            max_size=2,
        )
        | values
    )
    return {
        "model": st.just(NAME) | values,
        "messages": _messages(
            values,
            ["user", "assistant", "x"],
            ["text", "tool_use", "tool_result", "thinking", "image"],
        ),
        "system": st.text(max_size=20) | values,
        "max_tokens": COUNTS | values,
        "stop_sequences": STOPS | values,
        "stream": st.booleans() | values,
        "temperature": st.floats(0, 1) | values,
        "top_p": st.floats(0, 1) | values,
        "top_k": st.integers(0, 400) | values,
        "metadata": values,
        "tools": tools,
        "tool_choice": st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
            optional={"name": st.text(max_size=8) | values},
        )
        | values,
        "thinking": st.fixed_dictionaries(
            {"type": st.sampled_from(["enabled", "disabled", "x"])},
            optional={"budget_tokens": values},
        )
        | values,
        "mcp_servers": values,
    }


def _bodies(base: dict, fields: dict):
    """``base`` with some fields replaced by drawn values and some removed, or any value."""
    changed = st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: fields[n] for n in names})
    )
    dropped = st.one_of(st.just(set()), st.just(set()), st.sets(st.sampled_from(sorted(base))))
    body = st.tuples(changed, dropped).map(
        lambda cd: {k: v for k, v in {**base, **cd[0]}.items() if k not in cd[1]}
    )
    return st.one_of(body, body, body, VALUES)  # a body that is not an object now and then


OPENAI_BASE = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
COMPLETION_BASE = {"model": NAME, "prompt": "Hi", "max_tokens": 3}
ANTHROPIC_BASE = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def _one_line(message: str) -> None:
    assert isinstance(message, str) and message and "\n" not in message, message
    assert len(message) < 1000, message[:200]


# --- the parsers ---------------------------------------------------------------------------------


# Cases found before, kept: NaN was sampled with, an int past float range raised OverflowError,
# int(inf) too, a field name with a newline made a two-line message.
OPENAI_FOUND = [
    (True, {**OPENAI_BASE, "temperature": math.nan}),
    (False, {**COMPLETION_BASE, "top_p": 10**400}),
    (True, {**OPENAI_BASE, "a\nb": 1}),
]
ANTHROPIC_FOUND = [
    {**ANTHROPIC_BASE, "top_k": math.inf},
    {**ANTHROPIC_BASE, "temperature": math.nan},
    {**ANTHROPIC_BASE, "\n": 0},
]
OPENAI_CASES = st.booleans().flatmap(
    lambda chat: st.tuples(
        st.just(chat),
        _bodies(OPENAI_BASE if chat else COMPLETION_BASE, _openai_fields(VALUES, chat)),
    )
)


@FUZZ
@given(case=OPENAI_CASES)
@example(case=OPENAI_FOUND[0]).via("found before")
@example(case=OPENAI_FOUND[1]).via("found before")
@example(case=OPENAI_FOUND[2]).via("found before")
def test_fuzz_openai_parser(case):
    chat, body = case
    t = time.perf_counter()
    try:
        ask = openai_request.parse(body, chat=chat)
    except openai_request.OpenAIError as e:
        assert 400 <= e.status < 500, e.message
        _one_line(e.message)
        event(f"refused {e.status}")
    else:
        event("accepted")
        assert ask.max_tokens >= 1 and 1 <= ask.n <= openai_request.MAX_N
        assert 0 <= ask.sampling.temperature <= 2 and 0 < ask.sampling.top_p <= 1
        assert 0 <= ask.sampling.min_p < 1 and ask.sampling.top_k >= 0
    assert time.perf_counter() - t < PARSE_S


@FUZZ
@given(body=_bodies(ANTHROPIC_BASE, _anthropic_fields(VALUES)), count_only=st.booleans())
@example(body=ANTHROPIC_FOUND[0], count_only=False).via("found before")
@example(body=ANTHROPIC_FOUND[1], count_only=False).via("found before")
@example(body=ANTHROPIC_FOUND[2], count_only=True).via("found before")
def test_fuzz_anthropic_parser(body, count_only):
    t = time.perf_counter()
    try:
        ask = anthropic_request.parse(body, count_only=count_only)
    except anthropic_request.AnthropicError as e:
        assert 400 <= e.status < 500, e.message
        _one_line(e.message)
        event(f"refused {e.status}")
    else:
        event("accepted")
        assert isinstance(ask.messages, list) and isinstance(ask.model, str)
        assert count_only or (ask.max_tokens >= 1 and 0 <= ask.sampling.temperature <= 1)
        assert count_only or (0 < ask.sampling.top_p <= 1 and isinstance(ask.sampling.top_k, int))
    assert time.perf_counter() - t < PARSE_S


# --- the app -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("fuzz_api"), vocab_size=320, hidden_size=64)
    add_tokenizer(path)
    model, tokenizer = load(str(path))
    with TestClient(make_app(model, tokenizer, NAME, max_batch=4)) as c:
        yield c


def _short(body):
    """At most 4 tokens a choice and 2 choices: the fuzz is of the parsing, not of generation."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 4:
                body[key] = 4
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
            body["n"] = 2
    return body


ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"]
RAW = st.binary(max_size=64) | st.sampled_from(
    [
        b"",
        b"[" * 3000,
        b'{"model": "tiny", "temperature": NaN}',
        b'{"model": "tiny", "max_tokens": 1e999}',
        b'{"model": "tiny", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"model": "tiny", "messages": "\xff"}',
        b"\xef\xbb\xbf{}",
        b'\x00{"a": 1}',
    ]
)


def _request(route: str):
    if route.startswith("/v1/messages"):
        fields = _anthropic_fields(WIRE)
        return _bodies(ANTHROPIC_BASE, fields).map(lambda b: json.dumps(_short(b)).encode())
    chat = route == "/v1/chat/completions"
    base = OPENAI_BASE if chat else COMPLETION_BASE
    return _bodies(base, _openai_fields(WIRE, chat)).map(lambda b: json.dumps(_short(b)).encode())


@settings(FUZZ, max_examples=max(1, EXAMPLES // 2))
@given(data=st.data())
def test_fuzz_the_app_answers_every_body_in_its_apis_shape(client, data):
    route = data.draw(st.sampled_from(ROUTES), label="route")
    raw = data.draw(_request(route) | RAW, label="body")
    t = time.perf_counter()
    r = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert time.perf_counter() - t < ANSWER_S
    assert r.status_code < 500, r.text[:500]
    event(f"{route} {r.status_code}")
    if r.status_code >= 400:
        body = r.json()
        if route.startswith("/v1/messages"):
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
            _one_line(body["error"]["message"])
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
            _one_line(body["error"]["message"])
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        data_lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert data_lines, r.text[:300]
        for line in data_lines:
            if line != "[DONE]":
                chunk = json.loads(line)
                assert "error" not in chunk, chunk  # a failure inside the stream
    else:
        assert isinstance(r.json(), dict)
