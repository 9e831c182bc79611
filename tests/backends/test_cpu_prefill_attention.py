"""A prompt's attention as one kernel call (csrc/src/prefill_attention.cpp,
``attention_kernels.prefill_attention``; issue 47, item 3 "attention over a chunk"): against MLX's
``scaled_dot_product_attention`` (f32, within 1e-5) for grouped heads, causal and not, a chunk
after cached keys (T > L), keys laid out as a cache's buffer view and as a forward without a
cache leaves them (transposed), at every instruction-set level, and a batch's rows under their
own boolean masks; the CPU backend's attention takes it for causal, unmasked and boolean-masked
prompts and leaves additive and per-head masks to ``ops.attention``; bad arguments are
one-line errors."""

import mlx.core as mx
import numpy as np
import pytest
from kernel_calls import CountedKernels, isa_levels

from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import attention_kernels

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


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_prefill_attention_is_mlx_attention(shape):
    n_q, n_kv, L, T, D, Dv = shape
    rng = np.random.default_rng(L * 100 + D)
    q = mx.array(rng.normal(size=(1, n_q, L, D)).astype(np.float32))
    buffer = rng.normal(size=(1, n_kv, T + 9, D)).astype(np.float32)  # a cache's room past T
    k = mx.array(buffer)[:, :, :T]  # a view of the buffer, as KVCache returns it
    v = mx.array(rng.normal(size=(1, n_kv, T, Dv)).astype(np.float32))
    k_t = mx.array(np.ascontiguousarray(np.array(k).transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    outputs = {}
    try:
        for level in isa_levels(K):
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
                outputs[level, causal] = np.array(y)
    finally:
        K.set_max_isa("best")
    if ("avx512", True) in outputs:  # AVX2's native halves: the same lane arithmetic
        for causal in (True, False):
            assert (outputs["avx2", causal] == outputs["avx512", causal]).all()


def test_masked_rows_are_mlx_attention():
    """A batch's rows, each with its own boolean mask (padding, other lengths, a window): every
    key scored, the mask's flags kept, as MLX's attention with that mask."""
    rng = np.random.default_rng(3)
    B, n_q, n_kv, L, T, D = 3, 4, 2, 9, 14, 32
    q = mx.array(rng.normal(size=(B, n_q, L, D)).astype(np.float32))
    k = mx.array(rng.normal(size=(B, n_kv, T, D)).astype(np.float32))
    v = mx.array(rng.normal(size=(B, n_kv, T, D)).astype(np.float32))
    mask = rng.random((B, 1, L, T)) < 0.6
    mask[..., 0] = True  # every query sees a key (MLX's softmax over none is NaN)
    try:
        for level in isa_levels(K):
            K.set_max_isa(level)
            for rows in (mx.array(mask), mx.array(mask[:1])):  # per row, or one for all
                ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=rows)
                y = K.prefill_attention(q, k, v, scale=D**-0.5, causal=False, mask=rows)
                assert np.abs(np.array(y) - np.array(ref)).max() <= 1e-5, level
    finally:
        K.set_max_isa("best")


def test_the_backend_takes_it_where_it_fits(monkeypatch):
    counter = CountedKernels(K, ("prefill_attention",))
    monkeypatch.setattr(kernels, "load", lambda: counter)
    q, k, v = (mx.zeros((2, 4, 8, 32)), mx.zeros((2, 2, 8, 32)), mx.zeros((2, 2, 8, 32)))
    assert attention_kernels.prefill_attention(q, k, v, 0.1, "causal") is not None
    assert attention_kernels.prefill_attention(q, k, v, 0.1, None) is not None
    window = mx.ones((8, 8), dtype=mx.bool_)  # (L, T): a window
    assert attention_kernels.prefill_attention(q, k, v, 0.1, window) is not None
    assert (
        attention_kernels.prefill_attention(q, k, v, 0.1, mx.ones((2, 1, 8, 8), mx.bool_))
        is not None
    )
    assert counter.calls["prefill_attention"] == 4
    alibi = mx.zeros((1, 4, 8, 8))  # additive, per head: ops.attention
    assert attention_kernels.prefill_attention(q, k, v, 0.1, alibi) is None
    assert (
        attention_kernels.prefill_attention(q, k, v, 0.1, mx.ones((1, 4, 8, 8), mx.bool_)) is None
    )
    assert attention_kernels.prefill_attention(q[:, :, :1], k, v, 0.1, "causal") is None  # decode
    assert attention_kernels.prefill_attention(q.astype(mx.float16), k, v, 0.1, "causal") is None
    assert counter.calls["prefill_attention"] == 4


def test_bad_arguments_are_one_line_errors():
    q, k, v = (mx.zeros((1, 3, 8, 32)), mx.zeros((1, 2, 8, 32)), mx.zeros((1, 2, 8, 32)))
    with pytest.raises(ValueError, match=r"n_q a multiple of n_kv, found \(1, 3, 8, 32\)"):
        K.prefill_attention(q, k, v, scale=1.0, causal=True)
    q, k, v = (mx.zeros((1, 2, 8, 24)), mx.zeros((1, 2, 8, 24)), mx.zeros((1, 2, 8, 24)))
    with pytest.raises(ValueError, match="head dims in multiples of 16, found D 24, Dv 24"):
        K.prefill_attention(q, k, v, scale=1.0, causal=True)
    with pytest.raises(ValueError, match=r"mask: expected a bool array \(1 or 1, 1, 8, 8\), found"):
        K.prefill_attention(q, k, v, scale=1.0, causal=False, mask=mx.ones((1, 1, 8, 7), mx.bool_))
