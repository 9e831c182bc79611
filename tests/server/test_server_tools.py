"""Tool calls through ``mlxinfer serve``: the official ``openai`` and ``anthropic`` clients
against a tiny model with a Hermes (Qwen-style) chat template."""

from __future__ import annotations

import json

import pytest
from servers import serving
from test_toolcalls import ADD, ASK, TOOLS, WEATHER, _tiny
from tool_templates import HERMES

openai = pytest.importorskip("openai", reason="the openai client is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the validator) is missing")
import httpx  # noqa: E402

from mlxinfer.server import make_app  # noqa: E402

NAME = "tiny-tools"
WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model, tokenizer = _tiny(tmp_path_factory.mktemp("tools"), HERMES)
    with serving(make_app(model, tokenizer, NAME)) as base:
        yield base


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def test_a_named_tool_choice_returns_a_call_whose_arguments_validate(url):
    ask = dict(
        model=NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice=WEATHER_CHOICE,
        max_tokens=300,
        temperature=0,
    )
    r = _client(url).chat.completions.create(**ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    chunks = list(_client(url).chat.completions.create(**ask, stream=True))
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
    assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)
    assert deltas[0].id.startswith("call_")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # no raw call text


def test_required_picks_one_of_the_tools_and_the_result_goes_back(url):
    client = _client(url)
    r = client.chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "add")
    jsonschema.validate(
        json.loads(call.function.arguments), WEATHER if call.function.name == "get_weather" else ADD
    )
    # The call and the tool's answer sent back: the model answers (whatever it says).
    follow = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    r = client.chat.completions.create(model=NAME, messages=follow, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_bad_tools_and_tool_choice_are_400s_naming_them(url):
    for body, param in (
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ):
        r = httpx.post(
            f"{url}/v1/chat/completions", json={"model": NAME, "messages": ASK, **body}, timeout=60
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_anthropic_tools_give_tool_use_blocks(url):
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed")
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    ask = dict(
        model=NAME,
        max_tokens=300,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "tool", "name": "add"},
        extra_body={"temperature": 0},
    )
    r = client.messages.create(**ask)
    assert r.stop_reason == "tool_use"
    [block] = [b for b in r.content if b.type == "tool_use"]
    assert block.name == "add" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, ADD)
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == "add" and streamed.input == block.input
    assert final.stop_reason == "tool_use"
    # The call and its result sent back as Anthropic blocks.
    follow = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "3"}],
        },
    ]
    r = client.messages.create(model=NAME, max_tokens=8, messages=follow, tools=tools)
    assert r.stop_reason in ("max_tokens", "end_turn", "tool_use")
    count = client.messages.count_tokens(model=NAME, messages=ASK, tools=tools)
    assert count.input_tokens > client.messages.count_tokens(model=NAME, messages=ASK).input_tokens
