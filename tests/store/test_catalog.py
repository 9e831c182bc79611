"""What the store holds, as ``list``, ``show``, ``rm``, ``cp``, ``ps`` and ``stop`` tell it:
each checked against the disk, or against a server that answers Ollama's ``/api/ps``."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner
from gguf_tiny import write_tiny_gguf
from tiny_checkpoint import CONFIG, write_checkpoint

import mlxinfer
from mlxinfer import store
from mlxinfer.cli.main import cli
from mlxinfer.files.manifest import verify

RECIPE = {"bits": 4, "group_size": 32}


def _disk(root: Path) -> set[str]:
    """The models on disk: <org>/<name>/<variant> folders with a config.json."""
    return {
        "/".join(p.parent.relative_to(root).parts)
        for p in root.glob("*/*/*/config.json")
        if not p.relative_to(root).parts[0].startswith(".")
    }


@pytest.fixture
def pulled(hub):
    store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)
    store.pull("org/tiny-GGUF:Q8_0", endpoint=hub.url)
    return hub


def test_list_show_rm_and_cp_agree_with_the_disk(pulled):
    root = store.store_root()
    found = store.entries(others=False)
    assert {e["name"] for e in found} == {"org/tiny:latest", "org/tiny-GGUF:Q8_0"}
    assert {str(Path(e["path"]).relative_to(root)) for e in found} == _disk(root)
    tiny = next(e for e in found if e["name"] == "org/tiny:latest")
    on_disk = sum(p.stat().st_size for p in Path(tiny["path"]).rglob("*") if p.is_file())
    assert tiny["bytes"] == on_disk and tiny["family"] == "llama"
    assert tiny["context_length"] == CONFIG["max_position_embeddings"]
    model, _ = mlxinfer.load(tiny["path"])
    assert tiny["parameters"] == _unpacked(model)  # counted from headers = the model's own

    info = store.show("org/tiny")
    assert info["architecture"] == "llama" and info["context_length"] == 128
    assert info["quantization"]["default"] == "4-bit g32"
    assert info["recipe"] == RECIPE and info["license"] == "apache-2.0"
    assert info["fits"] is True and 0 < info["fits_context"] <= 128
    assert store.show("org/tiny", check=True)["verify"] == "ok"

    alias = store.copy("org/tiny", "mine")
    assert alias == root / "library" / "mine" / "latest"
    assert (
        os.stat(alias / "model.safetensors").st_ino
        == os.stat(Path(tiny["path"]) / "model.safetensors").st_ino
    )  # shared, not copied
    assert verify(alias).ok and not verify(alias).unlisted
    with pytest.raises(store.StoreError, match="already exists in the store"):
        store.copy("org/tiny", "mine:latest")

    removed = store.remove("org/tiny")
    assert not removed.exists() and not (root / "org" / "tiny").exists()
    assert _disk(root) == {"library/mine/latest", "org/tiny-gguf/q8_0"}
    assert {e["name"] for e in store.entries(others=False)} == {"mine:latest", "org/tiny-GGUF:Q8_0"}
    assert mlxinfer.load("mine")[0] is not None  # the alias outlives the original
    with pytest.raises(store.StoreError, match=r"org/tiny:latest: not in the store"):
        store.remove("org/tiny")


def _unpacked(model) -> int:
    """Parameters of a loaded model, a quantized weight counted as its groups x group size."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    total = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            total += m.scales.size * m.group_size + (m.bias.size if "bias" in m else 0)
        elif not m.children():
            total += sum(v.size for _, v in tree_flatten(m.parameters()))
    return total


def test_rm_never_deletes_outside_the_store(pulled, tmp_path):
    victim = tmp_path / "victim"
    write_checkpoint(victim)
    before = sorted(p.name for p in victim.iterdir())
    for name in (str(victim), "../victim", "org/../../victim", "/etc/passwd"):
        with pytest.raises(store.StoreError, match="expected 'org/name'"):
            store.remove(name)
    # A link planted in the store that points outside it is refused, and the target stays.
    link = store.store_root() / "evil" / "model" / "latest"
    link.parent.mkdir(parents=True)
    link.symlink_to(victim)
    with pytest.raises(store.StoreError, match="not inside the store"):
        store.remove("evil/model")
    assert sorted(p.name for p in victim.iterdir()) == before


class _OllamaStub:
    """A server answering ``/api/ps`` with ``held`` and recording ``/api/generate`` bodies."""

    def __init__(self, held: list[str]):
        stub = self
        self.held, self.generated = held, []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                models = [{"name": n, "model": n, "size": 1234} for n in stub.held]
                self._send({"models": models})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.generated.append(body)
                gone = body["model"] if ":" in body["model"] else body["model"] + ":latest"
                stub.held = [n for n in stub.held if n != gone]  # name = name:latest
                self._send({"model": body["model"], "done": True, "done_reason": "unload"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_rm_refuses_a_model_the_running_server_holds_unless_forced(pulled, monkeypatch):
    with _OllamaStub(["org/tiny:latest"]) as server:
        store.record_server("0.0.0.0", server.port)  # as serve records itself
        assert store.server_url() == f"http://127.0.0.1:{server.port}"
        with pytest.raises(store.StoreError, match=r"rm org/tiny: the running server holds it"):
            store.remove("org/tiny")
        assert store.parse_name("org/tiny").path().is_dir()
        store.remove("org/tiny-GGUF:Q8_0")  # one it does not hold goes
        runner = CliRunner()
        out = runner.invoke(cli, ["ps"])
        assert out.exit_code == 0 and "org/tiny:latest" in out.output and "1.23 kB" in out.output
        out = runner.invoke(cli, ["stop", "org/tiny"])
        assert out.exit_code == 0 and server.generated == [
            {"model": "org/tiny", "keep_alive": 0, "stream": False}
        ]
        assert store.remove("org/tiny").parts[-3:] == ("org", "tiny", "latest")  # now free
    with _OllamaStub(["org/tiny:latest"]) as server:
        store.pull("org/tiny", recipe=RECIPE, endpoint=pulled.url)
        monkeypatch.setenv("MLXINFER_HOST", f"127.0.0.1:{server.port}")  # wins over the record
        store.record_server("127.0.0.1", 9)
        with pytest.raises(store.StoreError, match="holds it"):
            store.remove("org/tiny")
        store.remove("org/tiny", force=True)
        assert not store.parse_name("org/tiny").path().exists()


def test_the_cli_prints_architecture_and_context_and_lists_json(pulled):
    runner = CliRunner()
    out = runner.invoke(cli, ["show", "org/tiny"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert "architecture: llama" in lines and "context length: 128" in lines
    listed = json.loads(runner.invoke(cli, ["list", "--json", "--store-only"]).output)
    assert sorted(e["name"] for e in listed) == ["org/tiny-GGUF:Q8_0", "org/tiny:latest"]
    out = runner.invoke(cli, ["rm", "org/../x"])
    assert out.exit_code == 1 and len(out.output.strip().splitlines()) == 1
    assert runner.invoke(cli, ["cp", "org/tiny", "other/alias:v1"]).exit_code == 0
    assert "other/alias:v1" in runner.invoke(cli, ["list", "--store-only"]).output


def test_other_apps_models_are_listed_read_only(hub, tmp_path, monkeypatch):
    hf = tmp_path / "hf" / "models--mlx-community--Tiny-4bit"
    snap = hf / "snapshots" / ("a" * 40)
    write_checkpoint(snap, quantization={"group_size": 64, "bits": 4})
    (hf / "refs").mkdir()
    (hf / "refs" / "main").write_text("a" * 40)
    lms = tmp_path / "lms" / "lmstudio-community" / "Tiny-GGUF"
    lms.mkdir(parents=True)
    write_tiny_gguf(lms / "Tiny-Q8_0.gguf")
    ollama = tmp_path / "ollama"
    blob = ollama / "blobs" / ("sha256-" + "b" * 64)
    blob.parent.mkdir(parents=True)
    write_tiny_gguf(blob)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True)
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + "b" * 64}
    manifest.write_text(json.dumps({"layers": [layer]}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("LMSTUDIO_MODELS", str(tmp_path / "lms"))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    found = {e["name"]: e for e in store.entries()}
    assert found["mlx-community/Tiny-4bit"]["source"] == "hf-cache"
    assert found["mlx-community/Tiny-4bit"]["path"] == str(snap)
    assert found["lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf"]["source"] == "lm-studio"
    assert found["ollama:tiny:latest"]["path"] == str(blob)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before
    with pytest.raises(store.StoreError, match="not in the store"):
        store.remove("mlx-community/Tiny-4bit")  # other apps' models are never removed


def test_serve_records_itself_and_ps_and_rm_ask_it(pulled, monkeypatch):
    """A real ``serve`` started with an API key: its record leads ``ps`` to its ``/api/ps``
    (asked with the key from ``MLXINFER_API_KEY``; without it, a one-line error naming the
    variable), and ``rm`` refuses the model it holds; once it has ended, its record is ignored."""
    pytest.importorskip("uvicorn")
    import os
    import subprocess
    import sys
    import time

    from servers import free_port

    port = free_port()
    env = {**os.environ, "MLXINFER_API_KEY": "sekrit"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxinfer", "serve", "-m", "org/tiny", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    monkeypatch.setenv("MLXINFER_API_KEY", "sekrit")
    try:
        deadline, models = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            try:
                models = store.running_models()  # None: no server recorded yet
            except store.StoreError:  # recorded, not listening yet
                pass
            if models is not None:
                break
            time.sleep(0.2)
        assert store.server_url() == f"http://127.0.0.1:{port}"
        assert models and models[0]["context_length"] == 128
        out = CliRunner().invoke(cli, ["ps"])
        assert out.exit_code == 0 and models[0]["name"] in out.output
        with pytest.raises(store.StoreError, match="the running server holds it"):
            store.remove("org/tiny")
        store.remove("org/tiny-GGUF:Q8_0")  # not held: removed
        monkeypatch.delenv("MLXINFER_API_KEY")
        out = CliRunner().invoke(cli, ["ps"])
        assert out.exit_code == 1 and "HTTP 401" in out.output and "MLXINFER_API_KEY" in out.output
        assert len(out.output.strip().splitlines()) == 1
    finally:
        proc.terminate()
        proc.wait(30)
    assert store.server_url() is None  # its process has ended
    store.remove("org/tiny")


def test_the_server_serves_store_models_by_their_names(pulled):
    """``serve`` lists every pulled model under its store name (OpenAI's ``/v1/models``,
    Ollama's ``/api/tags``) and loads it on first use, by that name or its short forms
    (``org/name`` for ``org/name:latest``, any case); a name the store lacks is a 404."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from mlxinfer.server import make_app

    app = make_app(None, None, None, store=store.store_root(), keep_alive=60.0)
    with TestClient(app) as client:
        listed = {m["id"] for m in client.get("/v1/models").json()["data"]}
        assert listed == {"org/tiny:latest", "org/tiny-GGUF:Q8_0"}
        tags = {m["model"] for m in client.get("/api/tags").json()["models"]}
        assert tags == listed
        texts = []
        for name in ("org/tiny:latest", "org/tiny", "ORG/Tiny"):
            r = client.post(
                "/v1/completions",
                json={"model": name, "prompt": "ab", "max_tokens": 4, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert len(set(texts)) == 1  # one model, however it is named
        r = client.post("/v1/completions", json={"model": "org/other", "prompt": "ab"})
        assert r.status_code == 404
