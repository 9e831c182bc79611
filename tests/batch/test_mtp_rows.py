"""MTP rows in the batching engine: each row's head has a cache of its own, fed the row's final
hidden states by the engine's prefill and verification forwards (tiny random MiMo, Qwen3-Next
checkpoints built with transformers; no real MTP weights can be had here)."""

import time

import pytest
from mtp_models import QWEN3_NEXT, make_mimo, make_qwen_mtp

from mlxinfer.batch import Engine, verification
from mlxinfer.batch import rows as rows_mod
from mlxinfer.generation import generate_step
from mlxinfer.generation.drafts import PromptLookup
from mlxinfer.generation.mtp_drafts import MTP
from mlxinfer.generation.sampling import SamplingParams
from mlxinfer.loading.loader import load_model

PROMPTS = [
    [5, 17, 33, 2, 99, 120, 7, 64, 3, 11, 42, 8],
    [9, 9, 120, 4, 61],
    [200, 3, 3, 3, 3, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34],
]


@pytest.fixture(scope="module")
def wired(tmp_path_factory):
    path, _, _ = make_mimo(
        tmp_path_factory.mktemp("mtp") / "wired", num_hidden_layers=1, wired=0.0, seed=2
    )
    return load_model(path)[0]


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    path, _, _ = make_mimo(
        tmp_path_factory.mktemp("mtp") / "noisy", num_hidden_layers=1, wired=0.6, seed=1
    )
    return load_model(path)[0]


def alone(model, ids, n):
    return [t for t, _ in generate_step(ids, model, max_tokens=n)]


def in_batch(model, drafts, n=16, **submit):
    """Each prompt's steps, all submitted to one engine (``drafts[i]``: prompt i's draft)."""
    with Engine(model, max_batch=4) as engine:
        handles = [
            engine.submit(ids, max_tokens=n, draft=d, **submit) for ids, d in zip(PROMPTS, drafts)
        ]
        return [list(h.steps()) for h in handles]


@pytest.mark.parametrize("fixture", ["wired", "noisy"])
def test_greedy_mtp_rows_beside_plain_and_lookup_rows_equal_alone(request, fixture):
    model = request.getfixturevalue(fixture)
    out = in_batch(model, [MTP(), None, PromptLookup()])
    for ids, steps in zip(PROMPTS, out):
        assert [s[0] for s in steps] == alone(model, ids, 16)
    drafted, accepted = sum(s[4] for s in out[0]), sum(s[5] for s in out[0])
    assert drafted > 0
    if fixture == "wired":  # a head that predicts the trunk: most drafts pass in the batch too
        assert accepted / drafted > 0.9


def test_every_row_drafting_with_mtp(noisy):
    out = in_batch(noisy, [MTP(), MTP(), MTP()], num_draft=2)
    for ids, steps in zip(PROMPTS, out):
        assert [s[0] for s in steps] == alone(noisy, ids, 16)
        assert sum(s[4] for s in steps) > 0


def test_seeded_sampling_is_the_same_alone_and_in_the_batch(noisy):
    """A row reads only its own logits and key: with a seed, the tokens a MTP row samples in
    the batch are those it samples alone in the engine."""
    sampling = SamplingParams(temperature=0.8, seed=7)
    with Engine(noisy, max_batch=4) as engine:
        solo = list(
            engine.submit(PROMPTS[0], max_tokens=12, sampling=sampling, draft=MTP()).steps()
        )
    with Engine(noisy, max_batch=4) as engine:
        handles = [
            engine.submit(PROMPTS[0], max_tokens=12, sampling=sampling, draft=MTP()),
            engine.submit(PROMPTS[1], max_tokens=12),
        ]
        together = [list(h.steps()) for h in handles][0]
    assert [s[0] for s in together] == [s[0] for s in solo]


def test_hybrid_mtp_rows_equal_alone(tmp_path):
    path, _, _ = make_qwen_mtp(tmp_path / "qwen3_next", QWEN3_NEXT)
    model = load_model(path)[0]
    out = in_batch(model, [MTP(), None, MTP()], n=10)
    for ids, steps in zip(PROMPTS, out):
        assert [s[0] for s in steps] == alone(model, ids, 10)
    assert sum(s[4] for s in out[0]) > 0  # its recurrent layers refed after each rejection


class _Time:
    """A fake ``time`` for verification.py: it moves only by what the test adds (a forward of the
    model, a drafted token)."""

    def __init__(self):
        self.t = 0.0

    def perf_counter(self):
        return self.t


@pytest.mark.parametrize("ms", [0.0, 50.0])
def test_rows_k_follows_the_engines_measured_costs(wired, monkeypatch, ms):
    """The engine times its verification steps (by batch size) and the drafting rows' k reads
    them: a plain step first (what drafting must beat), then one drafting step of one token (the
    cheapest that times a draft and a longer verification). A forward costs 1 ms whatever its
    length (a GPU's flat verification): drafting free, a well-predicting head drafts deeper
    than 4; 50 ms a draft token, drafting goes off, and since not even drafts that always pass
    would pay, probes wait the longest interval (none in 40 tokens). The output is plain
    greedy's either way, and each step's first token carries its draft and verify time."""
    clock = _Time()
    propose = rows_mod.propose
    cls = type(wired)
    forward, trunk = cls.__call__, cls.trunk

    def timed_propose(rows, max_draft):
        proposals, forwards = propose(rows, max_draft)
        clock.t += ms * 1e-3 * sum(len(p.tokens) for p in proposals)
        return proposals, forwards

    def timed(f):
        def g(*args, **kwargs):
            clock.t += 1e-3
            return f(*args, **kwargs)

        return g

    monkeypatch.setattr(cls, "__call__", timed(forward))
    monkeypatch.setattr(cls, "trunk", timed(trunk))
    monkeypatch.setattr(verification, "time", clock)
    monkeypatch.setattr(rows_mod, "propose", timed_propose)
    wired.__dict__.pop("_batch_step_costs", None)  # the engines' costs live on the model
    try:
        out = in_batch(wired, [MTP(), None], n=40)
    finally:
        wired.__dict__.pop("_batch_step_costs", None)  # measured on the fake clock
    for ids, steps in zip(PROMPTS, out):
        assert [s[0] for s in steps] == alone(wired, ids, 40)
    drafted = [s.drafted for s in out[0] if s.passes]
    # The batch size's costs have no plain step timed: the row's first step is a plain one.
    assert drafted[0] == 0
    drafted = drafted[1:]
    assert drafted[0] == 1
    if ms:
        assert drafted[1:] == [0] * (len(drafted) - 1)
    else:
        assert max(drafted) > 4
    assert all(s.verify_s > 0 for s in out[0] if s.passes)
    assert time.perf_counter() > 0  # the real clock untouched
