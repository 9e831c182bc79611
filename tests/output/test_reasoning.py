"""Reasoning told apart from the answer (mlxinfer/output/reasoning.py): think tags and gpt-oss's harmony.

Spec: the splitters give the same (reasoning, answer) however the text is cut into pieces, hold
back only what may still become a marker, and leave text that is not theirs alone; a tiny model
forced (by a constraint) to write in each format gives its thoughts to ``reasoning`` and its
answer to ``text`` through the API, the CLI, the chat session (whose history keeps answers only)
and the server (OpenAI's ``reasoning_content``, Anthropic's ``thinking`` blocks); harmony's tool
calls are parsed; a harmony template renders as transformers renders it.
"""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from scripted import ScriptedEngine
from servers import serving
from test_toolcalls import TOOLS, _tiny
from tool_templates import HARMONY, HARMONY_SPECIALS, THINK, THINK_OPENED

pytest.importorskip("llguidance", reason="llguidance (the constraints that force the output)")
import httpx  # noqa: E402

from mlxinfer import stream_generate  # noqa: E402
from mlxinfer.cli.main import cli  # noqa: E402
from mlxinfer.generation.chat import ChatSession  # noqa: E402
from mlxinfer.generation.results import GenerationResult, GenerationStats  # noqa: E402
from mlxinfer.output.reasoning import Harmony, Plain, ThinkTags, reasoning_format, splitter_for
from mlxinfer.output.toolcalls import Harmony as HarmonyCalls  # noqa: E402
from mlxinfer.server import make_app  # noqa: E402

THOUGHT = "<think>\nThe capital is\nParis.\n</think>\n\nParis."
CHANNELS = (
    "<|channel|>analysis<|message|>User asks. Answer.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello <b> a<|x y!"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
    'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)


def pieces(fmt, text: str, size: int, started: bool = False) -> tuple[str, str]:
    splitter, thought, answer = fmt.splitter(started), [], []
    for i in range(0, len(text), size):
        a, b = splitter.feed(text[i : i + size])
        thought.append(a)
        answer.append(b)
    a, b = splitter.finish()
    return "".join(thought + [a]), "".join(answer + [b])


@pytest.mark.parametrize(
    "fmt, text, started, expected",
    [
        (ThinkTags(), THOUGHT, False, ("The capital is\nParis.", "Paris.")),
        (ThinkTags(), "The capital is\nParis.\n</think>\n\nParis.", True, None),
        (ThinkTags(), "Paris <think> is not a thought here", False, ("", None)),
        (ThinkTags(), "<think>never closed  ", False, ("never closed  ", "")),
        (ThinkTags(), "  <thi", False, ("", "<thi")),  # a tag that never completed is text
        (Harmony(), CHANNELS, False, ("User asks. Answer.", "Hello <b> a<|x y!")),
        (Harmony(), CALL, False, ("Need the weather.", "")),  # the call is output/toolcalls.py's
        (Harmony(), "text outside the format", False, ("", None)),
    ],
)
def test_every_cut_of_the_text_splits_the_same(fmt, text, started, expected):
    if expected is None or expected[1] is None:
        thought = (expected or ("The capital is\nParis.",))[0]
        expected = (thought, "Paris." if started else text)
    for size in (1, 2, 3, 7, len(text)):
        assert pieces(fmt, text, size, started) == expected, f"pieces of {size}"


def test_a_split_holds_back_only_a_possible_marker():
    splitter = ThinkTags().splitter()
    assert splitter.feed("<think>A") == ("A", "")
    assert splitter.feed(" b </th") == (" b", "")  # the space may precede the closer
    assert splitter.feed("ink> C") == ("", "C")
    splitter = Harmony().splitter()
    assert splitter.feed("<|channel|>final<|message|>Hi <") == ("", "Hi ")
    assert splitter.feed("3") == ("", "<3")


def test_the_format_is_read_from_the_template(tmp_path):
    _, harmony = _tiny(tmp_path / "h", HARMONY, HARMONY_SPECIALS)
    _, think = _tiny(tmp_path / "t", THINK)
    _, opened = _tiny(tmp_path / "o", THINK_OPENED)
    _, plain = _tiny(tmp_path / "p", "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert isinstance(reasoning_format(harmony), Harmony)
    assert isinstance(reasoning_format(think), ThinkTags)
    assert reasoning_format(plain) is None and isinstance(splitter_for(plain), Plain)
    # DeepSeek-R1's prompt opens the thought: its replies start inside it.
    assert splitter_for(opened).state == "reasoning" and splitter_for(think).state == "start"


def test_harmony_calls_are_messages_to_a_function():
    """Both places a recipient may stand (the channel's header, the role's), the text around
    the calls kept; a message to no one is no call."""
    fmt = HarmonyCalls()
    in_role = (
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.add"
        '<|channel|>commentary json<|message|>{"a": 1, "b": 2}<|call|>'
    )
    for text, name, args in (
        (CALL, "get_weather", {"city": "Paris"}),
        (in_role, "add", {"a": 1, "b": 2}),
    ):
        rest, [call] = fmt.parse(text)
        assert (call.name, call.arguments) == (name, args)
        assert rest.endswith("<|end|>") and "to=functions" not in rest
    assert fmt.parse(CHANNELS) == (CHANNELS, [])


# --- a tiny model forced to write in each format -----------------------------------------


@pytest.fixture(scope="module")
def think(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("think"), THINK)


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("harmony"), HARMONY, HARMONY_SPECIALS)


THINK_REGEX = r"<think>[a-z]{3,8}</think>[A-Z][a-z]{2,6}"


def _marks(tokenizer) -> dict[str, str]:
    return {m: f"<[{tokenizer.token_to_id(m)}]>" for m in HARMONY_SPECIALS}


def harmony_grammar(tokenizer, call: bool = False) -> str:
    """Lark: an analysis message, then a final answer or (``call``) a call of get_weather."""
    t = _marks(tokenizer)
    after = (
        f'{t["<|channel|>"]} "commentary to=functions.get_weather " {t["<|constrain|>"]} "json" '
        f'{t["<|message|>"]} "{{\\"city\\": \\"Paris\\", \\"days\\": 2}}" {t["<|call|>"]}'
        if call
        else f'{t["<|channel|>"]} "final" {t["<|message|>"]} /[A-Z][a-z]{{2,6}}/'
    )
    return (
        f'start: {t["<|channel|>"]} "analysis" {t["<|message|>"]} /[a-z]{{3,8}}/ {t["<|end|>"]} '
        f'{t["<|start|>"]} "assistant" {after}'
    )


def run(model, tokenizer, **options) -> tuple[str, str, list[GenerationResult]]:
    results = list(
        stream_generate(model, tokenizer, "Where?", chat_template=True, max_tokens=150, **options)
    )
    assert results[-1].finish_reason == "stop"  # the forced output is complete
    return "".join(r.reasoning for r in results), "".join(r.text for r in results), results


def test_think_tags_through_the_api(think):
    model, tokenizer = think
    thought, answer, _ = run(model, tokenizer, regex=THINK_REGEX, split_reasoning=True)
    assert re.fullmatch("[a-z]{3,8}", thought) and re.fullmatch("[A-Z][a-z]{2,6}", answer)
    _, raw, _ = run(model, tokenizer, regex=THINK_REGEX)
    assert raw == f"<think>{thought}</think>{answer}"  # off: the output as written


def test_harmony_channels_and_a_call_through_the_api(harmony):
    model, tokenizer = harmony
    thought, answer, _ = run(
        model, tokenizer, grammar=harmony_grammar(tokenizer), split_reasoning=True
    )
    assert re.fullmatch("[a-z]{3,8}", thought) and re.fullmatch("[A-Z][a-z]{2,6}", answer)
    grammar = harmony_grammar(tokenizer, call=True)
    thought, answer, results = run(
        model, tokenizer, grammar=grammar, tools=TOOLS, split_reasoning=True
    )
    [call] = results[-1].tool_calls
    assert (call.name, call.arguments) == ("get_weather", {"city": "Paris", "days": 2})
    assert re.fullmatch("[a-z]{3,8}", thought) and answer == ""


def test_a_chat_keeps_only_answers_in_its_history(harmony):
    """The harmony template refuses a past reply holding its channels: the session passes back
    the answer alone, so a second turn renders."""
    model, tokenizer = harmony
    session = ChatSession(model, tokenizer, grammar=harmony_grammar(tokenizer), max_tokens=60)
    for question in ("Where?", "And then?"):
        replies = list(session.send(question))
        assert "".join(r.reasoning for r in replies)
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2
    assert all("<|" not in m["content"] for m in session.messages)


@pytest.mark.parametrize("mode", ["show", "hide", "raw"])
def test_the_cli_shows_hides_or_leaves_the_thoughts(think, tmp_path, mode):
    model, tokenizer = think
    path = str(tokenizer.path)
    args = ["generate", "-m", path, "-p", "Where?", "--regex", THINK_REGEX, "-n", "60"]
    result = CliRunner().invoke(cli, args + ["--reasoning", mode])
    assert result.exit_code == 0, result.output
    out = result.output.strip()
    m = re.fullmatch(r"<think>([a-z]+)</think>([A-Z][a-z]+)", out)
    if mode == "raw":
        assert m
    elif mode == "hide":
        assert re.fullmatch("[A-Z][a-z]{2,6}", out)
    else:  # not a terminal here, so not dimmed: the thought, a blank line, the answer
        assert re.fullmatch(r"[a-z]{3,8}\n\n[A-Z][a-z]{2,6}", out)


def test_a_harmony_template_renders_as_transformers_renders_it(harmony):
    transformers = pytest.importorskip("transformers")
    _, tokenizer = harmony
    reference = transformers.AutoTokenizer.from_pretrained(str(tokenizer.path))
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "Sunny"},
    ]
    for extra in ({}, {"reasoning_effort": "high"}):
        ours = tokenizer.apply_chat_template(messages, tools=TOOLS, **extra)
        theirs = reference.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, tokenize=False, **extra
        )
        assert ours == theirs
    assert "Reasoning: high" in ours and "to=functions.get_weather" in ours


# --- the server ---------------------------------------------------------------------------


class Thinking(ScriptedEngine):
    """Answers every request with a reply that thinks first, three characters at a time."""

    def stream(self, tokenizer, prompt, *, max_tokens, **options):
        pieces = [THOUGHT[i : i + 3] for i in range(0, len(THOUGHT), 3)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            stats = GenerationStats(prompt_tokens=3)
            yield GenerationResult(piece, i, finish_reason="stop" if last else None, stats=stats)


@pytest.fixture(scope="module")
def server(think):
    model, tokenizer = think
    with serving(make_app(model, tokenizer, "thinker", engine=Thinking())) as url:
        yield url


ASK = {"model": "thinker", "messages": [{"role": "user", "content": "Where?"}], "max_tokens": 40}


def _events(response) -> list[dict]:
    return [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")
    ]


def test_openai_gets_reasoning_content(server):
    r = httpx.post(f"{server}/v1/chat/completions", json=ASK, timeout=60).json()
    message = r["choices"][0]["message"]
    assert (
        message["reasoning_content"] == "The capital is\nParis." and message["content"] == "Paris."
    )
    chunks = _events(
        httpx.post(f"{server}/v1/chat/completions", json={**ASK, "stream": True}, timeout=60)
    )
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The capital is\nParis."
    assert "".join(d.get("content", "") for d in deltas) == "Paris."
    # the legacy completions endpoint gets the text as written
    legacy = {"model": "thinker", "prompt": "Where?", "max_tokens": 40}
    assert (
        httpx.post(f"{server}/v1/completions", json=legacy, timeout=60).json()["choices"][0]["text"]
        == THOUGHT
    )


def test_anthropic_gets_a_thinking_block_first(server):
    headers = {"anthropic-version": "2023-06-01"}
    r = httpx.post(f"{server}/v1/messages", json=ASK, headers=headers, timeout=60).json()
    assert [b["type"] for b in r["content"]] == ["thinking", "text"]
    assert r["content"][0]["thinking"] == "The capital is\nParis."
    assert r["content"][1]["text"] == "Paris."
    events = _events(
        httpx.post(
            f"{server}/v1/messages", json={**ASK, "stream": True}, headers=headers, timeout=60
        )
    )
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "The capital is\nParis."
    assert "".join(d.get("text", "") for d in deltas) == "Paris."
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1]
    # a thinking block sent back in the history is accepted (and left out of the prompt)
    back = {
        **ASK,
        "messages": [
            *ASK["messages"],
            {"role": "assistant", "content": r["content"]},
            {"role": "user", "content": "Sure?"},
        ],
    }
    assert (
        httpx.post(f"{server}/v1/messages", json=back, headers=headers, timeout=60).status_code
        == 200
    )


def test_a_required_harmony_call_is_a_message_to_one_of_the_tools(harmony):
    """tool_choice "required" or a named function constrains gpt-oss's reply to a message to
    that function whose body its parameters' schema admits: through the API and the server."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the validator)")
    from test_toolcalls import ADD, WEATHER

    model, tokenizer = harmony
    schemas = {"get_weather": WEATHER, "add": ADD}
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        _, text, results = run(model, tokenizer, tools=TOOLS, tool_choice=choice)
        [call] = results[-1].tool_calls
        assert text == "" and not any(r.text for r in results)  # the call's text held back
        assert results[-1].in_tool_call
        jsonschema.validate(call.arguments, schemas[call.name])
        assert choice == "required" or call.name == "add"
    with serving(make_app(model, tokenizer, "oss")) as url:
        body = {
            "model": "oss",
            "messages": [{"role": "user", "content": "Weather?"}],
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 150,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    name = call["function"]["name"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


def test_template_variables_reach_the_template(think, tmp_path):
    """enable_thinking=False (Qwen3's switch) through the API, the CLI and both servers: the
    prompt gets the template's empty thought."""
    model, tokenizer = think
    path = str(tokenizer.path)
    ids = []
    for r in stream_generate(
        model,
        tokenizer,
        "Where?",
        chat_template=True,
        max_tokens=1,
        chat_template_kwargs={"enable_thinking": False},
    ):
        ids.append(r.stats.prompt_tokens)
    plain = next(stream_generate(model, tokenizer, "Where?", chat_template=True, max_tokens=1))
    assert ids[0] > plain.stats.prompt_tokens  # the "<think>\n\n</think>\n\n" it added
    args = ["generate", "-m", path, "-p", "Where?", "-n", "1", "-v"]
    off = CliRunner().invoke(cli, args + ["--chat-template-arg", "enable_thinking=false"])
    assert off.exit_code == 0, off.output
    bad = CliRunner().invoke(cli, args + ["--chat-template-arg", "enable_thinking"])
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output
    with serving(make_app(model, tokenizer, "t")) as url:
        ask = {"model": "t", "messages": [{"role": "user", "content": "Where?"}], "max_tokens": 1}
        counts = []
        for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
            r = httpx.post(f"{url}/v1/chat/completions", json={**ask, **extra}, timeout=60)
            counts.append(r.json()["usage"]["prompt_tokens"])
        assert counts[1] > counts[0]
        headers = {"anthropic-version": "2023-06-01"}
        body = {"model": "t", "messages": ask["messages"], "thinking": {"type": "disabled"}}
        r = httpx.post(f"{url}/v1/messages/count_tokens", json=body, headers=headers, timeout=60)
        assert r.json()["input_tokens"] == counts[1]
        r = httpx.post(
            f"{url}/v1/chat/completions", json={**ask, "reasoning_effort": "huge"}, timeout=60
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def test_a_template_switch_splits_the_same_through_the_servers_as_the_library(tmp_path):
    """DeepSeek-R1's template opens the thought in its prompt, unless ``enable_thinking=False``
    closes it there: whether a reply starts inside the reasoning is read from the request's own
    prompt, so both servers split a reply as ``stream_generate`` does with the same switch."""
    model, tokenizer = _tiny(tmp_path, THINK_OPENED)
    messages = [{"role": "user", "content": "Where?"}]
    headers = {"anthropic-version": "2023-06-01"}
    with serving(make_app(model, tokenizer, "o")) as url:
        for thinking in (True, False):
            kwargs = {} if thinking else {"enable_thinking": False}
            results = list(
                stream_generate(
                    model,
                    tokenizer,
                    messages,
                    chat_template=True,
                    max_tokens=8,
                    split_reasoning=True,
                    chat_template_kwargs=kwargs,
                )
            )
            split = ("".join(r.reasoning for r in results), "".join(r.text for r in results))
            assert split[0 if thinking else 1]  # the random reply is a thought, or an answer
            ask = {"model": "o", "messages": messages, "max_tokens": 8, "temperature": 0}
            openai = {**ask, "chat_template_kwargs": kwargs}
            r = httpx.post(f"{url}/v1/chat/completions", json=openai, timeout=60).json()
            message = r["choices"][0]["message"]
            assert (message.get("reasoning_content", ""), message["content"]) == split
            chunks = _events(
                httpx.post(
                    f"{url}/v1/chat/completions", json={**openai, "stream": True}, timeout=60
                )
            )
            deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
            streamed = tuple(
                "".join(d.get(k) or "" for d in deltas) for k in ("reasoning_content", "content")
            )
            assert streamed == split
            anthropic = {**ask, "thinking": {"type": "enabled" if thinking else "disabled"}}
            if thinking:
                anthropic["thinking"]["budget_tokens"] = 1024
            r = httpx.post(f"{url}/v1/messages", json=anthropic, headers=headers, timeout=60)
            blocks = {b["type"]: b.get("thinking", b.get("text")) for b in r.json()["content"]}
            assert (blocks.get("thinking", ""), blocks.get("text", "")) == split


def test_split_reasoning_through_the_engine(think):
    from mlxinfer import Engine

    model, tokenizer = think
    with Engine(model) as engine:
        results = list(
            engine.stream(
                tokenizer,
                "Where?",
                chat_template=True,
                max_tokens=150,
                regex=THINK_REGEX,
                split_reasoning=True,
            )
        )
    thought, answer = "".join(r.reasoning for r in results), "".join(r.text for r in results)
    assert re.fullmatch("[a-z]{3,8}", thought) and re.fullmatch("[A-Z][a-z]{2,6}", answer)
