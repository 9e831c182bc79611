"""``pull`` against a fake Hub on 127.0.0.1 (fake_hub.py): converted once, idempotent, resumable
after a kill, refused when the disk is short; a GGUF repo's one named quant; the pulled model is
what :func:`mlxinfer.convert` makes of the same files, and ``load`` finds it by name."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import pytest
from fake_hub import git_blob_id
from tiny_checkpoint import write_checkpoint

from mlxinfer import store
from mlxinfer.files.manifest import verify
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import resolve_model_path

RECIPE = {"bits": 4, "group_size": 32}  # uniform: fast; the default (-q) measures a plan


def test_pull_converts_once_as_convert_does_and_a_second_pull_does_nothing(hub, sources, tmp_path):
    seen = []
    record = store.pull("org/tiny", lambda *a: seen.append(a), recipe=RECIPE, endpoint=hub.url)
    path = Path(record["path"])
    assert record["status"] == "pulled" and path == store.parse_name("org/tiny").path()
    # The record: the commit the Hub resolved, each file's hashes, the recipe, the bytes.
    repo = hub.repos["org/tiny"]
    assert record["commit"] == repo.sha and record["repo"] == "org/tiny"
    assert set(record["files"]) == {"config.json", "model.safetensors", "tokenizer.json",
                                    "tokenizer_config.json"}  # fmt: skip
    data = repo.files["model.safetensors"]
    assert record["files"]["model.safetensors"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert record["recipe"] == RECIPE and record["converter"]
    files = [p for p in path.rglob("*") if p.is_file() and p.name != "mlxinfer-manifest.json"]
    assert record["bytes"] <= sum(p.stat().st_size for p in files)
    assert verify(path).ok and not verify(path).unlisted
    # Only what a model needs was downloaded (no README, no pickle).
    fetched = {r[1].rsplit("/", 1)[1] for r in hub.gets("") if "/resolve/" in r[1]}
    assert fetched == set(record["files"])
    # Progress: the download in bytes, ending at its total, then convert's stages.
    downloads = [a for a in seen if a[0] == "downloading weights"]
    assert downloads[-1][1] == downloads[-1][2] == sum(len(repo.files[f]) for f in fetched)
    assert [a[1] for a in downloads] == sorted(a[1] for a in downloads)
    assert any(a[0] == "writing weights" for a in seen)
    # The reference: convert on the same files with the same recipe.
    ref = tmp_path / "ref"
    convert(sources[0] / "hf", ref, **RECIPE)
    ours, theirs = mx.load(str(path / "model.safetensors")), mx.load(str(ref / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
    # Nothing left behind: no downloads, no work.
    root = store.store_root()
    assert not any((root / ".downloads").rglob("*.safetensors"))
    assert not list((root / ".work").iterdir())

    before = (len(hub.requests), os.stat(path / "model.safetensors").st_mtime_ns)
    again = store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)
    assert again["status"] == "up to date" and again["commit"] == record["commit"]
    new = hub.requests[before[0] :]
    assert not [r for r in new if "/resolve/" in r[1]]  # nothing downloaded
    assert os.stat(path / "model.safetensors").st_mtime_ns == before[1]  # nor converted


def test_load_finds_a_pulled_model_by_name_but_a_local_path_wins(hub, tmp_path, monkeypatch):
    import mlxinfer

    store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)
    hub.requests.clear()
    model, tokenizer = mlxinfer.load("org/tiny")  # (HF_ENDPOINT is not the fake: no Hub here)
    assert model.source_dir == store.parse_name("org/tiny").path()
    local = tmp_path / "here" / "org" / "tiny"
    write_checkpoint(local)
    monkeypatch.chdir(tmp_path / "here")
    assert resolve_model_path("org/tiny") == Path("org/tiny")  # the local directory first
    assert hub.requests == []


def test_a_gguf_repo_gives_only_the_named_quant(hub):
    record = store.pull("org/tiny-GGUF:q8_0", endpoint=hub.url)
    assert list(record["files"]) == ["tiny-Q8_0.gguf"]
    assert record["recipe"] == {"gguf": "imported with its own quantization"}
    assert [r[1] for r in hub.gets(".gguf")] == [
        f"/org/tiny-GGUF/resolve/{record['commit']}/tiny-Q8_0.gguf"
    ]
    assert Path(record["path"]).name == "q8_0" and (Path(record["path"]) / "config.json").is_file()
    with pytest.raises(store.StoreError, match=r"no GGUF quant 'Q2_K'; expected one of F16, Q8_0"):
        store.pull("org/tiny-GGUF:Q2_K", endpoint=hub.url)
    with pytest.raises(
        store.StoreError,
        match=r"several GGUF quants and no Q4_K_M \(the default\); name one of F16, Q8_0",
    ):
        store.pull("org/tiny-GGUF", endpoint=hub.url)
    with pytest.raises(store.StoreError, match="a variant names a GGUF quant"):
        store.pull("org/tiny:Q4_K_M", endpoint=hub.url)


def test_the_disk_check_refuses_with_the_numbers_before_downloading(hub, monkeypatch):
    import shutil as real

    pull_module = sys.modules["mlxinfer.store.pull"]  # (the package's `pull` is the function)
    usage = real.disk_usage("/")
    monkeypatch.setattr(pull_module.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(store.StoreError) as e:
        store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)
    message = str(e.value)
    need = sum(len(hub.repos["org/tiny"].files[f]) for f in
               ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"))  # fmt: skip
    assert "\n" not in message and "1.00 kB free" in message
    assert f"needs {need * 2 / 1e3:.2f} kB" in message and "to download" in message
    assert not [r for r in hub.requests if "/resolve/" in r[1]]
    assert not store.parse_name("org/tiny").path().exists()


PULL_SCRIPT = """
import sys
from mlxinfer import store
store.pull("org/tiny", recipe={"bits": 4, "group_size": 32}, endpoint=sys.argv[1])
"""


def test_a_pull_killed_mid_download_resumes_where_it_stopped(hub, tmp_path):
    hub.slow = 0.05  # ~80 kB/s: the weights take seconds
    size = len(hub.repos["org/tiny"].files["model.safetensors"])
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PULL_SCRIPT), hub.url],
                            env=os.environ.copy())  # fmt: skip
    part = next_part = None
    deadline = time.monotonic() + 15
    try:
        while time.monotonic() < deadline:
            found = list((store.store_root() / ".downloads").rglob("model.safetensors.part"))
            if found and found[0].stat().st_size > 4096:
                part = found[0]
                break
            assert proc.poll() is None, "the pull ended before it could be killed"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert part is not None, "no partial download within 15 s"
    have = part.stat().st_size
    assert 0 < have < size
    assert not store.parse_name("org/tiny").path().exists()  # nothing half-made in the store

    hub.slow = 0.0
    hub.requests.clear()
    record = store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)
    ranges = [r[2] for r in hub.gets("/model.safetensors")]
    assert ranges == [f"bytes={have}-"]  # only the rest was asked for
    assert record["files"]["model.safetensors"]["sha256"] == hashlib.sha256(
        hub.repos["org/tiny"].files["model.safetensors"]).hexdigest()  # fmt: skip
    assert verify(record["path"]).ok
    next_part = list((store.store_root() / ".downloads").rglob("*.part"))
    assert next_part == []


def test_an_mlx_format_repo_is_kept_as_published(hub, sources, tmp_path):
    from fake_hub import Repo

    published = tmp_path / "published"
    convert(sources[0] / "hf", published, **RECIPE)
    files = {p.name: p.read_bytes() for p in published.iterdir() if p.is_file()}
    hub.repos["mlx-community/tiny-4bit"] = Repo(files)
    record = store.pull("mlx-community/tiny-4bit", endpoint=hub.url)  # the default recipe: unused
    assert record["kind"] == "mlx" and record["recipe"] == {"mlx": "kept as published"}
    path = Path(record["path"])
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).read_bytes() == files[name]
    assert store.pull("mlx-community/tiny-4bit", endpoint=hub.url)["status"] == "up to date"


def test_pull_when_offline_keeps_what_the_store_has_and_refuses_what_it_lacks(hub, monkeypatch):
    from huggingface_hub import constants

    store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)
    hub.requests.clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)["status"] == "up to date"
    with pytest.raises(store.StoreError, match="HF_HUB_OFFLINE is set; pull needs the Hub"):
        store.pull("org/tiny-GGUF:Q8_0", endpoint=hub.url)
    assert hub.requests == []


def test_run_pulls_a_missing_model_then_chats(hub, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": hub.url}  # read when huggingface_hub is imported
    proc = subprocess.run(
        [sys.executable, "-m", "mlxinfer", "run", "org/tiny-GGUF:Q8_0", "-n", "3"],
        input="hello\n/exit\n", capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert store.parse_name("org/tiny-GGUF:Q8_0").path().is_dir()
    assert ">> " in proc.stdout + proc.stderr  # chat's prompt: it ran
    assert len(hub.gets(".gguf")) == 1
    again = subprocess.run(
        [sys.executable, "-m", "mlxinfer", "run", "org/tiny-GGUF:Q8_0", "-n", "3"],
        input="/exit\n", capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0 and len(hub.gets(".gguf")) == 1  # the store's copy, no pull


def test_mlxinfer_home_is_another_name_for_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.delenv("MLXINFER_CACHE")
    monkeypatch.setenv("MLXINFER_HOME", str(tmp_path / "home"))
    assert store.store_root() == tmp_path / "home" / "store"
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "cache"))  # the first name wins
    assert store.store_root() == tmp_path / "cache" / "store"


def test_files_the_hugging_face_cache_holds_are_not_downloaded_again(hub, tmp_path):
    repo = hub.repos["org/tiny"]
    blobs = tmp_path / "hf-cache" / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    weights = repo.files["model.safetensors"]
    (blobs / hashlib.sha256(weights).hexdigest()).write_bytes(weights)  # another app's download
    config = repo.files["tokenizer.json"]
    damaged = bytes([config[0] ^ 1]) + config[1:]  # same size, other bytes: not used
    (blobs / git_blob_id(config)).write_bytes(damaged)
    before = {p: p.read_bytes() for p in blobs.iterdir()}
    record = store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)
    fetched = {r[1].rsplit("/", 1)[1] for r in hub.requests if "/resolve/" in r[1]}
    assert fetched == {"config.json", "tokenizer.json", "tokenizer_config.json"}
    assert verify(record["path"]).ok
    assert {p: p.read_bytes() for p in blobs.iterdir()} == before  # the cache untouched
