"""Finding models: local directories and Hub repo ids (offline, from a local HF cache)."""

import shutil

import pytest
from hf_models import add_tokenizer, make_tiny

from mlxinfer import load
from mlxinfer.errors import ConfigError
from mlxinfer.loading.loader import resolve_model_path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache laid out as huggingface_hub writes it, holding one repo."""
    src, _ = make_tiny(tmp_path / "src", vocab_size=320)
    add_tokenizer(src)
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(src, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / commit


def test_repo_id_resolves_from_local_cache_offline(hub_cache):
    assert resolve_model_path("tiny-org/tiny-llama") == hub_cache
    model, tokenizer = load("tiny-org/tiny-llama")
    assert model.args.vocab_size == 320 and tokenizer.vocab_size > 0


def test_uncached_repo_offline_is_a_clear_error(hub_cache):
    with pytest.raises(ConfigError, match="not-there/model: not in the local Hugging Face cache"):
        resolve_model_path("not-there/model")


def test_neither_path_nor_repo_id(tmp_path):
    with pytest.raises(ConfigError, match="no such file or directory, and not a Hub repo id"):
        resolve_model_path(str(tmp_path / "a" / "b" / "c"))
