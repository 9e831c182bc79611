"""Crash-safe writes: fsync before the rename, debris of killed writers cleared, a manifest of
every file's size and SHA-256 checked at load (sizes) and by ``mlxinfer verify`` (sums), a
damaged default model fetched again, and SIGKILL at chosen moments of ``mlxinfer convert``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from fixtures import load_script
from hf_models import add_tokenizer, make_tiny

import mlxinfer
from mlxinfer.cli.main import cli
from mlxinfer.errors import ConfigError, WeightsError
from mlxinfer.files import atomic, entries
from mlxinfer.files.manifest import MANIFEST_NAME
from mlxinfer.loading import default_model, loader
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model

kc = load_script("tools/kill_convert.py")


@pytest.fixture(autouse=True)
def plans_off(monkeypatch):
    monkeypatch.setenv("MLXINFER_CPU_PLANS", "off")  # loads here check files, not speed


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("hf") / "tiny", vocab_size=320)
    return add_tokenizer(path)


@pytest.fixture(scope="module")
def mid_dir(tmp_path_factory):
    """~50 MB of float32 weights: writing takes long enough to be killed in the middle."""
    return kc.make_checkpoint(tmp_path_factory.mktemp("hf") / "mid")


@pytest.fixture
def model_dir(hf_dir, tmp_path):
    return Path(convert(hf_dir, tmp_path / "out")["path"])


def files_of(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


def debris(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


# ---------------------------------------------------------------------------
# fsync


def record_fsyncs(monkeypatch, watched: Path) -> list[tuple[tuple[int, int], bool]]:
    """Every fsync as ((device, inode) of what was flushed, whether ``watched`` existed then)."""
    calls = []
    real_fsync = os.fsync

    def note(fd):
        st = os.fstat(fd)
        calls.append(((st.st_dev, st.st_ino), watched.exists()))

    def fsync(fd):
        note(fd)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    if sys.platform == "darwin":  # files/atomic.py flushes with F_FULLFSYNC there
        import fcntl

        real_fcntl = fcntl.fcntl

        def full(fd, cmd, *args):
            if cmd == fcntl.F_FULLFSYNC:
                note(fd)
            return real_fcntl(fd, cmd, *args)

        monkeypatch.setattr(fcntl, "fcntl", full)
    return calls


def inode(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def test_convert_flushes_every_file_and_directory_before_the_rename_and_the_parent_after(
    hf_dir, tmp_path, monkeypatch
):
    dst = tmp_path / "out"
    calls = record_fsyncs(monkeypatch, dst)
    convert(hf_dir, dst)
    before = {ino for ino, existed in calls if not existed}
    after = {ino for ino, existed in calls if existed}
    # rename keeps inodes: each file and the directory itself, flushed in the temporary sibling
    for name in files_of(dst):
        assert inode(dst / name) in before, name
    assert inode(dst) in before
    assert inode(tmp_path) in after  # the parent, so that the rename itself is on disk


def test_prompt_cache_and_plan_cache_files_are_flushed_before_their_rename(tmp_path, monkeypatch):
    from mlxinfer.cache.kv import KVCache
    from mlxinfer.cache.prompt import load_cache, save_cache

    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    saved = tmp_path / "c.safetensors"
    calls = record_fsyncs(monkeypatch, saved)
    save_cache(saved, [cache])
    assert (inode(saved), False) in calls and (inode(tmp_path), True) in calls
    assert load_cache(saved)[0][0].offset == 3

    stored = tmp_path / "cpu-plans.json"
    calls = record_fsyncs(monkeypatch, stored)
    entries.write_entries(stored, {"k": {"cut": "one"}})
    assert (inode(stored), False) in calls and (inode(tmp_path), True) in calls
    assert json.loads(stored.read_text()) == {"k": {"cut": "one"}}
    assert files_of(tmp_path) == {"c.safetensors", "cpu-plans.json"}


# ---------------------------------------------------------------------------
# debris


WRITER = """
import sys, time
from pathlib import Path
from mlxinfer.files.atomic import writing_dir, writing_file
with (writing_dir if sys.argv[1] == "dir" else writing_file)(Path(sys.argv[2])) as tmp:
    (tmp / "half" if sys.argv[1] == "dir" else tmp).write_bytes(b"half")
    print("writing", flush=True)
    time.sleep(60)
"""


def writer(kind: str, dst: Path) -> subprocess.Popen:
    """A process in the middle of an atomic write to ``dst`` (until killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, kind, str(dst)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "writing\n"
    return proc


def test_debris_of_killed_writers_is_cleared_and_a_live_writers_kept(hf_dir, tmp_path):
    out, plans = tmp_path / "out", tmp_path / "cpu-plans.json"
    killed = [writer("dir", out), writer("file", plans)]
    for proc in killed:
        proc.kill()
        proc.wait()
    dead = debris(out) + debris(plans)
    assert len(dead) == 2
    live = writer("dir", out)
    try:
        running = [name for name in debris(out) if name not in dead]
        # another host's (a shared volume): its pid means nothing here, so its age decides
        foreign = "0" * 8 if atomic._host() != "0" * 8 else "1" * 8
        old, fresh = (tmp_path / f".out.{foreign}-{pid}-0123abcd.tmp" for pid in (1, 2))
        for path in (old, fresh):
            path.mkdir()
            (path / "model.safetensors").write_bytes(b"half")
        day_ago = time.time() - atomic.FOREIGN_DEBRIS_AGE_S - 60
        for path in (old, old / "model.safetensors"):
            os.utime(path, (day_ago, day_ago))

        convert(hf_dir, out)
        atomic.write_text(plans, "{}")

        assert debris(out) == sorted([*running, fresh.name]) and debris(plans) == []
    finally:
        live.kill()
        live.wait()


# ---------------------------------------------------------------------------
# the manifest


def test_every_converted_or_imported_model_carries_a_manifest_of_its_files(hf_dir, tmp_path):
    from gguf_tiny import write_tiny_gguf

    from mlxinfer.gguf import import_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    outs = [
        Path(convert(hf_dir, tmp_path / "hf-out")["path"]),
        Path(import_gguf(tmp_path / "tiny.gguf", tmp_path / "gguf-out")["path"]),
    ]
    for out in outs:
        manifest = json.loads((out / MANIFEST_NAME).read_text())
        assert manifest["format"] == "mlxinfer-manifest" and manifest["version"] == 1
        assert set(manifest["files"]) == files_of(out) - {MANIFEST_NAME}
        for name, entry in manifest["files"].items():
            data = (out / name).read_bytes()
            assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        result = mlxinfer.verify(out)
        assert result.ok and result.files == len(manifest["files"]) and result.problems == []
        cli_result = CliRunner().invoke(cli, ["verify", str(out)])
        assert cli_result.exit_code == 0
        assert cli_result.output == (
            f"{out}: OK ({result.files} files, {result.bytes / 2**20:.1f} MiB, "
            "sizes and SHA-256 match)\n"
        )


def test_a_file_of_another_size_or_a_missing_one_is_refused_at_load(model_dir):
    weights = model_dir / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "ab") as f:  # one byte more: the safetensors header still parses
        f.write(b"\0")
    with pytest.raises(WeightsError) as e:
        load_model(model_dir)
    assert str(e.value) == (
        f"{weights}: size {size + 1} bytes, expected {size} ({MANIFEST_NAME}); the file is damaged"
    )
    os.truncate(weights, size)
    load_model(model_dir)  # whole again
    tokenizer = model_dir / "tokenizer.json"
    n = tokenizer.stat().st_size
    tokenizer.unlink()
    with pytest.raises(WeightsError) as e:
        mlxinfer.load(model_dir)
    assert str(e.value) == f"{tokenizer}: missing (listed in {MANIFEST_NAME} with {n} bytes)"


def test_verify_names_each_damaged_or_missing_file_and_exits_1(model_dir):
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    expected = hashlib.sha256(data).hexdigest()
    data[len(data) // 2] ^= 0x01  # one bit of one weight: same size, loads
    weights.write_bytes(data)
    load_model(model_dir)
    tokenizer = model_dir / "tokenizer.json"
    n = tokenizer.stat().st_size
    tokenizer.unlink()

    result = mlxinfer.verify(model_dir)
    assert not result.ok
    assert result.problems == [
        f"{weights}: SHA-256 {hashlib.sha256(data).hexdigest()}, expected {expected} "
        f"({MANIFEST_NAME}); the file is damaged",
        f"{tokenizer}: missing (listed in {MANIFEST_NAME} with {n} bytes)",
    ]
    out = CliRunner().invoke(cli, ["verify", str(model_dir)])
    assert out.exit_code == 1
    assert out.output.splitlines() == [
        *(f"damaged: {p}" for p in result.problems),
        f"{model_dir}: 2 of 5 files damaged/missing",
    ]


def test_a_model_without_a_manifest_loads_and_verify_says_it_has_none(model_dir):
    (model_dir / MANIFEST_NAME).unlink()
    mlxinfer.load(model_dir)
    result = mlxinfer.verify(model_dir)
    assert not result.has_manifest and not result.ok
    out = CliRunner().invoke(cli, ["verify", str(model_dir)])
    assert out.exit_code == 3
    assert out.output == (
        f"{model_dir}: no {MANIFEST_NAME} (converted before manifests, or by another tool); "
        "nothing to check against\n"
    )


@pytest.mark.parametrize(
    "files,message",
    [
        (
            {"../../etc/passwd": {"size": 1, "sha256": "0" * 64}},
            "file name '../../etc/passwd' is not a path inside the model directory",
        ),
        (
            {"config.json": {"size": -1, "sha256": "ab"}},
            'entry \'config.json\': expected {"size": int >= 0, "sha256": 64 hex digits}, '
            'found {"size": -1, "sha256": "ab"}',
        ),
        ([], "'files' must be an object, found list"),
    ],
    ids=["outside", "negative-size", "list"],
)
def test_a_malformed_manifest_is_a_one_line_error(model_dir, files, message):
    path = model_dir / MANIFEST_NAME
    path.write_text(json.dumps({"format": "mlxinfer-manifest", "version": 1, "files": files}))
    for check in (load_model, mlxinfer.verify):
        with pytest.raises(WeightsError) as e:
            check(model_dir)
        assert str(e.value) == f"{path}: {message}"


def test_converting_over_a_complete_model_says_so_in_one_line(hf_dir, model_dir, tmp_path):
    with pytest.raises(ConfigError) as e:
        convert(hf_dir, model_dir)
    assert str(e.value) == (
        f"{model_dir}: a complete model already exists there (5 files match its {MANIFEST_NAME}); "
        "remove it to write it again"
    )
    out = CliRunner().invoke(cli, ["convert", str(hf_dir), "-o", str(model_dir)])
    assert out.exit_code == 1 and out.output.splitlines()[-1] == f"Error: {e.value}"
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError) as e:
        convert(hf_dir, tmp_path / "a-file")
    assert str(e.value) == f"{tmp_path / 'a-file'}: output path exists and is not a directory"


# ---------------------------------------------------------------------------
# the default model


@pytest.fixture
def tiny_default(tmp_path, monkeypatch):
    """The default model's fetch replaced by a tiny GGUF (the import is the real one); returns
    (its directory, the list of imports made)."""
    from gguf_tiny import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        default_model, "fetch_smollm2_gguf", lambda work, log: tmp_path / "tiny.gguf"
    )
    imports = []
    real_import = default_model.import_gguf

    def counted(src, dst, **kwargs):
        imports.append(dst)
        return real_import(src, dst, **kwargs)

    monkeypatch.setattr(default_model, "import_gguf", counted)
    path = default_model.default_model_path()
    assert imports == [path] and mlxinfer.verify(path).ok
    return path, imports


def test_a_default_model_of_the_wrong_size_is_imported_again(tiny_default):
    path, imports = tiny_default
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 10)
    messages = []
    assert default_model.default_model_path(log=messages.append) == path
    assert messages[0] == (
        f"Damaged default model ({weights}: size {size - 10} bytes, expected {size} "
        f"({MANIFEST_NAME}); the file is damaged); fetching it again"
    )
    assert len(imports) == 2 and mlxinfer.verify(path).ok
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no debris


def test_a_default_model_that_fails_to_load_is_imported_again_unless_its_files_are_intact(
    tiny_default, monkeypatch
):
    path, imports = tiny_default
    config = path / "config.json"
    config.write_text(" " * config.stat().st_size)  # same size, not JSON: only the sum tells
    messages = []
    model, tokenizer = mlxinfer.load(log=messages.append)
    assert any(m.startswith("The default model does not load (") for m in messages)
    assert len(imports) == 2 and mlxinfer.verify(path).ok

    def refuse(*args, **kwargs):  # intact files, refused for another reason: no new import
        raise WeightsError("too big for this machine")

    monkeypatch.setattr(loader, "load_model", refuse)
    with pytest.raises(WeightsError, match="too big"):
        mlxinfer.load()
    assert len(imports) == 2


# ---------------------------------------------------------------------------
# SIGKILL


@pytest.mark.parametrize(
    "moment", ["temporary directory made", "weights written", "manifest written"]
)
def test_sigkill_during_convert_leaves_nothing_or_a_complete_model_and_a_rerun_succeeds(
    mid_dir, tmp_path, moment
):
    dst = tmp_path / "out"
    inside = {"weights written": "model.safetensors", "manifest written": MANIFEST_NAME}
    proc = kc.start(kc.convert_command(mid_dir, dst))
    assert kc.kill_when(proc, kc.writing(dst, inside.get(moment))), "exited before the moment"
    landed, problem = kc.after_kill(dst)
    assert problem is None
    if moment != "manifest written":  # then the rename may have been quicker than the kill
        assert landed == "mid-write"
    if landed == "mid-write":
        convert(mid_dir, dst)  # the rerun, which also clears the killed run's debris
    else:
        with pytest.raises(ConfigError, match=kc.COMPLETE):
            convert(mid_dir, dst)
    assert debris(dst) == []
    assert kc.check_model(dst) is None


@pytest.mark.real
def test_sigkill_during_the_default_model_import_leaves_nothing_and_the_next_use_imports_it(
    tmp_path, monkeypatch
):
    from fixtures import smollm2_gguf_path

    env = {
        "MLXINFER_CACHE": str(tmp_path / "cache"),
        "MLXINFER_SMOLLM2_WHEEL": str(smollm2_gguf_path()),
    }
    dst = tmp_path / "cache" / "models" / default_model.DEFAULT_MODEL_NAME
    code = "from mlxinfer.loading.default_model import default_model_path; default_model_path()"
    proc = kc.start([sys.executable, "-c", code], env)
    assert kc.kill_when(proc, kc.writing(dst)), "exited before the moment"  # mid-import
    assert not dst.exists() and len(debris(dst)) == 1

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert default_model.default_model_path() == dst
    assert mlxinfer.verify(dst).ok
    kept = {p.name for p in (tmp_path / "cache").iterdir()} - {"blas-check.json"}  # the child's
    assert debris(dst) == [] and kept == {"models"}  # BLAS verdict (blas_check), not debris
