"""Coding agents connect unchanged (docs/server.md, "Fields", "Chat templates", "Model names").

Spec: Claude Code's captured first request (tests/fixtures/claude_code_request.json: 24 tools,
``context_management``, ``output_config``, ``metadata``, ``cache_control``, a ``system`` turn
mid-conversation, ``thinking: adaptive``, the billing header, ``max_tokens: 64000``) is
answered; fields with no local meaning and unknown ones are accepted and logged once, while a
malformed value of a used field, or a field that would change the output and cannot be
honoured, is a 400 naming it; the billing header's nonce does not defeat the prefix cache, and
the usage counts add up as Anthropic's do; a model without a template, or tools its template
cannot show, are 400s saying what to do; client model names map through aliases; the output
cap and the context clamp end with ``max_tokens``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from hf_models import add_tokenizer, make_tiny
from scripted import ScriptedEngine
from tool_templates import HERMES

pytest.importorskip("fastapi", reason="the server's extra is not installed")
from fastapi.testclient import TestClient  # noqa: E402

from mlxinfer import load  # noqa: E402
from mlxinfer.errors import TokenizerError  # noqa: E402
from mlxinfer.server import make_app  # noqa: E402
from mlxinfer.server.aliases import AliasError  # noqa: E402
from mlxinfer.server.fields import forget_logged  # noqa: E402
from mlxinfer.server.templating import fold_system  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"
NAME = "tiny"
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "context-1m-2025-08-07,x-y-1"}
ASK = [{"role": "user", "content": "Hello there, how are you?"}]
GREEDY = {"temperature": 0}
# A template that refuses a system message after the first turn, as Qwen3's does.
STRICT = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
# A template that shows the reasoning switches it is given.
SWITCHES = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "<|im_start|>assistant\nthinking={{ enable_thinking }} effort={{ reasoning_effort }}\n"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random llama whose chat template (Hermes) shows tools."""
    path, _ = make_tiny(
        tmp_path_factory.mktemp("agents"),
        vocab_size=320,
        hidden_size=64,
        max_position_embeddings=4096,
    )
    add_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(str(tiny_dir))


@pytest.fixture(scope="module")
def client(tiny):
    """The real engine behind the app, with an alias for Claude's names."""
    with TestClient(make_app(*tiny, NAME, model_aliases=["claude-*=tiny"])) as c:
        yield c


def _other(tiny_dir, template: str | None = "keep", context: int | None = None):
    """A fresh copy of the tiny model (its own tokenizer), with another chat template (None:
    none) or another context length."""
    model, tokenizer = load(str(tiny_dir))
    if template is None:
        tokenizer._chat_templates = {}
    elif template != "keep":
        from mlxinfer.tokenization.chat_template import ChatTemplate

        tokenizer._chat_templates = {"default": ChatTemplate(template, "test")}
    if context is not None:
        model.args.max_position_embeddings = context
    return model, tokenizer


class Recording(ScriptedEngine):
    """ScriptedEngine that also keeps each request's options (template kwargs, tools...)."""

    def __init__(self) -> None:
        super().__init__(delay=0)
        self.options: list[dict] = []

    def start(self, tokenizer, prompt, **options):
        self.options.append(options)
        return super().start(tokenizer, prompt, **options)


def _events(text: str) -> list[str]:
    return [line[len("event: ") :] for line in text.splitlines() if line.startswith("event: ")]


# --- Claude Code's own first request ---------------------------------------------------------


def test_claude_codes_first_request_is_answered(tiny_dir, caplog):
    """The captured request, headers and all, streams a whole message; the engine gets the
    system prompt without the billing header, the mid-conversation system turn in its place
    (Hermes renders any role), the 24 tools, and adaptive thinking at high effort."""
    captured = json.loads((FIXTURES / "claude_code_request.json").read_text())
    body = captured["body"]
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    engine = Recording()
    model, tokenizer = _other(tiny_dir, context=1 << 17)  # its 76 KB fit the context
    forget_logged()
    caplog.set_level(logging.INFO, logger="mlxinfer.server")
    with TestClient(
        make_app(model, tokenizer, NAME, engine=engine, model_aliases=["claude-*=tiny"])
    ) as c:
        for _ in range(2):
            r = c.post(captured["path"], json=body, headers=captured["headers"])
            assert r.status_code == 200, r.text[:500]
    events = _events(r.text)
    assert events[:2] == ["message_start", "ping"] and events[-2:] == [
        "message_delta",
        "message_stop",
    ]
    assert json.loads(r.text.split("data: ")[1].split("\n")[0])["message"]["model"] == body["model"]
    prompt = engine.prompts[-1]
    assert [m["role"] for m in prompt] == ["system", "user", "system"]
    assert prompt[0]["content"] == "".join(b["text"] for b in body["system"][1:])
    assert prompt[2]["content"] == body["messages"][1]["content"]
    options = engine.options[-1]
    assert [t["function"]["name"] for t in options["tools"]] == [t["name"] for t in body["tools"]]
    assert options["chat_template_kwargs"] == {"enable_thinking": True, "reasoning_effort": "high"}
    assert options["max_tokens"] == 64000  # the engine clamps it to the context left
    logged = [r.getMessage() for r in caplog.records if r.name == "mlxinfer.server"]
    for field in ("context_management", "metadata"):
        assert sum(f"field {field} " in m for m in logged) == 1, logged  # once, not per request


def test_count_tokens_of_claude_codes_request_ignore_the_billing_header(client):
    """count_tokens equals the count of the same request without the billing block, and a
    system string's leading billing line counts for nothing either."""
    body = json.loads((FIXTURES / "claude_code_request.json").read_text())["body"]
    with_header = client.post("/v1/messages/count_tokens", json=body, headers=HEADERS)
    without = {**body, "system": body["system"][1:]}
    bare = client.post("/v1/messages/count_tokens", json=without, headers=HEADERS)
    assert with_header.status_code == 200, with_header.text
    assert with_header.json()["input_tokens"] == bare.json()["input_tokens"] > 10_000
    line = "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=cli; cch=5e2a1;\n"
    counts = [
        client.post(
            "/v1/messages/count_tokens",
            json={"model": NAME, "messages": ASK, "system": system},
            headers=HEADERS,
        ).json()["input_tokens"]
        for system in (line + "Be brief.", "Be brief.")
    ]
    assert counts[0] == counts[1]
    # Tools with tool_choice none are not shown in generation, so they count for nothing.
    tool = {"name": "get_weather", "description": "w", "input_schema": {"type": "object"}}
    bare, shown, hidden = (
        client.post(
            "/v1/messages/count_tokens", json={"model": NAME, "messages": ASK, **extra}
        ).json()["input_tokens"]
        for extra in ({}, {"tools": [tool]}, {"tools": [tool], "tool_choice": {"type": "none"}})
    )
    assert hidden == bare < shown


# --- the prefix cache and Anthropic's usage ---------------------------------------------------


def _billed(nonce: str, question: str) -> dict:
    system = [
        {
            "type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.197.fa0; "
            f"cc_entrypoint=cli; cch={nonce};",
        },
        {
            "type": "text",
            "text": "You are a careful agent. " + "Paris is the capital of France. " * 12,
            "cache_control": {"type": "ephemeral"},
        },
    ]
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 2,
        "system": system,
        "messages": [{"role": "user", "content": question}],
        **GREEDY,
    }


def test_the_billing_nonce_does_not_defeat_the_prefix_cache(client):
    """Two calls whose billing blocks differ in ``cch=`` only: the second reads at least 80 %
    of its prompt from the cache; each usage adds up to count_tokens' count, Anthropic's way
    (input_tokens excludes what was read from and written into the cache), and what the first
    wrote is the prompt's full 16-token blocks (the engine's block size)."""
    usages, counts = [], []
    for nonce, question in (("a1b2c", "What is the capital?"), ("9f8e7", "Name the river?")):
        body = _billed(nonce, question)
        r = client.post("/v1/messages", json=body, headers=HEADERS)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
        count = {k: body[k] for k in ("model", "system", "messages")}
        counts.append(client.post("/v1/messages/count_tokens", json=count).json()["input_tokens"])
    for u, n in zip(usages, counts):
        assert (
            u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == n
        )
    first, second = usages
    assert first["cache_read_input_tokens"] < 0.8 * counts[0]  # a prompt not seen before
    assert (
        first["cache_creation_input_tokens"]
        == counts[0] // 16 * 16 - first["cache_read_input_tokens"]
    )
    assert second["cache_read_input_tokens"] >= 0.8 * counts[1], (second, counts)


# --- the fields rule ----------------------------------------------------------------------------


def test_fields_without_local_meaning_and_unknown_ones_are_accepted_and_logged_once(client, caplog):
    forget_logged()
    caplog.set_level(logging.INFO, logger="mlxinfer.server")
    chat = {
        "model": NAME,
        "messages": ASK,
        "max_tokens": 2,
        "store": False,
        "user": "u1",
        "parallel_tool_calls": True,
        "metadata": {"a": "b"},
        "prompt_cache_key": "k",
        "service_tier": "auto",
        "stream_options": None,
        "frequency_penalty": 0,
        "logit_bias": {},
        "modalities": ["text"],
        "x_future_field": {"any": 1},
    }
    messages = {
        "model": "claude-opus-4-8",
        "messages": ASK,
        "max_tokens": 2,
        "metadata": {"user_id": "x"},
        "context_management": {"edits": []},
        "service_tier": "auto",
        "container": None,
        "mcp_servers": [],
        "cache_control": {"type": "ephemeral"},
        "x_future_field": 1,
        "output_config": {"effort": "low", "x_knob": 1},
        "thinking": {"type": "adaptive"},
        "tools": [{"type": "web_search_20250305", "name": "web_search"}],
    }
    for _ in range(2):
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        r = client.post("/v1/messages", json=messages, headers=HEADERS)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "claude-opus-4-8"
    streamed = {
        **chat,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    r = client.post("/v1/chat/completions", json=streamed)
    assert r.status_code == 200 and '"usage"' in r.text
    logged = [r.getMessage() for r in caplog.records if r.name == "mlxinfer.server"]
    for api, field in (
        ("/v1/chat/completions", "x_future_field"),
        ("/v1/chat/completions", "store"),
        ("/v1/messages", "x_future_field"),
        ("/v1/messages", "context_management"),
        ("/v1/messages", "output_config.x_knob"),
    ):
        assert sum(m.startswith(f"{api}: ") and f" {field} " in m for m in logged) == 1, (
            field,
            logged,
        )


@pytest.mark.parametrize(
    "path, body, named",
    [
        ("/v1/chat/completions", {"logit_bias": {"1": 2}}, "logit_bias"),
        ("/v1/chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"stream_options": "yes"}, "stream_options"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/messages", {"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ("/v1/messages", {"output_config": "high"}, "output_config"),
        ("/v1/messages", {"thinking": {"type": "sometimes"}}, "thinking"),
        ("/v1/messages", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_a_bad_value_or_a_field_we_cannot_honour_is_a_400_naming_it(client, path, body, named):
    base = {"model": NAME, "max_tokens": 2}
    base.update({"prompt": "Once"} if path == "/v1/completions" else {"messages": ASK})
    r = client.post(path, json={**base, **body}, headers=HEADERS)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert named in error["message"] or error.get("param") == named, error


# --- templates: reasoning switches, system turns, tools, none at all ------------------------


def test_adaptive_thinking_and_effort_reach_the_templates_switches(tiny_dir):
    model, tokenizer = _other(tiny_dir, SWITCHES)
    with TestClient(make_app(model, tokenizer, NAME)) as c:
        count = {"model": NAME, "messages": ASK}
        variants = [
            {},
            {"thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}},
            {
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "output_config": {"effort": "low"},
            },
        ]
        counts = [
            c.post("/v1/messages/count_tokens", json={**count, **v}).json()["input_tokens"]
            for v in variants
        ]
    rendered = [
        tokenizer.encode(tokenizer.apply_chat_template(ASK, **kw), add_special_tokens=False)
        for kw in (
            {},
            {"enable_thinking": True, "reasoning_effort": "high"},
            {"enable_thinking": True, "reasoning_effort": "low"},
        )
    ]
    assert counts == [len(ids) for ids in rendered]
    assert len(set(counts)) == 3


def test_a_mid_conversation_system_turn_is_folded_where_the_template_refuses_it(tiny_dir):
    """A template that refuses a late system message (as Qwen3's does) gets it folded into the
    next user turn, or the one before when none follows; the leading system prompt, which
    starts the cached prefix, is never changed by a later turn (leading system messages, as
    Codex's two developer messages, become one)."""
    turns = [
        {"role": "system", "content": "S0"},
        {"role": "system", "content": "D0"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "system", "content": "S1"},
        {"role": "user", "content": "U2"},
        {"role": "system", "content": "S2"},
    ]
    assert fold_system(turns) == [
        {"role": "system", "content": "S0\n\nD0"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "S1\n\nU2\n\nS2"},
    ]
    engine = Recording()
    model, tokenizer = _other(tiny_dir, STRICT)
    with TestClient(make_app(model, tokenizer, NAME, engine=engine)) as c:
        body = {
            "model": NAME,
            "max_tokens": 2,
            "system": "S0",
            "messages": [{"role": "user", "content": "U1"}, {"role": "system", "content": "S1"}],
        }
        assert c.post("/v1/messages", json=body).status_code == 200
        r = c.post(
            "/v1/messages/count_tokens", json={k: body[k] for k in ("model", "system", "messages")}
        )
        assert r.status_code == 200, r.text
    assert engine.prompts[-1] == [
        {"role": "system", "content": "S0"},
        {"role": "user", "content": "U1\n\nS1"},
    ]


def test_tools_a_template_cannot_show_are_a_400_never_dropped(tiny_dir):
    """add_tokenizer's ChatML template ignores ``tools``: offering some is a 400 on both APIs
    (with tool_choice "none" they are not shown, which is what was asked)."""
    chatml = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    model, tokenizer = _other(tiny_dir, chatml)
    tool = {"name": "get_weather", "description": "w", "input_schema": {"type": "object"}}
    function = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    with TestClient(make_app(model, tokenizer, NAME, engine=Recording())) as c:
        r = c.post(
            "/v1/messages", json={"model": NAME, "max_tokens": 2, "messages": ASK, "tools": [tool]}
        )
        assert r.status_code == 400 and "does not show tools" in r.json()["error"]["message"], (
            r.text
        )
        r = c.post(
            "/v1/chat/completions", json={"model": NAME, "messages": ASK, "tools": [function]}
        )
        assert r.status_code == 400 and "does not show tools" in r.json()["error"]["message"], (
            r.text
        )
        r = c.post(
            "/v1/chat/completions",
            json={"model": NAME, "messages": ASK, "tools": [function], "tool_choice": "none"},
        )
        assert r.status_code == 200, r.text


def test_a_model_without_a_template_is_a_400_naming_the_flag_which_fixes_it(tiny_dir, tmp_path):
    model, tokenizer = _other(tiny_dir, None)
    with TestClient(make_app(model, tokenizer, NAME, engine=Recording())) as c:
        for path, extra in (("/v1/chat/completions", {}), ("/v1/messages", {"max_tokens": 2})):
            r = c.post(path, json={"model": NAME, "messages": ASK, **extra})
            assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"], (
                r.text
            )
    engine = Recording()
    with TestClient(make_app(model, tokenizer, NAME, engine=engine, chat_template="chatml")) as c:
        r = c.post("/v1/messages", json={"model": NAME, "messages": ASK, "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert tokenizer.apply_chat_template(ASK).startswith("<|im_start|>user\n")
    with pytest.raises(TokenizerError, match="no-such-template"):
        make_app(model, tokenizer, NAME, engine=Recording(), chat_template="no-such-template")
    # A --models-dir model without a template gets --chat-template when it loads.
    bare = tmp_path / "models" / "bare"
    shutil.copytree(tiny_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    app = make_app(models_dir=bare.parent, chat_template="chatml")
    with TestClient(app) as c:
        r = c.post("/v1/messages", json={"model": "bare", "messages": ASK, "max_tokens": 2})
        assert r.status_code == 200, r.text
        n = c.post("/v1/messages/count_tokens", json={"model": "bare", "messages": ASK})
    entry = app.state.models.entries["bare"]
    expected = entry.tokenizer.encode(
        "<|im_start|>user\nHello there, how are you?<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    assert n.json()["input_tokens"] == len(expected)


# --- model names, the output cap, the context ------------------------------------------------


def test_aliases_map_client_names_and_others_stay_404s(tiny):
    with TestClient(
        make_app(*tiny, NAME, engine=Recording(), model_aliases=["gpt-5*=tiny", "claude-*=tiny"])
    ) as c:
        assert (
            c.post(
                "/v1/chat/completions", json={"model": "gpt-5-codex", "messages": ASK}
            ).status_code
            == 200
        )
        r = c.post(
            "/v1/messages", json={"model": "claude-haiku-4-5", "messages": ASK, "max_tokens": 2}
        )
        assert r.status_code == 200 and r.json()["model"] == "claude-haiku-4-5"
        r = c.post("/v1/messages", json={"model": "llama-3", "messages": ASK, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    for bad in (["claude-*"], ["=tiny"], ["claude-*=other"]):
        with pytest.raises(AliasError, match="--model-alias"):
            make_app(*tiny, NAME, engine=Recording(), model_aliases=bad)


def test_the_output_cap_and_the_context_end_with_max_tokens(tiny, tiny_dir):
    """``max_output_tokens`` caps every request (3 tokens: max_tokens / length); a max_tokens
    past the context (a 64-token one), or past what the KV budget can hold, is clamped to the
    room left, never a 400."""
    never_stops = {"stop_sequences": [], "temperature": 0}
    with TestClient(make_app(*tiny, NAME, max_output_tokens=3)) as c:
        r = c.post(
            "/v1/messages", json={"model": NAME, "messages": ASK, "max_tokens": 100, **never_stops}
        )
        assert r.json()["stop_reason"] == "max_tokens" and r.json()["usage"]["output_tokens"] == 3
        r = c.post(
            "/v1/chat/completions",
            json={"model": NAME, "messages": ASK, "max_tokens": 100, **GREEDY},
        )
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 3
    model, tokenizer = _other(tiny_dir, context=64)
    with TestClient(make_app(model, tokenizer, NAME)) as c:
        r = c.post(
            "/v1/messages",
            json={"model": NAME, "messages": ASK, "max_tokens": 32000, **never_stops},
        )
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        prompt = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
        assert r.json()["stop_reason"] == "max_tokens" and u["output_tokens"] == 64 - prompt
    # A KV budget of 6 blocks (96 tokens) holds less than the 4,096-token context: max_tokens
    # is clamped to what it can hold (less the room every request keeps for drafts).
    app = make_app(*tiny, NAME, kv_budget=6 * 2 * 2 * 2 * 16 * 16 * 4)  # K, V in f32
    with TestClient(app) as c:
        engine = app.state.models.entries[NAME].engine
        assert engine.pool.max_blocks == 6
        r = c.post(
            "/v1/messages",
            json={"model": NAME, "messages": ASK, "max_tokens": 32000, **never_stops},
        )
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        prompt = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
        assert r.json()["stop_reason"] == "max_tokens"
        assert u["output_tokens"] == 6 * 16 - engine.max_draft - prompt


def test_a_flood_of_invented_field_names_is_remembered_within_bounds(caplog):
    """A hostile client inventing thousands of long field names: all accepted, at most
    MAX_LOGGED names (each cut to KEY_CHARS) remembered, one line saying the rest are not
    logged."""
    from mlxinfer.server import fields

    forget_logged()
    caplog.set_level(logging.INFO, logger="mlxinfer.server")
    screen = fields.Fields.of("/v1/test", {"model"})
    body = {f"{i:05d}" + "x" * 10_000: i for i in range(fields.MAX_LOGGED + 500)}
    assert screen.screen(body) is None and screen.screen(body) is None
    assert len(fields._logged) == fields.MAX_LOGGED + 1
    assert max(len(name) for _, name in fields._logged) == fields.KEY_CHARS
    lines = [r.getMessage() for r in caplog.records if r.name == "mlxinfer.server"]
    assert len(lines) == fields.MAX_LOGGED + 1 and "no more are logged" in lines[-1]
    assert max(len(line) for line in lines) < 200  # each name quoted cut short
    forget_logged()


def test_the_official_clients_send_agent_fields_and_read_the_usage(tiny):
    """The ``anthropic`` client (beta messages, with betas, cache_control, adaptive thinking,
    effort, context_management) and the ``openai`` client (store, metadata, prompt_cache_key)
    against a real server: both parse the replies, Anthropic's usage with its cache counts."""
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed")
    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    from servers import serving

    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cch=00000;"},
        {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
    ]
    extra = {
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    with serving(make_app(*tiny, NAME, model_aliases=["claude-*=tiny", "gpt-*=tiny"])) as url:
        client = anthropic.Anthropic(base_url=url, api_key="local", max_retries=0, timeout=60)
        m = client.beta.messages.create(
            model="claude-opus-4-8",
            max_tokens=3,
            system=system,
            messages=ASK,
            metadata={"user_id": "u"},
            betas=["context-management-2025-06-27", "interleaved-thinking-2025-05-14"],
            extra_body=extra,
        )
        assert m.model == "claude-opus-4-8" and m.stop_reason in ("max_tokens", "end_turn")
        u = m.usage
        assert u.cache_creation_input_tokens is not None and u.cache_read_input_tokens is not None
        with client.beta.messages.stream(
            model="claude-opus-4-8", max_tokens=3, system=system, messages=ASK, extra_body=extra
        ) as stream:
            final = stream.get_final_message()
        assert final.usage.cache_read_input_tokens >= 16  # the system prompt, cached before
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0, timeout=60)
        r = chat.chat.completions.create(
            model="gpt-5-codex",
            messages=ASK,
            max_completion_tokens=3,
            store=False,
            metadata={"k": "v"},
            prompt_cache_key="session-1",
            parallel_tool_calls=False,
            extra_body={"x_future_field": True},
        )
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.prompt_tokens > 0


def test_head_on_the_base_url_is_answered(client):
    # Claude Code probes ANTHROPIC_BASE_URL with HEAD before its first request (it was a 405).
    r = client.head("/")
    assert r.status_code in (200, 404)  # 404: the chat page is not built in this checkout
    assert r.content == b""
