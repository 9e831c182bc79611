"""``POST /v1/responses`` (mlxinfer/server/responses/) through the official ``openai`` client.

Spec: text, a function-call round trip and a JSON Schema ``text.format`` on a tiny model (its
greedy text equal to the library's, its calls and JSON valid against their schemas); a
reasoning model's thoughts as a ``reasoning`` item and its answer as the message; the stream's
events in the documented order, each one validating as the client's own type, accumulated by
the client's ``responses.stream``; a namespace's functions shown to the model under
``NS__NAME`` and called back by name and namespace, a custom (freeform) tool's call as a
``custom_tool_call``, hosted tools left out; Codex 0.171's captured first request answered
with a stream that parses; ``previous_response_id`` and malformed items 400s naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripted import ScriptedEngine
from servers import serving
from test_toolcalls import WEATHER
from tiny_checkpoint import write_checkpoint
from tool_templates import HERMES

openai = pytest.importorskip("openai", reason="the openai client is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the validator) is missing")
pytest.importorskip("llguidance", reason="llguidance (the constraints that force the output)")
import httpx  # noqa: E402
import pydantic  # noqa: E402
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

from mlxinfer import generate, load  # noqa: E402
from mlxinfer.batch import EngineError  # noqa: E402
from mlxinfer.generation.results import GenerationResult, GenerationStats  # noqa: E402
from mlxinfer.server import make_app  # noqa: E402

NAME = "tiny"
CODEX = Path(__file__).parents[1] / "fixtures" / "codex_request.json"
# Hermes calls and Qwen3's thinking switch: one template with both, as Qwen3's own has.
QWEN3ISH = HERMES.replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- endif %}{%- endif %}",
)
WEATHER_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
THOUGHT = "<think>\nThe capital is\nParis.\n</think>\n\nParis."
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama written by mlxinfer itself (no torch: milliseconds)."""
    path = write_checkpoint(tmp_path_factory.mktemp("responses"), max_position_embeddings=4096)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3ISH
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    model, tokenizer = load(str(path))
    assert "enable_thinking" in tokenizer.chat_template_source()
    return model, tokenizer


@pytest.fixture(scope="module")
def url(tiny):
    model, tokenizer = tiny
    with serving(make_app(model, tokenizer, NAME)) as base:
        yield base


class Scripted(ScriptedEngine):
    """Answers with ``reply`` three characters a token; records each request's prompt and
    options."""

    reply = "Hello."

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[dict] = []

    def start(self, tokenizer, prompt, **options):
        self.asked.append({"prompt": prompt, **options})
        return super().start(tokenizer, prompt, **options)

    def stream(self, tokenizer, prompt, *, max_tokens, **options):
        pieces = [self.reply[i : i + 3] for i in range(0, len(self.reply), 3)]
        stats = GenerationStats(prompt_tokens=7)
        for i, piece in enumerate(pieces):
            if i == 1 and self.reply.startswith("FAIL"):
                raise EngineError("the engine stopped")
            last = i == len(pieces) - 1
            yield GenerationResult(piece, i, finish_reason="stop" if last else None, stats=stats)


@pytest.fixture(scope="module")
def scripted(tiny):
    model, tokenizer = tiny
    engine = Scripted()
    with serving(make_app(model, tokenizer, NAME, engine=engine)) as base:
        yield base, engine


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


# --- a tiny model ------------------------------------------------------------------------------


def test_text_and_instructions_as_the_library_generates_them(url, tiny):
    model, tokenizer = tiny
    r = _client(url).responses.create(
        model=NAME,
        instructions="Be brief.",
        input="Hello there",
        max_output_tokens=12,
        temperature=0,
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    messages[1]["content"] = "Hello there"
    assert r.output_text == generate(model, tokenizer, messages, max_tokens=12)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    from mlxinfer.generation.loop import prepare_prompt

    prompt = prepare_prompt(tokenizer, messages, chat_template=True)
    assert r.usage.input_tokens == len(prompt) and r.usage.output_tokens == 12
    assert r.usage.total_tokens == len(prompt) + 12
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # reasoning.effort "none" reaches the template's switch: its empty thought is in the prompt
    off = _client(url).responses.create(
        model=NAME, input="Hello there", max_output_tokens=1, reasoning={"effort": "none"}
    )
    on = _client(url).responses.create(model=NAME, input="Hello there", max_output_tokens=1)
    assert off.usage.input_tokens > on.usage.input_tokens


def test_a_function_call_round_trip(url, tiny):
    _, tokenizer = tiny
    client = _client(url)
    ask = "What is the weather in Paris?"
    r = client.responses.create(
        model=NAME,
        input=ask,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
    )
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER)
    Response.model_validate(r.model_dump())  # every required field, strictly

    history = [
        {"role": "user", "content": ask},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    second = client.responses.create(
        model=NAME, input=history, tools=[WEATHER_TOOL], max_output_tokens=2
    )
    assert second.status in ("completed", "incomplete")
    from mlxinfer.generation.loop import prepare_prompt

    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    expected = [
        {"role": "user", "content": ask},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "id": call.call_id,
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": call.call_id},
    ]
    prompt = prepare_prompt(tokenizer, expected, chat_template=True, tools=chat_tools)
    assert second.usage.input_tokens == len(prompt)


def test_a_json_schema_format_is_followed(url):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "trip", "schema": schema, "strict": True}
    r = _client(url).responses.create(
        model=NAME, input="Where to?", text={"format": fmt}, max_output_tokens=100
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


# --- a scripted model ----------------------------------------------------------------------


def _events(url: str, body: dict) -> list[dict]:
    """The raw SSE events of a streamed request, each validated as the client's own type."""
    r = httpx.post(f"{url}/v1/responses", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events, kind = [], None
    for line in r.text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            assert event["type"] == kind
            EVENTS.validate_python(event)
            events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_reasoning_is_an_item_of_its_own(scripted):
    url, engine = scripted
    engine.reply = THOUGHT
    r = _client(url).responses.create(model=NAME, input="Where?")
    Response.model_validate(r.model_dump())
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "The capital is\nParis." and r.output_text == "Paris."
    tokens = -(-len(THOUGHT) // 3)
    # every token before the one the answer starts in is a reasoning token
    assert r.usage.output_tokens == tokens
    assert r.usage.output_tokens_details.reasoning_tokens == THOUGHT.rindex("Paris.") // 3

    with _client(url).responses.stream(model=NAME, input="Where?") as stream:
        events = list(stream)
        final = stream.get_final_response()
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, answer) == ("The capital is\nParis.", "Paris.")
    assert final.output_text == "Paris." and final.output[0].type == "reasoning"


def test_an_engine_failure_is_response_failed_or_a_500(scripted):
    url, engine = scripted
    engine.reply = "FAIL after the first token"
    events = _events(url, {"model": NAME, "input": "Hi"})
    assert [e["type"] for e in events][-1] == "response.failed"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "engine stopped" in failed.error.message
    r = httpx.post(f"{url}/v1/responses", json={"model": NAME, "input": "Hi"}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


NAMESPACE = {
    "type": "namespace",
    "name": "crm",
    "description": "The customer database",
    "tools": [
        {
            "type": "function",
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}},
        }
    ],
}
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "x"'},
}
CALLS = (
    'Let me look.<tool_call>\n{"name": "crm__lookup", "arguments": {"id": 7}}\n</tool_call>'
    '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n"}}\n'
    "</tool_call>"
)


def test_the_stream_order_namespaces_and_custom_tools(scripted):
    url, engine = scripted
    engine.reply = CALLS
    tools = [NAMESPACE, PATCH, {"type": "web_search"}]
    body = {"model": NAME, "input": "Find 7", "tools": tools}
    events = _events(url, body)
    shown = [t["function"]["name"] for t in engine.asked[-1]["tools"]]
    assert shown == ["crm__lookup", "apply_patch"]  # the hosted web_search has no local meaning
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = Response.model_validate(events[-1]["response"])
    message, call, custom = final.output
    assert message.content[0].text == "Let me look."
    assert (call.name, call.namespace, json.loads(call.arguments)) == ("lookup", "crm", {"id": 7})
    assert (custom.type, custom.name, custom.input) == (
        "custom_tool_call",
        "apply_patch",
        "*** Begin Patch\n",
    )
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [
        0,
        1,
        2,
    ]

    with _client(url).responses.stream(model=NAME, input="Find 7", tools=tools) as stream:
        parsed = stream.get_final_response()
    assert [item.type for item in parsed.output] == ["message", "function_call", "custom_tool_call"]

    # allowed_tools narrows what the model is shown; a namespaced function is named with its
    # namespace
    allowed = {
        "type": "allowed_tools",
        "mode": "auto",
        "tools": [{"type": "function", "name": "lookup", "namespace": "crm"}],
    }
    _client(url).responses.create(model=NAME, input="Find 7", tools=tools, tool_choice=allowed)
    assert [t["function"]["name"] for t in engine.asked[-1]["tools"]] == ["crm__lookup"]

    # the calls go back as input items: the model sees its own flat names again
    engine.reply = "Done."
    history = [
        {"role": "user", "content": "Find 7"},
        {k: call.model_dump()[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Ann"},
        {
            "type": "custom_tool_call",
            "call_id": custom.call_id,
            "name": "apply_patch",
            "input": "x",
        },
        {"type": "custom_tool_call_output", "call_id": custom.call_id, "output": "ok"},
    ]
    r = _client(url).responses.create(model=NAME, input=history, tools=tools)
    assert r.output_text == "Done."
    prompt = engine.asked[-1]["prompt"]
    assert [m["role"] for m in prompt] == ["user", "assistant", "tool", "assistant", "tool"]
    assert prompt[1]["tool_calls"][0]["function"] == {"name": "crm__lookup", "arguments": {"id": 7}}
    assert prompt[3]["tool_calls"][0]["function"]["arguments"] == {"input": "x"}


def test_codex_first_request_is_answered(scripted):
    """Codex 0.171.0's captured first request (tests/fixtures/codex_request.json) gets a stream
    Codex parses: its developer messages as system messages, its function and custom tools
    shown, its hosted ones (web_search, tool_search) left out, its other fields ignored."""
    url, engine = scripted
    engine.reply = THOUGHT
    captured = json.loads(CODEX.read_text())
    body = {**captured["body"], "model": NAME}  # Codex names gpt-5.5: aliases are serve's
    assert body["stream"] is True and body["store"] is False and "client_metadata" in body
    events = _events(url, body)
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in done] == ["reasoning", "message"]
    assert events[-1]["response"]["usage"]["input_tokens"] == 7
    asked = engine.asked[-1]
    roles = [m["role"] for m in asked["prompt"]]
    developer = [i for i in body["input"] if i["role"] == "developer"]
    assert roles == ["system"] * len(developer) + ["user"] * (len(body["input"]) - len(developer))
    texts = [p["text"] for p in developer[1]["content"]]
    assert asked["prompt"][1]["content"] == "".join(texts)
    kept = [t["name"] for t in body["tools"] if t["type"] in ("function", "custom")]
    assert [t["function"]["name"] for t in asked["tools"]] == kept
    assert asked["chat_template_kwargs"]["reasoning_effort"] == "medium"


def test_previous_response_id_and_malformed_input_are_400s_naming_the_field(scripted):
    url, engine = scripted
    engine.reply = "Hi."
    client = _client(url)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input="Hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    assert "stateless" in e.value.body["message"]
    too_many = [{"role": "user", "content": "x"}] * 10_001
    many = [{"type": "function", "name": f"f{i}"} for i in range(1_001)]
    cases = [
        ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [{}]}]}, None),
        (
            {"input": [{"role": "user", "content": "a"}, {"content": [{"type": "input_text"}]}]},
            "input[1].role",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": [{"type": "input_text", "text": 5}]},
                ]
            },
            "input[1].content[0].text",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].image_url",  # a data URL only: this server fetches nothing
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": too_many}, "input"),
        ({"input": 5}, "input"),
        ({"input": "Hi", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "Hi", "tools": [{"type": "namespace", "name": "n", "tools": many}]}, "tools"),
        ({"input": "Hi", "tools": [{"type": "namespace", "name": "n"}]}, "tools[0].tools"),
        ({"input": "Hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function"}}, None),
        ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "Hi", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ]
    for extra, param in cases:
        r = httpx.post(f"{url}/v1/responses", json={"model": NAME, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        if param is not None:
            assert error["param"] == param, error
    # fields with no local meaning, and unknown ones, are accepted
    ignored = {
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "parallel_tool_calls": True,
        "prompt_cache_key": "k",
        "client_metadata": {"a": "b"},
        "user": "u",
        "metadata": {"k": "v"},
        "truncation": "auto",
        "service_tier": "auto",
        "reasoning": {"summary": "auto"},
        "previous_response_id": None,
        "a_field_from_the_future": 1,
    }
    r = httpx.post(
        f"{url}/v1/responses", json={"model": NAME, "input": "Hi", **ignored}, timeout=60
    )
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "Hi."
    # an image in a tool's output (Codex's view_image) is a note, not a 400: the session goes on
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    history = [
        {"role": "user", "content": "Look"},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [image]},
    ]
    r = httpx.post(f"{url}/v1/responses", json={"model": NAME, "input": history}, timeout=60)
    assert r.status_code == 200 and "image omitted" in engine.asked[-1]["prompt"][-1]["content"]
    r = httpx.post(f"{url}/v1/responses", json={"model": "nope", "input": "Hi"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def _codex() -> Path | None:
    """Codex 0.171.0 where tools/agent_clients.py installs it (the user cache: the tests point
    ``MLXINFER_CACHE`` elsewhere, so the default one is looked in too), or None."""
    import os

    from mlxinfer.platform.machine import user_cache_dir

    xdg = os.environ.get("XDG_CACHE_HOME")
    default = (Path(xdg) if xdg else Path.home() / ".cache") / "mlxinfer"
    for cache in (user_cache_dir(), default):
        found = sorted((cache / "agents").glob("*codex-0.171.0*/node_modules/.bin/codex"))
        if found:
            return found[0]
    return None


class Agent(Scripted):
    """Calls exec_command (after a thought) until a tool's output is in the prompt, then
    answers."""

    def stream(self, tokenizer, prompt, *, max_tokens, **options):
        if any(m["role"] == "tool" for m in prompt):
            self.reply = "<think>\nIt ran.\n</think>\n\nAll done."
        else:
            call = {"name": "exec_command", "arguments": {"cmd": "echo hi"}}
            self.reply = (
                f"<think>\nRun it.\n</think>\n\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
            )
        yield from super().stream(tokenizer, prompt, max_tokens=max_tokens, **options)


def test_a_real_codex_turn_with_a_tool_call(tiny, tmp_path):
    """Codex 0.171.0 itself (installed by tools/agent_clients.py; skipped where it is not): a
    call of its exec_command, the command's output sent back, the answer printed."""
    import os
    import subprocess

    binary = _codex()
    if binary is None:
        pytest.skip("Codex 0.171.0 is not in the user cache (python tools/agent_clients.py)")
    model, tokenizer = tiny
    engine = Agent()
    with serving(make_app(model, tokenizer, "gpt-5.5", engine=engine)) as base:
        home = tmp_path / "home"
        (home / ".codex").mkdir(parents=True)
        (home / "work").mkdir()
        (home / ".codex" / "config.toml").write_text(
            'model = "gpt-5.5"\nmodel_provider = "local"\n\n[model_providers.local]\n'
            f'name = "local"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
            'env_key = "MLXINFER_API_KEY"\nrequest_max_retries = 0\nstream_max_retries = 0\n'
        )
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(home),
            "CODEX_HOME": str(home / ".codex"),
            "MLXINFER_API_KEY": "x",
        }
        args = ["exec", "--skip-git-repo-check", "--ephemeral", "--color", "never", "say hi"]
        done = subprocess.run(
            [str(binary), *args],
            env=env,
            cwd=home / "work",
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("All done.")
    assert len(engine.asked) == 2  # the call, then the answer after its output
    calls = [m for m in engine.asked[1]["prompt"] if m.get("tool_calls")]
    assert calls[-1]["tool_calls"][0]["function"]["arguments"] == {"cmd": "echo hi"}
