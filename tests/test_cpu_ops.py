"""The CPU backend's replacements for mx.fast ops, against float64 formulas.

Model-level parity with transformers on both paths is in test_parity.py.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlxinfer.models import cpu_ops
from mlxinfer.models.rope import make_rope


def rope_reference(x: np.ndarray, offset: int, inv_freq: np.ndarray, dims: int, traditional: bool) -> np.ndarray:
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
    saved = cpu_ops.OVERRIDE
    try:
        cpu_ops.OVERRIDE = True
        ours = np.array(rope(mx.array(x), offset=offset))
        cpu_ops.OVERRIDE = False
        fast = np.array(rope(mx.array(x), offset=offset))
    finally:
        cpu_ops.OVERRIDE = saved
    # float32 angles p·inv_freq lose ~p·2^-24 rad: the bound grows with the position
    tol = 1e-5 + 4e-7 * (offset + 5)
    assert np.abs(ours - ref).max() <= tol
    assert np.abs(fast - ref).max() <= 2 * tol  # the two paths agree with the definition, so each other


def test_rope_tables_are_shared_between_layers():
    cpu_ops._TABLES.clear()
    ropes = [make_rope(64, 10000.0, None, 2048) for _ in range(4)]  # one per layer
    x = mx.zeros((1, 2, 1, 64))
    saved = cpu_ops.OVERRIDE
    try:
        cpu_ops.OVERRIDE = True
        for rope in ropes:
            rope(x, offset=7)
    finally:
        cpu_ops.OVERRIDE = saved
    assert len(cpu_ops._TABLES) == 1


def test_rms_norm_matches_definition():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 48)).astype(np.float32) * 5
    w = rng.standard_normal(48).astype(np.float32)
    eps = 1e-5
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * w
    out = np.array(cpu_ops.rms_norm(mx.array(x), mx.array(w), eps))
    assert np.abs(out - ref).max() <= 1e-5
    assert np.abs(out - np.array(mx.fast.rms_norm(mx.array(x), mx.array(w), eps))).max() <= 1e-5


@pytest.mark.parametrize("rows", [1, 4, 40])
def test_blocked_projection_equals_matmul(rows):
    rng = np.random.default_rng(2)
    vocab = 5 * cpu_ops.HEAD_CHUNK + 17  # a ragged last block
    w = rng.standard_normal((vocab, 32)).astype(np.float32)
    x = rng.standard_normal((1, rows, 32)).astype(np.float32)
    out = np.array(cpu_ops.project(mx.array(x), mx.array(w)))
    assert out.shape == (1, rows, vocab)
    assert np.abs(out - x.astype(np.float64) @ w.T.astype(np.float64)).max() <= 1e-4
