"""The batching engine's side of micro-batched decode (mlxinfer/batch/flights.py), in one process.

Across pipeline ranks a flight of rows formed at one tick writes its keys on rank r at tick
t + r and lands (its logits sampled) at the last rank's tick. ``LateFlights`` reproduces that
timing in one process with the whole model: a flight's forward (its keys' writes and its logits)
runs only when it lands, a tick after its forming, as on the last of two ranks. The references
are one process's plain decoding (``generate_step``, which the suite holds to transformers).
The two-rank runs are tests/distributed/test_distributed_batch.py's and test_distributed_serve.py's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hf_models import make_tiny
from test_batch import FAMILIES, LONG, _prompt

from mlxinfer.batch import Engine
from mlxinfer.distributed.micro import Flight
from mlxinfer.generation import generate_step
from mlxinfer.loading.loader import load_model


class LateFlights:
    """Two stages' bookkeeping: a flight lands a tick after its forming, and only then are its
    keys written and its logits computed (the last rank's blocks)."""

    size = 2
    flight = Flight

    def __init__(self, model) -> None:
        self.model = model
        self.stages: list[Flight | None] = [None, None]
        self.ticks = self.most_rows = self.widest = 0

    def flying(self) -> list[Flight]:
        return [f for f in self.stages[:-1] if f is not None]

    def tick(self, new: Flight | None):
        self.stages = [new, self.stages[0]]
        self.ticks += 1
        landing = self.stages[1]
        if landing is None:
            return None
        self.most_rows = max(self.most_rows, len(landing.rows))
        self.widest = max(self.widest, landing.tokens.shape[1])
        logits = self.model(landing.tokens, landing.views)
        mx.eval(logits, [c.state for c in landing.views])
        return landing, logits


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("llama"), **LONG)
    return load_model(path)[0]


def _engine(model, **options) -> Engine:
    engine = Engine(model, **options)
    engine.flights.micro = LateFlights(model)  # before any request: the loop reads it at decode
    return engine


def _alone(model, prompt, n):
    return [(t, np.array(lp)) for t, lp in generate_step(prompt, model, max_tokens=n)]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """Sliding layers (window 6) beside full ones: a window pool, whose blocks a row gives back
    as its window moves on (at a flight's forming)."""
    config = {**LONG, **FAMILIES["gemma2"]}
    path, _ = make_tiny(tmp_path_factory.mktemp("gemma2"), perturb_vectors=True, **config)
    return load_model(path)[0]


@pytest.mark.parametrize("name", ["model", "gemma2"])
def test_rows_in_flights_decode_as_alone(name, request):
    """Prompts of mixed lengths, decoded in flights of about half the rows each: every row's
    tokens and log-probs are its plain decoding's."""
    model = request.getfixturevalue(name)
    prompts = [_prompt(n, 40 + n) for n in (5, 9, 33, 70, 2)]
    with _engine(model, block_size=8, prefill_step=32) as engine:
        assert (engine.window_pool is not None) == (name == "gemma2")
        with engine._cond:  # every request in the engine's first turn
            handles = [engine.submit(p, max_tokens=6) for p in prompts]
        got = [list(h.steps()) for h in handles]
        assert engine.stats().blocks_in_use == 0
        flights = engine.flights.micro
    assert flights.ticks > 6 and 2 <= flights.most_rows <= 3
    for prompt, steps in zip(prompts, got):
        alone = _alone(model, prompt, 6)
        assert [s.token for s in steps] == [t for t, _ in alone]
        for s, (_, lp) in zip(steps, alone):
            np.testing.assert_allclose(np.array(s.logprobs), lp, atol=1e-4)


def test_rows_drafting_by_prompt_lookup_verify_in_flights(model):
    """Rows drafting by prompt lookup beside a plain row: their flights feed their drafts, the
    acceptance (and the rewind of the rejected ones) at the landing; greedy, every row's
    tokens and log-probs are its plain decoding's, and drafts are kept."""
    from mlxinfer.generation.drafts import PromptLookup

    loop = _prompt(12, 7)
    prompts = [loop * 4, _prompt(30, 8) * 2, _prompt(9, 9), loop * 3 + _prompt(5, 1)]
    with _engine(model, block_size=8) as engine:
        with engine._cond:
            handles = [
                engine.submit(p, max_tokens=10, draft=None if i == 2 else PromptLookup())
                for i, p in enumerate(prompts)
            ]
        got = [list(h.steps()) for h in handles]
        assert engine.stats().blocks_in_use == 0
        assert engine.flights.micro.widest > 1 and engine.accepted_tokens > 0
    for prompt, steps in zip(prompts, got):
        alone = _alone(model, prompt, 10)
        assert [s.token for s in steps] == [t for t, _ in alone]
        for s, (_, lp) in zip(steps, alone):
            np.testing.assert_allclose(np.array(s.logprobs), lp, atol=1e-4)


class CancelAt:
    """A logits processor that cancels another request when its own row reaches ``length``
    tokens (prompt and generated): in the engine's thread, at a known point of the turns."""

    def __init__(self, length: int) -> None:
        self.length, self.target = length, None

    def __call__(self, history, logits):
        if self.target is not None and history.size >= self.length:
            self.target.cancel()
        return logits


def test_a_row_cancelled_in_flight_keeps_its_blocks_until_it_lands(model):
    """Rows 0 and 1 fly in turn; row 0's sampling cancels row 1 while row 1 flies. Its blocks
    must stay its own until its flight lands and writes its keys: given back at once, the long
    prompt still prefilling takes the first of them, and the landing overwrites its keys."""
    cancel = CancelAt(5 + 2)
    short = [_prompt(5, 1), _prompt(5, 2)]
    long = _prompt(200, 3)
    with _engine(model, prefill_step=16) as engine:
        with engine._cond:
            first = engine.submit(short[0], max_tokens=12, logits_processors=[cancel])
            second = engine.submit(short[1], max_tokens=12)
            cancel.target = second
            third = engine.submit(long, max_tokens=4)
        got = [list(h.steps()) for h in (first, second, third)]
        assert engine.stats().blocks_in_use == 0
    assert [s.token for s in got[0]] == [t for t, _ in _alone(model, short[0], 12)]
    seconds = [t for t, _ in _alone(model, short[1], 12)]
    assert 1 <= len(got[1]) < 12 and [s.token for s in got[1]] == seconds[: len(got[1])]
    for s, (t, lp) in zip(got[2], _alone(model, long, 4)):
        assert s.token == t
        np.testing.assert_allclose(np.array(s.logprobs), lp, atol=1e-4)


def test_a_block_filled_in_flight_reaches_the_disk_tier_with_its_keys(model, tmp_path):
    """A block whose last position a flight feeds is hashed (shareable, saved to disk) only
    once the flight has landed: a restart that reads it back answers as plain decoding."""
    prompt = _prompt(14, 5)  # positions 14 and 15 (the first block's last) fed by flights
    with _engine(model, prefix_cache_dir=tmp_path, block_size=16) as engine:
        with engine._cond:
            handles = [engine.submit(p, max_tokens=4) for p in (prompt, _prompt(9, 6))]
        made = [s.token for s in handles[0].steps()]
        list(handles[1].steps())
    again = prompt + made[:2] + [7]  # the first block (read from disk), then one more token
    with Engine(model, prefix_cache_dir=tmp_path, block_size=16) as engine:
        handle = engine.submit(again, max_tokens=3)
        steps = list(handle.steps())
        assert handle.cached_tokens == 16
    for s, (t, lp) in zip(steps, _alone(model, again, 3)):
        assert s.token == t
        np.testing.assert_allclose(np.array(s.logprobs), lp, atol=1e-4)


def test_rows_drafting_with_a_draft_model_verify_in_flights(model):
    """Rows drafting with a draft model (here the model itself, whose drafts the target keeps)
    beside a plain row: the draft pool proposes for a flight's rows at its forming and rewinds
    at its landing; greedy, every row's tokens and log-probs are its plain decoding's."""
    from mlxinfer.generation.drafts import DraftModel

    draft = DraftModel(model)
    prompts = [_prompt(n, 60 + n) for n in (7, 20, 3, 41)]
    runs = []
    for flights in (True, False):
        engine = _engine(model, block_size=8) if flights else Engine(model, block_size=8)
        with engine:
            with engine._cond:
                # A fixed k: an adaptive one follows each engine's timings (draft_length.py).
                handles = [
                    engine.submit(p, max_tokens=10, draft=None if i == 2 else draft, **fixed)
                    for i, p in enumerate(prompts)
                    for fixed in [{} if i == 2 else {"num_draft": 4}]
                ]
            runs.append([list(h.steps()) for h in handles])
            assert engine.stats().blocks_in_use == 0 and engine.accepted_tokens > 0
            assert not flights or engine.flights.micro.widest > 1
    got, plain = runs
    # Each row's drafts depend on its own tokens alone: the same kept, in flights or not.
    assert [[s.from_draft for s in r] for r in got] == [[s.from_draft for s in r] for r in plain]
    for prompt, steps in zip(prompts, got):
        alone = _alone(model, prompt, 10)
        assert [s.token for s in steps] == [t for t, _ in alone]
        for s, (_, lp) in zip(steps, alone):
            np.testing.assert_allclose(np.array(s.logprobs), lp, atol=1e-4)
