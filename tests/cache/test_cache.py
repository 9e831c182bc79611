"""KV cache kinds: sizes, windows, quantization, trimming, save/load."""

import mlx.core as mx
import numpy as np
import pytest
from hf_models import make_tiny, torch_logits

from mlxinfer.cache.kv import KVCache, cache_nbytes
from mlxinfer.cache.prompt import PromptCache
from mlxinfer.cache.quantized import QuantizedKVCache
from mlxinfer.cache.rotating import RotatingKVCache
from mlxinfer.generation import generate_step
from mlxinfer.loading.loader import load_model

IDS = [5, 17, 99, 3, 240, 8, 61, 130, 2, 77, 19, 200, 45, 1, 33, 150, 9, 12, 255, 4]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # head_dim 64 so 64-wide quantization groups fit the quantized cache.
    path, torch_model = make_tiny(
        tmp_path_factory.mktemp("tiny"),
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model, _ = load_model(path)
    return model, torch_model


def test_plain_cache_nbytes_is_exact(tiny):
    model, _ = tiny
    cache = model.make_cache()
    model(mx.array([IDS]), cache)
    layers, kv_heads, head_dim, itemsize = 2, 1, 64, 4
    assert cache_nbytes(cache) == 2 * layers * kv_heads * head_dim * len(IDS) * itemsize


def test_cache_grows_in_steps_and_writes_in_place():
    c = KVCache()
    k = mx.ones((1, 2, 3, 8))
    c.update_and_fetch(k, k)
    assert c.keys.shape[2] == KVCache.step  # preallocated
    buf = c.keys
    c.update_and_fetch(k[:, :, :1], k[:, :, :1])
    assert c.keys is buf and c.offset == 4


def test_trim_then_refill_equals_fresh(tiny):
    model, _ = tiny
    cache = model.make_cache()
    model(mx.array([IDS]), cache)
    assert all(c.trim(5) == 5 for c in cache)
    out = np.array(model(mx.array([IDS[-5:]]), cache)[0])
    ref = np.array(model(mx.array([IDS]))[0, -5:])
    assert np.abs(out - ref).max() < 1e-4


def test_rotating_cache_equals_sliding_window_attention(tmp_path):
    path, torch_model = make_tiny(tmp_path, "mistral", sliding_window=6)
    model, _ = load_model(path)
    assert isinstance(model.make_cache()[0], RotatingKVCache)
    cache = model.make_cache()
    chunks = [IDS[:9], IDS[9:10], IDS[10:16]] + [[t] for t in IDS[16:]]
    out = np.concatenate([np.array(model(mx.array([c]), cache)[0]) for c in chunks])
    assert np.abs(out - torch_logits(torch_model, IDS)).max() < 1e-3
    assert cache[0].nbytes == 2 * 2 * 16 * 6 * 4  # kv_heads × head_dim × window × f32, K and V


def test_rotating_keep_and_window_masks():
    c = RotatingKVCache(max_size=6, keep=2)
    for _ in range(9):  # 9 single tokens: positions 0..8; kept 0,1 and the last 4 (5..8)
        c.update_and_fetch(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))
    assert c._positions() == [0, 1, 5, 6, 7, 8]
    mask = np.array(c.make_mask(2))  # queries at 9 and 10 see keep tokens and a window of 4
    k_pos = [0, 1, 5, 6, 7, 8, 9, 10]
    expected = [[kp < 2 or (kp <= q and q - kp < 4) for kp in k_pos] for q in (9, 10)]
    assert mask.tolist() == expected


def test_rotating_mask_is_causal_until_the_window_is_reached():
    """Nothing evicted and every query within the window: the mask is "causal" (sdpa's fast form,
    the CPU kernels' prompt attention), which is what the visibility rule gives there; from the
    query that would pass the window on, the boolean mask."""
    c = RotatingKVCache(max_size=8, keep=0)
    c.update_and_fetch(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))  # positions 0..2
    assert c.make_mask(5) == "causal"  # queries 3..7: each sees every earlier key (window 8)
    mask = np.array(c.make_mask(6))  # query 8 would see 0 at distance 8: outside
    k_pos, q_pos = range(9), range(3, 9)
    assert mask.tolist() == [[kp <= q and q - kp < 8 for kp in k_pos] for q in q_pos]
    causal = np.tril(np.ones((5, 8), bool), k=3)  # "causal": query i sees keys up to T - L + i
    full = np.array([[kp <= q and q - kp < 8 for kp in range(8)] for q in range(3, 8)])
    assert (causal == full).all()


def test_max_kv_size_bounds_memory(tiny):
    model, _ = tiny
    cache = model.make_cache(max_kv_size=8)
    list(generate_step(IDS, model, prompt_cache=PromptCache(cache), max_tokens=10))
    assert all(c._size == 8 for c in cache)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "mask,queries", [(None, 1), ("causal", 3), ("causal", 20)]
)  # 20: a prefill chunk
def test_quantized_attention_equals_attention_on_dequantized_kv(bits, mask, queries):
    from mlxinfer.models.layers import quantized_attention

    q, k, v = (
        mx.random.normal((1, n, L, 64), key=mx.random.key(i))
        for i, (n, L) in enumerate([(4, queries), (2, 27), (2, 27)])
    )
    kq, vq = mx.quantize(k, group_size=64, bits=bits), mx.quantize(v, group_size=64, bits=bits)
    deq = [mx.dequantize(*t, group_size=64, bits=bits) for t in (kq, vq)]
    ref = mx.fast.scaled_dot_product_attention(q, *deq, scale=0.125, mask=mask)
    out = quantized_attention(q, kq, vq, scale=0.125, mask=mask, group_size=64, bits=bits)
    assert np.abs(np.array(out) - np.array(ref)).max() < 1e-4


@pytest.mark.parametrize(
    "bits,tol", [(8, 0.01), (4, 0.25)]
)  # 4-bit groups of 64 are coarse; exactness is checked above
def test_quantized_cache_close_to_float(tiny, bits, tol):
    model, _ = tiny
    ref = np.array(model(mx.array([IDS]))[0])
    cache = model.make_cache(kv_bits=bits)
    assert isinstance(cache[0], QuantizedKVCache)
    out = np.concatenate(
        [np.array(model(mx.array([c]), cache)[0]) for c in (IDS[:12], IDS[12:15])]
        + [np.array(model(mx.array([[t]]), cache)[0]) for t in IDS[15:]]
    )
    err = np.abs(out - ref).max() / np.ptp(ref)
    assert 0 < err < tol  # quantization changes the numbers, but only a little
    float_bytes = 2 * 2 * 64 * len(IDS) * 4
    assert cache_nbytes(cache) < float_bytes * (0.35 if bits == 8 else 0.2)


def test_prompt_cache_reuses_common_prefix(tiny):
    model, _ = tiny
    pc = PromptCache(model.make_cache())
    first = [t for t, _ in generate_step(IDS[:10], model, prompt_cache=pc, max_tokens=4)]
    assert pc.tokens == IDS[:10] + first[:3]  # the last token was never fed
    assert pc.cache[0].offset == len(pc.tokens)
    todo = pc.reuse(IDS[:8] + [1, 2])
    assert todo == [1, 2] and pc.cache[0].offset == 8


def test_stopping_early_leaves_cache_consistent(tiny):
    model, _ = tiny
    pc = PromptCache(model.make_cache())
    steps = generate_step(IDS[:10], model, prompt_cache=pc, max_tokens=50)
    got = [next(steps)[0] for _ in range(3)]
    steps.close()
    assert pc.tokens == IDS[:10] + got and pc.cache[0].offset == 13
    # Continuing from the cache gives what a fresh run gives.
    fresh = [t for t, _ in generate_step(IDS[:10], model, max_tokens=6)]
    again = [t for t, _ in generate_step(IDS[:10], model, prompt_cache=pc, max_tokens=6)]
    assert again == fresh


@pytest.mark.parametrize("kind", ["plain", "rotating", "quantized"])
def test_save_and_load_round_trip(tiny, tmp_path, kind):
    model, _ = tiny
    opts = {"plain": {}, "rotating": {"max_kv_size": 8}, "quantized": {"kv_bits": 8}}[kind]
    pc = PromptCache(model.make_cache(**opts))
    list(generate_step(IDS, model, prompt_cache=pc, max_tokens=3))
    pc.save(tmp_path / "c.safetensors")
    loaded = PromptCache.load(tmp_path / "c.safetensors")
    assert loaded.tokens == pc.tokens
    assert [type(c) for c in loaded.cache] == [type(c) for c in pc.cache]
    assert loaded.cache[0].offset == pc.cache[0].offset
    a = [t for t, _ in generate_step(IDS + [7], model, prompt_cache=pc, max_tokens=4)]
    b = [t for t, _ in generate_step(IDS + [7], model, prompt_cache=loaded, max_tokens=4)]
    assert a == b


def test_prefill_allocates_the_whole_prompt_once():
    """A reserved cache grows once for the whole prompt instead of once per prefill chunk,
    and gets the decode's room only after the prompt, keeping what it holds."""
    from mlxinfer.cache.kv import KVCache
    from mlxinfer.cache.prompt import PromptCache
    from mlxinfer.generation.prefill import MAX_RESERVED_DECODE, prefill

    class Recorder:  # a one-layer "model" that writes its tokens' ids as keys
        def __call__(self, tokens, cache):
            x = mx.broadcast_to(
                tokens[:, None, :, None].astype(mx.float32), (1, 2, tokens.shape[1], 8)
            )
            cache[0].update_and_fetch(x, x)
            return x

    grown = []
    cache = KVCache()
    original = cache.update_and_fetch

    def spy(k, v):
        before = None if cache.keys is None else cache.keys.shape[2]
        out = original(k, v)
        if cache.keys.shape[2] != before:
            grown.append(cache.keys.shape[2])
        return out

    def reset():
        grown.clear()
        cache.keys = cache.values = None
        cache.offset = cache.reserved = 0

    cache.update_and_fetch = spy
    prefill(Recorder(), PromptCache([cache]), list(range(1000)), step=128)
    assert grown == [1001]  # exactly the 1000 prompt tokens + the next one
    assert cache.keys.shape[2] == 1001

    # With the decode length known, its room is added after the prompt (not during it), and the
    # prompt's keys survive the copy; past that room, growth is in 256-token steps.
    reset()
    prefill(Recorder(), PromptCache([cache]), list(range(1000)), step=128, then=50)
    assert grown == [1001] and cache.keys.shape[2] == 1050
    np.testing.assert_array_equal(np.array(cache.keys[0, 0, :1000, 0]), np.arange(1000))
    for _ in range(51):
        Recorder()(mx.zeros((1, 1), mx.int32), [cache])
    assert grown == [1001, 1050 + 256]

    # A huge max_tokens does not allocate its whole length up front.
    reset()
    prefill(Recorder(), PromptCache([cache]), list(range(1000)), step=128, then=10**9)
    assert cache.keys.shape[2] == 1000 + MAX_RESERVED_DECODE


def test_a_write_that_fills_the_cache_keeps_no_larger_array_alive():
    """MLX returns an update that covers the whole buffer as the update itself; when that is a
    view into a larger array (one slice of a stacked q/k/v product), the cache must copy it."""
    stacked = mx.random.normal((1, 127, 15, 64))  # q, k and v heads of one product
    mx.eval(stacked)
    for cache in (KVCache(), RotatingKVCache(max_size=512), QuantizedKVCache(bits=8)):
        k = stacked[:, :, 9:12, :].transpose(0, 2, 1, 3)
        v = stacked[:, :, 12:15, :].transpose(0, 2, 1, 3)
        if isinstance(cache, KVCache):
            cache.reserve(127)
        cache.update_and_fetch(k, v)
        mx.eval(cache.state)
        del k, v
        base = mx.get_active_memory()
        held = cache.nbytes
        stacked_bytes = stacked.nbytes
        del stacked
        # Dropping our reference frees the stacked array: the cache held only its own copy.
        assert base - mx.get_active_memory() >= stacked_bytes, type(cache).__name__
        assert held > 0
        stacked = mx.random.normal((1, 127, 15, 64))
        mx.eval(stacked)
