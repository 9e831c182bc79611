"""Tool calls (mlxinfer/output/toolcalls.py): each family's call format parsed, tools rendered by the
chat template, and ``tool_choice`` constraining a call to the function's schema."""

from __future__ import annotations

import json

import pytest
from hf_models import add_tokenizer, make_tiny
from tool_templates import HERMES, LLAMA3, MISTRAL, SPECIALS

pytest.importorskip("llguidance", reason="llguidance (structured output) is missing")
jsonschema = pytest.importorskip(
    "jsonschema", reason="jsonschema (the test's validator) is missing"
)

from mlxinfer import Engine, load, stream_generate  # noqa: E402
from mlxinfer.output.toolcalls import (  # noqa: E402
    FORMATS,
    Hermes,
    Llama3,
    Mistral,
    check_tools,
    template_messages,
    tool_format,
)
from mlxinfer.output.tooling import ToolStream  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "maximum": 99},
        "b": {"type": "integer", "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# --- parsing each family's output ---------------------------------------------------------------

CASES = [
    (
        Hermes(),
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
        "\n</tool_call>",
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 2}), ("add", {"a": 1, "b": 2})],
    ),
    (Hermes(), '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}', "", [("add", {"a": 3})]),
    (Hermes(), "No call here.", "No call here.", []),
    (
        Hermes(),
        "<tool_call>\n{not json}\n</tool_call>",
        "<tool_call>\n{not json}\n</tool_call>",
        [],
    ),
    (
        Llama3(),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}',
        "",
        [("get_weather", {"city": "Oslo", "days": 1})],
    ),
    (
        Llama3(),
        '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3}}',
        "",
        [("add", {"a": 1, "b": 2}), ("add", {"a": 3})],
    ),
    (Llama3(), "The weather is fine {mostly}.", "The weather is fine {mostly}.", []),
    (
        Mistral(),
        'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 5, "b": 6}}]',
        "Sure.",
        [("add", {"a": 5, "b": 6})],
    ),
    (Mistral(), "[TOOL_CALLS] [broken", "[TOOL_CALLS] [broken", []),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_each_familys_calls_are_parsed(fmt, text, content, calls):
    got_content, got = fmt.parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_a_stream_shows_the_text_and_holds_back_the_calls(fmt, text, content, calls):
    """Fed a character at a time, the text shown plus what finish() adds is the content,
    and no piece of a call is ever shown."""
    stream = ToolStream(fmt)
    shown = "".join(stream.feed(ch) for ch in text)
    rest, got = stream.finish()
    assert [(c.name, c.arguments) for c in got] == calls
    if calls:
        assert (shown + rest).strip() == content and fmt.opener not in shown
    else:
        assert shown + rest == text


def test_tools_are_checked_naming_the_field():
    assert check_tools([{"name": "f"}]) == [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    for bad, named in (
        ([], "tools: expected a non-empty list"),
        ([{"type": "retrieval"}], "tools[0]"),
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters"),
    ):
        with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
            check_tools(bad)


# --- tiny models with each family's template ----------------------------------------------------


def _tiny(tmp_path, template: str, specials=()):
    path, _ = make_tiny(tmp_path, vocab_size=320, hidden_size=64, max_position_embeddings=4096)
    add_tokenizer(path)
    if specials:  # appended after the 320 trained ids: give the model room for them
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        tok.add_special_tokens(list(specials))
        tok.save(str(path / "tokenizer.json"))
        path, _ = make_tiny(
            tmp_path,
            vocab_size=tok.get_vocab_size(),
            hidden_size=64,
            max_position_embeddings=4096,
        )
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load(str(path))


@pytest.fixture(scope="module", params=["hermes", "llama3", "mistral"])
def family(request, tmp_path_factory):
    template = {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL}[request.param]
    model, tokenizer = _tiny(
        tmp_path_factory.mktemp(request.param), template, SPECIALS.get(request.param, ())
    )
    return request.param, model, tokenizer


def test_the_format_is_read_from_the_template(family):
    name, _, tokenizer = family
    assert tool_format(tokenizer).name == name


def test_the_template_shows_the_tools(family):
    from mlxinfer.generation.loop import prepare_prompt

    _, _, tokenizer = family
    text = tokenizer.decode(prepare_prompt(tokenizer, ASK, tools=check_tools(TOOLS)))
    assert '"get_weather"' in text and '"add"' in text
    assert "get_weather" not in tokenizer.decode(prepare_prompt(tokenizer, ASK))


@pytest.mark.parametrize("choice", ["get_weather", "add", "required"])
def test_a_chosen_call_is_parsed_and_its_arguments_validate(family, choice):
    """tool_choice naming a function (or "required"): the random model's output is that
    family's call, parsed into a call whose arguments validate against the schema."""
    _, model, tokenizer = family
    tool_choice = (
        choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    )
    for seed in range(3):
        results = list(
            stream_generate(
                model,
                tokenizer,
                ASK,
                chat_template=True,
                tools=TOOLS,
                tool_choice=tool_choice,
                temperature=1.0,
                seed=seed,
                max_tokens=300,
            )
        )
        text = "".join(r.text for r in results)
        calls = results[-1].tool_calls
        assert results[-1].finish_reason == "stop" and len(calls) == 1, text
        assert choice == "required" or calls[0].name == choice
        jsonschema.validate(calls[0].arguments, SCHEMAS[calls[0].name])


def test_tool_choice_in_the_batch_and_errors(family):
    _, model, tokenizer = family
    with Engine(model) as engine:
        results = list(
            engine.stream(
                tokenizer,
                ASK,
                chat_template=True,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "add"}},
                max_tokens=300,
            )
        )
    assert [c.name for c in results[-1].tool_calls] == ["add"]
    with pytest.raises(ValueError, match="'nope' is not among the tools"):
        next(
            stream_generate(
                model,
                tokenizer,
                ASK,
                chat_template=True,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "nope"}},
            )
        )


def test_a_conversation_with_a_call_and_its_result_renders(family):
    """An assistant turn's tool_calls (arguments as OpenAI's JSON text) and the tool's answer
    reach the template as the Hugging Face convention has them."""
    from mlxinfer.generation.loop import prepare_prompt

    name, _, tokenizer = family
    turns = template_messages(
        [
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
            {"role": "user", "content": "Thanks."},
        ]
    )
    assert turns[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    text = tokenizer.decode(prepare_prompt(tokenizer, turns, tools=check_tools(TOOLS)))
    assert '"a": 1' in text
    if name == "hermes":
        assert "<tool_response>\n3\n</tool_response>" in text


def test_the_default_is_hermes_and_every_format_is_listed():
    assert [f.name for f in FORMATS] == ["hermes", "mistral", "llama3", "harmony"]


def test_a_chat_session_keeps_its_calls_for_the_next_turn(family):
    """The streamed text holds no call markup, so ChatSession keeps the parsed calls as the
    assistant message's tool_calls: the next turn's prompt renders the call back, as the
    template renders a call it is given."""
    from mlxinfer import ChatSession

    _, model, tokenizer = family
    chat = ChatSession(
        model,
        tokenizer,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=300,
    )
    results = list(chat.send(ASK[0]["content"]))
    (call,) = results[-1].tool_calls
    kept = chat.messages[-1]
    assert kept["role"] == "assistant" and kept["content"] == "".join(r.text for r in results)
    assert kept["tool_calls"] == [
        {
            "type": "function",
            "id": call.id,
            "function": {"name": "add", "arguments": call.arguments},
        }
    ]
    rendered = tokenizer.apply_chat_template(chat.messages, tools=TOOLS)
    without = tokenizer.apply_chat_template(
        [*chat.messages[:-1], {"role": "assistant", "content": kept["content"]}], tools=TOOLS
    )
    # the call is rendered back: its arguments, as the templates write JSON
    arguments = json.dumps(call.arguments)[1:-1]  # '"a": 12, "b": 7'
    assert arguments in rendered and arguments not in without
