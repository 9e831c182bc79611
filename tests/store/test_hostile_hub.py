"""A Hub that answers nonsense (sizes that overflow, paths outside the repo, more bytes than it
listed, other bytes than its hashes say) or refuses (a gated repo): one line naming what it
found, and nothing written outside the store."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from fake_hub import git_blob_id

from mlxinfer import store

RECIPE = {"bits": 4, "group_size": 32}


def _entry(path, data: bytes, **changes) -> dict:
    entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
    if path.endswith(".safetensors"):
        lfs = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        entry["lfs"] = lfs
    return {**entry, **changes}


def _files(tmp_path: Path) -> set[Path]:
    return {p for p in tmp_path.rglob("*") if p.is_file() or p.is_symlink()}


def _outside_cache(tmp_path: Path, before: set[Path]) -> set[Path]:
    cache = tmp_path / "cache"
    return {p for p in _files(tmp_path) - before if not p.is_relative_to(cache)}


LISTINGS = {
    "a size past 64 TiB": (
        "model.safetensors",
        {"size": 10**30},
        "with size 1" + "0" * 30 + ", expected 0..",
    ),
    "a negative size": ("model.safetensors", {"size": -1}, "with size -1, expected 0.."),
    "a size as text": ("model.safetensors", {"size": "12"}, "with size '12'"),
    "a path up and out": (
        "../../escape.json",
        {},
        "the file '../../escape.json', outside the repo",
    ),
    "an absolute path": ("/tmp/escape.json", {}, "the file '/tmp/escape.json', outside the repo"),
    "a dot-dot inside": ("a/../../escape.json", {}, "outside the repo"),
    "a backslash": ("..\\escape.json", {}, "outside the repo"),
    "a malformed LFS hash": (
        "model.safetensors",
        {"lfs": {"oid": "x", "size": 1, "pointerSize": 1}},
        "LFS SHA-256 'x'",
    ),  # fmt: skip
    "an LFS entry without its fields": ("model.safetensors", {"lfs": {"oid": "x"}}, "malformed"),
}


@pytest.mark.parametrize("case", list(LISTINGS))
def test_a_hostile_listing_is_one_line_and_nothing_is_downloaded(case, hub, tmp_path):
    path, changes, expected = LISTINGS[case]
    repo = hub.repos["org/tiny"]
    data = repo.files.get(path, b"{}")
    listing = [_entry(p, d) for p, d in sorted(repo.files.items()) if p != path]
    repo.listing = [*listing, _entry(path, data, **changes)]
    before = _files(tmp_path)
    with pytest.raises(store.StoreError) as e:
        store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)
    assert "\n" not in str(e.value) and expected in str(e.value), str(e.value)
    assert not [r for r in hub.requests if "/resolve/" in r[1]]
    assert _outside_cache(tmp_path, before) == set()
    assert not store.parse_name("org/tiny").path().exists()


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"size": 10}, "the Hub sent more than the 10 bytes it listed"),
        ({"lfs": {"oid": "0" * 64, "size": 1, "pointerSize": 134}}, "SHA-256 "),
    ],
)
def test_bytes_other_than_listed_are_discarded(change, expected, hub, tmp_path):
    repo = hub.repos["org/tiny"]
    repo.listing = [_entry(p, d, **(change if p == "model.safetensors" else {}))
                    for p, d in sorted(repo.files.items())]  # fmt: skip
    with pytest.raises(store.StoreError, match=expected) as e:
        store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)
    assert "\n" not in str(e.value)
    downloads = store.store_root() / ".downloads"
    assert not list(downloads.rglob("model.safetensors*"))  # neither kept nor left to resume
    assert not store.parse_name("org/tiny").path().exists()


def test_a_gated_repo_names_hf_token(hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    hub.repos["org/tiny"].gated = True
    with pytest.raises(store.StoreError) as e:
        store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url, token=False)
    message = str(e.value)
    assert "\n" not in message and "gated" in message and "HF_TOKEN" in message
    assert "https://huggingface.co/org/tiny" in message  # the licence page


def test_an_unknown_repo_or_revision_is_one_line(hub):
    with pytest.raises(store.StoreError, match=r"org/nope: no such repo on the Hub"):
        store.pull("org/nope", endpoint=hub.url)
    with pytest.raises(store.StoreError, match=r"org/tiny: no such revision"):
        store.pull("org/tiny", revision="v9", endpoint=hub.url)
    with pytest.raises(store.StoreError, match="pull takes a Hub repo id"):
        store.pull("tiny", endpoint=hub.url)
    with pytest.raises(store.StoreError, match=r"recipe keys \['evil'\]"):
        store.pull("org/tiny", recipe={"evil": 1}, endpoint=hub.url)


def test_a_silent_hub_is_an_error_within_the_timeout(hub, monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["mlxinfer.store.hub"], "TIMEOUT_S", 0.5)
    hub.stall = 3.0
    start = time.monotonic()
    with pytest.raises(store.StoreError, match="cannot be reached or refused") as e:
        store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)
    assert time.monotonic() - start < 2.5 and "\n" not in str(e.value)


def test_a_listing_in_pages_is_followed_to_its_end(hub):
    hub.page_size = 2  # the Hub's Link: rel="next" after every 2 entries
    record = store.pull("org/tiny", recipe=RECIPE, endpoint=hub.url)
    assert set(record["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    pages = [r for r in hub.requests if "/tree/" in r[1]]
    assert len(pages) == 3  # 6 files, 2 a page
