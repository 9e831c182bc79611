"""A hybrid family (recurrent layers beside attention) over two ranks on 127.0.0.1, started as
tests/distributed/test_distributed.py starts them: as a pipeline, and split by heads (tensor: every rank
runs every layer on its share of the attention heads, conv channels or Gated DeltaNet key
heads, its recurrent layers' state caches holding that share's state).

LFM2 with layers [attention, conv, conv, attention]: rank 0 runs an attention and a conv
layer, rank 1 a conv and an attention layer, so each rank's attention mask comes from its own
first attention layer (in the whole model, the first is layer 0: on rank 1 that is a conv
layer's state cache). One launch runs ``generate_step`` (the reference: transformers' greedy
tokens and float32 log-probabilities) and ``batch_generate`` with 8 prompts of mixed lengths,
whose recurrent rows keep their states per request (the reference: one process's texts, which
tests/models/test_hybrid.py holds to transformers). The same launch writes the prefix cache on disk
(each rank its own part's KV blocks and state snapshots) and a second one, new processes, reads
them back (``_check_disk``). Run as a script, this file is one rank:
``python test_distributed_hybrid.py MODEL_DIR MODE JOB OUT``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve()
PROMPT = [1, 5, 9, 30, 7, 44]
N_TOKENS = 8
# Attention first and last: each rank holds one of each kind.
LAYER_TYPES = ["full_attention", "conv", "conv", "full_attention"]


def _lfm2(path: Path, **overrides):
    from hf_models import add_tokenizer, make_tiny

    config = dict(
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        block_multiple_of=64,
        vocab_size=320,
        perturb_vectors=True,
    )
    path, model = make_tiny(path, "lfm2", **{**config, **overrides})
    add_tokenizer(path)
    return path, model


def _reference(model, n=N_TOKENS):
    """transformers' greedy tokens and the f32 log-probabilities of each step's choice."""
    import torch
    from hf_models import torch_greedy

    tokens = torch_greedy(model, PROMPT, n)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens[:-1]])).logits[0]
    return tokens, torch.log_softmax(logits, -1).numpy()[len(PROMPT) - 1 :]


def _one_process(path: Path, prompts: list[list[int]]) -> list[str]:
    import mlxinfer

    model, tokenizer = mlxinfer.load(path)
    texts = [mlxinfer.generate(model, tokenizer, p, max_tokens=N_TOKENS) for p in prompts]
    assert len(set(texts)) == len(texts)  # distinct: a row given another's state shows
    return texts


def _run(tmp_path: Path, path: Path, mode: str, prompts: list[list[int]], **more):
    from test_distributed import WAIT_S, Ranks

    tmp_path.mkdir(exist_ok=True)
    out, job = tmp_path / "out.json", tmp_path / "job.json"
    job.write_text(json.dumps({"prompt": PROMPT, "n": N_TOKENS, "prompts": prompts, **more}))
    command = [sys.executable, str(SCRIPT), str(path), mode, str(job), str(out)]
    with Ranks(tmp_path, command) as ranks:
        codes = [ranks.wait(0, WAIT_S + 30), ranks.wait(1, 30)]
        assert codes == [0, 0], ranks.text(0) + ranks.text(1)
        results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
        return results, ranks.text(0) + ranks.text(1)


def _check(results, model, texts):
    tokens, logprobs = _reference(model)
    for result in results:  # every rank yields the same
        assert result["tokens"] == tokens
        assert result["texts"] == texts
    delta = np.abs(np.array(results[0]["logprobs"]) - logprobs).max()
    print(f"max |Δ| of the f32 log-probabilities against transformers: {delta:.2e}")
    assert delta < 1e-3


SLOW = pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="more two-rank launches than the suite's share: set MLXINFER_SLOW=1 to run",
)


@SLOW
def test_lfm2_pipeline_matches_transformers_and_batches(tmp_path):
    from test_distributed_batch import _prompts

    path, model = _lfm2(tmp_path / "lfm2")
    prompts = _prompts()
    texts = _one_process(path, prompts)
    disk = tmp_path / "prefix-cache"
    results, log = _run(tmp_path, path, "pipeline", prompts, disk=str(disk), write=DISK_PROMPTS)
    assert "rank 0/2 runs layers 0-1 of 4" in log and "rank 1/2 runs layers 2-3 of 4" in log
    _check(results, model, texts)
    _check_disk(tmp_path, path, "pipeline", results)


# The prefix cache on disk: two 70-token prompts (4 full blocks of 16 each; snapshots every 2
# blocks: after 32 and 64 tokens), then, restarted, each extended past its 4th block.
BS, EVERY = 16, 2
DISK_PROMPTS = [[(7 * i + 3 * k + 5) % 290 + 3 for i in range(70)] for k in range(2)]
EXTENDED = [p[:66] + [5, 6, 7, 8, 9, 10 + k] for k, p in enumerate(DISK_PROMPTS)]


def _greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    import mlxinfer
    from mlxinfer.generation import generate_step

    model, _ = mlxinfer.load(path)
    return [[t for t, _ in generate_step(p, model, max_tokens=N_TOKENS)] for p in prompts]


def _check_disk(tmp_path: Path, path: Path, mode: str, results, stateless=()) -> None:
    """The first launch's engine wrote each rank's own files: its part's 4 blocks of each
    prompt and its states after 32 and 64 tokens (``stateless``: the ranks without a recurrent
    layer, which write none); the ranks' files never share a name. Rank 1's snapshot after the
    second prompt's 64 tokens is removed, then a restart (new processes) reads back: the first
    extended prompt resumes after 64 tokens on both ranks (4 blocks and a snapshot read), the
    second after 32 (the deepest snapshot every rank holds: 4 blocks read, a snapshot after 32
    on the ranks with states). The tokens are one process's."""
    expected = _greedy(path, DISK_PROMPTS + EXTENDED)
    files = {r: result["files"] for r, result in enumerate(results)}
    for r, result in enumerate(results):
        assert result["written"] == expected[:2], r
        states = [] if r in stateless else [[32, 64]] * 2
        assert [sorted(map(int, s)) for s in files[r]["states"]] == states, r
        assert [len(b) for b in files[r]["blocks"]] == [4, 4], r
    named = [f for r in files for kind in files[r].values() for p in kind for f in p.values()]
    assert len(set(named)) == len(named)  # no two ranks' (or kinds') files share a name
    on_disk = sorted(str(f) for f in (tmp_path / "prefix-cache").rglob("*.safetensors"))
    assert on_disk == sorted(named)
    if 1 not in stateless:
        Path(files[1]["states"][1]["64"]).unlink()
    again, _ = _run(tmp_path / "restart", path, mode, [], disk=results[0]["disk"], read=EXTENDED)
    for r, result in enumerate(again):
        assert result["read"] == expected[2:], r
        assert result["cached"] == [64, 64 if 1 in stateless else 32], r
        assert result["loaded"] == [4 + (r not in stateless), 4 + (r not in stateless)], r


def test_unlike_ranks_snapshot_stores_keep_the_same_snapshots():
    """Across ranks each store's budget is a number of snapshots, the fewest any rank's bytes
    buy (``Turns.fewest_snapshots``, an all-min at engine start): a rank whose states take 4 KiB
    and one whose take 1 KiB, each with 16 KiB, keep 4 each and evict the same ones (by bytes
    alone the second would keep 16). A rank without states asks too (None) and keeps none."""
    import mlx.core as mx

    from mlxinfer.batch.snapshots import Stateless, make_store

    class Turns:  # both ranks' requests, answered as the all-min answers them
        asked: list = []

        def fewest_snapshots(self, mine):
            self.asked.append(mine)
            return 4

    turns = Turns()
    templates = [[mx.zeros((1, 256)), mx.zeros((1, 768))], [mx.zeros((1, 256))], []]
    stores = [make_store(16 << 10, t, lambda h: True, turns) for t in templates]
    assert turns.asked == [4, 16, None]
    for k in range(6):
        for t, store in zip(templates, stores):
            assert store.put(bytes([k]), t)
    assert [list(s._items) for s in stores[:2]] == [[bytes([k]) for k in range(2, 6)]] * 2
    assert isinstance(stores[2], Stateless) and len(stores[2]) == 0
    assert bytes([9]) in stores[2] and stores[2].get(bytes([9])) == []
    alone = make_store(16 << 10, templates[1], lambda h: True)  # one process: bytes
    for k in range(20):
        alone.put(bytes([k]), templates[1])
    assert len(alone) == 16


def test_a_rank_without_attention_layers_keeps_the_others_blocks_in_no_bytes():
    """Across ranks every pool has the fewest blocks any rank's budget buys
    (``Turns.equal_blocks``, an all-min at engine start). A pipeline rank of conv layers only
    has blocks of 0 bytes: it buys any number, so both ranks get the 6 that the other's 1536
    bytes buy for its 256-byte blocks (4 tokens x 2 heads x (4 + 4) float32s), and its pool,
    holding no bytes, admits, shares and evicts as the other's does. No rank with a pool: a
    one-line refusal on every rank."""
    import mlx.core as mx

    from mlxinfer.batch.layout import STATE, make_pools
    from mlxinfer.batch.pool import KVPool, LayerShape
    from mlxinfer.distributed.batching import Turns
    from mlxinfer.errors import DistributedError

    class Two(Turns):  # this rank and one other, answered as the all-min answers them
        def __init__(self, other):
            self.other, self.asked = other, []

        def _least(self, values, what):
            self.asked.append(values)
            return [min(a, b) for a, b in zip(values, self.other)]

    shapes = [LayerShape(2, 4, 4, mx.float32)]
    budget = 6 * 256
    pooled, stateless = Two(other=[1 << 30]), Two(other=[budget // 256])
    assert pooled.equal_blocks(256, budget) == 6  # the other rank's pool holds no bytes
    assert stateless.equal_blocks(0, budget) == 6  # (with any budget of its own)
    assert stateless.asked[0][0] > 6 and pooled.asked == [[6]]
    assert Two(other=[3]).equal_blocks(256, budget) == 3  # the other's budget buys fewer
    with pytest.raises(DistributedError, match="no rank holds an attention layer"):
        Two(other=[1 << 30]).equal_blocks(0, budget)
    with pytest.raises(DistributedError, match="holds no block"):
        Two(other=[1 << 30]).equal_blocks(256, 100)
    with pytest.raises(ValueError, match="number of blocks"):
        KVPool([], block_size=4, kv_budget=budget)

    empty, window_pool = make_pools([], [STATE, STATE], block_size=4, kv_budget=0, blocks=6)
    full = KVPool(shapes, block_size=4, kv_budget=budget)
    assert window_pool is None and empty.max_blocks == full.max_blocks == 6
    tables = []
    for pool in (full, empty):
        pool.reserve()
        a = pool.admit(list(range(9)), max_tokens=3)  # 12 tokens: 3 blocks
        pool.append_slots(a, list(range(9)))
        pool.release(a)
        b = pool.admit(list(range(9)), max_tokens=7)  # 2 full blocks shared, 2 more
        c = pool.admit(list(range(50, 62)), max_tokens=4)  # 4 blocks: no room now
        pool.append_slots(b, list(range(8, 12)))
        tables.append((b.blocks, c, pool.stats().prefix_hits, pool.available()))
    assert tables[0] == tables[1] == ([0, 1, 2], None, 2, 2)  # block 2: freed, lowest
    assert empty.nbytes == 0 and full.nbytes == 6 * 256


@SLOW
@pytest.mark.slow
def test_lfm2_tensor_matches_transformers_and_batches(tmp_path):
    """Split by heads and conv channels: each rank runs half of every layer (its attention
    heads, its conv channels, its MLP hidden units), its conv layers' state caches holding its
    channels only."""
    from test_distributed_batch import _prompts

    path, model = _lfm2(tmp_path / "lfm2")
    prompts = _prompts()[:3]
    texts = _one_process(path, prompts)
    results, log = _run(tmp_path, path, "tensor", prompts)
    assert "falls back" not in log, log
    for r, (heads, channels) in enumerate([("0-1", "0-31"), ("2-3", "32-63")]):
        line = (
            f"rank {r}/2 runs heads {heads} of 4 in every attention layer and channels "
            f"{channels} of 64 of each conv layer"
        )
        assert line in log, log
    _check(results, model, texts)


@SLOW
@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, layer_types, stateless",
    [
        ("tensor", LAYER_TYPES, ()),
        # rank 1: attention layers only (no state to keep; it takes the others' turns)
        ("pipeline", ["full_attention", "conv", "full_attention", "full_attention"], (1,)),
        # rank 1: conv layers only (a pool of no bytes), rank 0 no recurrent layer
        ("pipeline", ["full_attention", "full_attention", "conv", "conv"], (0,)),
    ],
    ids=["tensor", "pipeline-rank-1-without-states", "pipeline-rank-1-without-attention"],
)
def test_lfm2_prefix_cache_on_disk_across_ranks(tmp_path, mode, layer_types, stateless):
    """The prefix cache on disk as above, split by heads and channels (each rank's files hold
    its channels' states), and as a pipeline whose rank 1 holds no recurrent layer (it writes
    no snapshot and resumes wherever rank 0's snapshots let it), or whose rank 1 holds conv
    layers only (its pool holds no bytes, its blocks' files no keys; rank 0 no snapshot)."""
    from test_distributed_batch import _prompts

    path, model = _lfm2(tmp_path / "lfm2", layer_types=layer_types)
    prompts = _prompts()[:4]
    texts = _one_process(path, prompts)
    disk = tmp_path / "prefix-cache"
    results, _ = _run(tmp_path, path, mode, prompts, disk=str(disk), write=DISK_PROMPTS)
    _check(results, model, texts)
    _check_disk(tmp_path, path, mode, results, stateless)


@SLOW
@pytest.mark.slow
@pytest.mark.parametrize(
    "layer_types, convs_only",
    [
        (["full_attention", "full_attention", "conv", "conv"], 1),
        (["conv", "conv", "full_attention", "full_attention"], 0),
    ],
    ids=["rank-1-conv-only", "rank-0-conv-only"],
)
def test_lfm2_pipeline_batches_with_a_rank_of_conv_layers_only(tmp_path, layer_types, convs_only):
    """A pipeline rank of conv layers only has no attention layer for a pool: its engine keeps
    one of no bytes with the other rank's blocks (the same block tables, prefix sharing and
    admissions, compared every turn). ``generate_step`` gives transformers' greedy tokens and
    ``batch_generate`` one process's texts, on both ranks, with a budget of 12 blocks for the
    8 prompts' 24 (admissions wait for room: a pool of more blocks admits sooner, which the
    ranks' comparison of each turn's admissions refuses)."""
    from test_distributed_batch import _prompts

    import mlxinfer
    from mlxinfer.batch.layout import layer_shapes
    from mlxinfer.batch.store import block_bytes

    path, model = _lfm2(tmp_path / "lfm2", layer_types=layer_types)
    prompts = _prompts()
    texts = _one_process(path, prompts)
    # Both attention layers are on one rank: its block is the whole model's. A quarter of
    # kv_budget goes to the state snapshots (snapshots.split_budget): 12 blocks are left.
    per_block = block_bytes(layer_shapes(mlxinfer.load(path)[0]), 16)
    job = {"kv_budget": 16 * per_block}
    results, log = _run(tmp_path, path, "pipeline", prompts, **job)
    first = 2 * convs_only
    assert f"rank {convs_only}/2 runs layers {first}-{first + 1} of 4" in log, log
    _check(results, model, texts)


@SLOW
@pytest.mark.slow
@pytest.mark.parametrize(
    "layer_types",
    [
        # rank 0: recurrent layers only (no mask); rank 1: its first layer is attention
        ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        ["full_attention", "linear_attention", "linear_attention", "full_attention"],
    ],
    ids=["no-attention-on-rank-0", "both-kinds-on-each"],
)
def test_qwen3_next_pipeline_matches_transformers(tmp_path, layer_types):
    """Qwen3-Next's Gated DeltaNet (two state arrays per layer) and MoE blocks."""
    from hf_models import add_tokenizer, make_tiny
    from test_distributed_batch import _prompts
    from test_qwen3_next import TINY

    config = {**TINY, "vocab_size": 320, "layer_types": layer_types}
    path, model = make_tiny(tmp_path / "qwen3_next", perturb_vectors=True, **config)
    add_tokenizer(path)
    prompts = _prompts()[:4]
    texts = _one_process(path, prompts)  # rank 0 without attention: a pool of no bytes
    results, _ = _run(tmp_path, path, "pipeline", prompts)
    _check(results, model, texts)


@SLOW
@pytest.mark.slow  # a two-rank launch: the shares are checked in the default suite
# (test_distributed_recurrent.py)
def test_qwen3_next_tensor_matches_transformers_and_batches(tmp_path):
    """Split by heads: the output-gated attention by query heads (each head's [queries | gate]
    rows together), Gated DeltaNet by key heads (their value heads with them: each rank's state
    cache holds its heads' conv inputs and states), the experts by hidden units."""
    from hf_models import add_tokenizer, make_tiny
    from test_distributed_batch import _prompts
    from test_qwen3_next import TINY

    config = {**TINY, "vocab_size": 320}  # recurrent layers first: every rank holds attention
    path, model = make_tiny(tmp_path / "qwen3_next", perturb_vectors=True, **config)
    add_tokenizer(path)
    prompts = _prompts()[:4]
    texts = _one_process(path, prompts)
    results, log = _run(tmp_path, path, "tensor", prompts)
    assert "falls back" not in log, log
    for r in range(2):
        line = (
            f"rank {r}/2 runs heads {2 * r}-{2 * r + 1} of 4 in every attention layer and "
            f"hidden units {16 * r}-{16 * r + 15} of 32 of each layer's 8 experts and key head "
            f"{r} of 2 of each linear-attention layer"
        )
        assert line in log, log
    _check(results, model, texts)


def _rank_main() -> None:
    import mlxinfer
    from mlxinfer.errors import DistributedError
    from mlxinfer.generation import generate_step

    model_dir, mode, job, out = sys.argv[1:5]
    job = json.loads(Path(job).read_text())
    model, tokenizer = mlxinfer.load(
        model_dir, distributed=mode, log=lambda m: print(m, file=sys.stderr)
    )
    from distributed_rank import finish

    if job.get("read"):  # a restart: the prefix cache on disk only
        finish(out, _disk_reads(model, job["disk"], job["read"], job["n"]))
    tokens, logprobs = [], []
    for token, lp in generate_step(job["prompt"], model, max_tokens=job["n"]):
        tokens.append(token)
        logprobs.append(lp.tolist())
    try:
        texts = mlxinfer.batch_generate(
            model, tokenizer, job["prompts"], max_tokens=job["n"], kv_budget=job.get("kv_budget")
        )
    except DistributedError as e:  # refused on every rank alike
        texts = str(e)
    result = {"tokens": tokens, "logprobs": logprobs, "texts": texts}
    if job.get("write"):
        result.update(_disk_writes(model, job["disk"], job["write"], job["n"]))
    finish(out, result)


def _disk_writes(model, directory: str, prompts: list[list[int]], n: int) -> dict:
    """An engine with the prefix cache on disk runs ``prompts``; this rank's files of each
    (its blocks' and its snapshots', by the tokens they end) as its engine names them."""
    from mlxinfer.batch import Engine
    from mlxinfer.batch.snapshots import chain

    with Engine(model, block_size=BS, state_every=EVERY, prefix_cache_dir=directory) as engine:
        written = [[s.token for s in engine.submit(p, max_tokens=n).steps()] for p in prompts]
    disk, states = engine.pool.disk, getattr(engine.snapshots, "format", None)
    files = {"blocks": [], "states": []}
    for p in prompts:
        hashes = chain(p, BS, (len(p) - 1) // BS)
        paths = {(k + 1) * BS: disk.path(h) for k, h in enumerate(hashes)}
        files["blocks"].append({t: str(f) for t, f in paths.items() if f.exists()})
        if states is not None:  # a rank without recurrent layers keeps none
            paths = {(k + 1) * BS: disk.path(h, states) for k, h in enumerate(hashes)}
            files["states"].append({t: str(f) for t, f in paths.items() if f.exists()})
    return {"disk": directory, "written": written, "files": files}


def _disk_reads(model, directory: str, prompts: list[list[int]], n: int) -> dict:
    """A restarted engine runs ``prompts`` one at a time: their tokens, the prefix tokens each
    resumed after, the files each read (blocks and snapshots)."""
    from mlxinfer.batch import Engine

    result = {"read": [], "cached": [], "loaded": []}
    with Engine(model, block_size=BS, state_every=EVERY, prefix_cache_dir=directory) as engine:
        for p in prompts:
            before = engine.metrics()["prefix_disk_blocks_loaded"]
            handle = engine.submit(p, max_tokens=n)
            result["read"].append([s.token for s in handle.steps()])
            result["cached"].append(handle.cached_tokens)
            result["loaded"].append(engine.metrics()["prefix_disk_blocks_loaded"] - before)
    return result


if __name__ == "__main__":
    _rank_main()
