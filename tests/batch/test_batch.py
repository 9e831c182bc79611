"""Continuous batching (issue #15): the paged pool, the engine, batch_generate.

Spec: batching is invisible. Each prompt, submitted at its own time into a running
batch, yields exactly transformers' greedy tokens for it alone; paged attention
gives the contiguous cache's logits; a seeded request draws the same tokens
alone and in a batch; cancelling returns every block; a shared prefix is served
from the pool's blocks.
"""

from __future__ import annotations

import math
import re
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from hf_models import add_tokenizer, make_tiny, torch_greedy
from mlx.utils import tree_flatten, tree_map
from test_qwen3_next import TINY as QWEN3_NEXT

from mlxinfer.batch import Engine, KVPool, PoolFullError
from mlxinfer.batch.layout import layer_shapes
from mlxinfer.batch.pool import LayerShape
from mlxinfer.batch.store import flat_rows
from mlxinfer.generation import generate_step
from mlxinfer.generation.sampling import SamplingParams
from mlxinfer.loading.loader import load_model

LONG = dict(max_position_embeddings=1024)
FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "gemma": dict(model_type="gemma", head_dim=16),
    "phi3": dict(model_type="phi3", pad_token_id=0, eos_token_id=2),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        head_dim=16,
    ),
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=24,
        num_key_value_heads=4,
        moe_intermediate_size=32,
        n_routed_experts=4,
        q_lora_rank=None,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_shared_experts=1,
    ),
    "gemma2": dict(
        model_type="gemma2",
        head_dim=16,
        num_hidden_layers=3,
        sliding_window=6,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", head_dim=16, num_hidden_layers=4, sliding_window=6
    ),
    "qwen2-sliding": dict(
        model_type="qwen2",
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    ),
    "gpt2": dict(model_type="gpt2", n_positions=1024),
    "bloom": dict(model_type="bloom"),
    "xglm": dict(model_type="xglm", ffn_dim=128),
    "granite": dict(
        model_type="granite",
        embedding_multiplier=3.0,
        attention_multiplier=0.05,
        residual_multiplier=0.4,
        logits_scaling=2.5,
        pad_token_id=0,
        eos_token_id=2,
    ),
    "olmo2": dict(model_type="olmo2", pad_token_id=0, eos_token_id=2),
    "smollm3": dict(model_type="smollm3", no_rope_layer_interval=2, pad_token_id=0, eos_token_id=2),
    # recurrent layers: each row keeps its own state beside its blocks
    "lfm2": dict(
        model_type="lfm2",
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "conv"],
        conv_L_cache=3,
        block_multiple_of=64,
    ),
    "qwen3_next": {**QWEN3_NEXT, "num_experts": 4, "shared_expert_intermediate_size": 32},
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        intermediate_size=32,
        sliding_window=64,
        eos_token_id=None,
    ),
    "olmo3": dict(
        model_type="olmo3", num_hidden_layers=4, sliding_window=48, pad_token_id=0, eos_token_id=2
    ),
    # rows at their own positions get their own query scales (past 64, Llama 4's scaling grows)
    "ministral3": dict(
        model_type="ministral3",
        head_dim=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 16.0,
            "original_max_position_embeddings": 64,
            "llama_4_scaling_beta": 0.5,
        },
    ),
    "granitemoe": dict(
        model_type="granitemoe",
        num_local_experts=4,
        num_experts_per_tok=2,
        embedding_multiplier=3.0,
        attention_multiplier=0.05,
        residual_multiplier=0.4,
        logits_scaling=2.5,
        pad_token_id=0,
        eos_token_id=2,
    ),
    # frequencies that follow the length: the rows of each regime share a forward
    "phi3-longrope": dict(
        model_type="phi3",
        pad_token_id=0,
        eos_token_id=2,
        original_max_position_embeddings=42,  # the 40-token prompt crosses it while decoding
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 42,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
            "long_factor": [2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5],
        },
    ),
    "llama-dynamic": dict(
        model_type="llama",
        max_position_embeddings=64,  # prompts of 5-40 tokens stay inside, the rest outgrow it
        rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
    ),
    "glm4_moe": dict(
        model_type="glm4_moe",
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=2,
        topk_group=1,
        use_qk_norm=True,
        attention_bias=True,
    ),
}
LENGTHS = [5, 17, 40, 90, 150, 300, 600, 900]
NEW = 6


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path, torch_model = make_tiny(
        tmp_path_factory.mktemp(request.param),
        perturb_vectors=True,
        **{**LONG, **FAMILIES[request.param]},
    )
    model, tokenizer = load_model(path)
    return request.param, model, torch_model


def test_batched_greedy_equals_transformers_alone(family):
    """8 prompts of 5-900 tokens, joining a running batch at different times: each gets
    transformers' greedy tokens for it alone."""
    name, model, torch_model = family
    prompts = [_prompt(n, seed) for seed, n in enumerate(LENGTHS)]
    expected = [torch_greedy(torch_model, p, NEW) for p in prompts]
    with Engine(model, max_batch=8, prefill_step=128) as engine:
        first = [engine.submit(p, max_tokens=NEW) for p in prompts[:3]]
        early = next(first[0].steps())  # the batch is running when the others join
        rest = [engine.submit(p, max_tokens=NEW) for p in prompts[3:]]
        got = [[early.token] + [s.token for s in first[0].steps()]]
        got += [[s.token for s in h.steps()] for h in first[1:] + rest]
        # Rows share steps in every family: RoPE, learned (GPT-2) and ALiBi (BLOOM) positions,
        # and those whose frequencies follow the length (the rows of a regime together).
        assert engine.steps_run < len(prompts) * NEW
        assert engine.stats().blocks_in_use == 0
    for n, g, e in zip(LENGTHS, got, expected):
        assert g == e, f"{name}: prompt of {n} tokens"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path, torch_model = make_tiny(tmp_path_factory.mktemp("llama"), **LONG)
    model, _ = load_model(path)
    return model, torch_model


@pytest.mark.parametrize("attention", ["pages", "gather"])
def test_paged_logits_equal_the_contiguous_cache(llama, attention):
    """Both ways decode reads the pool (over the blocks in place, over a gathered copy)."""
    model, _ = llama
    prompts = [_prompt(n, 10 + n) for n in (7, 33, 70)]
    alone = [[lp for _, lp in generate_step(p, model, max_tokens=5)] for p in prompts]
    with Engine(model, block_size=8, prefill_step=16, attention=attention) as engine:
        handles = [engine.submit(p, max_tokens=5) for p in prompts]
        paged = [[s.logprobs for s in h.steps()] for h in handles]
    for a, p in zip(alone, paged):
        for x, y in zip(a, p):
            np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-4)


def test_seeded_request_draws_the_same_tokens_alone_and_in_a_batch(llama):
    model, _ = llama
    target = _prompt(20, 99)
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    with Engine(model) as engine:
        alone = [s.token for s in engine.submit(target, max_tokens=12, sampling=sampling).steps()]
    with Engine(model, max_batch=8) as engine:
        others = [
            engine.submit(
                _prompt(10 + 7 * i, i), max_tokens=12, sampling=SamplingParams(0.7, seed=i)
            )
            for i in range(7)
        ]
        mine = engine.submit(target, max_tokens=12, sampling=sampling)
        batched = [s.token for s in mine.steps()]
        for h in others:
            list(h.steps())
    plain = [t for t, _ in generate_step(target, model, max_tokens=12, sampler=sampling.sampler())]
    assert batched == alone == plain


def test_cancel_from_another_thread_returns_every_block(llama):
    model, _ = llama
    # The store keeps its size (shrink_every=inf) whatever the time the test takes.
    with Engine(model, block_size=8, shrink_every=math.inf) as engine:
        # A long first request grows the store past what the cancelled ones touch.
        warm = engine.submit(_prompt(300, 1), max_tokens=4)
        list(warm.steps())
        mx.synchronize()
        baseline_memory, baseline = mx.get_active_memory(), engine.stats()
        assert baseline.blocks_in_use == 0
        handles = [engine.submit(_prompt(30 + i, i), max_tokens=500) for i in range(3)]
        seen = []
        for step in handles[0].steps():
            seen.append(step.token)
            if len(seen) == 3:
                threading.Thread(target=lambda: [h.cancel() for h in handles]).start()
        for h in handles[1:]:
            list(h.steps())
        assert 3 <= len(seen) < 500
        stats = engine.stats()
        assert stats.blocks_in_use == 0
        assert engine.pool.available() == stats.blocks_total
        assert stats.nbytes == baseline.nbytes  # the store did not grow for them
        mx.synchronize()
        assert mx.get_active_memory() <= baseline_memory + 64 * 1024


def test_the_engine_gives_a_bursts_memory_back_and_answers_the_same(llama):
    model, _ = llama
    with Engine(model, block_size=8, shrink_every=math.inf) as engine:
        before = [s.token for s in engine.submit(_prompt(20, 7), max_tokens=8).steps()]
    with Engine(model, block_size=8, shrink_every=0.0) as engine:  # looks at every step
        burst = [engine.submit(_prompt(300, i), max_tokens=4) for i in range(4)]
        for h in burst:
            list(h.steps())
        grown = engine.stats().nbytes
        per_block = engine.pool.bytes_per_block
        assert grown >= 4 * 38 * per_block  # four rows of 38 blocks at once
        deadline = time.monotonic() + 30
        while engine.stats().nbytes > 16 * per_block and time.monotonic() < deadline:
            time.sleep(0.05)  # the idle engine looks again every POLL_S
        assert engine.stats().nbytes == 16 * per_block  # back to the store's first size
        after = [s.token for s in engine.submit(_prompt(20, 7), max_tokens=8).steps()]
    assert after == before


def test_a_reserved_pool_holds_its_whole_budget_from_the_start_and_answers_the_same(llama):
    model, _ = llama
    per_block = KVPool(layer_shapes(model), block_size=8).bytes_per_block
    with Engine(model, block_size=8, kv_budget=100 * per_block) as engine:
        before = [s.token for s in engine.submit(_prompt(200, 3), max_tokens=8).steps()]
    with Engine(model, block_size=8, kv_budget=100 * per_block, reserve=True) as engine:
        assert engine.stats().nbytes == 100 * per_block
        after = [s.token for s in engine.submit(_prompt(200, 3), max_tokens=8).steps()]
        assert engine.pool.shrink() == 0 and engine.pool.shrink() == 0  # never below the budget
        assert engine.stats().nbytes == 100 * per_block
    assert after == before


def test_a_request_larger_than_the_budget_is_a_clear_error_and_others_run(llama):
    model, _ = llama
    per_block = KVPool(layer_shapes(model), block_size=16).bytes_per_block
    with Engine(model, block_size=16, kv_budget=4 * per_block) as engine:
        ok = engine.submit(_prompt(20, 3), max_tokens=10)
        with pytest.raises(
            PoolFullError,
            match="kv_budget: a request of 100 tokens and 8 of draft room needs 7 blocks",
        ):
            engine.submit(_prompt(90, 4), max_tokens=10)
        assert len(list(ok.steps())) == 10


def test_an_empty_budget_names_the_setting(llama):
    model, _ = llama
    with pytest.raises(PoolFullError, match="kv_budget: 1 bytes hold no block"):
        Engine(model, kv_budget=1)


def test_shared_prefix_is_served_from_the_pool(llama):
    model, torch_model = llama
    system = _prompt(400, 7)
    a, b = system + _prompt(9, 8), system + _prompt(13, 9)
    with Engine(model, block_size=16) as engine:
        first = engine.submit(a, max_tokens=4)
        assert [s.token for s in first.steps()] == torch_greedy(torch_model, a, 4)
        before = engine.stats()
        second = engine.submit(b, max_tokens=4)
        tokens = [s.token for s in second.steps()]
        after = engine.stats()
    assert second.cached_tokens == 400 // 16 * 16
    assert after.prefix_hits - before.prefix_hits == 400 // 16
    assert tokens == torch_greedy(torch_model, b, 4)


def test_short_prompts_share_prefill_forwards(llama):
    """Prompts of 30-40 tokens submitted together are prefilled in shared forwards (each row
    padded to the longest, the padding rewound): fewer prefill forwards than prompts, each
    row's log-probs those of the single-request loop (1e-4), its tokens transformers'."""
    model, torch_model = llama
    prompts = [_prompt(n, 50 + n) for n in (30, 33, 36, 40, 31, 35)]
    alone = [[lp for _, lp in generate_step(p, model, max_tokens=8)] for p in prompts]
    with Engine(model, max_batch=8, prefill_step=256) as engine:
        handles = [engine.submit(p, max_tokens=8) for p in prompts]
        steps = [list(h.steps(timeout=60)) for h in handles]
        assert engine.prefill_steps < len(prompts)
        assert engine.stats().blocks_in_use == 0
    for p, a, b in zip(prompts, alone, steps):
        assert [s.token for s in b] == torch_greedy(torch_model, p, 8)
        for x, s in zip(a, b):
            np.testing.assert_allclose(np.array(x), np.array(s.logprobs), atol=1e-4)


def test_batch_generate_submits_every_request_before_reading_one(tmp_path, monkeypatch):
    """``batch_generate`` submits all its requests (``Engine.start``) before it reads any result:
    a stream's generator submits on its first ``next()``, which returns with the request's first
    token, so the requests were admitted one at a time (each prefilled alone between the decode
    steps of those before it: a 4-row batch of SmolLM2 took longer than its requests one after
    another). The texts stay ``generate``'s, a stop string's cut included."""
    import mlxinfer
    from mlxinfer.batch import batch_generate
    from mlxinfer.batch.requests import Stream

    path, _ = make_tiny(tmp_path / "llama", **LONG)
    add_tokenizer(path)
    model, tokenizer = mlxinfer.load(path)
    prompts = [_prompt(n, 90 + n) for n in (5, 11, 17, 8)]
    expected = [mlxinfer.generate(model, tokenizer, p, max_tokens=6) for p in prompts]
    events: list[str] = []
    start, read = Engine.start, Stream.__next__
    monkeypatch.setattr(
        Engine, "start", lambda self, *a, **k: events.append("start") or start(self, *a, **k)
    )
    monkeypatch.setattr(Stream, "__next__", lambda self: events.append("next") or read(self))
    assert batch_generate(model, tokenizer, prompts, max_tokens=6) == expected
    assert events[: len(prompts)] == ["start"] * len(prompts)
    assert "start" not in events[len(prompts) :] and "next" in events
    stop = next(t[2:4] for t in expected if len(t) >= 4 and t[2:4].strip())
    cut = [mlxinfer.generate(model, tokenizer, p, max_tokens=6, stop=[stop]) for p in prompts]
    assert batch_generate(model, tokenizer, prompts, max_tokens=6, stop=[stop]) == cut


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """Gemma 2's sliding (window 6) and full layers, alternating."""
    path, torch_model = make_tiny(
        tmp_path_factory.mktemp("gemma2"), perturb_vectors=True, **{**LONG, **FAMILIES["gemma2"]}
    )
    model, _ = load_model(path)
    return model, torch_model


def test_sliding_layers_hold_only_their_window(gemma2):
    """The sliding layers' keys live in a window pool where a sequence keeps only the blocks its
    window still sees: with a window of 6 and blocks of 16, at most 2 per decoding row (the
    full layers hold the whole sequence), the store stays that small, and the tokens are still
    transformers'. Without ``hold_windows`` every layer holds the whole sequence."""
    model, torch_model = gemma2
    prompts = [_prompt(300, 41), _prompt(120, 42), _prompt(500, 43)]
    expected = [torch_greedy(torch_model, p, 6) for p in prompts]
    with Engine(model, block_size=16, prefill_step=64) as engine:
        handles = [engine.submit(p, max_tokens=6) for p in prompts]
        first = next(handles[0].steps())  # all three decoding or prefilling now
        held = engine.metrics()["kv_window_blocks_in_use"]
        got = [[first.token] + [s.token for s in handles[0].steps()]]
        got += [[s.token for s in h.steps()] for h in handles[1:]]
        window_bytes = engine.window_pool.nbytes
        assert engine.stats().blocks_in_use == 0 and engine.window_stats().blocks_in_use == 0
        assert engine.metrics()["kv_window_blocks_in_use"] == 0
    assert got == expected
    # A prefilling row holds its chunk too: 64 tokens past a 6-token window, at most 6 blocks.
    assert held <= 2 + 2 + 6
    assert window_bytes <= 16 * engine.window_pool.bytes_per_block  # the store's first growth
    full_blocks = sum(-(-(len(p) + 6) // 16) for p in prompts)
    with Engine(model, block_size=16, prefill_step=64, hold_windows=False) as engine:
        assert engine.window_pool is None
        assert [[s.token for s in engine.submit(p, max_tokens=6).steps()] for p in prompts] == (
            expected
        )
        assert engine.pool.nbytes >= full_blocks * engine.pool.bytes_per_block


def test_sliding_layers_read_only_the_blocks_their_window_sees(gemma2):
    """A decode step of a 300-token row: the full layers' block table spans its 19 blocks, the
    window pool's only the blocks a query at position 300 sees with a window of 6 (positions
    295-300: block 18), its keys' positions starting there; the mask matches."""
    from mlxinfer.batch.layout import check_batchable, layer_shapes, make_pools
    from mlxinfer.batch.views import StepBatch

    model, _ = gemma2
    windows = check_batchable(model)[1]
    pool, window_pool = make_pools(layer_shapes(model), windows, block_size=16, kv_budget=1 << 24)
    ids = _prompt(300, 47)
    seq, wseq = pool.admit(ids, 8), window_pool.admit(ids, 8)
    StepBatch(pool, [seq], [ids], windows, window=(window_pool, [wseq]))
    step = StepBatch(pool, [seq], [[5]], windows, "pages", window=(window_pool, [wseq]))
    assert step.main.table.shape == (1, 19) and step.windowed.table.shape == (1, 1)
    assert step.windowed.base.tolist() == [288] and step.windowed.T == 301 - 288
    assert window_pool.stats().blocks_in_use == 1 and pool.stats().blocks_in_use == 19
    visible = step._visible_keys(6, step.windowed)[0, 0]  # keys at positions 288-300
    assert visible.tolist() == [False] * 7 + [True] * 6


def test_a_shared_prefix_is_served_from_both_pools(gemma2):
    """A second request sharing a 200-token prefix takes its full layers' blocks from the pool
    and its sliding layers' last window from the window pool (the blocks before it are never
    read): 192 tokens served (12 whole blocks before the prompt's last token), transformers'
    tokens for both."""
    model, torch_model = gemma2
    system = _prompt(200, 44)
    a, b = system + _prompt(5, 45), system + _prompt(7, 46)
    with Engine(model, block_size=16) as engine:
        first = engine.submit(a, max_tokens=4)
        assert [s.token for s in first.steps()] == torch_greedy(torch_model, a, 4)
        second = engine.submit(b, max_tokens=4)
        assert [s.token for s in second.steps()] == torch_greedy(torch_model, b, 4)
    assert second.cached_tokens == 192


def test_a_window_pool_shares_only_whole_windows():
    """``shareable``: a full pool shares up to its first missing block; a window pool shares up to
    the last prefix whose window (the blocks a query at its end still sees) is all there."""
    pool = KVPool(SHAPES, block_size=4, kv_budget=1 << 20, window=6)
    # A query at position 4n sees from 4n - 5: blocks (4n - 5) // 4 .. n - 1.
    assert pool.shareable([None, None, 7, 8]) == 4  # sees blocks 2 and 3
    assert pool.shareable([None, 5, 6, None, 9]) == 3  # n = 5, 4 need block 3; n = 3: 1 and 2
    assert pool.shareable([None, 5, None, 8]) == 0  # n = 2 sees from position 3: block 0 too
    assert pool.shareable([None, None, None]) == 0
    assert KVPool(SHAPES, block_size=4, kv_budget=1 << 20).shareable([3, None, 8]) == 1


# -- the pool alone -------------------------------------------------------------------------

SHAPES = [LayerShape(2, 4, 4, mx.float32)]


def test_pool_accounting_and_lru_eviction():
    pool = KVPool(SHAPES, block_size=4, kv_budget=6 * 4 * 2 * 8 * 4)  # 6 blocks
    assert pool.stats().blocks_total == 6 and pool.bytes_per_block == 4 * 2 * 8 * 4
    a = pool.admit(list(range(9)), max_tokens=3)  # 12 tokens: 3 blocks reserved
    pool.append_slots(a, list(range(9)))
    s = pool.stats()
    assert (s.blocks_in_use, pool.available()) == (3, 3)  # 3 allocated (2 full + 1 partial)
    pool.release(a)
    s = pool.stats()
    assert (s.blocks_in_use, s.blocks_cached, s.blocks_free) == (0, 2, 4)  # full blocks stay cached
    # The same prefix again: both full blocks are hits (the last token is always computed).
    b = pool.admit(list(range(9)), max_tokens=3)
    assert b.length == 8 and pool.stats().prefix_hits == 2
    pool.release(b)
    # Fill the pool with other tokens: the cached blocks are evicted, least recently used first.
    c = pool.admit(list(range(100, 124)), max_tokens=0)
    pool.append_slots(c, list(range(100, 124)))
    assert pool.stats().blocks_cached == 0 and pool.stats().blocks_in_use == 6
    assert pool.admit([1, 2, 3], max_tokens=1) is None  # no room now
    pool.release(c)
    assert pool.stats().blocks_cached == 6


def test_a_write_puts_each_tokens_heads_at_its_slot():
    """``flat_rows``' places: token t of slot b * block_size + i is at block b, position i,
    for every kv head (numpy's indexed assignment as the reference), other places untouched."""
    pool = KVPool(SHAPES, block_size=4, kv_budget=1 << 20)
    seq = pool.admit(list(range(7)), max_tokens=0)
    slots = pool.append_slots(seq, list(range(7)))
    new = np.random.default_rng(0).standard_normal((7, 2, 4)).astype(np.float32)
    before = np.array(pool.keys[0])
    pool.write(0, flat_rows(slots, 2, 4), mx.array(new), mx.array(new))
    want = before.copy()
    want[slots // 4, :, slots % 4] = new
    assert np.array_equal(np.array(pool.keys[0]), want)
    assert np.array_equal(np.array(pool.values[0]), want)


def test_the_store_gives_back_a_bursts_tail_and_keeps_what_is_in_use():
    pool = KVPool(SHAPES, block_size=4, kv_budget=1 << 20)
    seqs = []
    for i in range(10):  # a burst: 10 rows of 40 tokens, 10 blocks each
        seq = pool.admit(list(range(1000 * i, 1000 * i + 40)), max_tokens=0)
        slots = pool.append_slots(seq, list(range(1000 * i, 1000 * i + 40)))
        value = mx.full((40, 2, 4), float(i + 1))
        pool.write(0, flat_rows(slots, 2, 4), value, value)
        seqs.append(seq)
    assert pool.n_blocks == 128 and seqs[0].blocks == list(range(10))  # lowest blocks first
    before = pool.nbytes
    assert pool.shrink() == 0  # 100 of 128 in use: nothing to give back
    for seq in seqs[1:]:
        pool.release(seq)
    assert pool.shrink() == 0  # the busiest moment since the last look needed 100 blocks
    # Since then 10 blocks in use (0..9): the store is cut to 2 x 10 = 20 blocks, the cached
    # ones past it forgotten, and the survivor's keys are where they were.
    assert pool.shrink() == 108 and pool.n_blocks == 20
    assert pool.nbytes == before * 20 // 128
    s = pool.stats()
    assert (s.blocks_in_use, s.blocks_cached) == (10, 10)  # blocks 10..19 still cached
    kept = pool.keys[0][mx.array(seqs[0].blocks)]
    assert mx.all(kept == 1).item() and mx.all(pool.values[0][mx.array(seqs[0].blocks)] == 1)
    assert pool.shrink() == 0  # no longer twice what it needs
    # The pool serves and grows again as before.
    more = pool.admit(list(range(5000, 5100)), max_tokens=0)
    pool.append_slots(more, list(range(5000, 5100)))
    assert pool.stats().blocks_in_use == 35 and pool.n_blocks >= 35


def test_fork_copies_the_shared_partial_block_on_write():
    pool = KVPool(SHAPES, block_size=4, kv_budget=1 << 20)
    a = pool.admit(list(range(6)), max_tokens=4)
    slots = pool.append_slots(a, list(range(6)))
    pool.write(0, flat_rows(slots, 2, 4), mx.ones((6, 2, 4)), mx.ones((6, 2, 4)))
    child = pool.fork(a)
    assert child.blocks == a.blocks
    new = pool.append_slots(child, [50])
    assert child.blocks[0] == a.blocks[0]  # the full block stays shared
    assert child.blocks[1] != a.blocks[1]  # the partial one was copied before the write
    copied = pool.keys[0][child.blocks[1]]  # (kv_heads, block_size, dim)
    assert mx.all(copied[:, :2] == 1).item() and mx.all(copied[:, 2:] == 0).item()
    assert new[0] == child.blocks[1] * 4 + 2
    pool.release(child)
    pool.release(a)
    assert pool.stats().blocks_in_use == 0


def test_a_cache_the_pool_does_not_hold_is_named(llama, monkeypatch):
    from mlxinfer.cache.quantized import QuantizedKVCache

    model, _ = llama
    monkeypatch.setattr(model, "make_cache", lambda: [QuantizedKVCache(bits=8)])
    with pytest.raises(NotImplementedError, match="uses a QuantizedKVCache, which the paged pool"):
        Engine(model)


# -- the CLI's prompt file ---------------------------------------------------------------------


def test_prompt_file_lines_and_json_lines(tmp_path):
    from mlxinfer.batch.prompts import read_prompts

    path = tmp_path / "p.txt"
    path.write_text(
        'Hello there\n\n{"prompt": "Hi"}\n{"messages": [{"role": "user", "content": "Yo"}]}\n'
    )
    assert read_prompts(path) == ["Hello there", "Hi", [{"role": "user", "content": "Yo"}]]


@pytest.mark.parametrize(
    "text, message",
    [
        ('ok\n{"prompt": 3\n', r"p.jsonl:2: not valid JSON"),
        (
            '{"text": "x"}\n',
            r"p.jsonl:1: expected a \"prompt\" string or a \"messages\" list.*found keys \['text'\]",
        ),
        ("\n\n", r"p.jsonl: no prompts"),
    ],
)
def test_a_bad_prompt_file_names_the_file_and_line(tmp_path, text, message):
    from click.testing import CliRunner

    from mlxinfer.cli.main import cli

    path = tmp_path / "p.jsonl"
    path.write_text(text)
    result = CliRunner().invoke(cli, ["generate", "--batch", str(path)])
    assert result.exit_code == 1
    assert re.search(message, result.output), result.output


def test_batch_refuses_options_it_does_not_take_yet(tmp_path):
    from click.testing import CliRunner

    from mlxinfer.cli.main import cli

    path = tmp_path / "p.txt"
    path.write_text("Hello\n")
    result = CliRunner().invoke(cli, ["generate", "--batch", str(path), "--max-kv-size", "64"])
    assert result.exit_code == 2
    assert "--batch does not take --max-kv-size yet" in result.output
    args = ["generate", "--batch", str(path), "--self-draft-layers", "2"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "--batch does not take --self-draft-layers" in result.output
    result = CliRunner().invoke(cli, ["generate", "--batch", str(path), "--num-draft", "2"])
    assert result.exit_code == 2 and "--num-draft needs a draft source" in result.output


def test_generate_batch_with_a_draft_model_prints_the_plain_texts(tmp_path):
    """``generate --batch FILE --draft-model D``: the same JSON lines as without the draft
    (greedy); a draft with another vocabulary is an error naming both models."""
    import json

    from click.testing import CliRunner
    from hf_models import add_tokenizer

    from mlxinfer.cli.main import cli

    target, _ = make_tiny(tmp_path / "target", vocab_size=320)
    draft, _ = make_tiny(tmp_path / "draft", vocab_size=320, num_hidden_layers=1, seed=1)
    other, _ = make_tiny(tmp_path / "other", num_hidden_layers=1, seed=2)
    for path, size in ((target, 320), (draft, 320), (other, 300)):
        add_tokenizer(path, vocab_size=size)
    prompts = tmp_path / "p.txt"
    prompts.write_text('Hello world\n{"prompt": "Paris is the"}\n')
    args = ["generate", "-m", str(target), "--batch", str(prompts), "-n", "12"]
    plain = CliRunner().invoke(cli, args)
    drafted = CliRunner().invoke(cli, [*args, "--draft-model", str(draft), "--num-draft", "3"])
    assert plain.exit_code == 0 and drafted.exit_code == 0, plain.output + drafted.output
    lines = [json.loads(line) for line in drafted.stdout.splitlines()]
    assert [line["index"] for line in lines] == [0, 1] and drafted.stdout == plain.stdout
    result = CliRunner().invoke(cli, [*args, "--draft-model", str(other)])
    assert result.exit_code == 1 and "different vocabularies" in result.output
    assert str(other) in result.output and str(target) in result.output


def test_a_long_prefill_making_progress_is_not_a_timeout(llama, monkeypatch):
    """``timeout`` bounds a wait with no progress, not a whole prefill: a prompt whose eight
    chunks take 0.3 s each (2.4 s in all) is answered under a 1 s timeout (a 19k-token agent
    prompt on a loaded CPU once took past the server's 600 s and failed with a 500)."""
    import time

    from mlxinfer.batch.prefill import Prefill

    model, _ = llama
    slow = Prefill._rows

    def crawling(self, group):
        time.sleep(0.3)
        slow(self, group)

    monkeypatch.setattr(Prefill, "_rows", crawling)
    with Engine(model, prefill_step=16) as engine:
        handle = engine.submit(_prompt(128, 3), max_tokens=2)
        assert len(list(handle.steps(timeout=1.0))) == 2


def test_waits_on_the_engine_are_bounded(llama, monkeypatch):
    """A token that does not come within ``timeout`` is a TimeoutError (and cancels the request);
    a request left when the engine stops ends with EngineError instead of waiting forever."""
    import time

    from mlxinfer.batch import EngineError
    from mlxinfer.batch import engine as engine_module

    model, _ = llama
    slow = engine_module.Engine._decode

    def stalled(self):
        time.sleep(1.5)
        slow(self)

    monkeypatch.setattr(engine_module.Engine, "_decode", stalled)
    with Engine(model) as engine:
        handle = engine.submit(_prompt(10, 1), max_tokens=3)
        with pytest.raises(TimeoutError, match=r"request \d+: no token within 0.5 s"):
            next(handle.steps(timeout=0.5))
    engine = Engine(model)
    handle = engine.submit(_prompt(10, 2), max_tokens=500)
    engine.close()
    with pytest.raises(EngineError, match="engine stopped"):
        list(handle.steps())
    with pytest.raises(EngineError, match="engine stopped"):
        engine.submit(_prompt(10, 3), max_tokens=3)


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("cpu_exp", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_attention_over_pages_is_attention_over_the_rows_keys(window, cpu_exp, with_sinks):
    """``paged_attention`` against ``mx.fast.scaled_dot_product_attention`` over each row's own
    keys alone: rows of 3, 40 and 77 keys in blocks of 16 scattered over a store, 6 query heads
    on 2 kv heads, a sliding window or none; MLX's exponential or the CPU backend's; with a
    sink logit per head (gpt-oss) or none."""
    from mlxinfer.backends.cpu import ops
    from mlxinfer.batch.views import _page_index
    from mlxinfer.cache.kv import Pages
    from mlxinfer.models.layers.attention import paged_attention

    rng = np.random.default_rng(0)
    lengths, bs, n_kv, n_q, D = [3, 40, 77], 16, 2, 6, 8
    store_k = rng.standard_normal((20, n_kv, bs, D)).astype(np.float32)
    store_v = rng.standard_normal((20, n_kv, bs, D)).astype(np.float32)
    n = -(-max(lengths) // bs)
    order = rng.permutation(20)
    table = np.zeros((3, n), np.int32)
    visible = np.zeros((3, n * bs), bool)
    for b, length in enumerate(lengths):
        blocks = order[b * n : b * n + -(-length // bs)]
        table[b, : len(blocks)] = blocks
        keys = np.arange(n * bs)
        visible[b] = (keys < length) & (window is None or length - 1 - keys < (window or 0))
    q = rng.standard_normal((3, n_q, 1, D)).astype(np.float32)
    pages = Pages(
        mx.array(store_k),
        mx.array(store_v),
        *_page_index(table, n_kv),
        mx.array(visible.reshape(3, 1, n, 1, bs)),
    )
    exp = ops.exp if cpu_exp else mx.exp
    sinks = mx.array(rng.standard_normal(n_q).astype(np.float32) * 2) if with_sinks else None
    out = np.array(paged_attention(mx.array(q), pages, scale=0.3, exp=exp, sinks=sinks))
    for b in range(len(lengths)):
        keys = np.concatenate([store_k[i] for i in table[b]], axis=1)  # (n_kv, n * bs, D)
        vals = np.concatenate([store_v[i] for i in table[b]], axis=1)
        seen = np.flatnonzero(visible[b])
        expected = mx.fast.scaled_dot_product_attention(
            mx.array(q[b : b + 1]),
            mx.array(keys[None, :, seen]),
            mx.array(vals[None, :, seen]),
            scale=0.3,
            sinks=sinks,
        )
        np.testing.assert_allclose(out[b : b + 1], np.array(expected), atol=1e-5)


# --- speculative decoding by prompt lookup inside the batch ------------------------------------


def _repetitive(n: int, seed: int) -> list[int]:
    """A prompt that repeats a short phrase: prompt lookup finds drafts in it."""
    phrase = _prompt(7, seed)
    return (phrase * (n // 7 + 1))[:n]


def test_prompt_lookup_in_the_batch_gives_transformers_greedy_tokens(llama):
    """Drafting rows (per-row draft lengths) and plain rows share verification steps; every row
    gets transformers' greedy tokens for its prompt alone, and drafts were accepted."""
    from mlxinfer.generation.drafts import PromptLookup

    model, torch_model = llama
    prompts = [_repetitive(60, 1), _prompt(30, 2), _repetitive(120, 3), _prompt(9, 4)]
    expected = [torch_greedy(torch_model, p, 12) for p in prompts]
    with Engine(model, max_batch=8) as engine:
        # a fixed k (lookup drafts up to it, as matches allow): whatever the step costs say here
        handles = [
            engine.submit(
                p,
                max_tokens=12,
                draft=PromptLookup() if i % 2 == 0 else None,
                num_draft=4 if i % 2 == 0 else None,
            )
            for i, p in enumerate(prompts)
        ]
        steps = [list(h.steps()) for h in handles]
        assert engine.stats().blocks_in_use == 0
    for p, got, want in zip(prompts, steps, expected):
        assert [s.token for s in got] == want, f"prompt of {len(p)} tokens"
    drafted = [s for i in (0, 2) for s in steps[i]]
    assert any(s.from_draft for s in drafted)  # drafts were kept: fewer passes than tokens
    assert sum(s.passes for s in drafted) < len(drafted)
    assert not any(s.drafted for i in (1, 3) for s in steps[i])  # plain rows draft nothing


def test_a_seeded_lookup_request_is_the_same_alone_in_a_batch_and_in_the_single_loop(llama):
    """Sampling (temperature 0.8): the acceptance draws from the row's own key, split as
    ``speculative_generate_step`` splits it, so its tokens match that loop's."""
    from mlxinfer.generation.drafts import PromptLookup
    from mlxinfer.generation.speculative import speculative_generate_step

    model, _ = llama
    target = _repetitive(50, 5)
    sampling = SamplingParams(temperature=0.8, seed=77)

    def in_engine(others: int) -> list[int]:
        with Engine(model, max_batch=8) as engine:
            noise = [
                engine.submit(_prompt(20 + i, 10 + i), max_tokens=10, sampling=SamplingParams(0.7))
                for i in range(others)
            ]
            mine = engine.submit(
                target, max_tokens=10, sampling=sampling, draft=PromptLookup(), num_draft=3
            )
            tokens = [s.token for s in mine.steps()]
            for h in noise:
                list(h.steps())
        return tokens

    alone = in_engine(0)
    single = [
        s.token
        for s in speculative_generate_step(
            target, model, PromptLookup(), max_tokens=10, sampler=sampling.sampler(), num_draft=3
        )
    ]
    assert in_engine(5) == alone == single


def test_rewinding_a_sequence_returns_its_draft_blocks():
    pool = KVPool(SHAPES, block_size=4, kv_budget=1 << 20)
    seq = pool.admit(list(range(6)), max_tokens=10)
    pool.append_slots(seq, list(range(6)))
    before = pool.stats()
    pool.append_slots(seq, [50, 51, 52, 53, 54])  # drafts: fills block 1, takes block 2
    assert len(seq.blocks) == 3 and len(seq.hashes) == 2
    pool.rewind(seq, 7)  # one draft kept
    after = pool.stats()
    assert seq.tokens == list(range(6)) + [50] and len(seq.blocks) == 2 and len(seq.hashes) == 1
    assert after.blocks_in_use == before.blocks_in_use
    assert after.blocks_in_use + after.blocks_cached + after.blocks_free == after.blocks_total
    assert pool.available() == before.blocks_total - before.blocks_in_use - seq.reserved
    other = pool.admit(list(range(6)) + [50, 51], max_tokens=1)  # block 1's old hash is gone
    assert other is not None and pool.prefix_hits == 1  # only block 0 (tokens 0-3) is shared
    pool.release(other)
    pool.release(seq)
    assert pool.stats().blocks_in_use == 0


def test_the_engine_drafts_by_prompt_lookup_or_a_draft_model_only(llama):
    from mlxinfer.cache.prompt import PromptCache
    from mlxinfer.generation.drafts import DraftModel, PromptLookup, SelfDraft

    model, _ = llama
    with Engine(model) as engine:
        with pytest.raises(
            ValueError, match="draft: the batching engine drafts by prompt lookup or with a draft"
        ):
            engine.submit([1, 2, 3], max_tokens=2, draft=SelfDraft(1))
        shared = DraftModel(model, prompt_cache=PromptCache(model.make_cache()))
        with pytest.raises(ValueError, match="each request keeps its own draft cache"):
            engine.submit([1, 2, 3], max_tokens=2, draft=shared)
        with pytest.raises(ValueError, match=r"num_draft must be in 1\.\.8"):
            engine.submit([1, 2, 3], max_tokens=2, draft=PromptLookup(), num_draft=9)
        with pytest.raises(ValueError, match="num_draft: given without a draft"):
            engine.submit([1, 2, 3], max_tokens=2, num_draft=2)
        with pytest.raises(TypeError, match="submit: expected token ids, found a str"):
            engine.submit("Hello", max_tokens=2)


# --- speculative decoding with a draft model inside the batch -----------------------------------


def _noisy_copy(path, scale: float = 0.02):
    """The checkpoint with noise on every weight: a draft model right often, not always."""
    model, _ = load_model(path)
    rng = np.random.default_rng(0)
    model.update(
        tree_map(lambda w: w + mx.array(rng.normal(0, scale, w.shape), w.dtype), model.parameters())
    )
    return model  # its weights lazy: submit evaluates them on this thread


@pytest.fixture(scope="module")
def drafted_llama(tmp_path_factory):
    """(target, its transformers twin, a draft: the same checkpoint with noise)."""
    path, torch_model = make_tiny(tmp_path_factory.mktemp("drafted"), **LONG)
    model, _ = load_model(path)
    return model, torch_model, _noisy_copy(path)


def test_a_draft_model_in_the_batch_gives_transformers_greedy_tokens(drafted_llama):
    """Rows drafting with a draft model (their draft keys in its pool), a prompt-lookup row and a
    plain row share verification steps: each gets transformers' greedy tokens for its prompt
    alone, drafts were accepted and rejected, and every block comes back."""
    from mlxinfer.generation.drafts import DraftModel, PromptLookup

    model, torch_model, draft = drafted_llama
    prompts = [_prompt(40, 1), _prompt(300, 2), _repetitive(60, 3), _prompt(9, 4)]
    sources = [DraftModel(draft), DraftModel(draft), PromptLookup(), None]
    expected = [torch_greedy(torch_model, p, 16) for p in prompts]
    with Engine(model, max_batch=8, prefill_step=128) as engine:
        handles = [
            # Both draft-model rows draft every step (fixed k), so their draft forwards meet:
            # an adaptive row times a plain step first and, this draft being as slow as the
            # target, may stop drafting (generation/draft_length.py).
            engine.submit(p, max_tokens=16, draft=d, num_draft={0: 2, 1: 4}.get(i))
            for i, (p, d) in enumerate(zip(prompts, sources))
        ]
        steps = [list(h.steps()) for h in handles]
        metrics = engine.metrics()
        assert engine.stats().blocks_in_use == 0 and metrics["draft_kv_bytes"] == 0
    for p, got, want in zip(prompts, steps, expected):
        assert [s.token for s in got] == want, f"prompt of {len(p)} tokens"
    drafted = [s for i in (0, 1) for s in steps[i]]
    assert any(s.from_draft for s in drafted)  # drafts were kept: fewer passes than tokens
    assert sum(s.passes for s in drafted) < len(drafted)
    assert sum(s.drafted for s in drafted) > sum(s.accepted for s in drafted)  # and some not
    assert not any(s.drafted for s in steps[3])  # the plain row drafts nothing
    # The two rows drafting with one draft model share its forwards (its own pool): at least
    # one forward per draft of either row, fewer than one per draft of both.
    per_row = [sum(s.drafted for s in steps[i]) for i in (0, 1)]
    assert max(per_row) <= metrics["draft_steps"] < sum(per_row)
    assert metrics["draft_model_bytes"] == sum(
        a.nbytes for _, a in tree_flatten(draft.parameters())
    )


def test_a_named_draft_models_pool_shares_the_kv_budget(drafted_llama):
    """``Engine(draft_models=[m])``: the target's pool and the draft's have the same number of
    blocks, which the budget buys for both together; drafting gives transformers' tokens; a
    request the target's pool alone could hold, but not its share, is refused at submit; a
    budget that holds no block for both is an error naming the sizes."""
    from mlxinfer.batch.layout import layer_shapes
    from mlxinfer.generation.drafts import DraftModel

    model, torch_model, draft = drafted_llama
    per_token = sum(s.bytes_per_token for s in layer_shapes(model))
    draft_per_token = sum(s.bytes_per_token for s in layer_shapes(draft))
    budget = 40 * 8 * (per_token + draft_per_token) + 100  # 40 blocks of 8 tokens in each
    prompts, long = [_prompt(40, 1), _prompt(90, 3)], _prompt(400, 2)  # long: 52 blocks
    with Engine(model, block_size=8, kv_budget=budget, draft_models=[draft]) as engine:
        (draft_pool,) = engine._draft_pools.values()
        assert engine.pool.max_blocks == draft_pool.pool.max_blocks == 40
        handles = [  # fixed k: an adaptive row may stop drafting a draft this slow
            engine.submit(p, max_tokens=16, draft=DraftModel(draft), num_draft=2) for p in prompts
        ]
        steps = [list(h.steps(timeout=60)) for h in handles]  # two rows drafting together
        for p, got in zip(prompts, steps):
            assert [s.token for s in got] == torch_greedy(torch_model, p, 16)
        assert any(s.from_draft for got in steps for s in got)
        assert list(engine._draft_pools.values()) == [draft_pool]  # the named pool served it
        with pytest.raises(PoolFullError, match="kv_budget"):
            engine.submit(long, max_tokens=8)
    with Engine(model, block_size=8, kv_budget=budget) as engine:  # no draft: all the budget
        assert engine.pool.max_blocks == budget // (8 * per_token)
        assert len(list(engine.submit(long, max_tokens=8).steps(timeout=60))) == 8
    with pytest.raises(
        PoolFullError, match=f"kv_budget: 1000 bytes hold no block of {8 * per_token}"
    ):
        Engine(model, block_size=8, kv_budget=1000, draft_models=[draft])


def test_a_seeded_draft_model_request_is_the_same_alone_in_a_batch_and_in_the_single_loop(
    drafted_llama,
):
    """Sampling (temperature 0.8): the draft draws from its own key and the acceptance from
    another, split as ``speculative_generate_step`` splits them, so the tokens are that loop's,
    alone or among other requests."""
    from mlxinfer.generation.drafts import DraftModel
    from mlxinfer.generation.speculative import speculative_generate_step

    model, _, draft = drafted_llama
    target = _prompt(50, 5)
    sampling = SamplingParams(temperature=0.8, seed=77)

    def in_engine(others: int) -> list:
        with Engine(model, max_batch=8) as engine:
            noise = [
                engine.submit(
                    _prompt(20 + i, 10 + i),
                    max_tokens=10,
                    sampling=SamplingParams(0.7),
                    draft=DraftModel(draft) if i % 2 else None,
                )
                for i in range(others)
            ]
            mine = engine.submit(
                target, max_tokens=12, sampling=sampling, draft=DraftModel(draft), num_draft=3
            )
            steps = [(s.token, s.from_draft) for s in mine.steps()]
            for h in noise:
                list(h.steps())
        return steps

    alone = in_engine(0)
    single = [
        (s.token, s.from_draft)
        for s in speculative_generate_step(
            target, model, DraftModel(draft), max_tokens=12, sampler=sampling.sampler(), num_draft=3
        )
    ]
    assert in_engine(4) == alone == single
    assert any(d for _, d in alone) and not all(d for _, d in alone)


def test_a_draft_pool_proposes_the_draft_models_greedy_tokens(llama):
    """One draft forward over rows that lack one or two tokens of their history (padded to the
    longest, the padding rewound), then a token a forward until each has its k: each row's
    greedy drafts are transformers' greedy continuation of its history by the draft model, and
    again after a rewind to what a verification kept."""
    from mlxinfer.batch.draft_pool import DraftPool
    from mlxinfer.batch.requests import _Request
    from mlxinfer.generation.speculative import _draft_sampler

    draft, torch_draft = llama
    pool = DraftPool(draft, draft, blocks=64, block_size=8)
    histories = [_prompt(21, 31), _prompt(9, 32), _prompt(40, 33)]
    lacking, ks = [1, 2, 1], [4, 3, 2]
    rows = []
    for history, lack in zip(histories, lacking):
        r = _Request(history, 16, None, [], frozenset())
        r.tokens = list(history)
        assert pool.admit(r, 16)
        pool.feed(r, len(history) - lack)
        rows.append(r)
    greedy = SamplingParams()

    def proposed():
        samplers = [_draft_sampler(greedy, [], None, mx.random.key(0)) for _ in rows]
        return [d.tolist() for d, q in pool.propose(rows, ks, samplers)]

    got = proposed()
    assert got == [torch_greedy(torch_draft, r.tokens, k) for r, k in zip(rows, ks)]
    for r, d, k in zip(rows, got, ks):  # held: the history and all drafts but the last
        assert r.draft_seq.tokens == r.tokens + d[: k - 1]
    # The target kept each row's first draft, then its own token (3, say): the draft keeps the
    # history and that draft, and proposes after history + [d0, 3].
    for r, d in zip(rows, got):
        pool.rewind(r, r.tokens + d[:1])
        assert r.draft_seq.tokens == r.tokens + d[:1]
        r.tokens = r.tokens + d[:1] + [3]
    assert proposed() == [torch_greedy(torch_draft, r.tokens, k) for r, k in zip(rows, ks)]
    for r in rows:
        pool.release(r)
    assert pool.bytes_in_use == 0


def test_a_draft_model_no_pool_holds_drafts_with_a_cache_per_request(drafted_llama, tmp_path):
    """A draft model with recurrent layers (LFM2's convolutions) has no draft pool: each row
    drafts in a cache of its own (k forwards a row), with the target's greedy tokens still."""
    from mlxinfer.generation.drafts import DraftModel

    model, torch_model, _ = drafted_llama
    path, _ = make_tiny(tmp_path / "lfm2", **{**LONG, **FAMILIES["lfm2"]})
    draft, _ = load_model(path)
    prompts = [_prompt(30, 6), _prompt(70, 7)]
    expected = [torch_greedy(torch_model, p, 8) for p in prompts]
    with Engine(model, max_batch=8) as engine:
        handles = [engine.submit(p, max_tokens=8, draft=DraftModel(draft)) for p in prompts]
        steps = [list(h.steps()) for h in handles]
        assert not engine._draft_pools
        assert engine.metrics()["draft_steps"] >= sum(s.drafted for row in steps for s in row)
    assert [[s.token for s in row] for row in steps] == expected


def test_cancelling_draft_model_requests_returns_every_block_and_draft_cache(drafted_llama):
    from mlxinfer.generation.drafts import DraftModel

    model, _, draft = drafted_llama
    with Engine(model, block_size=8) as engine:
        handles = [
            engine.submit(_prompt(30 + i, i), max_tokens=500, draft=DraftModel(draft))
            for i in range(3)
        ]
        seen = []
        for step in handles[0].steps():
            seen.append(step.token)
            if len(seen) == 3:
                assert engine.metrics()["draft_kv_bytes"] > 0
                threading.Thread(target=lambda: [h.cancel() for h in handles]).start()
        for h in handles[1:]:
            list(h.steps())
        assert 3 <= len(seen) < 500
        stats = engine.stats()
        assert stats.blocks_in_use == 0 and engine.pool.available() == stats.blocks_total
        deadline = time.monotonic() + 5
        while engine.metrics()["draft_kv_bytes"]:  # counted at the engine thread's next turn
            assert time.monotonic() < deadline, "the draft caches were not released"
            time.sleep(0.01)
        assert all(r.drafter is None for h in handles for r in [h._request])


# --- a quantized pool (kv_bits) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    """A tiny llama whose heads are one quantization group wide (64)."""
    path, torch_model = make_tiny(tmp_path_factory.mktemp("llama64"), head_dim=64, **LONG)
    model, _ = load_model(path)
    return model, torch_model


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_pool_gives_the_quantized_caches_logits(llama64, bits):
    """``Engine(kv_bits=)`` stores keys and values as ``QuantizedKVCache`` does (per token, per
    group of 64): each row's log-probs equal the single-request loop's over that cache (1e-4), and
    8-bit greedy tokens are still transformers'."""
    from mlxinfer.cache.prompt import PromptCache

    model, torch_model = llama64
    prompts = [_prompt(n, 30 + n) for n in (9, 40, 75)]
    alone = []
    for p in prompts:
        pc = PromptCache(model.make_cache(kv_bits=bits))
        alone.append([(t, lp) for t, lp in generate_step(p, model, prompt_cache=pc, max_tokens=5)])
    with Engine(model, block_size=8, prefill_step=16, kv_bits=bits) as engine:
        assert engine.pool.layers[0].bits == bits
        handles = [engine.submit(p, max_tokens=5) for p in prompts]
        batched = [list(h.steps()) for h in handles]
    for a, b in zip(alone, batched):
        assert [t for t, _ in a] == [s.token for s in b]
        for (_, x), s in zip(a, b):
            np.testing.assert_allclose(np.array(x), np.array(s.logprobs), atol=1e-4)
    if bits == 8:
        for p, b in zip(prompts, batched):
            assert [s.token for s in b] == torch_greedy(torch_model, p, 5)


def test_a_quantized_pool_holds_more_tokens_per_byte(llama64):
    model, _ = llama64
    plain = KVPool(layer_shapes(model)).bytes_per_block
    # 64 values of 4 bytes -> 64 bytes (8 bits) or 32 (4 bits), plus a float32 scale and bias
    for bits, packed in ((8, 64), (4, 32)):
        quantized = KVPool(layer_shapes(model, kv_bits=bits)).bytes_per_block
        assert quantized / plain == pytest.approx((packed + 8) / 256)
    with pytest.raises(ValueError, match="kv_bits must be 4 or 8, got 3"):
        layer_shapes(model, kv_bits=3)


def test_kv_bits_needs_whole_groups(llama):
    model, _ = llama
    with pytest.raises(
        ValueError, match="kv_bits: layer 0's keys .* whole groups of kv_group_size=64"
    ):
        Engine(model, kv_bits=8)
