"""``/api/pull``, ``/api/copy`` and ``/api/delete`` on mlxinfer's model store, through the
official ``ollama`` client, against a fake Hub on 127.0.0.1 (tests/store/fake_hub.py) and a
cache root of the test's own: what they do is what ``mlxinfer pull``, ``cp`` and ``rm`` do."""

from __future__ import annotations

import functools
import json

import pytest
from fake_hub import FakeHub, Repo, Serving
from servers import serving
from test_toolcalls import _tiny
from tiny_checkpoint import write_checkpoint
from tool_templates import HERMES

ollama = pytest.importorskip("ollama", reason="the ollama client is not installed")
httpx = pytest.importorskip("httpx", reason="httpx is not installed")

import mlxinfer.store  # noqa: E402
from mlxinfer.server import make_app  # noqa: E402

REPO = "org/tiny"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    write_checkpoint(tmp_path / "hf")
    files = {p.name: p.read_bytes() for p in sorted((tmp_path / "hf").iterdir())}
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MLXINFER_HOST", raising=False)
    with Serving(FakeHub({REPO: Repo(files)})) as h:
        # The route pulls as `mlxinfer pull` does: this Hub's address in place of HF_ENDPOINT,
        # uniform 4-bit in place of the measured plan (minutes; the store's tests check both).
        real = mlxinfer.store.pull
        pull = functools.partial(real, endpoint=h.url, recipe={"bits": 4, "group_size": 32})
        monkeypatch.setattr(mlxinfer.store, "pull", pull)
        yield h


@pytest.fixture
def url(tmp_path):
    with serving(make_app(*_tiny(tmp_path / "served", HERMES), "tiny")) as base:
        yield base


def test_pull_streams_progress_then_copy_and_delete_act_on_the_store(hub, url):
    client = ollama.Client(host=url, timeout=120)
    steps = list(client.pull(REPO, stream=True))
    assert steps[0].status == "pulling manifest" and steps[-1].status == "success"
    downloads = [s for s in steps if s.status == "downloading weights"]
    assert downloads and downloads[-1].completed == downloads[-1].total > 0
    assert all(s.digest.startswith("sha256:") for s in downloads)
    assert mlxinfer.store.show(REPO)["name"].startswith(REPO)
    seen = len(hub.requests)
    assert client.pull(REPO).status == "success"  # again, whole: up to date, nothing fetched
    assert not [r for r in hub.requests[seen:] if r[0] == "GET" and "/resolve/" in r[1]]

    assert client.copy(REPO, "org/mine").status == "success"
    names = {e["name"].split(":")[0] for e in mlxinfer.store.entries(others=False)}
    assert {REPO, "org/mine"} <= names
    assert client.delete("org/mine").status == "success"
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("org/mine")
    assert e.value.status_code == 404 and "not in the store" in e.value.error


def test_bad_names_are_ollama_errors(hub, url):
    client = ollama.Client(host=url, timeout=60)
    with pytest.raises(ollama.ResponseError) as e:  # an Ollama library name is no Hub repo id
        client.pull("llama3.2")
    assert e.value.status_code == 400 and "org/name" in e.value.error
    lines = httpx.post(f"{url}/api/pull", json={"model": "../x"}, timeout=60).text.splitlines()
    assert "error" in json.loads(lines[-1]) and all(json.loads(x) for x in lines)
    for path, body in (("/api/copy", {"source": REPO}), ("/api/delete", {"model": 5})):
        r = httpx.request("DELETE" if "delete" in path else "POST", f"{url}{path}", json=body)
        assert r.status_code == 400 and isinstance(r.json()["error"], str)


def test_mlxinfer_ps_and_stop_ask_this_server(tmp_path, monkeypatch):
    """``mlxinfer ps`` and ``stop`` (mlxinfer.store.servers) speak Ollama's API to the server."""
    import shutil

    model, tokenizer = _tiny(tmp_path / "served", HERMES)
    shutil.copytree(tokenizer.path, tmp_path / "models" / "other")
    app = make_app(model, tokenizer, "tiny", models_dir=tmp_path / "models", keep_alive=300)
    with serving(app) as base:
        monkeypatch.setenv("MLXINFER_HOST", base.removeprefix("http://"))
        assert httpx.post(f"{base}/api/generate", json={"model": "other"}).status_code == 200
        names = [m["name"] for m in mlxinfer.store.running_models()]
        assert sorted(names) == ["other:latest", "tiny:latest"]
        mlxinfer.store.stop_model("other")
        assert [m["name"] for m in mlxinfer.store.running_models()] == ["tiny:latest"]
