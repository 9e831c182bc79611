"""The memory guard (loading/memory.py): a model is weighed against what the machine can give before
it loads, and refused with the numbers unless forced; a generation's KV cache holds to its
budget and ends with a finish reason when it reaches it; a --models-dir server counts the
models it holds and unloads idle ones before another loads."""

from __future__ import annotations

import struct

import mlx.core as mx
import pytest
from click.testing import CliRunner
from hf_models import TINY, add_tokenizer, make_tiny
from mlx.utils import tree_flatten

from mlxinfer import load
from mlxinfer.cache.kv import KVCache, cache_nbytes
from mlxinfer.cache.prompt import PromptCache
from mlxinfer.errors import InsufficientMemoryError, PromptTooLongError
from mlxinfer.generation import stream_generate
from mlxinfer.generation.chat import ChatSession
from mlxinfer.loading import memory
from mlxinfer.loading.loader import weight_files
from mlxinfer.server.models import Models

# One token's keys and values in TINY's cache on the CPU (float32): per layer, keys and values
# of num_key_value_heads heads of hidden_size / num_attention_heads.
HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]
KV_PER_TOKEN = TINY["num_hidden_layers"] * 2 * TINY["num_key_value_heads"] * HEAD_DIM * 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("memory") / "tiny", vocab_size=320)
    return add_tokenizer(path)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(str(tiny_dir))


def tensor_bytes(file) -> int:
    """A safetensors file's data bytes: its size less the 8-byte length and the header."""
    data = file.read_bytes()
    (header,) = struct.unpack("<Q", data[:8])
    return len(data) - 8 - header


def machine(monkeypatch, free: int) -> None:
    """Pretend the machine can give ``free`` bytes."""
    monkeypatch.setattr(memory, "capacity", lambda *a: memory.Capacity(free, "a test's figure"))


def test_the_estimate_of_a_model_is_its_tensor_bytes_at_the_dtype_it_computes_in(tiny_dir, tiny):
    files = weight_files(tiny_dir)
    stored = sum(tensor_bytes(f) for f in files)  # make_tiny saves float32
    assert memory.weights_bytes(files, None) == stored
    assert memory.weights_bytes(files, mx.float32) == stored
    assert memory.weights_bytes(files, mx.float16) == stored // 2
    loaded = sum(v.nbytes for _, v in tree_flatten(tiny[0].parameters()))
    assert loaded == stored


def test_a_model_that_does_not_fit_is_refused_with_the_numbers_unless_forced(tiny_dir, monkeypatch):
    weights = sum(tensor_bytes(f) for f in weight_files(tiny_dir))
    kv = TINY["max_position_embeddings"] * KV_PER_TOKEN  # the whole (short) context's KV
    need = weights + kv + memory.HEADROOM
    machine(monkeypatch, need - 1)
    with pytest.raises(InsufficientMemoryError) as refused:
        load(str(tiny_dir))
    message = str(refused.value)
    assert message == (
        f"{tiny_dir}: needs {memory.size_text(need)} (weights {memory.size_text(weights)} + "
        f"KV budget {memory.size_text(kv)} + headroom {memory.size_text(memory.HEADROOM)}), "
        f"but this machine can give {memory.size_text(need - 1)} (a test's figure); load it "
        "anyway with force=True (--force), or pick a smaller or more quantized model"
    )
    model, _ = load(str(tiny_dir), force=True)
    assert model is not None
    machine(monkeypatch, need)
    assert load(str(tiny_dir))[0] is not None


def test_the_cli_refuses_with_the_numbers_and_force_loads(tiny_dir, monkeypatch):
    from mlxinfer.cli.main import cli

    machine(monkeypatch, 1000)
    args = ["generate", "--model", str(tiny_dir), "-p", "hi", "-n", "3", "--no-chat-template"]
    refused = CliRunner().invoke(cli, args)
    assert refused.exit_code != 0
    assert "this machine can give 1.00 kB (a test's figure)" in refused.output
    forced = CliRunner().invoke(cli, [*args, "--force"])
    assert forced.exit_code == 0, forced.output


PROMPT = list(range(10, 20))  # 10 token ids


def test_a_generation_ends_at_its_kv_budget_with_the_reason(tiny):
    model, tokenizer = tiny
    budget = 25 * KV_PER_TOKEN  # the prompt's 10 tokens and 15 more
    cache = PromptCache(model.make_cache())
    results = list(
        stream_generate(
            model, tokenizer, PROMPT, max_tokens=100, kv_budget=budget, prompt_cache=cache
        )
    )
    last = results[-1]
    assert len(results) == 15 and last.finish_reason == "length"
    assert last.stats.limited_by == "kv_budget"
    assert cache_nbytes(cache.cache) <= budget
    assert all(c.keys.shape[2] <= 25 for c in cache.cache if isinstance(c, KVCache))
    # under the budget nothing changes
    free = list(stream_generate(model, tokenizer, PROMPT, max_tokens=8, kv_budget=budget))
    assert len(free) == 8 and free[-1].stats.limited_by == ""
    assert [r.token for r in free] == [r.token for r in results[:8]]


def test_a_prompt_past_the_kv_budget_is_refused_before_prefill(tiny):
    model, tokenizer = tiny
    with pytest.raises(PromptTooLongError, match=r"prompt: 10 tokens, but the KV budget holds 8"):
        next(stream_generate(model, tokenizer, PROMPT, kv_budget=8 * KV_PER_TOKEN))
    kept = list(
        stream_generate(model, tokenizer, PROMPT, kv_budget=8 * KV_PER_TOKEN, truncate_prompt=True)
    )
    assert kept[-1].stats.prompt_tokens == 4 and len(kept) == 4  # half the room for new tokens


def test_without_a_budget_a_generation_holds_to_what_the_machine_can_give(tiny, monkeypatch):
    model, tokenizer = tiny
    machine(monkeypatch, memory.HEADROOM + 30 * KV_PER_TOKEN)
    results = list(stream_generate(model, tokenizer, PROMPT, max_tokens=100))
    assert len(results) == 20 and results[-1].stats.limited_by == "kv_budget"


def test_a_chat_session_holds_its_whole_history_to_the_budget(tiny):
    model, tokenizer = tiny
    session = ChatSession(model, tokenizer, kv_budget=200 * KV_PER_TOKEN, max_tokens=40)
    turns = []
    with pytest.raises(PromptTooLongError, match="KV budget holds 200 tokens"):
        for _ in range(20):
            turns.append(list(session.send("tell me more"))[-1])
            assert cache_nbytes(session.prompt_cache.cache) <= 200 * KV_PER_TOKEN
    assert len(turns) >= 2 and all(t.finish_reason == "length" for t in turns)


def test_a_models_dir_server_unloads_an_idle_model_before_another_one_loads(
    tiny_dir, tmp_path, monkeypatch
):
    import shutil

    for name in ("alpha", "beta"):
        shutil.copytree(tiny_dir, tmp_path / name)
    budget = 4 << 20
    weights = sum(tensor_bytes(f) for f in weight_files(tiny_dir))
    need = weights + budget + memory.HEADROOM
    mx.clear_cache()
    # a machine with room for one model and a MiB more: what MLX holds is taken from it
    total = mx.get_active_memory() + need + (1 << 20)
    monkeypatch.setattr(
        memory,
        "capacity",
        lambda *a: memory.Capacity(total - mx.get_active_memory(), "a test's machine"),
    )
    registry = Models(engine_options={"kv_budget": budget}, models_dir=tmp_path, load=load)
    try:
        registry.get("alpha")
        registry.get("beta")  # alpha is idle, and its KV budget would not leave room: unloaded
        assert not registry.entries["alpha"].loaded and registry.entries["beta"].loaded
        beta = registry.entries["beta"].engine
        monkeypatch.setattr(
            beta, "metrics", lambda: {"requests_running": 1, "requests_waiting": 0, "kv_bytes": 0}
        )
        with pytest.raises(InsufficientMemoryError) as refused:
            registry.get("alpha")  # beta is busy: nothing to unload
        message = str(refused.value)
        assert message.startswith(f"model 'alpha': needs {memory.size_text(need + budget)} ")
        assert f"KV budgets of the models loaded {memory.size_text(budget)}" in message
        assert message.endswith("or wait until one of beta is idle")
        assert registry.entries["beta"].loaded and not registry.entries["alpha"].loaded
    finally:
        registry.close()


def test_a_model_with_no_room_is_a_503_in_each_apis_shape(tiny_dir, tmp_path, monkeypatch):
    import shutil

    from fastapi.testclient import TestClient

    from mlxinfer.server import make_app

    shutil.copytree(tiny_dir, tmp_path / "alpha")
    monkeypatch.setattr(memory, "capacity", lambda *a: memory.Capacity(1000, "a test's machine"))
    app = make_app(models_dir=tmp_path, load=load)
    with TestClient(app) as client:
        ask = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = client.post("/v1/chat/completions", json=ask)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loadable"
        assert "a test's machine" in r.json()["error"]["message"]
        r = client.post("/v1/messages", json=ask)
        assert r.status_code == 503 and r.json()["type"] == "error"
        assert "a test's machine" in r.json()["error"]["message"]
