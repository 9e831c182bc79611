"""A prompt's attention as one kernel call (csrc/src/prefill_attention.cpp,
``compiled.prefill_attention``; issue 47, item 3 "attention over a chunk"): against MLX's
``scaled_dot_product_attention`` (f32, within 1e-5) for grouped heads, causal and not, a chunk
after cached keys (T > L), keys laid out as a cache's buffer view and as a forward without a
cache leaves them (transposed), at every instruction-set level; the CPU backend's attention
takes it for a causal prompt of one sequence and leaves mask arrays and batches to
``ops.attention``; bad arguments are one-line errors."""

import mlx.core as mx
import numpy as np
import pytest
from kernel_calls import CountedKernels

from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import compiled

K = kernels.load()
pytestmark = [
    pytest.mark.skipif(K is None, reason=f"compiled kernels absent: {kernels.reason()}"),
    pytest.mark.skipif(
        mx.default_device().type != mx.DeviceType.cpu, reason="the CPU backend's kernels"
    ),
    pytest.mark.skipif(
        K is not None and not hasattr(K, "prefill_attention"),
        reason="kernels built before prefill_attention.cpp",
    ),
]

SHAPES = [  # n_q, n_kv, L, T, D, Dv
    (4, 1, 37, 37, 256, 256),  # Gemma-3-270M's grouping
    (9, 3, 40, 40, 64, 64),  # SmolLM2's
    (4, 2, 5, 21, 32, 32),  # a chunk after 16 cached keys
    (6, 6, 3, 3, 16, 48),  # no grouping, another value width
    (8, 2, 70, 70, 128, 128),  # more positions than a task's chunk of 8
]


def isa_levels() -> list[str]:
    levels = ["scalar", "neon"] if K.best_isa == "neon" else ["scalar", "avx2", "avx512"]
    return levels[: levels.index(K.best_isa) + 1]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_prefill_attention_is_mlx_attention(shape):
    n_q, n_kv, L, T, D, Dv = shape
    rng = np.random.default_rng(L * 100 + D)
    q = mx.array(rng.normal(size=(1, n_q, L, D)).astype(np.float32))
    buffer = rng.normal(size=(1, n_kv, T + 9, D)).astype(np.float32)  # a cache's room past T
    k = mx.array(buffer)[:, :, :T]  # a view of the buffer, as KVCache returns it
    v = mx.array(rng.normal(size=(1, n_kv, T, Dv)).astype(np.float32))
    k_t = mx.array(np.ascontiguousarray(np.array(k).transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    try:
        for level in isa_levels():
            K.set_max_isa(level)
            for causal in (True, False):
                ref = mx.fast.scaled_dot_product_attention(
                    q, k, v, scale=D**-0.5, mask="causal" if causal else None
                )
                for keys in (k, k_t):
                    y = K.prefill_attention(q, keys, v, scale=D**-0.5, causal=causal)
                    assert y.shape == (1, n_q, L, Dv)
                    err = np.abs(np.array(y) - np.array(ref)).max()
                    assert err <= 1e-5, (level, causal, err)
    finally:
        K.set_max_isa("best")


def test_the_backend_takes_it_for_one_causal_sequence(monkeypatch):
    counter = CountedKernels(K, ("prefill_attention",))
    monkeypatch.setattr(kernels, "load", lambda: counter)
    q, k, v = (mx.zeros((1, 4, 8, 32)), mx.zeros((1, 2, 8, 32)), mx.zeros((1, 2, 8, 32)))
    assert compiled.prefill_attention(q, k, v, 0.1, "causal") is not None
    assert compiled.prefill_attention(q, k, v, 0.1, None) is not None
    assert counter.calls["prefill_attention"] == 2
    array_mask = mx.ones((8, 8), dtype=mx.bool_)  # a window or a batch's rows: ops.attention
    assert compiled.prefill_attention(q, k, v, 0.1, array_mask) is None
    assert compiled.prefill_attention(q[:, :, :1], k, v, 0.1, "causal") is None  # decode
    two = mx.concatenate([q, q])
    assert compiled.prefill_attention(two, mx.concatenate([k, k]), v, 0.1, "causal") is None
    half = q.astype(mx.float16)
    assert compiled.prefill_attention(half, k, v, 0.1, "causal") is None
    assert counter.calls["prefill_attention"] == 2


def test_bad_arguments_are_one_line_errors():
    q, k, v = (mx.zeros((1, 3, 8, 32)), mx.zeros((1, 2, 8, 32)), mx.zeros((1, 2, 8, 32)))
    with pytest.raises(ValueError, match=r"n_q a multiple of n_kv, found \(1, 3, 8, 32\)"):
        K.prefill_attention(q, k, v, scale=1.0, causal=True)
    q, k, v = (mx.zeros((1, 2, 8, 24)), mx.zeros((1, 2, 8, 24)), mx.zeros((1, 2, 8, 24)))
    with pytest.raises(ValueError, match="head dims in multiples of 16, found D 24, Dv 24"):
        K.prefill_attention(q, k, v, scale=1.0, causal=True)
