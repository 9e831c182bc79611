"""A ``.gguf`` file where a model directory is expected (``load``, ``generate -m``, ``serve
-m``): imported once into the cache and loaded from there; any other file is our error
naming it (it was a bare NotADirectoryError)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner
from gguf_bytes import gguf_file, tiny_llama

from mlxinfer import generate, load
from mlxinfer.cli.main import cli
from mlxinfer.errors import ConfigError
from mlxinfer.gguf import import_gguf


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    gguf_file(path, tiny_llama())
    return path


def _imports(tmp_path):
    return sorted((tmp_path / "cache" / "models" / "gguf").iterdir())


def test_a_gguf_file_loads_like_its_import_and_is_imported_once(tiny_gguf, tmp_path):
    reference_dir = tmp_path / "converted"
    import_gguf(tiny_gguf, reference_dir)
    expected = generate(*load(reference_dir), "ab", max_tokens=6, chat_template=False)
    assert generate(*load(tiny_gguf), "ab", max_tokens=6, chat_template=False) == expected
    (made,) = _imports(tmp_path)
    stamp = made.stat().st_mtime_ns
    load(tiny_gguf)  # the second time: from the cache
    assert _imports(tmp_path) == [made] and made.stat().st_mtime_ns == stamp
    os.utime(tiny_gguf, ns=(stamp + 10**9, stamp + 10**9))  # the file changed: imported again
    load(tiny_gguf)
    assert len(_imports(tmp_path)) == 2


def test_another_file_is_our_error_naming_it(tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("not a model")
    with pytest.raises(ConfigError, match=r"notes\.txt: a file, expected a model directory"):
        load(other)
    r = CliRunner().invoke(cli, ["generate", "-m", str(other), "-p", "hi"])
    assert r.exit_code == 1 and "notes.txt: a file, expected a model directory" in r.output
    assert "Traceback" not in r.output


def test_bench_takes_a_gguf_file_as_its_import(tiny_gguf, tmp_path, monkeypatch):
    """``bench -m FILE.gguf``: the import's directory is what the bench (and mlx-lm, with
    ``--compare``) reads; the file itself was a bare NotADirectoryError in the notes."""
    from mlxinfer import bench

    seen = {}

    def fake_run(llm, model_dir, *args, **kwargs):
        seen["dir"] = model_dir
        bench.bandwidth.comparison_notes(llm, model_dir, None)  # read the checkpoint's files
        raise SystemExit(0)

    monkeypatch.setattr(bench, "run_benchmark", fake_run)
    r = CliRunner().invoke(cli, ["bench", "-m", str(tiny_gguf), "-p", "4", "-n", "2"])
    assert r.exit_code == 0, r.output
    (made,) = _imports(tmp_path)
    assert seen["dir"] == made and (made / "config.json").is_file()
