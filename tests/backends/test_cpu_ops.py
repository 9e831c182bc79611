"""The CPU backend's replacements for mx.fast ops, against float64 formulas.

Model-level parity with transformers on both paths is in test_parity.py.
"""

import io
import re
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxinfer.backends.cpu import ops as cpu_ops
from mlxinfer.backends.cpu.layers import CPURoPE, with_mixin
from mlxinfer.models.layers import make_rope


def rope_reference(
    x: np.ndarray, offset: int, inv_freq: np.ndarray, dims: int, traditional: bool
) -> np.ndarray:
    """RoPE by its definition, in float64: pair i of position p turns by p·inv_freq[i]."""
    x = x.astype(np.float64)
    L, half = x.shape[-2], dims // 2
    angles = np.arange(offset, offset + L)[:, None] * inv_freq[None, :]
    c, s = np.cos(angles), np.sin(angles)
    if traditional:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        rot = np.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(*x.shape[:-1], dims)
    else:
        a, b = x[..., :half], x[..., half:dims]
        rot = np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    return np.concatenate([rot, x[..., dims:]], axis=-1)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims,head_dim", [(64, 64), (32, 64)])
@pytest.mark.parametrize("offset", [0, 5000])
def test_rope_table_path_matches_definition(traditional, dims, head_dim, offset):
    base = 10000.0
    rope = make_rope(dims, base, None, 2048, traditional=traditional)
    x = np.random.default_rng(0).standard_normal((1, 3, 5, head_dim)).astype(np.float32)
    inv_freq = base ** (-np.arange(0, dims, 2) / dims)
    ref = rope_reference(x, offset, inv_freq, dims, traditional)
    fast = np.array(rope(mx.array(x), offset=offset))
    with_mixin(rope, CPURoPE)  # the CPU backend's RoPE: a shared cos/sin table
    ours = np.array(rope(mx.array(x), offset=offset))
    # float32 angles p·inv_freq lose ~p·2^-24 rad: the bound grows with the position
    tol = 1e-5 + 4e-7 * (offset + 5)
    assert np.abs(ours - ref).max() <= tol
    assert (
        np.abs(fast - ref).max() <= 2 * tol
    )  # the two paths agree with the definition, so each other


def test_rope_tables_are_shared_between_layers_of_one_thread():
    tables = cpu_ops._thread_cache("tables")
    tables.clear()
    ropes = [make_rope(64, 10000.0, None, 2048) for _ in range(4)]  # one per layer
    x = mx.array(np.random.default_rng(0).standard_normal((1, 2, 1, 64)).astype(np.float32))
    for rope in ropes:
        with_mixin(rope, CPURoPE)
        rope(x, offset=7)
    assert len(tables) == 1
    # Another thread builds its own: a lazy table belongs to the thread (stream) that built it.
    other = []
    thread = threading.Thread(
        target=lambda: other.append(
            (np.array(ropes[0](x, offset=7)), len(cpu_ops._thread_cache("tables")))
        )
    )
    thread.start()
    thread.join()
    assert len(tables) == 1 and other[0][1] == 1
    assert np.array_equal(other[0][0], np.array(ropes[0](x, offset=7)))


def test_rms_norm_matches_definition():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 48)).astype(np.float32) * 5
    w = rng.standard_normal(48).astype(np.float32)
    eps = 1e-5
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * w
    out = np.array(cpu_ops.rms_norm(mx.array(x), mx.array(w), eps))
    assert np.abs(out - ref).max() <= 1e-5
    assert np.abs(out - np.array(mx.fast.rms_norm(mx.array(x), mx.array(w), eps))).max() <= 1e-5


def test_offset_norm_forms_one_plus_w_once_and_again_for_a_new_weight():
    """Gemma's (1 + w) norm on the CPU backend: x / rms(x) * (1 + w) by its definition, with
    1 + w made once when the backend is applied (the call's graph holds no Add), and a
    replaced weight read as itself (a stale 1 + w would give the first weight's output)."""
    from mlxinfer.backends.cpu.layers import CPUOffsetNorm
    from mlxinfer.models.layers import OffsetRMSNorm

    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 48)).astype(np.float32) * 3
    norm = OffsetRMSNorm(48, eps=1e-6)
    with_mixin(norm, CPUOffsetNorm)

    def ref(w):
        rms = np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
        return x / rms * (1.0 + w)

    for w in (rng.standard_normal(48), rng.standard_normal(48)):
        norm.update({"weight": mx.array(w.astype(np.float32))})
        out = norm(mx.array(x))  # a replaced weight: (1 + w) formed in the call
        assert np.abs(np.array(out) - ref(w)).max() <= 1e-5
        norm.keep_one_plus()  # as the backend's apply does
        again = norm(mx.array(x))  # 1 + w already made: only the norm itself in the graph
        dot = io.StringIO()
        mx.export_to_dot(dot, again)
        primitives = re.findall(r'label ?= ?"([^"]*)"', dot.getvalue())
        assert primitives and "Add" not in primitives, primitives
        assert np.abs(np.array(again) - ref(w)).max() <= 1e-5


def attention_reference(q, k, v, scale, allowed):
    """Softmax attention by definition in float64; ``allowed`` (L, T) booleans; kv heads shared by query groups."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    reps = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, reps, axis=1), np.repeat(v, reps, axis=1)
    s = np.where(allowed, q @ k.swapaxes(-1, -2) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize(
    "L,T", [(1, 40), (1, cpu_ops.DECODE_LONG_KEYS + 64), (7, 7), (300, 300), (200, 520)]
)
@pytest.mark.parametrize("mask_kind", ["causal", "window", "additive", None])
@pytest.mark.parametrize("evaluate_blocks", [False, True])  # True in a stepwise (quantized) prefill
def test_attention_matches_definition(L, T, mask_kind, evaluate_blocks, monkeypatch):
    monkeypatch.setattr(
        cpu_ops, "SCORE_BUDGET", 6 * 64 * T
    )  # blocks of 64 queries: several blocks when L > 64
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 6, L, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, T, 16)).astype(np.float32) for _ in range(2))
    pos_q, pos_k = np.arange(T - L, T)[:, None], np.arange(T)[None]
    allowed = pos_k <= pos_q if mask_kind else np.ones((L, T), bool)
    mask = mask_kind
    if mask_kind == "window":
        allowed = allowed & (pos_q - pos_k < 5)
        mask = mx.array(allowed)
    elif mask_kind == "additive":
        mask = mx.array(np.where(allowed, 0.0, -np.inf).astype(np.float32))
    out = np.array(
        cpu_ops.attention(
            mx.array(q),
            mx.array(k),
            mx.array(v),
            scale=0.25,
            mask=mask,
            evaluate_blocks=evaluate_blocks,
        )
    )
    assert np.abs(out - attention_reference(q, k, v, 0.25, allowed)).max() <= 1e-5


def test_exp_matches_float64_and_masks_to_zero():
    x = np.linspace(-87, 88, 100_001).astype(np.float32)
    got = np.array(cpu_ops.exp(mx.array(x)))
    assert np.max(np.abs(got / np.exp(x.astype(np.float64)) - 1)) <= 1.5e-7
    edges = np.array(
        cpu_ops.exp(mx.array([-np.inf, -1e4, 89.0, 1e30, np.inf, np.nan], dtype=mx.float32))
    )
    assert edges[:2].tolist() == [0.0, 0.0]  # masked logits
    assert np.isposinf(edges[2:5]).all() and np.isnan(edges[5])


def test_softmax_matches_definition():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((3, 4, 700)) * 8).astype(np.float32)
    x[0, 0, :650] = -np.inf  # a mostly masked row
    ref = np.exp(x - x.max(-1, keepdims=True)).astype(np.float64)
    ref /= ref.sum(-1, keepdims=True)
    got = np.array(cpu_ops.softmax(mx.array(x)))
    assert np.abs(got - ref).max() <= 1e-6 and (got[0, 0, :650] == 0).all()


def test_swiglu_matches_definition():
    g = np.linspace(-30, 30, cpu_ops.SMALL + 1001).astype(np.float32)  # the large-input path
    u = np.cos(g).astype(np.float32)
    ref = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    assert np.abs(np.array(cpu_ops.swiglu(mx.array(g), mx.array(u))) - ref).max() <= 1e-5


@pytest.mark.parametrize("L,T", [(1, 30), (90, 90)])
def test_attention_with_a_per_head_additive_mask(L, T, monkeypatch):
    """ALiBi: an (n_heads, L, T) bias, one per query head, grouped like the queries."""
    monkeypatch.setattr(cpu_ops, "SCORE_BUDGET", 6 * 32 * T)  # several query blocks for L = 90
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 6, L, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 3, T, 16)).astype(np.float32) for _ in range(2))
    bias = (rng.standard_normal((6, 1, T)) * np.ones((1, L, 1))).astype(np.float32)
    allowed = np.arange(T)[None] <= np.arange(T - L, T)[:, None]
    mask = np.where(allowed, bias, -np.inf).astype(np.float32)
    out = np.array(
        cpu_ops.attention(mx.array(q), mx.array(k), mx.array(v), scale=0.25, mask=mx.array(mask))
    )
    qf, kf, vf = (a.astype(np.float64) for a in (q, k, v))
    kf, vf = np.repeat(kf, 2, axis=1), np.repeat(vf, 2, axis=1)
    s = qf @ kf.swapaxes(-1, -2) * 0.25 + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ vf
    assert np.abs(out - ref).max() <= 1e-5


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_dequantize_equals_mlx(bits, group_size, dtype):
    """The one-kernel dequantization (2, 4, 8 bits from 32-bit words; 3, 5, 6 from the bytes
    of 8 values) against ``mx.dequantize``, bit for bit."""
    from mlxinfer.backends.cpu.quantized import dequantize

    w = mx.random.normal((2, 96, 256), key=mx.random.key(bits * group_size)).astype(dtype)
    parts = mx.quantize(w, group_size=group_size, bits=bits)
    got = dequantize(*parts, group_size=group_size, bits=bits)
    assert got.shape == w.shape and got.dtype == w.dtype
    assert mx.array_equal(got, mx.dequantize(*parts, group_size=group_size, bits=bits)).item()


def test_prefill_evaluates_each_quantized_product_and_stays_lazy_elsewhere():
    from mlxinfer.backends.cpu.quantized import CPUQuantizedLinear, stepwise, stepwise_prefill

    layer = nn.QuantizedLinear.from_linear(nn.Linear(128, 96, bias=True), 64, 4)
    x = mx.random.normal((1, 40, 128), key=mx.random.key(7))  # many rows: dequantize + matmul
    ref = np.array(nn.QuantizedLinear.__call__(layer, x))
    with stepwise_prefill(nn.Sequential(layer)):
        assert not stepwise()  # MLX's own quantized layer: nothing to do stepwise
    layer.__class__ = CPUQuantizedLinear
    traced = mx.compile(lambda a: layer(a))  # lazy outside prefill: traceable
    assert np.abs(np.array(traced(x)) - ref).max() <= 1e-4
    with stepwise_prefill(nn.Sequential(layer)):
        assert stepwise()
        elsewhere = []  # another thread (another request) is not in this prefill
        thread = threading.Thread(target=lambda: elsewhere.append(stepwise()))
        thread.start()
        thread.join()
        assert elsewhere == [False]
        assert np.abs(np.array(layer(x)) - ref).max() <= 1e-4
        with pytest.raises(ValueError, match="eval"):  # the product is evaluated as it is built
            mx.compile(lambda a: layer(a) * 2)(x)
    assert not stepwise()
    with stepwise_prefill(nn.Sequential(nn.Linear(128, 96))):
        assert not stepwise()  # float models are left lazy


@pytest.mark.parametrize(
    "bits,group_size,bias", [(4, 64, False), (4, 32, True), (8, 128, False), (6, 64, True)]
)
def test_sliced_mlp_equals_whole_mlp(bits, group_size, bias):
    """The stepwise MLP, slice by slice of hidden units, against MLX's quantized layers and silu."""
    from mlxinfer.backends.cpu import quantized as quant
    from mlxinfer.backends.cpu.layers import swap_layers
    from mlxinfer.models.layers import GatedMLP

    dim, hidden, rows = (
        128,
        quant.MLP_SLICE + 256,
        quant.MLP_SLICE_ROWS + 4,
    )  # a full slice and a partial one
    mlp = GatedMLP(dim, hidden, nn.silu, bias=bias)
    if bias:
        for name in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(mlp, name)
            layer.bias = mx.random.normal(layer.bias.shape, key=mx.random.key(len(name)))
    nn.quantize(mlp, group_size=group_size, bits=bits)
    x = mx.random.normal((1, rows, dim), key=mx.random.key(bits))

    def whole(layer, a):
        return nn.QuantizedLinear.__call__(layer, a)  # MLX's quantized matmul, not ours

    ref = whole(mlp.down_proj, nn.silu(whole(mlp.gate_proj, x)) * whole(mlp.up_proj, x))
    assert swap_layers(mlp) == 5  # three quantized layers, the MLP, gate/up stacked (fused.py)
    with quant.stepwise_prefill(mlp):
        assert quant.slices_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj) == quant.stepwise()
        assert not quant.slices_mlp(
            x[:, : quant.MLP_SLICE_ROWS - 1], mlp.gate_proj, mlp.up_proj, mlp.down_proj
        )
        out = mlp(x)
    assert np.abs(np.array(out) - np.array(ref)).max() <= 1e-4 * np.abs(np.array(ref)).max()


def test_long_decode_attention_in_float16_matches_definition():
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 4, 1, 16)).astype(np.float16)
    k, v = (
        rng.standard_normal((1, 2, cpu_ops.DECODE_LONG_KEYS + 88, 16)).astype(np.float16)
        for _ in range(2)
    )
    out = cpu_ops.attention(mx.array(q), mx.array(k), mx.array(v), scale=0.25, mask=None)
    assert out.dtype == mx.float16
    ref = attention_reference(q, k, v, 0.25, np.ones((1, k.shape[2]), bool))
    assert np.abs(np.array(out.astype(mx.float32)) - ref).max() <= 2e-3


def test_attention_in_float16_matches_definition():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 4, 64, 16)).astype(np.float16)
    k, v = (rng.standard_normal((1, 2, 600, 16)).astype(np.float16) for _ in range(2))
    allowed = np.arange(600)[None] <= np.arange(600 - 64, 600)[:, None]
    out = cpu_ops.attention(mx.array(q), mx.array(k), mx.array(v), scale=0.25, mask="causal")
    assert out.dtype == mx.float16
    assert (
        np.abs(np.array(out.astype(mx.float32)) - attention_reference(q, k, v, 0.25, allowed)).max()
        <= 2e-3
    )


def test_a_quantized_tied_head_over_many_rows_matches_its_dequantized_weight(monkeypatch):
    """More rows than the kernels take (a prompt's positions): the head's vocabulary blocks
    dequantized one after another (a partial last block too) and multiplied by the BLAS,
    never MLX's scalar quantized matmul; equal to the float64 product with the weight MLX's
    own dequantization gives."""
    from mlxinfer.backends.cpu import quantized
    from mlxinfer.backends.cpu.layers import CPUTiedHead

    monkeypatch.setattr(quantized, "HEAD_BLOCK", 96)  # 300 rows: blocks of 96, 96, 96, 12
    head = nn.QuantizedEmbedding(300, 128, group_size=64, bits=4)
    head.update({"weight": head.weight, "scales": mx.random.uniform(0.01, 0.1, (300, 2))})
    with_mixin(head, CPUTiedHead)
    calls = []
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = mx.random.normal((2, 20, 128))
    y = head.as_linear(x)
    w = mx.dequantize(head["weight"], head["scales"], head["biases"], group_size=64, bits=4)
    expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert y.shape == (2, 20, 300) and not calls
    np.testing.assert_allclose(np.asarray(y), expected, atol=1e-4, rtol=1e-5)
