"""Sampling on the CPU backend as one kernel call (csrc/src/sample.cpp, ``backends.sample``;
issue 47, items 2 and 4: the sampling input in one pass, no host work a kernel can do): the
distribution it draws from is the filters' as transformers' warpers define them (temperature,
top-k, top-p, min-p, in that order), derived here in float64 numpy; stratified uniform numbers
give every kept token its share of draws; ``make_sampler`` takes it on the CPU backend and MLX's
own ops without it (``MLXINFER_CPU_OPS=0``), seeded samplers repeat themselves; bad settings are
one-line errors."""

import mlx.core as mx
import numpy as np
import pytest

from mlxinfer import backends
from mlxinfer.backends import kernels
from mlxinfer.generation.sampling import filtered_logprobs, make_sampler

K = kernels.load()
pytestmark = [
    pytest.mark.skipif(K is None, reason=f"compiled kernels absent: {kernels.reason()}"),
    pytest.mark.skipif(
        mx.default_device().type != mx.DeviceType.cpu, reason="the CPU backend's kernels"
    ),
    pytest.mark.skipif(K is not None and not hasattr(K, "sample"), reason="built before sample"),
]
RNG = np.random.default_rng(0)


def reference(x: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The filtered distribution of one row, by the warpers' definitions, in float64."""
    x = x.astype(np.float32) / np.float32(temperature)  # divided in the logits' dtype
    x = x.astype(np.float64)
    keep = np.isfinite(x)
    if 0 < top_k < x.size:
        kth = np.sort(x)[::-1][top_k - 1]
        keep &= x >= kth
    if top_p < 1.0:
        order = sorted(np.flatnonzero(keep), key=lambda i: (-x[i], i))
        e = np.exp(x[order] - x[order[0]])
        p = e / e.sum()
        before = np.cumsum(p) - p
        drop = np.array(order)[before >= top_p]
        keep[drop] = False
    if min_p > 0.0:
        keep &= x >= x[keep].max() + np.log(min_p)
    e = np.where(keep, np.exp(np.where(keep, x, 0) - x[keep].max()), 0.0)
    return e / e.sum()


SETTINGS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, top_k=40),
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=0.8, top_k=100, top_p=0.5, min_p=0.01),
    dict(temperature=0.5, top_p=0.999),  # most of the vocabulary: the candidates grow
]


@pytest.mark.parametrize(
    "settings", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items())
)
@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_the_distribution_drawn_from_is_the_filters(settings, vocab):
    logits = (RNG.standard_normal((3, vocab)) * 3).astype(np.float32)
    logits[1, : vocab // 3] = -np.inf  # a masked row (constrained decoding's -inf)
    logits[1, -1] = logits[1, -2]  # a tie
    logits[2, vocab // 2] = 60.0  # one token holds nearly all the mass
    u = mx.array(RNG.random(3).astype(np.float32))
    probs = np.array(K.sample(mx.array(logits), u, probs=True, **settings))
    for row in range(3):
        ref = reference(logits[row], **settings)
        # the same tokens kept (those below float32's range, e^-87 of the top, count as 0)
        assert not np.any((probs[row] > 0) & (ref == 0)), row
        assert np.all(probs[row][ref > 1e-30] > 0), row
        assert np.abs(probs[row] - ref).max() <= 1e-6 * max(1.0, ref.max()), row
    # MLX's own filter (float32 sums) agrees too, up to its rounding
    ours = np.exp(np.array(filtered_logprobs(mx.array(logits), **settings)))
    assert np.abs(probs - ours).max() <= 1e-3


@pytest.mark.parametrize("settings", SETTINGS[:5], ids=lambda s: "-".join(s))
def test_stratified_draws_give_each_token_its_share(settings):
    """N uniform numbers (j + 0.5) / N through the inverse transform: each kept token drawn
    N·p times within one (whatever order the kernel walks its tokens in), none other."""
    vocab, n = 2000, 4096
    row = (RNG.standard_normal(vocab) * 2).astype(np.float32)
    p = reference(row, **settings)
    logits = mx.array(np.repeat(row[None], n, axis=0))
    u = mx.array(((np.arange(n) + 0.5) / n).astype(np.float32))
    tokens = np.array(K.sample(logits, u, **settings))
    assert tokens.dtype == np.uint32
    counts = np.bincount(tokens, minlength=vocab)
    assert np.all(counts[p == 0] == 0)
    assert np.abs(counts - n * p).max() <= 1.0 + 1e-6 * n


def test_make_sampler_takes_the_kernel_on_the_cpu_backend_and_mlx_ops_without(monkeypatch):
    calls = []
    real = backends.sample

    def counted(*a, **k):
        token = real(*a, **k)
        calls.append(token is not None)
        return token

    monkeypatch.setattr(backends, "sample", counted)
    logits = mx.array(np.random.default_rng(1).standard_normal((1, 3000)).astype(np.float32))
    kept = reference(np.array(logits[0]), temperature=0.7, top_p=0.8) > 0
    first = [int(make_sampler(0.7, top_p=0.8, seed=5)(logits)[0]) for _ in range(3)]
    assert len(set(first)) == 1 and kept[first[0]]  # seeded: the same draw each time
    sampler = make_sampler(0.7, top_p=0.8, seed=5)
    drawn = {int(sampler(logits)[0]) for _ in range(50)}
    assert all(kept[t] for t in drawn) and len(drawn) > 1
    assert calls and all(calls)
    calls.clear()
    monkeypatch.setenv(backends.ENV, "0")  # the plain MLX path: categorical over the filter
    drawn = {int(make_sampler(0.7, top_p=0.8, seed=s)(logits)[0]) for s in range(30)}
    assert all(kept[t] for t in drawn)
    assert calls and not any(calls)


def test_bad_settings_are_one_line_value_errors():
    x, u = mx.zeros((2, 8)), mx.zeros((2,))
    with pytest.raises(ValueError, match=r"\[mlxinfer sample\] temperature: expected a finite"):
        K.sample(x, u, temperature=0.0)
    with pytest.raises(ValueError, match=r"top_k/top_p/min_p: expected"):
        K.sample(x, u, top_p=0.0)
    with pytest.raises(ValueError, match=r"u: expected 2 float32 uniform numbers"):
        K.sample(x, mx.zeros((3,)))
    with pytest.raises(ValueError, match=r"logits: expected a \(B, V\) float array"):
        K.sample(mx.zeros((8,)), u)
