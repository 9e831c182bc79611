"""Ollama's API at the HTTP level: the probes apps send before they chat (recorded shapes of VS
Code Copilot's Ollama provider and Raycast's), NDJSON on the wire, the second listener of
``serve --ollama``, the API key, and hostile bodies, each answered in Ollama's error shape
``{"error": "..."}`` with its status."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timezone

import pytest
from servers import free_port, serving
from test_toolcalls import _tiny
from tool_templates import HERMES

httpx = pytest.importorskip("httpx", reason="httpx is not installed")

from mlxinfer.server import make_app  # noqa: E402
from mlxinfer.server.run import server  # noqa: E402

NAME, KEY = "tiny", "sk-ollama-test"
# What VS Code Copilot's Ollama provider sends to list a server's models and their abilities
# (github/copilot-chat's byok OllamaLMProvider: version >= 0.6.4, tags, then show per model).
COPILOT = {"User-Agent": "GitHubCopilotChat/0.30.0", "Content-Type": "application/json"}
# Raycast's Ollama extension: the tags, then show with the older "name" field, then ps.
RAYCAST = {"User-Agent": "Raycast/1.100.0 (macOS)", "Accept": "*/*"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("ollama-probes"), HERMES)


@pytest.fixture(scope="module")
def url(tiny):
    with serving(make_app(*tiny, NAME, max_batch=4)) as base:
        yield base


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=60) as client:
        yield client


def test_the_root_says_ollama_is_running_unless_a_browser_asks(url, http):
    r = http.get(f"{url}/", headers={"Accept": "*/*"})
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert http.head(f"{url}/").status_code == 200
    page = http.get(f"{url}/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert page.status_code in (200, 404) and page.text != "Ollama is running"


def test_copilots_probes(url, http):
    version = http.get(f"{url}/api/version", headers=COPILOT).json()["version"]
    assert tuple(int(x) for x in version.split(".")) >= (0, 6, 4)
    [model] = http.get(f"{url}/api/tags", headers=COPILOT).json()["models"]
    assert model["model"] == model["name"] == f"{NAME}:latest"
    shown = http.post(f"{url}/api/show", json={"model": model["model"]}, headers=COPILOT).json()
    arch = shown["model_info"]["general.architecture"]
    assert shown["model_info"][f"{arch}.context_length"] == 4096
    assert "tools" in shown["capabilities"] and "vision" not in shown["capabilities"]


def test_raycasts_probes(url, http):
    models = http.get(f"{url}/api/tags", headers=RAYCAST).json()["models"]
    assert [m["name"] for m in models] == [f"{NAME}:latest"]
    shown = http.post(f"{url}/api/show", json={"name": NAME}, headers=RAYCAST).json()
    assert shown["details"]["family"] == "llama" and shown["model_info"]
    running = http.get(f"{url}/api/ps", headers=RAYCAST).json()["models"]
    assert running[0]["name"] == f"{NAME}:latest" and running[0]["size_vram"] >= 0


def test_a_stream_is_ndjson_one_object_a_line(url, http):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    body["options"] = {"temperature": 0, "num_predict": 6}
    with http.stream("POST", f"{url}/api/chat", json=body) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        raw = r.read().decode()
    assert raw.endswith("\n") and "\n\n" not in raw  # no blank lines, no SSE comments
    lines = [json.loads(line) for line in raw.splitlines()]
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"]
    assert lines[-1]["eval_count"] == 6 and isinstance(lines[-1]["total_duration"], int)
    # Ollama's docs post with curl -d (a form type): read as JSON all the same.
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    whole = http.post(f"{url}/api/generate", content=json.dumps({**body, "stream": False,
                      "prompt": "hi"}), headers=form)  # fmt: skip
    assert whole.status_code == 200 and whole.json()["done"] is True


def test_an_empty_request_loads_and_keep_alive_0_unloads(tmp_path, tiny, http):
    # A --models-dir model: loaded by the empty request, unloaded by keep_alive 0.
    import shutil

    source = tiny[1].path
    shutil.copytree(source, tmp_path / "other")
    app = make_app(*tiny, NAME, models_dir=tmp_path, keep_alive=300)
    with serving(app) as base:
        r = http.post(f"{base}/api/generate", json={"model": "other"}).json()
        assert r["done"] and r["done_reason"] == "load" and r["response"] == ""
        assert "other:latest" in [m["name"] for m in http.get(f"{base}/api/ps").json()["models"]]
        r = http.post(f"{base}/api/chat", json={"model": "other:latest", "keep_alive": 0}).json()
        assert r["done_reason"] == "unload" and r["message"]["content"] == ""
        assert "other:latest" not in [
            m["name"] for m in http.get(f"{base}/api/ps").json()["models"]
        ]
        assert "other:latest" in [m["name"] for m in http.get(f"{base}/api/tags").json()["models"]]

        def expires(keep_alive) -> datetime:
            body = {"model": "other", "keep_alive": keep_alive}
            assert http.post(f"{base}/api/generate", json=body).json()["done_reason"] == "load"
            models = http.get(f"{base}/api/ps").json()["models"]
            [running] = [m for m in models if m["name"] == "other:latest"]
            return datetime.fromisoformat(running["expires_at"].replace("Z", "+00:00"))

        now = datetime.now(timezone.utc)
        assert abs((expires("5m") - now).total_seconds() - 300) < 30
        assert abs((expires(7200) - now).total_seconds() - 7200) < 30
        assert expires(-1).year == 2318  # kept loaded, as Ollama shows it
        assert app.state.models.reap() == []  # a negative keep_alive: never idle long enough
        # A generation's keep_alive 0: unloaded once the reply is done.
        ask = {"model": "other", "prompt": "hi", "stream": False, "keep_alive": 0}
        ask["options"] = {"num_predict": 1}
        assert http.post(f"{base}/api/generate", json=ask).status_code == 200
        assert app.state.models.reap() == ["other"]


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"messages": []}', 400, "model"),
    (b'{"model": 5, "messages": []}', 400, "model"),
    (b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
    (b'{"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}', 400, "role"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}', 400, "content"),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
        400,
        "stream",
    ),  # fmt: skip
    (b'{"model": "tiny", "prompt": "x", "options": "fast"}', 400, "options"),
    (b'{"model": "tiny", "prompt": "x", "options": {"temperature": "hot"}}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "x", "options": {"top_p": 0}}', 400, "top_p"),
    (b'{"model": "tiny", "prompt": "x", "options": {"num_predict": -3}}', 400, "num_predict"),
    (b'{"model": "tiny", "prompt": "x", "options": {"stop": [1]}}', 400, "stop"),
    (
        b'{"model": "tiny", "prompt": "x", "options": {"presence_penalty": 0.5}}',
        400,
        "presence_penalty",
    ),  # fmt: skip
    (b'{"model": "tiny", "prompt": "x", "format": 5}', 400, "format"),
    (b'{"model": "tiny", "prompt": "x", "format": {"type": "nonsense"}}', 400, "format"),
    (b'{"model": "tiny", "prompt": "x", "keep_alive": "forever"}', 400, "keep_alive"),
    (b'{"model": "tiny", "prompt": "x", "think": "very"}', 400, "think"),
    (b'{"model": "tiny", "prompt": "x", "images": ["aGk="]}', 400, "text only"),
    (b'{"model": "tiny", "prompt": "x", "suffix": "y"}', 400, "suffix"),
    (b'{"model": "tiny", "prompt": "x", "top_logprobs": 21}', 400, "top_logprobs"),
    (b'{"model": "tiny", "prompt": "x", "logprobs": "yes"}', 400, "logprobs"),
    (b'{"model": "tiny", "prompt": "x", "tools": [{"type": "function"}]}', 200, ""),  # unknown
    (b'{"model": "nope", "prompt": "x"}', 404, "nope"),
]


@pytest.mark.parametrize("raw, status, words", BAD)
def test_hostile_bodies_get_ollamas_error_shape(url, http, raw, status, words):
    path = "/api/chat" if b"messages" in raw else "/api/generate"
    try:  # a well-formed body asks for one token, whole, unless it says otherwise
        body = json.loads(raw)
        if isinstance(body, dict):
            body = {"stream": False, **body}
            if not isinstance(body.get("options"), (str, dict)):
                body["options"] = {"num_predict": 1}
        raw = json.dumps(body).encode()
    except ValueError:
        pass
    r = http.post(f"{url}{path}", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    if status != 200:
        assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str)
        assert words in r.json()["error"], r.text


def test_other_routes_errors_and_the_prompt_past_num_ctx(url, http):
    for method, path, body, status in (
        ("GET", "/api/nothing", None, 404),
        ("GET", "/api/chat", None, 405),
        ("POST", "/api/show", {"model": "nope"}, 404),
        ("POST", "/api/show", {}, 400),
        ("POST", "/api/embed", {"model": NAME, "input": 5}, 400),
        ("POST", "/api/embed", {"model": NAME, "input": "x"}, 400),  # not an embedding model
    ):
        r = http.request(method, f"{url}{path}", json=body)
        assert r.status_code == status and isinstance(r.json()["error"], str), (path, r.text)
    long = {"role": "user", "content": "word " * 200}
    r = http.post(
        f"{url}/api/chat",
        json={"model": NAME, "messages": [long], "stream": False, "options": {"num_ctx": 64}},
    )
    assert r.status_code == 400 and "num_ctx" in r.json()["error"]
    ok = {"num_ctx": 4096 * 4, "num_predict": 2, "temperature": 0}  # past the context: no bound
    r = http.post(f"{url}/api/chat", json={"model": NAME, "messages": [long], "stream": False,
                                           "options": ok})  # fmt: skip
    assert r.status_code == 200 and r.json()["eval_count"] == 2


def test_the_api_key_guards_api_but_not_the_version(tiny, http):
    with serving(make_app(*tiny, NAME, api_key=KEY)) as base:
        assert http.get(f"{base}/api/version").status_code == 200
        r = http.get(f"{base}/api/tags")
        assert r.status_code == 401 and isinstance(r.json()["error"], str)
        auth = {"Authorization": f"Bearer {KEY}"}
        assert http.get(f"{base}/api/tags", headers=auth).status_code == 200


def test_serve_ollama_listens_on_a_second_address_too(tiny, http):
    app = make_app(*tiny, NAME)
    first, second = free_port(), free_port()
    srv = server(app, "127.0.0.1", first, log_level="warning", also=[("127.0.0.1", second)])
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start within 30 s"
        time.sleep(0.05)
    try:
        for port in (first, second):
            r = http.get(f"http://127.0.0.1:{port}/api/tags")
            assert r.json()["models"][0]["model"] == f"{NAME}:latest"
    finally:
        srv.should_exit = True
        thread.join(10)


def test_serve_ollama_asks_for_ollamas_address(tiny, monkeypatch):
    from click.testing import CliRunner

    import mlxinfer.server
    from mlxinfer.cli.main import cli

    asked = []
    monkeypatch.setattr(mlxinfer.server, "serve", lambda *a, **options: asked.append(options))
    directory = str(tiny[1].path)
    for flags, also in (([], None), (["--ollama"], [("127.0.0.1", 11434)])):
        result = CliRunner().invoke(cli, ["serve", "-m", directory, *flags])
        assert result.exit_code == 0, result.output
        assert asked[-1].get("also") == also and asked[-1]["host"] == "127.0.0.1"
    assert "Ollama's under /api" in result.output and "127.0.0.1:11434" in result.output
