"""Speculative decoding over a hybrid trunk (Qwen3-Next: Gated DeltaNet layers) without the
refeed: the verification pass keeps each position's recurrent state, so a rejected draft goes
back to the state at the last token kept with no other forward (tiny random checkpoint built
with transformers, with its MTP head; no real weights can be had here)."""

import mlx.core as mx
import numpy as np
import pytest
from mtp_models import QWEN3_NEXT, make_qwen_mtp

from mlxinfer.batch import Engine, recurrent
from mlxinfer.cache.prompt import PromptCache
from mlxinfer.cache.state import StateCache
from mlxinfer.generation import generate_step
from mlxinfer.generation.drafts import PromptLookup
from mlxinfer.generation.mtp_drafts import MTP
from mlxinfer.generation.prefill import prefill
from mlxinfer.generation.speculative import speculative_generate_step
from mlxinfer.loading.loader import load_model
from mlxinfer.models.layers import gated_delta

PROMPT = [5, 17, 33, 2, 99, 120, 7, 64, 3, 11, 42, 8, 5, 17, 33]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _, _ = make_qwen_mtp(tmp_path_factory.mktemp("hybrid") / "qwen3_next", QWEN3_NEXT)
    return load_model(path)[0]


def plain(model, n):
    return [t for t, _ in generate_step(PROMPT, model, max_tokens=n)]


def count_forwards(monkeypatch) -> list[int]:
    """Calls of the first Gated DeltaNet layer (one per trunk forward), counted."""
    calls = [0]
    call = gated_delta.GatedDeltaNet.__call__

    def counted(self, x, cache):
        calls[0] += getattr(self, "_first", False)
        return call(self, x, cache)

    monkeypatch.setattr(gated_delta.GatedDeltaNet, "__call__", counted)
    return calls


def first_linear(model):
    return next(m for _, m in model.named_modules() if isinstance(m, gated_delta.GatedDeltaNet))


@pytest.mark.parametrize("draft", [MTP, PromptLookup])
@pytest.mark.parametrize("refeed", [False, True])
def test_greedy_equals_plain_with_one_forward_a_step(model, monkeypatch, draft, refeed):
    """Greedy with a draft equals plain greedy; each step is one trunk forward, rejections
    included, where the refeed (a layer that keeps no states by position) takes a second."""
    first_linear(model)._first = True
    calls = count_forwards(monkeypatch)
    if refeed:  # as before: no state by position, so restore and feed the kept tokens again
        monkeypatch.setattr(StateCache, "can_rewind_within", lambda self, n: n == self.offset)
    try:
        pc = PromptCache(model.make_cache())
        steps = list(
            speculative_generate_step(
                PROMPT, model, draft(), prompt_cache=pc, max_tokens=24, num_draft=3
            )
        )
    finally:
        first_linear(model)._first = False
    assert [s.token for s in steps] == plain(model, 24)
    passes = sum(s.passes for s in steps)
    rejected = sum(1 for s in steps if s.passes and s.accepted < s.drafted)
    assert rejected > 0 and passes > 0
    prefill_chunks = 1
    extra = calls[0] - prefill_chunks - passes
    assert extra == (rejected if refeed else 0)
    # The caches end as a plain run's over the same tokens (recurrent states within 1e-5).
    ref = PromptCache(model.make_cache())
    prefill(model, ref, pc.tokens)
    for c, r in zip(pc.cache, ref.cache):
        for a, b in zip(c.state, r.state):
            assert np.allclose(np.array(a), np.array(b), atol=1e-5)


def test_state_after_a_rejection_equals_a_plain_runs(model):
    """Verify [y, d1, d2, d3] in one pass, keep y and d1: each recurrent state is that of a plain
    run fed the same tokens one at a time (decode steps), within 1e-5."""
    tokens = [7, 64, 3, 11]
    pc = PromptCache(model.make_cache())
    prefill(model, pc, PROMPT)
    for c in pc.cache:
        if isinstance(c, StateCache):
            c.recording = True
    model(mx.array([tokens]), pc.cache)
    states = [c for c in pc.cache if isinstance(c, StateCache)]
    n = len(PROMPT) + 2
    assert all(c.can_rewind_within(n) for c in states)
    for c in states:
        c.rewind_within(n)
    ref = PromptCache(model.make_cache())
    prefill(model, ref, PROMPT)
    for t in tokens[:2]:
        model(mx.array([[t]]), ref.cache)
    refs = [c for c in ref.cache if isinstance(c, StateCache)]
    for c, r in zip(states, refs):
        assert c.offset == r.offset == n
        for a, b in zip(c.state, r.state):
            assert np.allclose(np.array(a), np.array(b), atol=1e-5)
    assert not states[0].can_rewind_within(n - 1)  # only within the last pass


def test_hybrid_rows_take_recorded_states_in_the_batch(model, monkeypatch):
    """In the batching engine too: MTP and prompt-lookup rows over the hybrid trunk equal plain
    greedy, and after a rejection no row is fed again (no forward beyond the steps)."""
    refed: list[int] = []
    original = recurrent.RecurrentRows.refeed_states

    def spy(self, rows, drafts, saved, starts, kept, L):
        forward = type(self.model).__call__
        count = [0]

        def counting(m, *args, **kwargs):
            count[0] += 1
            return forward(m, *args, **kwargs)

        monkeypatch.setattr(type(self.model), "__call__", counting)
        original(self, rows, drafts, saved, starts, kept, L)
        monkeypatch.setattr(type(self.model), "__call__", forward)
        refed.append(count[0])

    monkeypatch.setattr(recurrent.RecurrentRows, "refeed_states", spy)
    prompts = [PROMPT, PROMPT[3:]]
    with Engine(model, max_batch=4) as engine:
        handles = [
            engine.submit(p, max_tokens=16, draft=d, num_draft=3)
            for p, d in zip(prompts, [MTP(), PromptLookup()])
        ]
        out = [list(h.steps()) for h in handles]
    for p, steps in zip(prompts, out):
        assert [s.token for s in steps] == [t for t, _ in generate_step(p, model, max_tokens=16)]
    assert any(s.passes and s.accepted < s.drafted for steps in out for s in steps)
    assert refed and not any(refed)
