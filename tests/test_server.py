"""``mlxinfer serve``: the OpenAI API over HTTP on the batching engine (mlxinfer/server/).

A real uvicorn server on a loopback port, spoken to by the official ``openai`` client and
by raw HTTP. Needs the server extra (FastAPI, uvicorn) and the ``openai`` client."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from hf_models import add_tokenizer, make_tiny

pytest.importorskip("fastapi", reason="the server extra (FastAPI) is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the server extra (uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
httpx = pytest.importorskip("httpx", reason="httpx (the openai client's HTTP) is not installed")

from mlxinfer import generate, load  # noqa: E402
from mlxinfer.server import make_app  # noqa: E402

NAME, KEY = "tiny", "sk-local-test"
MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("server"), vocab_size=320, hidden_size=64)
    add_tokenizer(path)
    return load(str(path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny):
    """A server on a loopback port, for the module; yields its base URL and its app."""
    model, tokenizer = tiny
    app = make_app(model, tokenizer, NAME, api_key=KEY, max_batch=8)
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start within 30 s"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", app
    srv.should_exit = True
    thread.join(10)


def _client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _alone(tiny, messages, n):
    model, tokenizer = tiny
    return generate(model, tokenizer, messages, max_tokens=n)


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


def test_text_completion(server, tiny):
    url, _ = server
    model, tokenizer = tiny
    r = _client(url).completions.create(model=NAME, prompt="Once upon", max_tokens=8, temperature=0)
    assert r.choices[0].text == generate(
        model, tokenizer, "Once upon", max_tokens=8, chat_template=False
    )


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


def test_a_client_that_goes_away_frees_its_blocks(server):
    url, app = server
    engine = app.state.engine
    before = engine.stats().blocks_in_use
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                break  # one token in: hang up
    deadline = time.monotonic() + 20
    while engine.stats().blocks_in_use != before:
        assert time.monotonic() < deadline, "the request's blocks were not freed"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": NAME, "messages": MESSAGES, "logit_bias": {"1": 2}}, 400, "logit_bias"),
        ({"model": NAME, "messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens"),
        ({"model": NAME, "messages": MESSAGES, "n": 2}, 400, "n"),
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
        headers={"Authorization": f"Bearer {KEY}"},
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
    assert r.status_code == 200 and r.json() == {"status": "ok", "model": NAME}


def test_health_reports_a_dead_engine(tiny):
    """/health asks the engine thread, not only HTTP: a stopped engine is a 503."""
    from fastapi.testclient import TestClient

    model, tokenizer = tiny
    app = make_app(model, tokenizer, NAME)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        app.state.engine.close()
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "error"
        r = client.post("/v1/chat/completions", json={"model": NAME, "messages": MESSAGES})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_serve_binds_loopback_by_default():
    from click.testing import CliRunner

    from mlxinfer.cli import cli

    result = CliRunner().invoke(cli, ["serve", "--help"])
    assert result.exit_code == 0 and "127.0.0.1" in result.output
