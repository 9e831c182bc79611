"""The prefix cache's disk tier (batch/disk.py): full blocks written as files, read back by a
later engine (a restart) or another engine sharing the directory; bad files ignored and
removed; the disk budget held. The reference for every greedy output is a cold engine
without the disk tier (whose batched greedy tokens test_batch holds to transformers')."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import threading
import time

import pytest
from tiny_checkpoint import write_checkpoint

from mlxinfer.batch import Engine
from mlxinfer.batch.pool import block_hash
from mlxinfer.loading.loader import load_model

BS = 16
# head_dim 64: one whole group of kv_group_size 64 for the kv_bits=8 pool
SHAPE = dict(
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_hidden_layers=2,
    max_position_embeddings=4096,
)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, _ = load_model(write_checkpoint(tmp_path_factory.mktemp("tiny") / "m", **SHAPE))
    return model


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A model of the same shapes with another configuration: another model's blocks."""
    path = write_checkpoint(tmp_path_factory.mktemp("other") / "m", rms_norm_eps=1e-6, **SHAPE)
    model, _ = load_model(path)
    return model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Gemma 3's sliding-window layers (window 40) with one global layer in 6 (its window pool
    beside the pool), and with none in 4 (one pool of windows)."""
    models = {}
    for layers in (6, 4):
        path = write_checkpoint(
            tmp_path_factory.mktemp("gemma3") / "m",
            model_type="gemma3_text",
            sliding_window=40,
            head_dim=64,
            **{**SHAPE, "num_hidden_layers": layers},
        )
        models[layers] = load_model(path)[0]
    return models


@pytest.mark.parametrize("layers, blocks_read", [(6, 300 // BS), (4, 3)])
def test_sliding_window_models_read_their_prefix_back_too(gemma3, layers, blocks_read, tmp_path):
    """Both pools' blocks in each file; a model of windows only reads the blocks its window
    sees (3 of 18: the window of 40 tokens ends in the 18th block)."""
    model = gemma3[layers]
    system = _ids(300, 11)
    first, second = system + _ids(20, 12), system + _ids(17, 13)
    with Engine(model, block_size=BS, prefix_cache_dir=tmp_path) as engine:
        assert (engine.window_pool is not None) == (layers == 6)
        _run(engine, first)
    with Engine(model, block_size=BS, prefix_cache_dir=tmp_path) as engine:
        tokens, cached = _run(engine, second)
        assert engine.pool.disk.loaded == blocks_read
    assert cached == 300 // BS * BS
    assert tokens == _cold(model, second)


LFM2 = dict(
    model_type="lfm2",
    layer_types=["conv", "full_attention", "conv", "conv"],
    conv_L_cache=3,
    block_multiple_of=64,
)


@pytest.mark.parametrize("damaged", [False, True])
def test_a_recurrent_model_resumes_from_a_state_snapshot_on_disk(damaged, tmp_path):
    """LFM2: the blocks and the snapshot of the states after them come back from disk. The
    first prompt (320 tokens) leaves snapshots after 256 tokens (a prefill chunk) and after
    its last full block (304); the next turn extends it past 304. A damaged snapshot file is
    removed, and the request resumes from the one before."""
    path = write_checkpoint(tmp_path / "m", **{**SHAPE, "num_hidden_layers": 4, **LFM2})
    model, _ = load_model(path)
    first = _ids(320, 14)
    second = first[:310] + _ids(17, 16)
    with Engine(model, block_size=BS, prefix_cache_dir=tmp_path / "d") as engine:
        _run(engine, first)
        snapshots = engine.snapshots
    state_file = snapshots.tier.path(_hashes(first)[304 // BS - 1], snapshots.format)
    assert state_file.is_file()
    if damaged:
        state_file.write_bytes(state_file.read_bytes()[:-1] + b"\0")
    with Engine(model, block_size=BS, prefix_cache_dir=tmp_path / "d") as engine:
        tokens, cached = _run(engine, second)
        rejected = engine.pool.disk.rejected
    assert (cached, rejected) == ((256, 1) if damaged else (304, 0))
    assert tokens == _cold(model, second)


def _run(engine, prompt, n=6):
    handle = engine.submit(prompt, max_tokens=n)
    return [s.token for s in handle.steps()], handle.cached_tokens


def _cold(model, prompt, n=6, **options):
    with Engine(model, block_size=BS, **options) as engine:
        return _run(engine, prompt, n)[0]


def _hashes(prompt):
    out, parent = [], b""
    for i in range((len(prompt) - 1) // BS):
        parent = block_hash(parent, prompt[i * BS : (i + 1) * BS])
        out.append(parent)
    return out


def test_a_restarted_engine_reads_the_prefix_back_from_disk(tiny, tmp_path):
    system = _ids(300, 1)
    first, second = system + _ids(20, 2), system + _ids(17, 3)
    with Engine(tiny, block_size=BS, prefix_cache_dir=tmp_path) as engine:
        _run(engine, first)
    with Engine(tiny, block_size=BS, prefix_cache_dir=tmp_path) as engine:  # the restart
        tokens, cached = _run(engine, second)
        loaded = engine.pool.disk.loaded
    assert cached == 300 // BS * BS
    assert loaded == 300 // BS
    assert tokens == _cold(tiny, second)


def test_a_quantized_pool_stores_its_packed_blocks(tiny, tmp_path):
    prompt = _ids(200, 4)
    with Engine(tiny, block_size=BS, kv_bits=8, prefix_cache_dir=tmp_path) as engine:
        _run(engine, prompt)
    with Engine(tiny, block_size=BS, kv_bits=8, prefix_cache_dir=tmp_path) as engine:
        tokens, cached = _run(engine, prompt)
    assert cached == (len(prompt) - 1) // BS * BS
    assert tokens == _cold(tiny, prompt, kv_bits=8)


def _damage(kind, path, tmp_path, tiny, other, prompt, index):
    """Replace the file of block ``index`` of ``prompt`` at ``path`` by a bad one."""
    blob = path.read_bytes()
    if kind == "a fifo":  # reading it must not hang the engine
        path.unlink()
        os.mkfifo(path)
        return b"fifo"
    if kind == "truncated":
        path.write_bytes(blob[: len(blob) // 2])
    elif kind == "corrupted data":
        path.write_bytes(blob[:-100] + bytes(b ^ 0xFF for b in blob[-100:]))
    elif kind == "corrupted header":
        path.write_bytes(blob[:8] + b"[" + blob[9:])  # not an object
    else:  # another model's or another kv_bits' file for the same block, renamed onto ours
        model, options = (other, {}) if kind == "other model" else (tiny, {"kv_bits": 8})
        with Engine(model, block_size=BS, prefix_cache_dir=tmp_path / "x", **options) as e:
            _run(e, prompt, 1)
            theirs = e.pool.disk.path(_hashes(prompt)[index])
        assert theirs != path and theirs.is_file()
        shutil.copyfile(theirs, path)


@pytest.mark.parametrize(
    "kind",
    ["truncated", "corrupted data", "corrupted header", "other model", "other kv_bits", "a fifo"],
)
def test_a_bad_block_file_is_ignored_and_removed(kind, tiny, other, tmp_path, caplog):
    prompt = _ids(200, 5)
    with Engine(tiny, block_size=BS, prefix_cache_dir=tmp_path / "d") as engine:
        _run(engine, prompt, 1)
        path = engine.pool.disk.path(_hashes(prompt)[4])
    bad = _damage(kind, path, tmp_path, tiny, other, prompt, 4) or path.read_bytes()
    with caplog.at_level(logging.WARNING, "mlxinfer.prefix_cache"):
        with Engine(tiny, block_size=BS, prefix_cache_dir=tmp_path / "d") as engine:
            tokens, cached = _run(engine, prompt)
            rejected = engine.pool.disk.rejected
    assert rejected == 1
    assert cached == 4 * BS  # the blocks before the bad one
    assert tokens == _cold(tiny, prompt)
    assert any("removed" in r.getMessage() for r in caplog.records)
    assert path.is_file() and path.read_bytes() != bad  # removed, written again when computed
    with Engine(tiny, block_size=BS, prefix_cache_dir=tmp_path / "d") as engine:
        assert _run(engine, prompt)[1] == (len(prompt) - 1) // BS * BS


def test_the_disk_budget_holds_and_the_oldest_blocks_go(tiny, tmp_path):
    old, new = _ids(8 * BS + 1, 6), _ids(8 * BS + 1, 7)  # 8 full blocks each
    with Engine(tiny, block_size=BS, prefix_cache_dir=tmp_path / "sizes") as e:
        _run(e, old[: BS + 1], 1)
    per_file = next((tmp_path / "sizes").rglob("*.safetensors")).stat().st_size
    budget = 10 * per_file
    with Engine(
        tiny, block_size=BS, prefix_cache_dir=tmp_path, prefix_cache_disk_bytes=budget
    ) as e:
        _run(e, old, 1)
        e.pool.disk.flush()
        time.sleep(0.05)  # the new prompt's files are younger (mtime)
        _run(e, new, 1)
    assert 0 < e.pool.disk.bytes_on_disk() <= budget
    assert e.pool.disk.evicted >= 6
    with Engine(
        tiny, block_size=BS, prefix_cache_dir=tmp_path, prefix_cache_disk_bytes=budget
    ) as e:
        assert _run(e, new, 1)[1] == 8 * BS
        assert _run(e, old, 1)[1] == 0  # its first block went first


def test_two_engines_share_a_directory(tiny, tmp_path):
    system = _ids(160, 8)
    prompts = [system + _ids(40, 9 + i) for i in range(4)]
    a = Engine(tiny, block_size=BS, prefix_cache_dir=tmp_path)
    b = Engine(tiny, block_size=BS, prefix_cache_dir=tmp_path)
    try:  # both write the shared prefix's blocks at once, and their own
        threads = [
            threading.Thread(target=_run, args=(e, p, 2)) for e, p in zip([a, b, a, b], prompts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        a.close()
        b.close()
    with Engine(tiny, block_size=BS, prefix_cache_dir=tmp_path) as c:
        for p in prompts:
            tokens, cached = _run(c, p)
            assert cached == (len(p) - 1) // BS * BS
            assert tokens == _cold(tiny, p)
        assert c.pool.disk.rejected == 0


def test_a_full_write_queue_drops_blocks_and_never_waits(tiny, tmp_path):
    prompt = _ids(200, 10)
    with Engine(tiny, block_size=BS, prefix_cache_dir=tmp_path) as engine:
        engine.pool.disk.queue_bytes = 0
        tokens, _ = _run(engine, prompt)
        disk = engine.pool.disk
    assert disk.dropped >= (len(prompt) - 1) // BS and disk.written == 0
    assert tokens == _cold(tiny, prompt)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="a cold 1,500-token prefill of SmolLM2 f32: 20 s idle, 90 s at load 10 on 2 cores "
    "(set MLXINFER_SLOW=1); the tiny model's restart tests run in the suite",
)
def test_smollm2_restart_reuses_a_1500_token_prefix(smollm2_f32_dir, tmp_path):
    """The issue's restart check, in-process (one cold prefill of 1,500 tokens): the engine
    that answers cold writes the prompt's blocks; a fresh engine answers the same prompt from
    disk with the cold greedy tokens, and a new question on the same prefix from disk too.
    (A new question's tokens against a cold run's: the tiny model's restart test.)"""
    from mlxinfer.tokenization import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_f32_dir)
    model, _ = load_model(smollm2_f32_dir)
    facts = " ".join(f"Item {i} is stored in box {i * 7 % 50} on shelf {i % 9}." for i in range(95))
    prefix = tokenizer.encode(f"Read the inventory below.\n{facts}\n")
    asked = prefix + tokenizer.encode("Question: where is item 3? Answer:")
    new = prefix + tokenizer.encode("Question: which shelf holds item 12? Answer:")
    assert len(prefix) >= 1450 and len(asked) >= 1500
    with Engine(model, prefix_cache_dir=tmp_path) as engine:
        cold, cached = _run(engine, asked, 8)
    assert cached == 0
    with Engine(model, prefix_cache_dir=tmp_path) as engine:  # the restart
        warm, cached = _run(engine, asked, 8)
        assert engine.pool.disk.loaded == (len(asked) - 1) // 16
        _, cached_new = _run(engine, new, 1)
    assert cached >= 1400 and cached_new >= 1400
    assert warm == cold


# -- --prompt-cache-file (cache/prompt_file.py) ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return write_checkpoint(root / "a", **SHAPE), write_checkpoint(
        root / "b", rms_norm_eps=1e-6, **SHAPE
    )


def _generate(model_dir, prompt, *extra):
    from click.testing import CliRunner

    from mlxinfer.cli.main import cli

    args = ["generate", "-m", str(model_dir), "-p", prompt, "-n", "5", "-v", *map(str, extra)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    cached = re.search(r"prompt tokens\s+\d+ \((\d+) cached\)", result.stderr)
    return result.stdout, int(cached.group(1)), result.stderr


PROMPT = "Hello world, the quick brown fox jumps over the lazy dog. " * 3


def test_generate_resumes_from_its_prompt_cache_file(tiny_dirs, tmp_path):
    path = tmp_path / "session.cache"
    text, cached, _ = _generate(tiny_dirs[0], PROMPT, "--prompt-cache-file", path)
    assert cached == 0 and path.is_file()
    again, cached, _ = _generate(tiny_dirs[0], PROMPT + "naïve café", "--prompt-cache-file", path)
    cold, _, _ = _generate(tiny_dirs[0], PROMPT + "naïve café")
    assert cached > 10
    assert again == cold


@pytest.mark.parametrize("kind", ["truncated", "corrupted", "other model", "other kv_bits"])
def test_a_foreign_or_damaged_prompt_cache_file_is_a_warning_and_a_cold_start(
    kind, tiny_dirs, tmp_path
):
    path = tmp_path / "session.safetensors"
    source, extra = (tiny_dirs[1], []) if kind == "other model" else (tiny_dirs[0], [])
    if kind == "other kv_bits":
        extra = ["--kv-bits", "8"]
    _generate(source, PROMPT, "--prompt-cache-file", path, *extra)
    blob = path.read_bytes()
    if kind == "a fifo":  # reading it must not hang the engine
        path.unlink()
        os.mkfifo(path)
        return b"fifo"
    if kind == "truncated":
        path.write_bytes(blob[: len(blob) - 10])
    elif kind == "corrupted":
        path.write_bytes(blob[:8] + b"[" + blob[9:])
    text, cached, err = _generate(tiny_dirs[0], PROMPT, "--prompt-cache-file", path)
    assert cached == 0
    assert re.search(rf"warning: {re.escape(str(path))}: not used \(.+\); starting cold", err)
    assert text == _generate(tiny_dirs[0], PROMPT)[0]
    assert _generate(tiny_dirs[0], PROMPT, "--prompt-cache-file", path)[1] > 0  # written anew


def test_a_restarted_server_reports_the_prefix_read_from_disk(tiny_dirs, tmp_path):
    """make_app(prefix_cache_dir=...) (serve --prefix-cache-dir) hands it to its engine; the
    server's shutdown writes the queued blocks; the next server's usage counts them cached."""
    from fastapi.testclient import TestClient

    from mlxinfer.loading.loader import load
    from mlxinfer.server import make_app

    model, tokenizer = load(tiny_dirs[0])
    body = {"model": "tiny", "prompt": PROMPT * 4, "max_tokens": 3, "temperature": 0}
    usage, loaded = [], []
    for _ in range(2):
        with TestClient(make_app(model, tokenizer, "tiny", prefix_cache_dir=tmp_path)) as client:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"])
            metrics = client.get("/metrics").text
            loaded += re.findall(
                r'mlxinfer_prefix_disk_blocks_loaded_total\{model="tiny"\} (\d+)', metrics
            )
    assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert loaded == ["0", str(usage[1]["prompt_tokens_details"]["cached_tokens"] // 16)]
    assert (
        usage[1]["prompt_tokens_details"]["cached_tokens"]
        == (usage[1]["prompt_tokens"] - 1) // 16 * 16
    )


def test_the_fingerprint_follows_the_weight_files(tmp_path):
    """The manifest's sums where there is one; else each file's, cached by size and mtime (a
    rewritten weight file is another model)."""
    from mlxinfer.batch.disk import attach
    from mlxinfer.files.manifest import write_manifest

    path = write_checkpoint(tmp_path / "m", **SHAPE)
    model, _ = load_model(path)
    with Engine(model, block_size=BS) as engine:
        pool = engine.pool

    def digest():
        tier = attach(model, [pool], directory=tmp_path / "d", budget=None, refusal=None)
        tier.close()
        return tier

    first = digest()
    assert list((tmp_path / "d" / "file-sums").glob("*.json"))  # kept for the next start
    assert digest().fingerprint == first.fingerprint
    weights = path / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1  # same size, another value
    weights.write_bytes(bytes(blob))
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = digest()
    assert second.fingerprint != first.fingerprint
    write_manifest(path)
    third = digest()
    manifest = path / "mlxinfer-manifest.json"
    data = json.loads(manifest.read_text())
    data["files"]["model.safetensors"]["sha256"] = "0" * 64  # the manifest is what is read
    manifest.write_text(json.dumps(data))
    assert digest().fingerprint not in (third.fingerprint, second.fingerprint)


def test_chat_resumes_from_its_prompt_cache_file(tiny_dirs, tmp_path):
    from click.testing import CliRunner

    from mlxinfer.cli.main import cli

    path = tmp_path / "chat.safetensors"
    args = ["chat", "-m", str(tiny_dirs[0]), "--chat-template", "chatml", "-n", "4", "-v"]
    cached = []
    for _ in range(2):  # the same first message: all but its last token from the file
        result = CliRunner().invoke(cli, [*args, "--prompt-cache-file", str(path)], input=PROMPT)
        assert result.exit_code == 0, result.output
        found = re.search(r"prompt tokens\s+(\d+) \((\d+) cached\)", result.stderr)
        cached.append((int(found.group(1)), int(found.group(2))))
    assert cached[0][1] == 0 and cached[1][1] == cached[1][0] - 1


def test_an_unusable_prefix_cache_dir_is_a_one_line_error(tiny, tmp_path):
    from mlxinfer.errors import MlxInferError

    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    with pytest.raises(
        MlxInferError, match=rf"{re.escape(str(taken))}: cannot be the prefix cache"
    ):
        Engine(tiny, block_size=BS, prefix_cache_dir=taken)
