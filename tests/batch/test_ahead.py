"""Plain decode steps queued ahead of their tokens' landing (mlxinfer/batch/ahead.py).

The engine builds step n + 1 from step n's sampled tokens as device arrays before it reads
them. The references are one process's plain decoding (``generate_step``, which the suite holds
to transformers): every row's tokens and log-probs must be its own alone, whichever step its EOS
lands in, whoever joins or leaves, and the pool must end as it would have: every block given
back, and the finished rows' full blocks named by their real tokens (a later prompt that
continues one hits them), never by the placeholders fed ahead of them.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hf_models import make_tiny
from test_batch import FAMILIES, LONG, _prompt

from mlxinfer import SamplingParams
from mlxinfer.batch import Engine, ahead
from mlxinfer.generation import generate_step
from mlxinfer.loading.loader import load_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("llama"), **LONG)
    return load_model(path)[0]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """Sliding layers (window 6) beside full ones: the window pool records the fed tokens too."""
    config = {**LONG, **FAMILIES["gemma2"]}
    path, _ = make_tiny(tmp_path_factory.mktemp("gemma2"), perturb_vectors=True, **config)
    return load_model(path)[0]


def _alone(model, prompt, n, **options):
    return [(t, np.array(lp)) for t, lp in generate_step(prompt, model, max_tokens=n, **options)]


class Spy:
    """Counts the steps queued ahead and the plain steps run in turn."""

    def __init__(self, engine: Engine, monkeypatch) -> None:
        self.ahead = self.plain = 0
        queue, decode_rows = engine.ahead._queue, engine._decode_rows  # (the engine's scheduler)

        def counted_queue(*args):
            self.ahead += 1
            return queue(*args)

        def counted_rows(*args):
            self.plain += 1
            return decode_rows(*args)

        monkeypatch.setattr(engine.ahead, "_queue", counted_queue)
        monkeypatch.setattr(engine, "_decode_rows", counted_rows)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_rows_ending_at_eos_in_any_step_decode_as_alone(name, request, monkeypatch):
    """Five rows, each given as EOS the token its plain decoding draws at a different step, so
    that each ends while its next step is already queued: every row's tokens up to that EOS and
    its log-probs are its plain decoding's, every block comes back, and a prompt continuing a
    finished row (its prompt and what it generated) hits that row's full blocks and decodes as
    alone."""
    model = request.getfixturevalue(name)
    prompts = [_prompt(n, 50 + n) for n in (5, 9, 17, 30, 2)]
    alone = [_alone(model, p, 12) for p in prompts]
    ends, eos = [], []
    for i, steps in enumerate(alone):  # the first step (from the 3rd on) drawing a new token
        tokens = [t for t, _ in steps]
        k = next((j for j in range(2 + i, len(tokens)) if tokens[j] not in tokens[:j]), None)
        ends.append(len(tokens) - 1 if k is None else k)  # none: it runs to max_tokens
        eos.append(frozenset() if k is None else frozenset({tokens[k]}))
    assert sum(map(bool, eos)) >= 3
    with Engine(model, block_size=4, prefill_step=64) as engine:
        spy = Spy(engine, monkeypatch)
        with engine._cond:  # every request in the engine's first turn
            handles = [engine.submit(p, max_tokens=12, eos=e) for p, e in zip(prompts, eos)]
        got = [list(h.steps()) for h in handles]
        assert engine.stats().blocks_in_use == 0
        assert spy.ahead > 6 and spy.plain == 0
        # The step queued for the last row's EOS is waited for, not left running (an exit
        # meanwhile can hang in OpenBLAS's shutdown, docs/blas.md): nothing stays queued.
        deadline = time.monotonic() + 5
        while engine.ahead.queued is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.ahead.queued is None
        for steps, reference, k in zip(got, alone, ends):
            assert [s.token for s in steps] == [t for t, _ in reference[: k + 1]]
            for s, (_, lp) in zip(steps, reference):
                np.testing.assert_allclose(np.array(s.logprobs), lp, atol=1e-4)
        # row 3 (30 prompt tokens) fed a placeholder ahead of each of its tokens
        follow = prompts[3] + [s.token for s in got[3]]
        hits = engine.stats().prefix_hits
        steps = list(engine.submit(follow, max_tokens=5).steps())
        assert engine.stats().prefix_hits > hits
    assert [s.token for s in steps] == [t for t, _ in _alone(model, follow, 5)]


def test_a_row_cancelled_while_its_step_flies_gives_every_block_back(llama):
    """One row's consumer cancels it after three tokens while the others decode on: its blocks
    come back, and the others' tokens are their plain decoding's. (It may draw 400: the engine
    never runs that far before the cancel lands.)"""
    prompts = [_prompt(n, 70 + n) for n in (6, 13, 21)]
    with Engine(llama, block_size=4) as engine:
        with engine._cond:
            handles = [
                engine.submit(p, max_tokens=400 if i == 1 else 20) for i, p in enumerate(prompts)
            ]
        seen = []
        for s in handles[1].steps():
            seen.append(s.token)
            if len(seen) == 3:
                handles[1].cancel()
        got = [[s.token for s in h.steps()] for h in (handles[0], handles[2])]
        assert engine.stats().blocks_in_use == 0
    assert 3 <= len(seen) < 400
    assert seen == [t for t, _ in _alone(llama, prompts[1], len(seen))]
    for p, tokens in zip((prompts[0], prompts[2]), got):
        assert tokens == [t for t, _ in _alone(llama, p, 20)]


def test_a_row_with_processors_runs_its_steps_in_turn_beside_the_ones_ahead(llama, monkeypatch):
    """A row with a logits processor (which reads each token before the next step) joins rows
    decoding ahead: what flies lands, the steps run in turn while it decodes, and ahead again
    after it leaves; seeded sampled rows draw their plain decoding's tokens throughout."""

    def ban(history, logits):  # never the token 7: a processor that changes the tokens
        return logits.at[:, 7].add(-1e9)

    sampling = SamplingParams(temperature=0.9, seed=11)
    long_ = _prompt(40, 3)
    with Engine(llama, block_size=4, prefill_step=8) as engine:
        spy = Spy(engine, monkeypatch)
        with engine._cond:
            plain = engine.submit(_prompt(7, 1), max_tokens=30, sampling=sampling)
            greedy = engine.submit(_prompt(11, 2), max_tokens=30)
        processed = engine.submit(long_, max_tokens=6, logits_processors=[ban])
        got = [[s.token for s in h.steps()] for h in (plain, greedy, processed)]
        assert engine.stats().blocks_in_use == 0
    assert spy.ahead > 3 and spy.plain > 3
    assert got[0] == [t for t, _ in _alone(llama, _prompt(7, 1), 30, sampler=sampling.sampler())]
    assert got[1] == [t for t, _ in _alone(llama, _prompt(11, 2), 30)]
    assert got[2] == [t for t, _ in _alone(llama, long_, 6, logits_processors=[ban])]


def test_off_runs_every_step_in_turn(llama, monkeypatch):
    """``ahead.ON = False`` (read when an engine is made): no step goes ahead."""
    monkeypatch.setattr(ahead, "ON", False)
    with Engine(llama) as engine:
        assert engine.ahead is None
        steps = [s.token for s in engine.submit(_prompt(9, 4), max_tokens=8).steps()]
    assert steps == [t for t, _ in _alone(llama, _prompt(9, 4), 8)]
