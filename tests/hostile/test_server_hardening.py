"""``mlxinfer serve`` against hostile and heavy clients (mlxinfer/server/limits.py, run.py).

Each limit answers in the API's own JSON error shape (OpenAI's on ``/v1/chat/completions`` and
the rest, Anthropic's on ``/v1/messages``), through a real uvicorn (``run.server``, the one
``serve`` starts) where the transport matters, through FastAPI's test client where it does not.
Raw sockets stand in for the clients no library would be: a body that never comes, 101 headers."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
from hf_models import add_tokenizer, make_tiny

pytest.importorskip("fastapi", reason="the server extra (FastAPI) is not installed")
pytest.importorskip("uvicorn", reason="the server extra (uvicorn) is not installed")
httpx = pytest.importorskip("httpx", reason="httpx is not installed")

from fastapi.testclient import TestClient  # noqa: E402
from scripted import ScriptedEngine  # noqa: E402
from servers import free_port  # noqa: E402

from mlxinfer import load  # noqa: E402
from mlxinfer.server import make_app  # noqa: E402
from mlxinfer.server.anthropic import request as anthropic_request  # noqa: E402
from mlxinfer.server.openai import request as openai_request  # noqa: E402

NAME = "tiny"
MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]
CHAT = {"model": NAME, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
ANTHROPIC = {"model": NAME, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # A long context, so that a stream can outlive the SIGTERM bound.
    path, _ = make_tiny(
        tmp_path_factory.mktemp("hardening"),
        vocab_size=320,
        hidden_size=64,
        max_position_embeddings=32768,
    )
    add_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(str(tiny_dir))


@contextmanager
def running(app):
    """``app`` under the uvicorn server ``mlxinfer serve`` runs (its h11 limit, its shutdown),
    on a loopback port; yields the port."""
    from mlxinfer.server.run import server

    port = free_port()
    srv = server(app, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start within 30 s"
        time.sleep(0.02)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(15)


def _raw(port: int, head: str, body: bytes = b"", timeout: float = 5.0) -> tuple[int, dict, bytes]:
    """Send a hand-written request; (status, headers, body) of the answer, read until the server
    closes the connection (or ``timeout``: then AssertionError)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.replace("\n", "\r\n").encode("latin-1") + body)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except socket.timeout:
            raise AssertionError(f"no answer within {timeout} s: {data[:200]!r}") from None
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, rest


def _openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert "\n" not in error["message"]
    return error


def _anthropic_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["message"] and "\n" not in body["error"]["message"]
    return body["error"]


# --- the body ------------------------------------------------------------------------------------


def test_a_body_over_the_cap_is_a_413_before_or_while_it_is_read(tiny):
    """A Content-Length over ``max_body`` is answered before a byte of the body (none is sent
    here: without the cap the server would wait for it); a chunked body is counted as it comes."""
    app = make_app(*tiny, NAME, engine=ScriptedEngine(delay=0), max_body=4096)
    with running(app) as port:
        for path in ("/v1/chat/completions", "/v1/messages"):
            head = (
                f"POST {path} HTTP/1.1\nHost: 127.0.0.1:{port}\n"
                f"Content-Type: application/json\nContent-Length: {1 << 30}\n\n"
            )
            status, headers, body = _raw(port, head)
            assert status == 413 and headers["connection"] == "close"
            reply = json.loads(body)
            if path == "/v1/messages":
                assert reply["error"]["type"] == "request_too_large"
            else:
                assert reply["error"]["code"] == "request_too_large"
            assert f"{1 << 30} bytes (at most 4096)" in json.dumps(reply)

        def chunks():  # no Content-Length: sent chunked, 10 KB in all
            for _ in range(10):
                yield b" " * 1000

        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            content=chunks(),
            headers={"content-type": "application/json"},
        )
        assert _openai_error(r, 413)["code"] == "request_too_large"
        ok = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200, ok.text  # a body under the cap


def test_a_body_sent_too_slowly_is_a_408(tiny):
    """10 of 100 announced bytes, then nothing: answered 408 once ``body_timeout`` has passed,
    and the connection closed (without the timeout the server waits as long as the client)."""
    app = make_app(*tiny, NAME, engine=ScriptedEngine(delay=0), body_timeout=0.5)
    with running(app) as port:
        head = (
            f"POST /v1/messages HTTP/1.1\nHost: 127.0.0.1:{port}\n"
            "Content-Type: application/json\nContent-Length: 100\n\n"
        )
        t = time.monotonic()
        status, headers, body = _raw(port, head, b'{"model": ', timeout=5)
        assert status == 408 and 0.4 < time.monotonic() - t < 4
        assert headers["connection"] == "close"
        reply = json.loads(body)
        assert reply["type"] == "error" and "10 bytes came in 0.5 s" in reply["error"]["message"]


def test_a_body_without_a_json_content_type_is_a_415(tiny):
    """A browser's form or text/plain POST (no CORS preflight) is never read as JSON."""
    with TestClient(make_app(*tiny, NAME, engine=ScriptedEngine(delay=0))) as client:
        body = json.dumps(CHAT).encode()
        for kind in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"content-type": kind} if kind else {}
            r = client.post("/v1/chat/completions", content=body, headers=headers)
            assert _openai_error(r, 415)["code"] == "unsupported_media_type"
            r = client.post("/v1/messages", content=json.dumps(ANTHROPIC), headers=headers)
            assert "application/json" in _anthropic_error(r, 415)["message"]
        for kind in ("application/json; charset=utf-8", "Application/JSON", "application/x+json"):
            r = client.post("/v1/chat/completions", content=body, headers={"content-type": kind})
            assert r.status_code == 200, (kind, r.text)


def test_a_prompt_far_past_the_context_is_refused_before_tokenizing(tiny, monkeypatch):
    """A million characters for a 32768-token context: a 400 (``context_length_exceeded``)
    counted in characters, the tokenizer never called (it takes seconds on such a prompt, minutes
    on 50 MB)."""
    import mlxinfer.generation.loop as loop
    import mlxinfer.generation.request as request

    calls = []

    def counted(real):
        def prepare(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        return prepare

    monkeypatch.setattr(request, "prepare_prompt", counted(request.prepare_prompt))
    monkeypatch.setattr(loop, "prepare_prompt", counted(loop.prepare_prompt))
    long = [{"role": "user", "content": "word " * 200_000}]
    with TestClient(make_app(*tiny, NAME)) as client:
        r = client.post("/v1/chat/completions", json={**CHAT, "messages": long})
        error = _openai_error(r, 400)
        assert error["code"] == "context_length_exceeded"
        assert "1000015 characters" in error["message"] and "32768 tokens" in error["message"]
        r = client.post("/v1/completions", json={"model": NAME, "prompt": "word " * 200_000})
        assert _openai_error(r, 400)["code"] == "context_length_exceeded"
        r = client.post("/v1/messages", json={**ANTHROPIC, "messages": long})
        assert "characters" in _anthropic_error(r, 400)["message"]
        r = client.post("/v1/messages/count_tokens", json={"model": NAME, "messages": long})
        assert "characters" in _anthropic_error(r, 400)["message"]
        assert calls == []
        r = client.post("/v1/messages/count_tokens", json={"model": NAME, "messages": MESSAGES})
        assert r.status_code == 200 and calls == [1]  # a short prompt is tokenized as before


# --- headers and hosts ---------------------------------------------------------------------------


def test_headers_past_the_limits_are_a_431_and_a_long_beta_header_passes(tiny):
    """40 KB of ``anthropic-beta`` (more than uvicorn's default 16 KB head) is served; 101 headers,
    or 70 KB of them, are a 431 in the API's shape."""
    app = make_app(*tiny, NAME, engine=ScriptedEngine(delay=0))
    with running(app) as port:
        url = f"http://127.0.0.1:{port}"
        beta = ",".join(f"feature-{i:05d}-2025-01-01" for i in range(1700))
        assert 40_000 < len(beta) < 64_000
        r = httpx.post(f"{url}/v1/messages", json=ANTHROPIC, headers={"anthropic-beta": beta})
        assert r.status_code == 200, r.text[:300]
        many = {f"x-h{i}": "1" for i in range(101)}
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=many)
        assert "headers" in _openai_error(r, 431)["message"]
        big = {"x-a": "a" * 35_000, "x-b": "b" * 35_000}
        r = httpx.post(f"{url}/v1/messages", json=ANTHROPIC, headers=big)
        assert _anthropic_error(r, 431)["type"] == "request_too_large"


def test_only_this_machines_names_are_served_on_loopback(tiny):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 sends
    ``Host: evil.example``: a 403, as for any name not allowed; localhost, 127.0.0.1 and [::1]
    (any port) are served, and ``allowed_hosts`` adds names (``*``: any)."""

    def get(port, host, path="/health"):
        status, _, body = _raw(port, f"GET {path} HTTP/1.1\nHost: {host}\nConnection: close\n\n")
        return status, json.loads(body)

    with running(make_app(*tiny, NAME, engine=ScriptedEngine(delay=0))) as port:
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]:8080", "LOCALHOST"):
            assert get(port, host)[0] == 200, host
        for host in (f"evil.example:{port}", "evil.example", "127.0.0.1.evil.example"):
            status, body = get(port, host)
            assert status == 403 and body["error"]["code"] == "host_not_allowed", host
        status, body = get(port, "evil.example", "/v1/messages")
        assert status == 403 and body["error"]["type"] == "permission_error"
    app = make_app(*tiny, NAME, engine=ScriptedEngine(delay=0), allowed_hosts=["box.lan", "*.home"])
    with running(app) as port:
        assert get(port, "box.lan:8080")[0] == get(port, "pc.home")[0] == 200
        assert get(port, f"localhost:{port}")[0] == 200
        assert get(port, "evil.example")[0] == get(port, "home")[0] == 403
    with running(
        make_app(*tiny, NAME, engine=ScriptedEngine(delay=0), allowed_hosts=["*"])
    ) as port:
        assert get(port, "evil.example")[0] == 200


def test_serve_allows_any_host_only_when_bound_past_loopback(tiny_dir, monkeypatch):
    """``mlxinfer serve``'s options reach the app's limits; bound to 0.0.0.0 it answers any host
    (documented), bound to loopback only this machine's names unless --allowed-hosts says more."""
    from click.testing import CliRunner

    import mlxinfer.server.run as run
    from mlxinfer.cli.main import cli

    apps = []

    class NotRun:
        def __init__(self, app):
            apps.append(app)

        def run(self):
            pass

    monkeypatch.setattr(run, "server", lambda app, host, port, **kw: NotRun(app))
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: pytest.fail("serve ran uvicorn.run"))
    # each app (and its engine) is kept: a small pool, not the 1 GiB default reserved four times
    args = ["serve", "-m", str(tiny_dir), "--kv-budget", str(16 << 20)]
    for extra in (
        ["--host", "0.0.0.0"],
        [],
        ["--allowed-hosts", "a.lan,b.lan", "--allowed-hosts", "c.lan"],
        ["--max-body", "1M", "--max-queue", "3", "--body-timeout", "2.5", "--max-headers", "20"],
    ):
        result = CliRunner().invoke(cli, args + extra)
        assert result.exit_code == 0, result.output
    limits = [app.state.limits for app in apps]
    assert limits[0].allowed_hosts == ("*",) and limits[1].allowed_hosts is None
    assert limits[2].allowed_hosts == ("a.lan", "b.lan", "c.lan")
    assert (limits[3].max_body, limits[3].max_queue) == (1 << 20, 3)
    assert (limits[3].body_timeout, limits[3].max_headers) == (2.5, 20)
    assert limits[1].max_body == 32 << 20 and limits[1].max_queue == 256  # the defaults
    result = CliRunner().invoke(cli, args + ["--max-body", "lots"])
    assert result.exit_code == 2 and "expected a byte count" in result.output


# --- every error in the API's shape --------------------------------------------------------------


def test_every_error_is_json_in_the_apis_shape(tiny, monkeypatch):
    """Deep JSON, invalid UTF-8, NaN, a float past range, an out-of-range seed, an unknown route
    and an unexpected exception: each a JSON error of the path's API, never a 500 in text."""
    deep = b'{"model": "tiny", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    bodies = [
        (deep, 400, "nested too deeply"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
        (b'{"model": "tiny", "temperature": NaN}', 400, "NaN"),
        (b'{"model": "tiny", "temperature": -Infinity}', 400, "Infinity"),
        (b'{"model": "tiny", "top_p": 1e999}', 400, "out of range"),
        (b'{"model": "tiny", "messages": [' + b"[]," * 100 + b"[]]}", 400, None),
    ]
    app = make_app(*tiny, NAME, engine=ScriptedEngine(delay=0))
    with TestClient(app, raise_server_exceptions=False) as client:
        headers = {"content-type": "application/json"}
        for body, status, words in bodies:
            r = client.post("/v1/chat/completions", content=body, headers=headers)
            error = _openai_error(r, status)
            assert words is None or words in error["message"], error
            r = client.post("/v1/messages", content=body, headers=headers)
            assert words is None or words in _anthropic_error(r, status)["message"]
        r = client.post("/v1/chat/completions", json={**CHAT, "seed": 2**64})
        assert _openai_error(r, 400)["param"] == "seed"
        assert _openai_error(client.get("/v1/nothing"), 404)["message"] == "Not Found"
        assert _anthropic_error(client.get("/v1/messages"), 405)
        monkeypatch.setattr(openai_request, "parse", lambda *a, **k: 1 / 0)
        r = client.post("/v1/chat/completions", json=CHAT)
        error = _openai_error(r, 500)
        assert error["type"] == "server_error" and "ZeroDivisionError" in error["message"]
        monkeypatch.setattr(anthropic_request, "parse", lambda *a, **k: [][1])
        r = client.post("/v1/messages", json=ANTHROPIC)
        assert "IndexError" in _anthropic_error(r, 500)["message"]


OPENAI_BAD = [
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -0.1),
    ("temperature", 2.5),
    ("temperature", 10**400),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("min_p", 1.0),
    ("min_p", -math.inf),
    ("top_k", -1),
    ("top_k", 2**31),
    ("seed", -1),
    ("seed", 2**63),
    ("max_tokens", 2**31),
    ("max_tokens", 10**5000),
    # refused before too: the JSON types
    ("temperature", True),
    ("top_k", 2.5),
    ("seed", False),
    ("max_tokens", True),
    ("n", True),
    ("logprobs", 1),
    ("top_logprobs", 21),
    ("stream", "yes"),
]
ANTHROPIC_BAD = [
    ("temperature", math.nan),
    ("temperature", 1.5),
    ("temperature", -1),
    ("top_p", math.inf),
    ("top_p", 0.0),
    ("top_k", 2.5),
    ("top_k", -3),
    ("top_k", math.nan),
    ("top_k", True),
    ("max_tokens", 2**31),
    ("max_tokens", 10**5000),
    ("stream", "yes"),
    ("max_tokens", True),  # refused before too
]


def test_sampling_fields_are_range_checked_with_their_json_types():
    """Each bad value is a 400 naming its field, one short line, whatever the JSON parser let
    through (NaN, Infinity and floats past range never get past it: checked again here). The
    edges of each range pass: MLX takes seeds below 2**64, and choice i samples with seed + i."""
    for field, value in OPENAI_BAD:
        with pytest.raises(openai_request.OpenAIError) as e:
            openai_request.parse({**CHAT, field: value}, chat=True)
        assert e.value.status == 400 and e.value.param == field, (field, e.value.message)
        assert len(e.value.message) < 200
    for field, value in ANTHROPIC_BAD:
        with pytest.raises(anthropic_request.AnthropicError) as e:
            anthropic_request.parse({**ANTHROPIC, field: value})
        assert e.value.status == 400 and e.value.message.startswith(f"{field}:"), e.value.message
        assert len(e.value.message) < 200
    edges = {"temperature": 2, "top_p": 1, "top_k": 40, "min_p": 0.05, "seed": 2**63 - 1}
    ask = openai_request.parse({**CHAT, **edges, "n": 16}, chat=True)
    assert ask.sampling.seed == 2**63 - 1 and ask.sampling.temperature == 2.0
    assert openai_request.choice_sampling(ask.sampling, 15).seed < 2**64
    ask = anthropic_request.parse(
        {**ANTHROPIC, "temperature": 1, "top_p": 0.5, "top_k": 5, "stream": True}
    )
    assert (ask.sampling.top_k, ask.sampling.temperature, ask.stream) == (5, 1.0, True)


# --- load: /health, the queue, SIGTERM -----------------------------------------------------------


def _open_streams(port: int, n: int, max_tokens: int) -> list[socket.socket]:
    body = json.dumps({**CHAT, "max_tokens": max_tokens, "stream": True}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(head + body)
        socks.append(s)
    return socks


def _metrics(port: int) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key.partition("{")[0]] = float(value)
    return out


def test_health_and_metrics_answer_at_once_while_48_streams_wait(tiny):
    """48 streams on a batch of 4, the engine slowed to 0.1 s a step: 44 wait for a place, more
    than Starlette's 40 worker threads. /health and /metrics still answer within a second (they
    need no thread), every stream is queued (none refused), and once the clients hang up every
    request is cancelled and every block returned."""
    from mlxinfer.batch import Engine

    model, tokenizer = tiny
    engine = Engine(model, max_batch=4)
    decode = engine._decode

    def slowed():
        time.sleep(0.1)
        decode()

    engine._decode = slowed
    with running(make_app(model, tokenizer, NAME, engine=engine)) as port:
        socks = _open_streams(port, 48, max_tokens=40)
        try:
            deadline = time.monotonic() + 15
            while (m := _metrics(port))["mlxinfer_requests_waiting"] + m[
                "mlxinfer_requests_running"
            ] < 48:
                assert time.monotonic() < deadline, f"48 requests not all queued: {m}"
                time.sleep(0.1)
            for _ in range(5):
                for path in ("/health", "/metrics"):
                    t = time.perf_counter()
                    r = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10)
                    assert r.status_code == 200 and time.perf_counter() - t < 1.0, path
                time.sleep(0.1)
        finally:
            for s in socks:
                s.close()
        deadline = time.monotonic() + 15
        while (m := _metrics(port))["mlxinfer_kv_blocks_in_use"] or m[
            "mlxinfer_requests_running"
        ] + m["mlxinfer_requests_waiting"]:
            assert time.monotonic() < deadline, f"the hung-up requests still hold: {m}"
            time.sleep(0.1)


def test_a_full_queue_is_a_503_with_retry_after(tiny):
    """``max_queue=2``: with two requests waiting (the scripted engine runs none, so both count),
    a third is a 503 with Retry-After in each API's shape; once they end, requests are served."""
    app = make_app(*tiny, NAME, engine=ScriptedEngine(delay=0, pause=1.0), max_queue=2)
    with running(app) as port:
        url = f"http://127.0.0.1:{port}"
        socks = _open_streams(port, 2, max_tokens=8)
        try:
            deadline = time.monotonic() + 10
            while app.state.work.in_flight < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = httpx.post(f"{url}/v1/chat/completions", json=CHAT)
            error = _openai_error(r, 503)
            assert r.headers["retry-after"] == "2" and error["code"] == "overloaded"
            assert "--max-queue" in error["message"]
            r = httpx.post(f"{url}/v1/messages", json=ANTHROPIC)
            assert _anthropic_error(r, 503)["type"] == "overloaded_error"
            assert r.headers["retry-after"] == "2"
        finally:
            for s in socks:
                s.close()
        deadline = time.monotonic() + 10
        while app.state.work.in_flight:
            assert time.monotonic() < deadline, "the ended streams are still counted"
            time.sleep(0.05)
        assert httpx.post(f"{url}/v1/messages", json=ANTHROPIC, timeout=30).status_code == 200


def test_sigterm_cancels_a_stream_and_serve_exits_within_seconds(tiny_dir, tmp_path):
    """``mlxinfer serve`` with a stream of 20000 tokens under way (about two minutes here): SIGTERM
    ends the stream with an error event, and the process within 10 s, its shutdown complete."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxinfer", "serve", "-m", str(tiny_dir), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve did not start within 60 s"
            time.sleep(0.1)
        body = {**CHAT, "model": tiny_dir.name, "max_tokens": 20000, "stream": True}
        lines, t = [], None
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=30) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 10:  # the stream is under way
                    t = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
                if t is not None and time.monotonic() - t > 10:
                    break  # the stream outlived the bound
        proc.wait(max(0.1, 10 - (time.monotonic() - t)))
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = (tmp_path / "serve.log").read_text()
    assert took < 10 and "Finished server process" in output, output[-2000:]
    assert any('"error"' in line for line in lines), lines[-3:]
