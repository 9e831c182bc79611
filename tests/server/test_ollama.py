"""Ollama's API on ``mlxinfer serve``, through the official ``ollama`` Python client: list, show,
ps, chat and generate whole and streamed (the same greedy text as the OpenAI route), tools,
thinking, ``format``, embed.

A tiny model with a Hermes (Qwen-style) chat template answers for real; tool calls and
thinking come from a scripted engine whose text the server parses as the engine's."""

from __future__ import annotations

import json
from datetime import datetime

import numpy as np
import pytest
from scripted import ScriptedEngine
from servers import serving
from test_embeddings import write_checkpoint
from test_toolcalls import ADD, ASK, TOOLS, _tiny
from tool_templates import HERMES, THINK

ollama = pytest.importorskip("ollama", reason="the ollama client is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the validator) is missing")

from mlxinfer.generation.results import GenerationResult, GenerationStats  # noqa: E402
from mlxinfer.server import make_app  # noqa: E402

NAME = "tiny"
GREEDY = {"temperature": 0, "num_predict": 12}
MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("ollama"), HERMES)


@pytest.fixture(scope="module")
def embedding(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ollama-embed") / "tiny-embedding")[0]


@pytest.fixture(scope="module")
def url(tiny, embedding):
    model, tokenizer = tiny
    app = make_app(model, tokenizer, NAME, max_batch=4, embedding_model=str(embedding))
    with serving(app) as base:
        yield base


def _client(url):
    return ollama.Client(host=url, timeout=120)


def _openai(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def test_list_show_and_ps_describe_the_served_models(url, embedding):
    client = _client(url)
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {f"{NAME}:latest", f"{embedding.name}:latest"}
    tiny = listed[f"{NAME}:latest"]
    assert isinstance(tiny.modified_at, datetime) and tiny.size > 0 and len(tiny.digest) == 64
    assert tiny.details.family == "llama"

    shown = client.show(NAME)  # name and name:latest are one model
    assert client.show(f"{NAME}:latest").modelinfo == shown.modelinfo
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 4096
    assert shown.capabilities == ["completion", "tools"]  # Hermes shows tools, marks no thinking
    assert "<tools>" in shown.template
    assert client.show(embedding.name).capabilities == ["embedding"]

    running = {m.model: m for m in client.ps().models}
    assert running[f"{NAME}:latest"].context_length == 4096
    assert running[f"{NAME}:latest"].expires_at.year > 2100  # the start model stays loaded


def test_chat_whole_and_streamed_give_the_openai_routes_greedy_text(url):
    expected = _openai(url).chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=12, temperature=0
    )
    text = expected.choices[0].message.content
    client = _client(url)
    r = client.chat(model=NAME, messages=MESSAGES, options=GREEDY)
    assert r.message.role == "assistant" and r.message.content == text
    assert r.done and r.done_reason == "length" and r.eval_count == 12
    assert r.prompt_eval_count == expected.usage.prompt_tokens
    for key in ("total_duration", "prompt_eval_duration", "eval_duration", "load_duration"):
        assert isinstance(getattr(r, key), int), key
    assert r.total_duration >= r.eval_duration > 0
    datetime.fromisoformat(r.created_at.replace("Z", "+00:00"))

    chunks = list(client.chat(model=NAME, messages=MESSAGES, options=GREEDY, stream=True))
    assert "".join(c.message.content or "" for c in chunks) == text
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].done_reason == "length" and chunks[-1].eval_count == 12


def test_generate_is_one_user_turn_and_raw_is_the_text_itself(url):
    prompt, system = "Tell me a story.", "You are terse."
    turns = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    chat = _openai(url).chat.completions.create(
        model=NAME, messages=turns, max_tokens=12, temperature=0
    )
    client = _client(url)
    r = client.generate(model=NAME, prompt=prompt, system=system, options=GREEDY)
    assert r.response == chat.choices[0].message.content and r.done_reason == "length"
    streamed = client.generate(
        model=NAME, prompt=prompt, system=system, options=GREEDY, stream=True
    )
    assert "".join(c.response for c in streamed) == r.response

    completion = _openai(url).completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0
    )
    raw = client.generate(model=NAME, prompt=prompt, raw=True, options=GREEDY)
    assert raw.response == completion.choices[0].text != r.response


def test_options_change_the_output_as_asked(url):
    client = _client(url)
    whole = client.chat(model=NAME, messages=MESSAGES, options=GREEDY).message.content
    stop = whole[4:7]
    cut = client.chat(model=NAME, messages=MESSAGES, options={**GREEDY, "stop": [stop]})
    assert cut.message.content == whole[: whole.index(stop)] and cut.done_reason == "stop"
    short = client.chat(model=NAME, messages=MESSAGES, options={"temperature": 0, "num_predict": 3})
    assert short.eval_count == 3 and whole.startswith(short.message.content)
    seeded = {"temperature": 1.5, "seed": 7, "num_predict": 8, "top_k": 0, "top_p": 1.0}
    first = client.chat(model=NAME, messages=MESSAGES, options=seeded).message.content
    assert client.chat(model=NAME, messages=MESSAGES, options=seeded).message.content == first
    penalised = client.chat(
        model=NAME, messages=MESSAGES, options={**GREEDY, "repeat_penalty": 5.0}
    ).message.content
    assert penalised != whole  # a strong penalty changes a tiny model's greedy text


def test_format_gives_json_that_validates(url):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    client = _client(url)
    options = {"temperature": 0, "num_predict": 60}
    r = client.chat(model=NAME, messages=MESSAGES, format=schema, options=options)
    jsonschema.validate(json.loads(r.message.content), schema)
    # "json": any object, as OpenAI's json_object (a random model's keys may run past 20 tokens)
    short = {"temperature": 0, "num_predict": 20}
    g = client.generate(model=NAME, prompt="Reply in JSON.", format="json", options=short)
    reference = _openai(url).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Reply in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=20,
        temperature=0,
    )
    assert g.response == reference.choices[0].message.content and g.response.startswith("{")
    plain = client.generate(model=NAME, prompt="Reply in JSON.", options=short).response
    assert not plain.lstrip().startswith("{")  # the format did it, not the model


def test_embed_gives_the_openai_routes_vectors(url, embedding):
    texts = ["the cat sat", "a dog barked loudly"]
    reference = _openai(url).embeddings.create(
        model=embedding.name, input=texts, encoding_format="float"
    )
    client = _client(url)
    r = client.embed(model=embedding.name, input=texts)
    np.testing.assert_allclose(r.embeddings, [d.embedding for d in reference.data], atol=1e-6)
    assert r.prompt_eval_count == reference.usage.prompt_tokens
    one = client.embeddings(model=f"{embedding.name}:latest", prompt=texts[0])
    np.testing.assert_allclose(one.embedding, reference.data[0].embedding, atol=1e-6)
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=NAME, input="x")  # a generative model: not an embedding one
    assert e.value.status_code == 400


def test_embed_truncates_past_the_context_unless_told_not_to(url, embedding):
    transformers = pytest.importorskip("transformers")
    long = "the cat sat on the mat " * 80  # past the checkpoint's 256 tokens
    cut = transformers.AutoTokenizer.from_pretrained(embedding)(
        long, truncation=True, max_length=256
    )["input_ids"]
    assert len(cut) == 256
    reference = _openai(url).embeddings.create(
        model=embedding.name, input=[cut], encoding_format="float"
    )
    client = _client(url)
    r = client.embed(model=embedding.name, input=long)  # Ollama's default: truncate
    np.testing.assert_allclose(r.embeddings[0], reference.data[0].embedding, atol=1e-6)
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=embedding.name, input=long, truncate=False)
    assert e.value.status_code == 400 and "context" in e.value.error


# --- tools and thinking: a scripted engine's text, parsed as the engine's -----------------------


class Scripted(ScriptedEngine):
    """Answers with ``reply`` in pieces, whatever it is asked."""

    def __init__(self, reply: str) -> None:
        super().__init__(delay=0)
        self.reply = reply

    def stream(self, tokenizer, prompt, *, max_tokens, **options):
        self.prompts.append(prompt)
        pieces = [self.reply[i : i + 4] for i in range(0, len(self.reply), 4)]
        stats = GenerationStats(prompt_tokens=5)
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield GenerationResult(piece, i, finish_reason="stop" if last else None, stats=stats)


def _scripted(tiny, reply: str):
    model, tokenizer = tiny
    engine = Scripted(reply)
    return make_app(model, tokenizer, NAME, engine=engine), engine


@pytest.fixture(scope="module")
def tools_url(tmp_path_factory):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    app, engine = _scripted(_tiny(tmp_path_factory.mktemp("ollama-tools"), HERMES), call)
    with serving(app) as base:
        yield base, engine


def test_tool_calls_come_back_as_objects_and_results_go_in_as_tool_turns(tools_url):
    url, engine = tools_url
    client = _client(url)
    r = client.chat(model=NAME, messages=ASK, tools=TOOLS)
    [call] = r.message.tool_calls
    assert call.function.name == "add" and call.function.arguments == {"a": 1, "b": 2}
    jsonschema.validate(dict(call.function.arguments), ADD)
    assert not r.message.content  # the call's text is not the answer
    chunks = list(client.chat(model=NAME, messages=ASK, tools=TOOLS, stream=True))
    calls = [c for chunk in chunks for c in chunk.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    # The official client drops the empty content and the call's id; the result is a tool turn.
    follow = [*ASK, r.message, {"role": "tool", "content": "3", "tool_name": "add"}]
    client.chat(model=NAME, messages=follow, tools=TOOLS)
    sent = engine.prompts[-1]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert sent[2]["role"] == "tool" and sent[2]["name"] == "add"
    assert sent[2]["tool_call_id"] == sent[1]["tool_calls"][0]["id"]


@pytest.fixture(scope="module")
def thinking_url(tmp_path_factory):
    reply = "<think>Two numbers.</think>The sum is 3."
    tiny = _tiny(tmp_path_factory.mktemp("ollama-think"), THINK)
    app, _ = _scripted(tiny, reply)
    with serving(app) as base:
        yield base


def test_thinking_is_its_own_field_and_show_says_the_model_thinks(thinking_url, url):
    client = _client(thinking_url)
    assert "thinking" in client.show(NAME).capabilities
    r = client.chat(model=NAME, messages=MESSAGES, think=True)
    assert r.message.thinking == "Two numbers." and r.message.content == "The sum is 3."
    g = client.generate(model=NAME, prompt="1 + 2?", think=True)
    assert g.thinking == "Two numbers." and g.response == "The sum is 3."
    with pytest.raises(ollama.ResponseError) as e:  # a model without thinking says so
        _client(url).chat(model=NAME, messages=MESSAGES, think=True)
    assert e.value.status_code == 400 and "thinking" in e.value.error


def test_a_slow_first_token_gets_empty_pieces_and_a_hang_up_cancels(tiny, monkeypatch):
    """While the first token is slow to come (a long prefill), the stream sends empty pieces, which
    the clients take as nothing; a client that hangs up mid-stream cancels its request."""
    import time

    import httpx
    from scripted import REPLY

    from mlxinfer.server import sse

    monkeypatch.setattr(sse, "KEEP_ALIVE_S", 0.1)
    engine = ScriptedEngine(first_pause=1.0)
    with serving(make_app(*tiny, NAME, engine=engine)) as base:
        body = {"model": NAME, "messages": MESSAGES}
        with httpx.stream("POST", f"{base}/api/chat", json=body, timeout=60) as r:
            lines = [json.loads(line) for line in r.iter_lines()]
        empties = [x for x in lines if not x["done"] and x["message"]["content"] == ""]
        assert len(empties) >= 3 and lines[-1]["done"]
        chunks = _client(base).chat(model=NAME, messages=MESSAGES, stream=True)
        assert "".join(c.message.content for c in chunks) == REPLY

    slow = ScriptedEngine(delay=0.2)  # the whole reply would take ~14 s
    with serving(make_app(*tiny, NAME, engine=slow)) as base:
        t0 = time.monotonic()
        with httpx.stream(
            "POST", f"{base}/api/generate", json={"model": NAME, "prompt": "hi"}
        ) as r:
            next(r.iter_lines())
        assert slow.closed.wait(10) and time.monotonic() - t0 < 10


def test_logprobs_are_the_openai_routes_whole_and_streamed(url):
    reference = _openai(url).chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    expected = [
        (t.token, round(t.logprob, 4), [a.token for a in t.top_logprobs])
        for t in reference.choices[0].logprobs.content
    ]
    client = _client(url)
    ask = dict(model=NAME, messages=MESSAGES, options={"temperature": 0, "num_predict": 6})
    whole = client.chat(**ask, logprobs=True, top_logprobs=3)

    def seen(entries):
        return [(e.token, round(e.logprob, 4), [a.token for a in e.top_logprobs]) for e in entries]

    assert seen(whole.logprobs) == expected and len(expected) == 6
    streamed = [e for c in client.chat(**ask, logprobs=True, top_logprobs=3, stream=True)
                for e in c.logprobs or []]  # fmt: skip
    assert seen(streamed) == expected
    assert client.chat(**ask).logprobs is None  # only when asked
