"""``mlxinfer serve``: the OpenAI API over HTTP on the batching engine (mlxinfer/server/).

A real uvicorn server on a loopback port, spoken to by the official ``openai`` client and
by raw HTTP. Needs the server extra (FastAPI, uvicorn) and the ``openai`` client."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
from hf_models import add_tokenizer, make_tiny

pytest.importorskip("fastapi", reason="the server extra (FastAPI) is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the server extra (uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
httpx = pytest.importorskip("httpx", reason="httpx (the openai client's HTTP) is not installed")

from scripted import ScriptedEngine  # noqa: E402
from servers import serving  # noqa: E402

from mlxinfer import generate, load  # noqa: E402
from mlxinfer.generation.results import GenerationResult, GenerationStats  # noqa: E402
from mlxinfer.server import make_app  # noqa: E402

NAME, KEY = "tiny", "sk-local-test"
MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("server"), vocab_size=320, hidden_size=64)
    add_tokenizer(path)
    return load(str(path))


@pytest.fixture(scope="module")
def server(tiny):
    """A server on a loopback port, for the module; yields its base URL and its app."""
    model, tokenizer = tiny
    app = make_app(model, tokenizer, NAME, api_key=KEY, max_batch=8)
    with serving(app) as url:
        yield url, app


def _client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _alone(tiny, messages, n, **options):
    model, tokenizer = tiny
    return generate(model, tokenizer, messages, max_tokens=n, **options)


def test_chat_completion_through_the_openai_client(server, tiny):
    url, _ = server
    r = _client(url).chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == _alone(tiny, MESSAGES, 12)
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > 0 and r.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_chat_through_the_openai_client(server, tiny):
    url, _ = server
    stream = _client(url).chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _alone(tiny, MESSAGES, 12)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_logprobs_whole_and_streamed(server, tiny):
    """Greedy: each token is its position's most likely one, so its log-prob heads its
    top_logprobs; the tokens spell the content; the stream carries the same entries."""
    url, _ = server
    model, tokenizer = tiny
    ask = dict(
        model=NAME, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    r = _client(url).chat.completions.create(**ask)
    content = r.choices[0].logprobs.content
    assert len(content) == 8 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0
        assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1 + 1e-5
        assert t.bytes == list(t.token.encode())
    streamed = [
        e
        for c in _client(url).chat.completions.create(**ask, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": NAME, "messages": MESSAGES, "top_logprobs": 2},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_text_completion(server, tiny):
    url, _ = server
    model, tokenizer = tiny
    r = _client(url).completions.create(model=NAME, prompt="Once upon", max_tokens=8, temperature=0)
    assert r.choices[0].text == generate(
        model, tokenizer, "Once upon", max_tokens=8, chat_template=False
    )


def test_text_completion_logprobs_in_the_legacy_shape(server, tiny):
    """/v1/completions' ``logprobs: k``: tokens, their log-probs, the k best per position and
    text offsets; greedy, so each token heads its alternatives; the first token's log-prob is
    the model's own, from a forward over the prompt."""
    import mlx.core as mx

    from mlxinfer.generation.loop import prepare_prompt

    url, _ = server
    model, tokenizer = tiny
    ask = dict(model=NAME, prompt="Once upon", max_tokens=6, temperature=0, logprobs=2)
    r = _client(url).completions.create(**ask)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 6 == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(value) and top[token] == value
    ids = prepare_prompt(tokenizer, "Once upon", chat_template=False)
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    expected = (logits - mx.logsumexp(logits)).max().item()
    assert lp.token_logprobs[0] == pytest.approx(expected, abs=1e-4)
    streamed = [
        (t, round(v, 4))
        for c in _client(url).completions.create(**ask, stream=True)
        if c.choices and c.choices[0].logprobs
        for t, v in zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs)
    ]
    assert streamed == [(t, round(v, 4)) for t, v in zip(lp.tokens, lp.token_logprobs)]
    bad = {"model": NAME, "prompt": "x", "logprobs": 6}
    e = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=bad)
    assert e.status_code == 400 and e.json()["error"]["param"] == "logprobs"


def test_n_choices_whole_and_streamed(server, tiny):
    """``n``: greedy, every choice is the text alone; seeded, choice i is the request with
    seed + i alone; streamed, each choice's chunks carry its index."""
    url, _ = server
    client = _client(url)
    r = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, n=3, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [_alone(tiny, MESSAGES, 6)] * 3
    one = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1)
    assert r.usage.completion_tokens == 18  # over the choices; the prompt counted once
    assert r.usage.prompt_tokens == one.usage.prompt_tokens

    seeded = dict(model=NAME, messages=MESSAGES, max_tokens=8, temperature=1.0)
    alone = [
        client.chat.completions.create(**seeded, seed=5 + i).choices[0].message.content
        for i in range(2)
    ]
    assert alone[0] != alone[1]
    texts = ["", ""]
    for c in client.chat.completions.create(**seeded, seed=5, n=2, stream=True):
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == alone
    whole = client.completions.create(model=NAME, prompt="Once upon", max_tokens=5, n=2, seed=5)
    assert len(whole.choices) == 2 and whole.usage.completion_tokens == 10


def test_response_format_json_schema_and_its_errors(server, tiny):
    """``response_format``: the content validates against the schema, streamed or not, and is
    the text ``generate`` gives under the same constraint; a schema the library cannot
    enforce is a 400 naming ``response_format``, before any token."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the validator) is missing")
    import json

    url, _ = server
    schema = {
        "type": "object",
        "properties": {
            "word": {"type": "string", "maxLength": 5},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["word", "n"],
        "additionalProperties": False,
    }
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }
    ask = dict(model=NAME, messages=MESSAGES, max_tokens=40, temperature=0, response_format=fmt)
    r = _client(url).chat.completions.create(**ask)
    content = r.choices[0].message.content
    jsonschema.validate(json.loads(content), schema)
    assert content == _alone(tiny, MESSAGES, 40, json_schema=schema)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in _client(url).chat.completions.create(**ask, stream=True)
        if c.choices
    )
    assert streamed == content
    for bad, named in (
        ({"type": "json_schema", "json_schema": {"schema": {"not": {}}}}, '["not"]'),
        ({"type": "yaml"}, "response_format.type"),
    ):
        e = httpx.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": NAME, "messages": MESSAGES, "response_format": bad},
        )
        assert e.status_code == 400 and e.json()["error"]["param"] == "response_format"
        assert named in e.json()["error"]["message"]


def test_eight_concurrent_streams_each_get_their_text_alone(server, tiny):
    """Batching is invisible through HTTP: 8 clients streaming at once, greedy."""
    url, _ = server
    asks = [
        [{"role": "user", "content": f"Tell me about the number {i} please."}] for i in range(8)
    ]
    expected = [_alone(tiny, m, 10) for m in asks]
    got = [None] * 8

    def run(i):
        stream = _client(url).chat.completions.create(
            model=NAME, messages=asks[i], max_tokens=10, temperature=0, stream=True
        )
        got[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == expected


def _metrics(url: str, model: str = NAME) -> dict[str, float]:
    """The samples of ``/metrics`` for ``model`` (labels dropped), and the unlabelled ones."""
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        name, _, label = key.partition("{")
        if not label or label == f'model="{model}"}}':
            out[name] = float(value)
    return out


def test_metrics_count_tokens_and_blocks(server):
    url, _ = server
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "# TYPE mlxinfer_generated_tokens_total counter" in r.text
    before = _metrics(url)
    assert before["mlxinfer_up"] == 1
    _client(url).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5, temperature=0)
    after = _metrics(url)
    assert after["mlxinfer_generated_tokens_total"] == before["mlxinfer_generated_tokens_total"] + 5
    assert after["mlxinfer_requests_done_total"] == before["mlxinfer_requests_done_total"] + 1
    assert after["mlxinfer_kv_blocks_in_use"] == before["mlxinfer_kv_blocks_in_use"]
    assert after["mlxinfer_prompt_tokens_total"] >= before["mlxinfer_prompt_tokens_total"]


def test_a_client_that_goes_away_frees_its_blocks(server):
    """Read from /metrics: the pool's blocks in use come back to their count before it."""
    url, _ = server
    before = _metrics(url)["mlxinfer_kv_blocks_in_use"]
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                break  # one token in: hang up
    deadline = time.monotonic() + 20
    while _metrics(url)["mlxinfer_kv_blocks_in_use"] != before:
        assert time.monotonic() < deadline, "the request's blocks were not freed"
        time.sleep(0.05)


def test_a_hang_up_cancels_the_request_at_once(tiny):
    """The stream is closed (in the engine: the request cancelled) within a token of the client
    going away, not when it would have ended (about 30 s here)."""
    engine = ScriptedEngine()
    with serving(make_app(*tiny, NAME, engine=engine)) as url:
        body = {"model": NAME, "messages": [{"role": "user", "content": "long"}], "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 6:
                    break
        assert engine.closed.wait(3), "the request ran on after its client went away"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
def test_a_client_that_hangs_up_on_a_whole_response_frees_its_blocks(tiny, route):
    """``"stream": false``: the handler notices the hang-up while the response is computed and
    cancels the request; its blocks come back (read from /metrics) long before the ~20 s the
    slowed engine would take to finish it."""
    from mlxinfer.batch import Engine

    model, tokenizer = tiny
    engine = Engine(model, max_batch=4)
    decode = engine._decode

    def slowed():  # 0.1 s a step: 200 tokens take about 20 s
        time.sleep(0.1)
        decode()

    engine._decode = slowed
    body = {"model": NAME, "max_tokens": 200, "temperature": 0, "stream": False}
    body.update({"prompt": "Once upon"} if route == "/v1/completions" else {"messages": MESSAGES})
    with serving(make_app(model, tokenizer, NAME, engine=engine)) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}{route}", json=body, timeout=1.0)
        deadline = time.monotonic() + 5
        while (m := _metrics(url))["mlxinfer_kv_blocks_in_use"] or not m.get(
            "mlxinfer_requests_done_total"
        ):
            assert time.monotonic() < deadline, "the request ran on after its client went away"
            time.sleep(0.05)
        assert m["mlxinfer_requests_done_total"] == 1
        assert m["mlxinfer_generated_tokens_total"] < 100


def test_a_quiet_stream_is_kept_alive(tiny, monkeypatch):
    """While no token comes, SSE comments (OpenAI) or ping events (Anthropic) keep the
    connection alive; the clients skip them and get the whole text."""
    from scripted import REPLY

    from mlxinfer.server import sse

    monkeypatch.setattr(sse, "KEEP_ALIVE_S", 0.05)
    with serving(make_app(*tiny, NAME, engine=ScriptedEngine(pause=0.5))) as url:
        body = {"model": NAME, "messages": MESSAGES, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            lines = list(r.iter_lines())
        assert lines.count(": keep-alive") >= 3 and lines[-2] == "data: [DONE]"
        chunks = _client(url).chat.completions.create(model=NAME, messages=MESSAGES, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
        client = _anthropic(url)
        with client.messages.stream(model=NAME, max_tokens=64, messages=MESSAGES) as stream:
            assert "".join(stream.text_stream) == REPLY
        with httpx.stream("POST", f"{url}/v1/messages", json={**body, "max_tokens": 64}) as r:
            events = [line for line in r.iter_lines() if line.startswith("event:")]
        assert events.count("event: ping") >= 4 and events[-1] == "event: message_stop"


def test_a_stream_answers_before_its_first_token(tiny, monkeypatch):
    """A stream's headers and keep-alives go out during the prefill (here 1 s before the
    first token), not after it: Claude Code's fetch gave up after 300 s of silence on a
    19k-token prompt. The Anthropic stream's pings come before message_start, which still
    carries the prompt's usage."""
    import time

    from scripted import REPLY

    from mlxinfer.server import sse

    monkeypatch.setattr(sse, "KEEP_ALIVE_S", 0.05)
    with serving(make_app(*tiny, NAME, engine=ScriptedEngine(first_pause=1.0))) as url:
        body = {"model": NAME, "messages": MESSAGES, "stream": True, "max_tokens": 64}
        for path in ("/v1/chat/completions", "/v1/messages"):
            t0 = time.perf_counter()
            with httpx.stream("POST", f"{url}{path}", json=body) as r:
                headers_s = time.perf_counter() - t0
                assert r.status_code == 200 and headers_s < 0.7, (path, headers_s)
                lines = [line for line in r.iter_lines() if line]
            # OpenAI's role chunk needs no token; then keep-alives until the first one
            first = 1 if path == "/v1/chat/completions" else 0
            assert lines[first] in (": keep-alive", "event: ping"), (path, lines[:3])
        start = lines.index("event: message_start")
        assert lines[:start].count("event: ping") >= 3
        assert '"input_tokens": 7' in lines[start + 1] or '"input_tokens":7' in lines[start + 1]
        client = _anthropic(url)
        with client.messages.stream(model=NAME, max_tokens=64, messages=MESSAGES) as stream:
            assert "".join(stream.text_stream) == REPLY


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": NAME, "messages": MESSAGES, "logit_bias": {"1": 2}}, 400, "logit_bias"),
        ({"model": NAME, "messages": MESSAGES, "tools": []}, 400, "tools"),
        ({"model": NAME, "messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens"),
        ({"model": NAME, "messages": MESSAGES, "n": 17}, 400, "n"),
        ({"model": NAME, "messages": MESSAGES, "n": 0}, 400, "n"),
        ({"model": NAME, "messages": []}, 400, "messages"),
        ({"model": NAME, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0]"),
        ({"model": NAME, "messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
        ({"model": "other", "messages": MESSAGES}, 404, "model"),
        ({"model": NAME, "messages": [{"role": "user", "content": "word " * 5000}]}, 400, None),
    ],
)
def test_bad_requests_are_4xx_in_openais_shape(server, body, status, param):
    url, _ = server
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_malformed_json_and_a_wrong_key(server):
    url, _ = server
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": NAME, "messages": MESSAGES},
        headers={"Authorization": "Bearer wrong"},
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_models_and_health(server):
    url, app = server
    assert [m.id for m in _client(url).models.list()] == [NAME]
    r = httpx.get(f"{url}/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "models": {NAME: {"loaded": True, "restarts": 0}}}


def test_health_reports_a_dead_engine(tiny):
    """/health asks the engine thread, not only HTTP: a stopped engine is a 503."""
    from fastapi.testclient import TestClient

    model, tokenizer = tiny
    app = make_app(model, tokenizer, NAME)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        app.state.models.entries[NAME].engine.close()
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "error"
        r = client.post("/v1/chat/completions", json={"model": NAME, "messages": MESSAGES})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the fault
def test_an_engine_fault_fails_its_requests_and_the_next_request_succeeds(tiny):
    """A fault inside a forward pass: the request it was running gets a 500 in the API's shape,
    /health reports the restart and the failure, and the next request is served."""
    from fastapi.testclient import TestClient

    model, tokenizer = tiny

    class Faulty:  # the model, except that a forward raises
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, *args, **kwargs):
            raise RuntimeError("injected fault")

    app = make_app(model, tokenizer, NAME)
    with TestClient(app) as client:
        app.state.models.entries[NAME].engine.model = Faulty(model)
        body = {"model": NAME, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == _alone(tiny, MESSAGES, 4)
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["models"][NAME]["restarts"] == 1
        assert "injected fault" in health["models"][NAME]["last_failure"]


def test_cors_headers_only_for_the_origins_asked_for(tiny):
    from fastapi.testclient import TestClient

    preflight = {
        "Origin": "http://localhost:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    with TestClient(make_app(*tiny, NAME, engine=ScriptedEngine())) as client:
        r = client.options("/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = client.get("/v1/models", headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    app = make_app(*tiny, NAME, engine=ScriptedEngine(), cors_origins=["http://localhost:3000"])
    with TestClient(app) as client:
        r = client.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = client.options(
            "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"}
        )
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    """(the tiny model's directory, a 1-layer draft with its tokenizer, a 1-layer draft with
    another vocabulary)."""
    target, _ = make_tiny(tmp_path_factory.mktemp("target"), vocab_size=320, hidden_size=64)
    add_tokenizer(target)
    draft, _ = make_tiny(
        tmp_path_factory.mktemp("draft"), vocab_size=320, num_hidden_layers=1, seed=1
    )
    add_tokenizer(draft)
    other, _ = make_tiny(tmp_path_factory.mktemp("other"), num_hidden_layers=1, seed=2)
    add_tokenizer(other, vocab_size=300)
    return target, draft, other


def _serve_app(monkeypatch, *args) -> tuple:
    """``mlxinfer serve ARGS``' result and the app it would have run (uvicorn not started)."""
    from click.testing import CliRunner

    import mlxinfer.server
    from mlxinfer.cli.main import cli

    apps = []

    def build(model, tokenizer, name, *, host, port, **options):
        apps.append(make_app(model, tokenizer, name, **options))

    monkeypatch.setattr(mlxinfer.server, "serve", build)
    result = CliRunner().invoke(cli, ["serve", *args])
    return result, apps[0] if apps else None


def test_serve_with_a_draft_model(tiny, draft_dirs, monkeypatch):
    """``serve --draft-model``: every request drafts with it, whole or streamed, greedy text as
    alone; /metrics shows its drafts, forwards and memory; another vocabulary is an error
    naming both models, and a second draft source a usage error."""
    from fastapi.testclient import TestClient

    target, draft, other = draft_dirs
    result, app = _serve_app(monkeypatch, "-m", str(target), "--draft-model", str(draft))
    assert result.exit_code == 0, result.output
    ask = {"model": target.name, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=ask)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == _alone(
            tiny, MESSAGES, 12
        )
        r = client.post("/v1/chat/completions", json={**ask, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert streamed == _alone(tiny, MESSAGES, 12)
        # Drafted tokens have their log-probs too (each token's the greedy one: its top entry).
        r = client.post("/v1/chat/completions", json={**ask, "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert "".join(t["token"] for t in content) == _alone(tiny, MESSAGES, 12)
        assert all(t["top_logprobs"][0]["token"] == t["token"] for t in content)
        engine = app.state.models.entries[target.name].engine
        # The draft's pool is inside the budget (1 GiB): as many blocks as the target's.
        (draft_pool,) = engine._draft_pools.values()
        assert draft_pool.pool.max_blocks == engine.pool.max_blocks
        held = [p.max_blocks * p.bytes_per_block for p in (engine.pool, draft_pool.pool)]
        per_block = engine.pool.bytes_per_block + draft_pool.pool.bytes_per_block
        assert sum(held) <= 1 << 30 < sum(held) + per_block
        m = engine.metrics()
        assert m["draft_tokens"] > 0 and m["draft_steps"] >= m["draft_tokens"]
        assert m["draft_model_bytes"] > 0 and m["draft_seconds"] > 0
        text = client.get("/metrics").text
        assert f'mlxinfer_draft_steps_total{{model="{target.name}"}} {m["draft_steps"]:g}' in text
        assert "# TYPE mlxinfer_draft_kv_bytes gauge" in text
    result, _ = _serve_app(monkeypatch, "-m", str(target), "--draft-model", str(other))
    assert result.exit_code == 1 and "different vocabularies" in result.output
    assert str(other) in result.output and str(target) in result.output
    assert "300 tokens vs the target's 320" in result.output
    result, _ = _serve_app(monkeypatch, "--prompt-lookup", "--draft-model", str(draft))
    assert result.exit_code == 2
    assert "choose one draft source, got --draft-model and --prompt-lookup" in result.output


def test_serve_takes_its_kv_budget_at_start_unless_told_to_grow(draft_dirs, monkeypatch):
    """A server's memory is flat all day: its pool holds every block of --kv-budget from the
    start (and keeps them after a request; --kv-reserve, the default, says so); --kv-grow grows it
    with the load instead."""
    from fastapi.testclient import TestClient

    target = draft_dirs[0]
    budget = 1 << 22
    for flags, reserved in (([], True), (["--kv-reserve"], True), (["--kv-grow"], False)):
        result, app = _serve_app(monkeypatch, "-m", str(target), "--kv-budget", str(budget), *flags)
        assert result.exit_code == 0, result.output
        engine = app.state.models.entries[target.name].engine
        whole = engine.pool.max_blocks * engine.pool.bytes_per_block
        assert whole <= budget < whole + engine.pool.bytes_per_block
        assert (engine.stats().nbytes == whole) is reserved
        ask = {"model": target.name, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
        with TestClient(app) as client:
            assert client.post("/v1/chat/completions", json=ask).status_code == 200
        assert (engine.stats().nbytes == whole) is reserved


def test_serve_binds_loopback_by_default():
    from click.testing import CliRunner

    from mlxinfer.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", "--help"])
    assert result.exit_code == 0 and "127.0.0.1" in result.output


# --- Anthropic's Messages API ---------------------------------------------------------------------


# The current Messages API has no sampling fields; the server takes temperature, top_p and top_k
# in the body as the API's earlier versions did (the client passes them through extra_body).
GREEDY = {"temperature": 0}


def _anthropic(url: str, key: str = KEY):
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed")
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def test_messages_through_the_anthropic_client(server, tiny):
    url, _ = server
    system = "You are terse."
    m = _anthropic(url).messages.create(
        model=NAME, system=system, messages=MESSAGES, max_tokens=12, extra_body=GREEDY
    )
    expected = _alone(tiny, [{"role": "system", "content": system}] + MESSAGES, 12)
    assert m.type == "message" and m.role == "assistant"
    assert m.content[0].text == expected
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12
    assert m.usage.input_tokens > 0


def test_streamed_messages_come_in_anthropics_order(server, tiny):
    url, _ = server
    with _anthropic(url).messages.stream(
        model=NAME, messages=MESSAGES, max_tokens=10, extra_body=GREEDY
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == _alone(tiny, MESSAGES, 10)
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.stop_reason == "max_tokens"


def test_a_stop_sequence_is_named(server, tiny):
    url, _ = server
    text = _alone(tiny, MESSAGES, 12)
    stop = text[3:6]  # a piece of what greedy decoding writes
    m = _anthropic(url).messages.create(
        model=NAME, messages=MESSAGES, max_tokens=12, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


class Stopped(ScriptedEngine):
    """Writes "It is sunny." and ends at a stop string, which its last result names (its token
    ids decode to other text: a reply that looked for the stop in them would miss it)."""

    def stream(self, tokenizer, prompt, *, max_tokens, **options):
        stats = GenerationStats(prompt_tokens=7)
        yield GenerationResult("It is ", 100, stats=stats)
        yield GenerationResult("sunny.", 101, finish_reason="stop", stop_string="STOP", stats=stats)


def test_the_stop_sequence_is_the_stop_string_the_result_names(tiny):
    """Anthropic's ``stop_sequence`` is the result's ``stop_string`` (the one the matcher hit),
    whole and streamed, though another of the request's stop strings is in the text."""
    with serving(make_app(*tiny, NAME, engine=Stopped())) as url:
        client = _anthropic(url)
        ask = dict(model=NAME, messages=MESSAGES, max_tokens=12, stop_sequences=["It", "STOP"])
        m = client.messages.create(**ask)
        assert (m.stop_reason, m.stop_sequence, m.content[0].text) == (
            "stop_sequence",
            "STOP",
            "It is sunny.",
        )
        with client.messages.stream(**ask) as stream:
            final = stream.get_final_message()
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "STOP")


def test_count_tokens_and_anthropic_errors(server):
    url, _ = server
    client = _anthropic(url)
    n = client.messages.count_tokens(model=NAME, messages=MESSAGES).input_tokens
    assert n > 0
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    r = httpx.post(
        f"{url}/v1/messages", json={"model": NAME, "messages": MESSAGES}, headers=headers
    )
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.text
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 4, "mcp_servers": [], "x_new": 1}
    r = httpx.post(f"{url}/v1/messages", json=body, headers=headers)
    assert r.status_code == 200, r.text  # no local meaning, or unknown: accepted and ignored
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 4, "thinking": {"type": "maybe"}}
    r = httpx.post(f"{url}/v1/messages", json=body, headers=headers)
    assert r.status_code == 400 and "thinking: {'type'" in r.json()["error"]["message"]
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 4, "tools": []}
    r = httpx.post(f"{url}/v1/messages", json=body, headers=headers)
    assert r.status_code == 400 and "tools: expected a non-empty list" in r.text
    body = {"model": "other", "messages": MESSAGES, "max_tokens": 4}
    r = httpx.post(f"{url}/v1/messages", json=body, headers=headers)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    import anthropic

    with pytest.raises(anthropic.AuthenticationError):
        _anthropic(url, key="wrong").messages.create(model=NAME, messages=MESSAGES, max_tokens=2)


# --- several models: --models-dir and --keep-alive ------------------------------------------------


def test_models_from_a_directory_load_on_first_use_and_unload_when_idle(tiny, tmp_path):
    """Two converted models under a directory: listed before they load, each loaded by the first
    request that names it, unloaded after keep_alive idle seconds and loaded again on demand; a
    name that is not one of them (a path included) is a 404."""
    from fastapi.testclient import TestClient

    from mlxinfer.loading.convert import convert

    src, _ = make_tiny(tmp_path / "hf", vocab_size=320, hidden_size=64)
    add_tokenizer(src)
    for name in ("alpha", "beta"):
        convert(src, tmp_path / "models" / name, dtype="float32")
    (tmp_path / "models" / "notes").mkdir()  # no config.json: not a model
    loads = []

    def load_counted(path):
        loads.append(Path(path).name)
        return load(path)

    app = make_app(models_dir=tmp_path / "models", keep_alive=3600, load=load_counted)
    registry = app.state.models
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["alpha", "beta"]
        assert loads == []
        r = client.post("/v1/chat/completions", json={"model": "alpha", **body})
        assert r.status_code == 200 and loads == ["alpha"]
        assert r.json()["choices"][0]["message"]["content"] == _alone(tiny, MESSAGES, 4)
        client.post("/v1/chat/completions", json={"model": "alpha", **body})
        assert loads == ["alpha"]  # loaded once
        health = client.get("/health").json()["models"]
        assert health["alpha"]["loaded"] and not health["beta"]["loaded"]
        assert registry.reap(now=time.monotonic() + 3601) == ["alpha"]
        assert not client.get("/health").json()["models"]["alpha"]["loaded"]
        r = client.post("/v1/chat/completions", json={"model": "alpha", **body})
        assert r.status_code == 200 and loads == ["alpha", "alpha"]
        for bad in ("gamma", "notes", "../models/alpha", str(tmp_path / "models" / "alpha")):
            r = client.post("/v1/chat/completions", json={"model": bad, **body})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", bad
