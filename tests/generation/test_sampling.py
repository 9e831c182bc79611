"""Samplers: exact filtered distributions (derived by hand), seeds, penalties."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxinfer.generation.sampling import filtered_logprobs, make_repetition_penalty, make_sampler

P = np.array([0.4, 0.3, 0.15, 0.1, 0.05])  # a known distribution
LOGP = mx.array(np.log(P)[None], dtype=mx.float32)


def probs(**kw):
    return np.exp(np.array(filtered_logprobs(LOGP, **kw)[0]))


def test_no_filter_is_identity():
    assert np.allclose(probs(), P, atol=1e-6)


def test_temperature_sharpens_by_power():
    expected = P**2 / (P**2).sum()  # T = 0.5 → p^(1/T), renormalised
    assert np.allclose(probs(temperature=0.5), expected, atol=1e-6)


def test_top_k_keeps_k_largest():
    assert np.allclose(probs(top_k=2), [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0], atol=1e-6)


def test_top_p_keeps_smallest_set_reaching_p():
    # 0.4 + 0.3 = 0.7 < 0.75, so the third token (mass before it 0.7 < 0.75) stays too.
    assert np.allclose(probs(top_p=0.75), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0], atol=1e-6)
    assert np.allclose(probs(top_p=0.4), [1, 0, 0, 0, 0], atol=1e-6)


def test_min_p_drops_below_fraction_of_max():
    # min_p 0.3 → threshold 0.12: keeps 0.4, 0.3, 0.15
    assert np.allclose(probs(min_p=0.3), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0], atol=1e-6)


def test_filters_compose_in_order():
    # top_k=4 → [.4,.3,.15,.1]/.95; then top_p=0.8: masses before: 0, .42, .74, .89 → keep 3.
    assert np.allclose(
        probs(top_k=4, top_p=0.8), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0], atol=1e-6
    )


def test_greedy_is_argmax():
    assert make_sampler(0.0)(LOGP).item() == 0


def test_seeded_sampler_is_reproducible_and_matches_distribution():
    a, b = make_sampler(1.0, seed=7), make_sampler(1.0, seed=7)
    draws_a = [a(LOGP).item() for _ in range(50)]
    assert draws_a == [b(LOGP).item() for _ in range(50)]
    s = make_sampler(1.0, seed=1)
    counts = np.bincount([s(LOGP).item() for _ in range(3000)], minlength=5)
    # Chi-square goodness of fit, 4 dof: 99.9% critical value 18.47.
    chi2 = (((counts - 3000 * P) ** 2) / (3000 * P)).sum()
    assert chi2 < 18.47


def test_top_k_sampler_never_draws_filtered_token():
    s = make_sampler(1.0, top_k=2, seed=3)
    assert {s(LOGP).item() for _ in range(200)} <= {0, 1}


def test_repetition_penalty_follows_transformers_rule():
    logits = mx.array([[2.0, -2.0, 1.0, 0.5]])
    out = make_repetition_penalty(2.0)(mx.array([0, 1, 1]), logits)
    assert np.allclose(np.array(out), [[1.0, -4.0, 1.0, 0.5]])


def test_repetition_penalty_matches_transformers_processor():
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 50)).astype(np.float32)
    seen = [3, 7, 7, 20, 49]
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), torch.tensor(logits)).numpy()
    ours = np.array(make_repetition_penalty(1.3)(mx.array(seen), mx.array(logits)))
    assert np.allclose(ours, ref, atol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-1),
        dict(temperature=float("nan")),  # the CPU kernel's own check caught it, not ours
        dict(temperature=float("inf")),
        dict(temperature=1, top_p=float("nan")),
        dict(temperature=1, top_p=0),
        dict(temperature=1, min_p=1.5),
        dict(temperature=1, top_k=-1),
    ],
)
def test_bad_settings_raise(kw):
    with pytest.raises(ValueError, match=r"^(temperature|top_p|min_p|top_k) must be"):
        make_sampler(**kw)


def test_top_p_matches_transformers_warper():
    import torch
    from transformers import TopPLogitsWarper

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(1, 100)).astype(np.float32) * 3
    ref = TopPLogitsWarper(0.9)(None, torch.tensor(logits)).numpy()
    ours = np.array(filtered_logprobs(mx.array(logits), top_p=0.9))
    assert np.array_equal(np.isfinite(ours), np.isfinite(ref))
    assert math.isclose(np.exp(ours[np.isfinite(ours)]).sum(), 1.0, rel_tol=1e-5)
