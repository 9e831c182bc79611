"""Real agent clients: the tool-capable templates they are served with (Gemma's turn format,
SmolLM2's ChatML), and (slow, opt-in) one turn of Claude Code and Codex CLI from npm against
`mlxinfer serve` (tools/agent_clients.py).

The template (tests/templates/gemma_tools.jinja) is Gemma 3's turn format as Google's own
template writes it, with the tools listed in the first user turn and calls in the Hermes form
mlxinfer's tool-call parser reads: the expected strings below are that format written out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxinfer.output.toolcalls import Hermes, tool_format
from mlxinfer.tokenization.chat_template import named_chat_template

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "tests" / "templates" / "gemma_tools.jinja"
FIXTURES = ROOT / "tests" / "fixtures"

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"],
    },
}
CLOCK = {"name": "now", "parameters": {"type": "object", "properties": {}}}


def render(messages, tools=None, add_generation_prompt=True):
    variables = {"bos_token": "<bos>"}
    if tools is not None:
        variables["tools"] = [{"type": "function", "function": f} for f in tools]
    return named_chat_template(str(TEMPLATE)).render(
        messages, add_generation_prompt=add_generation_prompt, variables=variables
    )


def test_plain_chat_is_gemmas_turn_format():
    """Without tools: Google's Gemma 3 format (system folded into the first user turn, the
    assistant's role "model", contents trimmed), as its own template renders it."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi there "},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Who are you?"}]},
    ]
    assert render(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWho are you?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert render(messages[1:2], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi there<end_of_turn>\n"
    )


def test_tools_are_listed_in_the_first_user_turn():
    """Every function's name, description and schema, as JSON, once, before the user's text."""
    out = render([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, CLOCK])
    first = out.split("<end_of_turn>")[0]
    assert first.startswith("<bos><start_of_turn>user\n")
    assert first.endswith("\n\nWeather in Paris?")
    listed = first.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [WEATHER, CLOCK]
    assert out.endswith("<start_of_turn>model\n")


def test_tools_without_user_turn_get_one_of_their_own():
    out = render([{"role": "system", "content": "S"}], tools=[CLOCK])
    assert out.startswith("<bos><start_of_turn>user\nS\n\n# Tools\n")
    assert out.endswith("</tool_call><end_of_turn>\n<start_of_turn>model\n")


def test_calls_and_results_round_trip_through_the_parser():
    """The parser the template's source selects (Hermes) reads back the calls the template
    wrote, with the arguments given; results go back in a user turn inside <tool_response>."""
    calls = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        },
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "noon"}]},
        {"role": "system", "content": "Answer in French."},
    ]
    out = render(messages, tools=[WEATHER, CLOCK])
    turns = out.split("<start_of_turn>")
    model_turn = next(t for t in turns if t.startswith("model\nChecking."))
    text, parsed = Hermes().parse(
        model_turn.removeprefix("model\n").removesuffix("<end_of_turn>\n")
    )
    assert text == "Checking."
    assert [(c.name, c.arguments) for c in parsed] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert "user\n<tool_response>\n18 C\n</tool_response><end_of_turn>\n" in turns
    assert "user\n<tool_response>\nnoon\n</tool_response><end_of_turn>\n" in turns
    assert turns[-2:] == ["user\nAnswer in French.<end_of_turn>\n", "model\n"]

    class Source:  # what tool_format reads: the template's source
        def chat_template_source(self, tools=False):
            return TEMPLATE.read_text()

    assert isinstance(tool_format(Source()), Hermes)


# SmolLM2-135M-Instruct's own template (its tokenizer_config.json): ChatML with a default system
# message, no tools.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_TOOLS = ROOT / "tests" / "templates" / "chatml_tools.jinja"


def render_chatml(template, messages, tools=None):
    variables = (
        {} if tools is None else {"tools": [{"type": "function", "function": f} for f in tools]}
    )
    return template.render(messages, add_generation_prompt=True, variables=variables)


def test_chatml_tools_is_smollm2s_format_and_lists_the_tools():
    """tests/templates/chatml_tools.jinja (Claude Code against SmolLM2): without tools, what
    SmolLM2's own template writes (with and without a system message); with tools, their
    schemas listed in the system turn; calls read back by the parser its source selects."""
    from mlxinfer.tokenization.chat_template import ChatTemplate

    ours, theirs = named_chat_template(str(CHATML_TOOLS)), ChatTemplate(SMOLLM2_TEMPLATE, "smollm2")
    for messages in (
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Who are you?"},
        ],
    ):
        assert render_chatml(ours, messages) == render_chatml(theirs, messages)
    calls = [{"type": "function", "function": {"name": "now", "arguments": {}}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Time?"}]},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "noon"},
        {"role": "system", "content": "Answer in French."},
    ]
    out = render_chatml(ours, messages, tools=[WEATHER, CLOCK])
    system = out.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [WEATHER, CLOCK]
    turns = out.split("<|im_start|>")[2:]
    assert turns[0] == "user\nTime?<|im_end|>\n"
    text, parsed = Hermes().parse(turns[1].removeprefix("assistant\n").removesuffix("<|im_end|>\n"))
    assert (text, [(c.name, c.arguments) for c in parsed]) == ("", [("now", {})])
    assert turns[2:] == [
        "user\n<tool_response>\nnoon\n</tool_response><|im_end|>\n",
        "system\nAnswer in French.<|im_end|>\n",
        "assistant\n",
    ]

    class Source:
        def chat_template_source(self, tools=False):
            return CHATML_TOOLS.read_text()

    assert isinstance(tool_format(Source()), Hermes)


@pytest.mark.real
def test_claude_codes_first_request_fits_gemma3():
    """Claude Code's captured first request (system, 24 tools, a mid-conversation system
    message) rendered for the real Gemma-3-270M tokenizer: the turn markers are its single
    special tokens, and the prompt leaves room in its 32k context for the reply."""
    from fixtures import gemma3_mlx_dir

    from mlxinfer.tokenization.tokenizer import Tokenizer

    model = gemma3_mlx_dir()
    tok = Tokenizer.from_dir(model)
    for marker in ("<start_of_turn>", "<end_of_turn>"):
        assert tok.token_to_id(marker) is not None, marker
        assert tok.encode(f"x{marker}\n", add_special_tokens=False)[1] == tok.token_to_id(marker)
    tok.set_chat_template(str(TEMPLATE))
    body = json.loads((FIXTURES / "claude_code_request.json").read_text())["body"]
    tools = [
        {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}
        for t in body["tools"]
    ]

    def text(content):
        return content if isinstance(content, str) else "".join(p["text"] for p in content)

    messages = [{"role": "system", "content": "\n\n".join(b["text"] for b in body["system"])}]
    messages += [{"role": m["role"], "content": text(m["content"])} for m in body["messages"]]
    prompt = tok.apply_chat_template(
        messages, tools=[{"type": "function", "function": f} for f in tools]
    )
    for tool in tools:
        assert json.dumps(tool, ensure_ascii=False) in prompt
    n = len(tok.encode(prompt, add_special_tokens=False))
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    assert 10_000 < n < context - 48, n


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="minutes on 2 cores (a 19k-token prompt): set MLXINFER_SLOW=1 to run",
)
def test_claude_code_and_codex_complete_a_turn(tmp_path):
    """tools/agent_clients.py: pinned Claude Code and Codex from npm, one turn each against
    `mlxinfer serve` (Claude Code on SmolLM2-135M-Instruct with one tool, Codex on
    Gemma-3-270M), each exiting 0 with a non-empty reply."""
    rows = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "agent_clients.py"), "--json", str(rows)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode == 2:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    result = json.loads(rows.read_text())
    assert [r["ok"] for r in result] == [True, True]
    assert all(r["reply"] for r in result)
