"""MTP rows' head caches inside ``kv_budget``: a pool of the head's one layer, as many blocks as
the target's (``batch/head_pool.py``), the target's pool shrunk so that both fit the budget, and
a row admitted only when both can reserve its worst case (tiny random MiMo and DeepSeek-V3
checkpoints, as in test_mtp_rows.py)."""

import threading
import time

import pytest
from mtp_models import DEEPSEEK_V3, make_mimo, make_nextn

from mlxinfer.batch import Engine
from mlxinfer.batch import rows as rows_mod
from mlxinfer.batch.head_pool import PooledCache
from mlxinfer.generation import generate_step
from mlxinfer.generation.mtp_drafts import MTP
from mlxinfer.loading.loader import load_model

# Four prompts of 12 tokens, no block shared: each row reserves the same blocks.
PROMPTS = [[(7 * i + 11 * j + 3) % 250 + 1 for j in range(12)] for i in range(4)]
BS, N_TOKENS, MAX_DRAFT = 8, 16, 4
ROW_BLOCKS = -(-(12 + N_TOKENS + MAX_DRAFT) // BS)  # a row's worst case, in blocks of each pool


@pytest.fixture(scope="module")
def wired(tmp_path_factory):
    path, _, _ = make_mimo(
        tmp_path_factory.mktemp("mtp") / "wired", num_hidden_layers=1, wired=0.0, seed=2
    )
    return load_model(path)[0]


def alone(model, ids, n):
    return [t for t, _ in generate_step(ids, model, max_tokens=n)]


def block_bytes(model):
    """(a block's bytes in the target's pool, in the head's pool), from an engine of them."""
    with Engine(model, block_size=BS, max_draft=MAX_DRAFT) as engine:
        return engine.pool.bytes_per_block, engine.pools.head_pool.pool.bytes_per_block


def held(engine) -> int:
    """Every byte of keys and values the engine holds: its pools' arrays and any row's own
    head cache."""
    own = sum(rows_mod.draft_nbytes(r) for r in engine._running)
    return engine.pool.nbytes + engine.pools.head_pool.nbytes + own


def test_budget_for_two_rows_runs_two_and_the_rest_wait(wired):
    """A budget that buys two rows' trunk and head blocks but not three: never more than two MTP
    rows run, the engine never holds more than the budget (kv_reserve: both pools at their
    size), and the rows that waited finish with plain greedy's tokens."""
    trunk, head = block_bytes(wired)
    budget = (2 * ROW_BLOCKS + 1) * (trunk + head) - 1  # 2 rows, not 3
    seen: list[tuple[int, int]] = []
    with Engine(
        wired, kv_budget=budget, block_size=BS, max_draft=MAX_DRAFT, kv_reserve=True
    ) as engine:
        assert engine.pool.max_blocks == engine.pools.head_pool.pool.max_blocks == 2 * ROW_BLOCKS
        decode = engine._decode

        def watched():
            decode()
            seen.append((len(engine._running), held(engine)))

        engine._decode = watched
        handles = [engine.submit(ids, max_tokens=N_TOKENS, draft=MTP()) for ids in PROMPTS]
        out = [[s.token for s in h.steps()] for h in handles]
        assert engine.pools.head_pool.bytes_in_use == 0  # every row's pairs given back
    assert max(n for n, _ in seen) == 2
    assert max(b for _, b in seen) <= budget
    for ids, tokens in zip(PROMPTS, out):
        assert tokens == alone(wired, ids, N_TOKENS)


def test_rows_keep_their_head_pairs_in_the_pool_and_the_metrics_count_them(wired):
    """While an MTP row runs its head's cache is a sequence of the head pool (no cache of its
    own): ``kv_bytes`` holds the head pool's arrays, ``draft_kv_bytes`` its blocks in use;
    cancelled, the row gives its head's blocks back."""
    with Engine(wired, block_size=BS, max_draft=MAX_DRAFT) as engine:
        heads = engine.pools.head_pool
        handle = engine.submit(PROMPTS[0], max_tokens=4000, draft=MTP())
        steps = handle.steps()
        next(steps)
        deadline = time.monotonic() + 5
        while engine.metrics()["draft_kv_bytes"] == 0:  # counted at the end of a turn
            assert time.monotonic() < deadline, "draft_kv_bytes never counted the head's pairs"
            time.sleep(0.005)
        assert isinstance(handle._request.drafter.cache, PooledCache)
        assert heads.nbytes > 0
        metrics = engine.metrics()
        assert metrics["kv_bytes"] == engine.pool.nbytes + heads.nbytes
        threading.Thread(target=handle.cancel).start()
        list(steps)
        deadline = time.monotonic() + 5
        while engine.metrics()["draft_kv_bytes"] or heads.bytes_in_use:
            assert time.monotonic() < deadline, "the head's blocks were not given back"
            time.sleep(0.005)
        assert heads.pool.available() == heads.pool.max_blocks


def test_mla_head_in_the_pool_equals_plain_greedy(tmp_path):
    """DeepSeek-V3's head keeps MLA's latent cache: the pool holds it as one "head" of
    kv_lora_rank keys and qk_rope_head_dim values a pair, and greedy stays plain greedy's."""
    path, _, _ = make_nextn(tmp_path / "dsv3", DEEPSEEK_V3)
    model = load_model(path)[0]
    with Engine(model, block_size=BS, max_draft=MAX_DRAFT, max_batch=4) as engine:
        shape = engine.pools.head_pool.pool.layers[0]
        assert (shape.kv_heads, shape.key_dim, shape.value_dim) == (
            1,
            DEEPSEEK_V3["kv_lora_rank"],
            DEEPSEEK_V3["qk_rope_head_dim"],
        )
        handles = [engine.submit(ids, max_tokens=10, draft=MTP()) for ids in PROMPTS[:2]]
        out = [list(h.steps()) for h in handles]
    for ids, steps in zip(PROMPTS, out):
        assert [s.token for s in steps] == alone(model, ids, 10)
    assert sum(s.drafted for s in out[0] if s.passes) > 0
