"""The store's tests: a fake Hub serving a tiny HF checkpoint and a tiny GGUF, and a cache root
of the test's own (MLXINFER_CACHE), so nothing is written outside ``tmp_path``."""

from __future__ import annotations

import pytest
from fake_hub import FakeHub, Repo, Serving
from gguf_tiny import write_tiny_gguf
from tiny_checkpoint import write_checkpoint


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    """A tiny HF checkpoint's files and a tiny GGUF's bytes."""
    root = tmp_path_factory.mktemp("sources")
    write_checkpoint(root / "hf")
    write_tiny_gguf(root / "tiny.gguf")
    hf = {p.name: p.read_bytes() for p in sorted((root / "hf").iterdir())}
    return root, hf, (root / "tiny.gguf").read_bytes()


@pytest.fixture
def hub(sources, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MLXINFER_HOST", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # never the user's own
    _, hf, gguf = sources
    repos = {
        "org/tiny": Repo({**hf, "README.md": b"# tiny", "pytorch_model.bin": b"never fetched"}),
        # two quants (the same bytes under two names) and a file a model does not need
        "org/tiny-GGUF": Repo({"tiny-Q8_0.gguf": gguf, "tiny-F16.gguf": gguf, "x.md": b""}),
    }
    with Serving(FakeHub(repos)) as h:
        yield h
