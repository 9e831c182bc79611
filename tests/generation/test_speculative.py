"""Speculative decoding: exact for greedy, the target's distribution when sampling.

Tiny random models give breadth (draft sources, always-right and always-wrong
drafts, caches after rewind, stream semantics, a chi-square test of the
sampled distribution that a wrong acceptance rule fails); the real SmolLM2
gives the truth that matters (token-identical greedy output for each source).
"""

import itertools
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from hf_models import add_tokenizer, make_tiny
from mlx.utils import tree_map

from mlxinfer import load, stream_generate
from mlxinfer.cache.prompt import PromptCache
from mlxinfer.cli.main import cli
from mlxinfer.errors import DraftError
from mlxinfer.generation import draft_length, generate_step, speculative
from mlxinfer.generation.draft_length import DraftLength, StepCosts
from mlxinfer.generation.drafts import DraftModel, PromptLookup, SelfDraft
from mlxinfer.generation.sampling import filtered_logprobs, make_repetition_penalty, make_sampler
from mlxinfer.generation.speculative import speculative_generate_step

# Repeats, so prompt lookup finds matches; ids only (no tokenizer in the token loop).
PROMPT = [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 20, 21, 11, 12]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny(
        tmp_path_factory.mktemp("spec") / "tiny",
        vocab_size=320,
        num_hidden_layers=4,
        hidden_size=128,
        max_position_embeddings=512,
    )
    add_tokenizer(path)
    model, tokenizer = load(path)
    return path, model, tokenizer


def variant(path, fn):
    """The checkpoint at ``path`` with ``fn`` applied to every weight (a draft with known behaviour)."""
    model, _ = load(path)
    model.update(tree_map(fn, model.parameters()))
    return model


@pytest.fixture(scope="module")
def drafts(tiny):
    path, model, _ = tiny
    rng = np.random.default_rng(0)
    # Its LM head negated: the draft proposes the target's least likely token, never its argmax.
    wrong = load(path)[0]
    wrong.lm_head.weight = -model.lm_head.weight
    noisy = variant(path, lambda w: w + mx.array(rng.normal(0, 0.04, w.shape), w.dtype))
    return {
        "right": DraftModel(model),
        "wrong": DraftModel(wrong),
        "noisy": DraftModel(noisy),
        "lookup": PromptLookup(),
        "self-1": SelfDraft(1),
        "self-3": SelfDraft(3),
    }


def plain(model, prompt, n, **kw):
    return [(t, lp) for t, lp in generate_step(prompt, model, max_tokens=n, **kw)]


# --- Greedy: token-identical to plain decoding --------------------------------------------------


@pytest.mark.parametrize("source", ["right", "wrong", "noisy", "lookup", "self-1", "self-3"])
@pytest.mark.parametrize("num_draft", [None, 1, 4])
def test_greedy_equals_plain_greedy(tiny, drafts, source, num_draft):
    _, model, _ = tiny
    ref = plain(model, PROMPT, 40)
    out = list(
        speculative_generate_step(PROMPT, model, drafts[source], max_tokens=40, num_draft=num_draft)
    )
    assert [t for t, *_ in out] == [t for t, _ in ref]
    # The log-probs yielded are the target's at that position, as in plain decoding.
    for step, (_, ref_lp) in zip(out, ref):
        assert np.allclose(np.array(step.logprobs), np.array(ref_lp), atol=1e-4)


def test_always_right_draft_is_always_accepted(tiny, drafts):
    _, model, _ = tiny
    out = list(
        speculative_generate_step(PROMPT, model, drafts["right"], max_tokens=40, num_draft=3)
    )
    # Every step: 3 accepted drafts, then the target's extra (bonus) token; 40 = 10 steps of 4.
    assert [s.from_draft for s in out] == [True, True, True, False] * 10
    # Each pass's counts travel with its first token: 10 passes, 3 drafted and 3 kept in each.
    assert [(s.passes, s.drafted, s.accepted) for s in out] == [
        (1, 3, 3),
        (0, 0, 0),
        (0, 0, 0),
        (0, 0, 0),
    ] * 10


def test_always_wrong_draft_is_never_accepted(tiny, drafts):
    _, model, _ = tiny
    out = list(
        speculative_generate_step(PROMPT, model, drafts["wrong"], max_tokens=30, num_draft=4)
    )
    assert not any(s.from_draft for s in out)
    assert [t for t, *_ in out] == [t for t, _ in plain(model, PROMPT, 30)]


def test_greedy_with_repetition_penalty_and_quantized_cache(tiny, drafts):
    _, model, _ = tiny
    procs = [make_repetition_penalty(1.5, 8)]
    for source in ("noisy", "lookup", "self-1"):
        ref = [
            t
            for t, _ in plain(
                model,
                PROMPT,
                30,
                logits_processors=procs,
                prompt_cache=PromptCache(model.make_cache(kv_bits=8, kv_group_size=32)),
            )
        ]
        out = speculative_generate_step(
            PROMPT,
            model,
            drafts[source],
            max_tokens=30,
            logits_processors=procs,
            prompt_cache=PromptCache(model.make_cache(kv_bits=8, kv_group_size=32)),
        )
        assert [t for t, *_ in out] == ref, source


# --- Caches after rewind ------------------------------------------------------------------------


def assert_same_cache(a: PromptCache, b: PromptCache):
    assert a.tokens == b.tokens
    for ca, cb in zip(a.cache, b.cache, strict=True):
        assert ca.offset == cb.offset == len(a.tokens)
        for x, y in zip(ca.state, cb.state, strict=True):
            assert x.shape == y.shape and np.allclose(np.array(x), np.array(y), atol=1e-5)


def filled(model, tokens):
    """A cache holding ``tokens``, filled in one plain forward pass."""
    pc = PromptCache(model.make_cache(), tokens)
    model(mx.array([tokens]), pc.cache)
    return pc


@pytest.mark.parametrize("source", ["right", "wrong", "noisy", "lookup", "self-3"])
def test_caches_after_run_equal_plain_caches(tiny, drafts, source):
    _, model, _ = tiny
    ref = PromptCache(model.make_cache())
    tokens = [t for t, _ in generate_step(PROMPT, model, prompt_cache=ref, max_tokens=25)]
    pc = PromptCache(model.make_cache())
    draft = drafts[source]
    if isinstance(draft, DraftModel):
        draft = DraftModel(draft.model, prompt_cache=PromptCache(draft.model.make_cache()))
    out = [
        t
        for t, *_ in speculative_generate_step(PROMPT, model, draft, prompt_cache=pc, max_tokens=25)
    ]
    assert out == tokens
    assert_same_cache(pc, ref)  # prompt + all generated tokens but the last
    if isinstance(draft, DraftModel):  # the draft's cache holds a prefix of them, exactly
        # (all but the last unless drafting went off: a draft model drafting like the target
        # costs what it saves, and catches up when it drafts again)
        dpc = draft.prompt_cache
        assert dpc.tokens == pc.tokens[: len(dpc.tokens)]
        assert_same_cache(dpc, filled(draft.model, dpc.tokens))


@pytest.mark.parametrize("stop_after", [1, 2, 5])
def test_early_stop_rewinds_both_caches(tiny, stop_after):
    _, model, _ = tiny
    pc = PromptCache(model.make_cache())
    draft = DraftModel(model, prompt_cache=PromptCache(model.make_cache()))
    steps = speculative_generate_step(
        PROMPT, model, draft, prompt_cache=pc, max_tokens=40, num_draft=4
    )
    got = [t for t, *_ in itertools.islice(steps, stop_after)]
    steps.close()
    # Like plain decoding's early stop, the cache holds the prompt and every token received; after
    # 1 or 2 tokens (inside a run of 4 accepted drafts) that means rewinding accepted drafts. The
    # 5th token is the target's own (the bonus), never fed, so it is the one thing left out.
    assert pc.tokens == PROMPT + (got if stop_after < 5 else got[:-1])
    assert_same_cache(pc, filled(model, pc.tokens))
    assert draft.prompt_cache.tokens == pc.tokens[: len(draft.prompt_cache.tokens)]
    assert_same_cache(draft.prompt_cache, filled(model, draft.prompt_cache.tokens))
    # The caches carry on: the next request reuses them and still matches plain decoding.
    again = [
        t
        for t, *_ in speculative_generate_step(PROMPT, model, draft, prompt_cache=pc, max_tokens=12)
    ]
    assert again == [t for t, _ in plain(model, PROMPT, 12)]


def test_rotating_cache_that_could_evict_is_refused(tiny, drafts):
    _, model, tok = tiny
    with pytest.raises(DraftError, match="rotating cache.*keeps 32 tokens"):
        list(
            stream_generate(
                model, tok, PROMPT, max_tokens=40, max_kv_size=32, draft=drafts["lookup"]
            )
        )
    # Big enough never to evict: allowed, and still exact.
    ref = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=20)]
    out = [
        r.token
        for r in stream_generate(
            model, tok, PROMPT, max_tokens=20, max_kv_size=64, draft=drafts["lookup"]
        )
    ]
    assert out == ref


# --- The streaming layer: same results as plain decoding ----------------------------------------


def results(model, tok, **kw):
    return [(r.text, r.token, r.finish_reason) for r in stream_generate(model, tok, PROMPT, **kw)]


@pytest.mark.parametrize("source", ["right", "noisy", "lookup", "self-1"])
def test_stream_equals_plain_stream(tiny, drafts, source):
    _, model, tok = tiny
    full = "".join(r[0] for r in results(model, tok, max_tokens=30))
    stop = full[8:11]
    for kw in (dict(max_tokens=30), dict(max_tokens=7), dict(max_tokens=30, stop=[stop])):
        assert results(model, tok, draft=drafts[source], num_draft=3, **kw) == results(
            model, tok, **kw
        ), kw


def test_eos_inside_an_accepted_run(tiny, drafts):
    _, model, tok = tiny
    greedy = [t for t, _ in plain(model, PROMPT, 30)]
    eos = greedy[
        5
    ]  # pretend the 6th token is EOS: it lies inside the second run of 4 accepted drafts
    saved = tok.eos_token_ids
    try:
        tok.eos_token_ids = frozenset({eos})
        pc = PromptCache(model.make_cache())
        out = list(
            stream_generate(
                model,
                tok,
                PROMPT,
                max_tokens=30,
                draft=drafts["right"],
                num_draft=4,
                prompt_cache=pc,
            )
        )
        ref = results(model, tok, max_tokens=30)
    finally:
        tok.eos_token_ids = saved
    assert [(r.text, r.token, r.finish_reason) for r in out] == ref
    assert [r.token for r in out] == greedy[: greedy.index(eos) + 1] and out[
        -1
    ].finish_reason == "stop"
    assert out[-1].from_draft  # EOS came from the draft, mid-run
    assert pc.tokens == PROMPT + [
        r.token for r in out
    ]  # the accepted tokens after EOS were rewound
    assert_same_cache(pc, filled(model, pc.tokens))


def test_stats_and_draft_flags(tiny, drafts):
    _, model, tok = tiny
    rs = list(
        stream_generate(model, tok, PROMPT, max_tokens=40, draft=drafts["right"], num_draft=3)
    )
    s = rs[-1].stats
    assert [r.from_draft for r in rs] == [True, True, True, False] * (len(rs) // 4) + [True] * (
        len(rs) % 4
    )
    assert s.accepted_tokens == s.draft_tokens and s.acceptance_rate == 1.0
    assert (
        s.speculative_steps == -(-len(rs) // 4)
        and s.tokens_per_step == len(rs) / s.speculative_steps
    )
    assert "draft accepted" in s.table() and "tokens per step" in s.table()
    # Per position: every step proposed 3 (the last step maybe fewer), all accepted; the ms.
    assert s.drafted_by_position[0] == s.speculative_steps and len(s.drafted_by_position) == 3
    assert s.accepted_by_position == s.drafted_by_position
    assert s.acceptance_by_position == [1.0, 1.0, 1.0]
    assert s.draft_ms > 0 and s.verify_ms > 0 and s.verify_ms_per_step > 0
    assert "by position" in s.table() and "100% 100% 100%" in s.table()
    assert f"{s.draft_ms_per_step:.1f} / {s.verify_ms_per_step:.1f} ms" in s.table()
    # A draft that is never right: position 0 decides every step, nothing past it is accepted.
    w = list(stream_generate(model, tok, PROMPT, max_tokens=12, draft=drafts["wrong"], num_draft=2))
    w = w[-1].stats
    assert w.accepted_by_position == [0, 0]
    assert w.drafted_by_position[0] == w.speculative_steps - 1  # the last step: one token left
    plain_stats = list(stream_generate(model, tok, PROMPT, max_tokens=5))[-1].stats
    assert "draft accepted" not in plain_stats.table()


def test_adaptive_k_follows_acceptance():
    """k maximises E(k) / cost(k) (generation/draft_length.py): with verifying 10 ms + 1 ms a
    position and a draft token 0.5 ms, full acceptance drafts deep, none turns drafting off
    (k = 0, plain decoding) with bounded probes, and a return of acceptance brings it back."""
    costs = StepCosts()
    for positions in (1, 5, 9):
        costs.record(4, 2.0, positions, 10.0 + positions)  # 0.5 ms a drafted token
    k = DraftLength(None, costs)
    assert k.k == 4  # the prior acceptance 0.75 with these costs
    for _ in range(10):
        k.update(k.k, k.k)  # everything accepted
    assert k.k >= 12
    high = k.k
    for _ in range(10):
        k.update(0, k.k)  # nothing accepted
    assert k.k == 0
    ks = []
    for _ in range(100):
        ks.append(k.k)
        k.update(0, ks[-1])
    probes = [i for i, x in enumerate(ks) if x]
    assert 2 <= len(probes) <= 5  # probes, each interval twice the last (8, 16, 32, 64)
    while k.k == 0:  # the next probe finds acceptance back
        k.update(0, 0)
    for _ in range(10):
        k.update(k.k, k.k)
    assert k.k >= high
    assert DraftLength(3, costs).k == 3
    assert expected_tokens([1.0, 0.5], 2) == 1 + 1 + 0.5


def test_k_tries_one_past_the_longest_verification_timed_and_probes_only_where_it_could_pay():
    """Where the best k verifies the longest length timed and the timed verifications are nearly
    flat, k goes one past it (that length is only the line's guess until timed), if that draft
    would more likely pass than not; once timed, the measured cost decides; a steep line is
    trusted. Where not even drafts that always pass would beat plain
    decoding at the measured costs, drafting goes off with probes at the longest interval; where
    a better acceptance could pay, at the shortest."""
    costs = StepCosts()
    costs.record(0, 0.0, 1, 10.0)
    costs.record(1, 4.0, 2, 12.0)  # nearly flat (1.2x); 4 a drafted token
    k = DraftLength(None, costs)  # prior 0.75: k = 1 is best (1.75 / 16 against 2.31 / 22)
    assert k.k == 2  # ... and verifies 2, the longest timed: one more, to time 3
    costs.record(2, 8.0, 3, 30.0)  # 3 positions dearer than the line said
    k.changed()
    assert k.k == 1
    del costs.verify[3]  # 3 not timed again: the line's guess
    costs._line = None
    k.passed, k.decided = [0.9, 0.3], [1.0, 1.0]  # the second draft would fail more often
    k.changed()
    assert k.k == 1  # drafting pays at k = 1 (1.9 / 16 > 1 / 10), and stays there
    k.passed, k.decided = [0.95, 0.95], [1.0, 1.0]  # k = 1: 1.95 / 19 > 1 / 10 > 2.85 / 28
    costs.verify[2] = 15.0  # a steep line (a CPU's): trusted, no step past it
    costs._line = None
    k.changed()
    assert k.k == 1
    never = StepCosts()
    never.record(0, 0.0, 1, 10.0)
    never.record(1, 10.0, 2, 30.0)  # a draft token 10, a position 20: (k + 1) / cost < 1 / 10
    off = DraftLength(None, never)
    off.passed, off.decided = [1.0], [1.0]  # even with every draft kept
    assert off.k == 0 and off.probe == draft_length.MAX_PROBE == never.probe
    could = StepCosts()
    could.record(0, 0.0, 1, 10.0)
    could.record(1, 1.0, 2, 11.0)  # cheap: drafts that pass would pay
    low = DraftLength(None, could)
    low.passed, low.decided = [0.05], [1.0]
    assert low.k == 0 and low.probe == draft_length.MIN_PROBE


def test_one_row_of_a_batch_drafts_the_step_that_times_a_draft():
    """Costs with a plain step timed and no draft yet: the step that times a draft drafts one
    token, in the first row that asks; the others of that step draft nothing (their drafts
    would add their cost to the timing); the step's record frees the claim."""
    costs = StepCosts()
    costs.record(0, 0.0, 1, 10.0)
    rows = [DraftLength(None, costs, measure_plain=True) for _ in range(3)]
    assert [r.k for r in rows] == [1, 0, 0]
    costs.record(0, 0.0, 1, 10.0)  # that row's k was clamped: no draft timed, the claim ends
    for r in rows:
        r.changed()
    assert [r.k for r in rows] == [1, 0, 0]
    costs.record(1, 2.0, 2, 11.0)  # timed: the rows choose from the costs
    for r in rows:
        r.changed()
    assert all(r.k >= 1 for r in rows)  # 1.75 / 13 > 1 / 10 at the prior's 0.75


def test_a_batch_row_weighs_the_others_tokens():
    """In a batch of B rows a row's draft makes every row verify k + 1 positions: it weighs
    (B - 1 + E(k)) / cost(k) against B / cost(0). A flat verification (10) and 2 a drafted
    token: alone a row with acceptance 0.6 drafts (1.6 / 12 > 1 / 10); in a batch of 8 it does
    not (8.6 / 12 < 8 / 10), nor would every row drafting alike (8 x 1.6 / (10 + 8 x 2) <
    8 / 10); at 0.95 acceptance and 0.5 a token it does (deep drafts pay for everyone)."""
    costs = StepCosts()
    costs.record(0, 0.0, 1, 10.0)
    costs.record(1, 2.0, 2, 10.0)
    row = DraftLength(None, costs)
    row.passed, row.decided = [0.6], [1.0]
    assert row.k >= 1
    row.batch = 8
    row.changed()
    assert row.k == 0
    cheap = StepCosts()
    cheap.record(0, 0.0, 1, 10.0)
    cheap.record(4, 2.0, 2, 10.0)  # 0.5 a drafted token
    good = DraftLength(None, cheap)
    good.passed, good.decided, good.batch = [0.95], [1.0], 8
    assert good.k >= 4


def expected_tokens(acceptance, k):
    d = DraftLength(None)
    d.passed, d.decided = [a * 100 for a in acceptance], [100.0] * len(acceptance)
    return round(d.expected(k), 1)


class _Clock:
    """A fake ``perf_counter``: a millisecond a call, plus what a draft adds."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1e-3
        return self.t


class _Timed(DraftModel):
    """A draft model whose every drafted token takes ``ms`` on ``clock``."""

    def __init__(self, model, clock, ms):
        super().__init__(model)
        self.clock, self.ms = clock, ms

    def start(self, model, cache, prompt):
        inner = super().start(model, cache, prompt)
        clock, ms = self.clock, self.ms

        class Drafter:
            def propose(self, history, k, sample):
                clock.t += k * ms * 1e-3
                return inner.propose(history, k, sample)

            def rewind(self, kept):
                inner.rewind(kept)

        return Drafter()


@pytest.mark.parametrize("ms", [0.0, 50.0])
def test_k_follows_measured_costs(tiny, monkeypatch, ms):
    """A draft that always agrees with the target: free to draft, k rises to the ceiling (one
    token to time a draft first, then two: one past the longest verification timed, then the
    line through them); 50 ms a token against a 1 ms verification, it costs more than it
    saves and k goes to 0 (plain decoding; no probe in 60 tokens, since not even drafts that
    always pass would pay), and either way the output is plain greedy's. Plain decoding is
    timed first (draft_length.MEASURE_PLAIN tokens)."""
    _, model, _ = tiny
    clock = _Clock()
    monkeypatch.setattr(draft_length, "perf_counter", clock)
    model.__dict__.pop("_step_costs", None)
    try:
        out = list(
            speculative_generate_step(PROMPT, model, _Timed(model, clock, ms), max_tokens=60)
        )
    finally:
        model.__dict__.pop("_step_costs", None)
    assert [s.token for s in out] == [t for t, _ in plain(model, PROMPT, 60)]
    drafted = [s.drafted for s in out if s.passes]
    # The model has no plain step timed: the first MEASURE_PLAIN tokens are plain decoding.
    first = draft_length.MEASURE_PLAIN
    assert drafted[:first] == [0] * first
    drafted = drafted[first:]
    if ms:
        assert drafted == [1] + [0] * (len(drafted) - 1)
    else:
        assert drafted[:2] == [1, 2] and max(drafted) >= 10 and len(drafted) <= 10
    assert all(s.verify_s > 0 for s in out if s.passes)


# --- Draft sources ------------------------------------------------------------------------------


def test_prompt_lookup_proposes_continuation_of_latest_longest_match():
    drafter = PromptLookup(max_ngram=3, min_ngram=1).start(None, [], [])
    history = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    tokens, q = drafter.propose(history, 3, None)
    # [1, 2, 3] occurs at the start, followed by 4, 9, 2 ([2, 3] alone would pick the later 5, 6).
    assert tokens.tolist() == [4, 9, 2] and q is None
    assert drafter.propose(history + [7], 3, None)[0].tolist() == []  # 7 never seen before
    fresh = PromptLookup().start(None, [], [])
    assert fresh.propose([1, 2, 3, 1, 2], 5, None)[0].tolist() == [
        3,
        1,
        2,
    ]  # runs up to the present


def test_vocabulary_mismatch_is_a_clear_error(tiny, tmp_path):
    path, model, tok = tiny
    other = tmp_path / "other"
    shutil.copytree(path, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    draft = DraftModel(*load(other))
    with pytest.raises(
        DraftError,
        match=rf"draft model {other} and target {path} have different vocabularies "
        r"\(token 300 is .* in the draft, .* in the target\)",
    ):
        list(stream_generate(model, tok, PROMPT, max_tokens=4, draft=draft))
    add_tokenizer(other, vocab_size=300)
    with pytest.raises(DraftError, match="300 tokens vs the target's 320"):
        list(stream_generate(model, tok, PROMPT, max_tokens=4, draft=DraftModel(*load(other))))
    result = CliRunner().invoke(
        cli, ["generate", "-m", str(path), "--draft-model", str(other), "-p", "Hi"]
    )
    assert result.exit_code == 1 and result.stderr.startswith(
        f"Error: draft model {other} and target {path}"
    )


def test_self_draft_needs_fewer_layers_than_the_model(tiny):
    _, model, tok = tiny
    for n in (0, 4):
        with pytest.raises(DraftError, match=f"between 1 and 3 for this 4-layer model, got {n}"):
            list(stream_generate(model, tok, PROMPT, max_tokens=4, draft=SelfDraft(n)))


def test_custom_sampler_without_settings_is_refused(tiny, drafts):
    _, model, _ = tiny
    with pytest.raises(ValueError, match="needs a sampler from make_sampler"):
        list(
            speculative_generate_step(
                PROMPT, model, drafts["lookup"], sampler=lambda lp: mx.argmax(lp, -1)
            )
        )


# --- Sampling: the target's distribution, exactly -----------------------------------------------

N_SAMPLES = 300  # cells expect >= 5 samples; a wrong rule scores far above the cut (see below)
TOP_K = 5  # 5 × 5 = 25 cells for the first two tokens
CHI2_CRIT_24_DOF = (
    51.18  # chi-square 99.9% quantile, 24 degrees of freedom (scipy.stats.chi2.ppf(.999, 24))
)


def target_dist(model, ids, processors, temperature):
    logits = model(mx.array([ids]))[0, -1:]  # no cache: an independent forward pass
    for process in processors:
        logits = process(mx.array(ids), logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.exp(np.array(filtered_logprobs(logprobs, temperature=temperature, top_k=TOP_K)[0]))


def first_two_fit(model, prompt, draft, processors=(), temperature=0.8):
    """Chi-square test of the first two sampled tokens against the target's own joint distribution.

    Returns (chi2, samples outside the target's support); a fit is (< 51.18, 0).
    """
    p1 = target_dist(model, prompt, processors, temperature)
    joint = {
        (a, b): p1[a] * pb
        for a in np.flatnonzero(p1)
        for b, pb in enumerate(target_dist(model, prompt + [int(a)], processors, temperature))
        if pb > 0
    }
    assert len(joint) == TOP_K**2
    pc = PromptCache(model.make_cache())
    counts = dict.fromkeys(joint, 0)
    outside = 0
    for seed in range(N_SAMPLES):
        steps = speculative_generate_step(
            prompt,
            model,
            draft,
            prompt_cache=pc,
            max_tokens=3,
            num_draft=2,
            sampler=make_sampler(temperature, top_k=TOP_K, seed=seed),
            logits_processors=processors,
        )
        pair = tuple(t for t, *_ in itertools.islice(steps, 2))
        steps.close()
        if pair in counts:
            counts[pair] += 1
        else:
            outside += 1
    chi2 = sum((counts[c] - N_SAMPLES * p) ** 2 / (N_SAMPLES * p) for c, p in joint.items())
    return chi2, outside


@pytest.fixture(scope="module")
def sharp_draft(tiny):
    """A draft whose distribution overlaps the target's, but not much: its head
    is the target's, tripled (sharper) and noised."""
    path, model, _ = tiny
    draft = load(path)[0]
    W = model.lm_head.weight
    draft.lm_head.weight = 3 * W + 0.1 * mx.random.normal(W.shape, key=mx.random.key(0))
    return draft


def lookup_prompt(model):
    """[7, 8, c, 9, 10, 7, 8]: lookup drafts c (what followed [7, 8] before), then 9. Pick the
    c the target itself likes best there, so the point-mass rule is exercised on both sides."""
    V = model.args.vocab_size
    prompts = mx.array([[7, 8, c, 9, 10, 7, 8] for c in range(V)])  # (V, 7): every c in one pass
    p = mx.softmax(model(prompts)[:, -1, :], axis=-1)[
        mx.arange(V), mx.arange(V)
    ]  # (V,): p(c | prompt_c)
    c = int(mx.argmax(p).item())
    assert 0.1 < target_dist(model, [7, 8, c, 9, 10, 7, 8], (), 0.8)[c] < 0.9
    return [7, 8, c, 9, 10, 7, 8]


@pytest.mark.parametrize("source", ["draft-model", "self-draft", "prompt-lookup"])
def test_sampled_tokens_follow_the_target_distribution(tiny, sharp_draft, source):
    _, model, _ = tiny
    if source == "draft-model":
        # Repetition penalty on both models too: prompt tokens are penalised, and so is token 1 for token 2.
        dpc = PromptCache(sharp_draft.make_cache())
        chi2, outside = first_two_fit(
            model, PROMPT, DraftModel(sharp_draft, prompt_cache=dpc), [make_repetition_penalty(1.3)]
        )
    elif source == "self-draft":
        chi2, outside = first_two_fit(model, PROMPT, SelfDraft(2))
    else:
        chi2, outside = first_two_fit(model, lookup_prompt(model), PromptLookup())
    assert outside == 0 and chi2 < CHI2_CRIT_24_DOF


@pytest.mark.parametrize("wrong_rule", ["accept-always", "resample-from-target"])
def test_a_wrong_acceptance_rule_fails_the_same_test(tiny, sharp_draft, monkeypatch, wrong_rule):
    _, model, _ = tiny
    if wrong_rule == "accept-always":
        monkeypatch.setattr(
            speculative, "_accepts", lambda p_d, q_d, u: mx.ones(p_d.shape, mx.bool_)
        )
    else:  # the classic bug: on rejection draw from p instead of max(0, p - q)
        monkeypatch.setattr(speculative, "_residual", lambda p, q: p)
    draft = DraftModel(sharp_draft, prompt_cache=PromptCache(sharp_draft.make_cache()))
    chi2, outside = first_two_fit(model, PROMPT, draft)
    assert not (outside == 0 and chi2 < CHI2_CRIT_24_DOF)
    if wrong_rule == "resample-from-target":
        assert (
            outside == 0 and chi2 > 2 * CHI2_CRIT_24_DOF
        )  # fails on the distribution alone, clearly


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_speculative_flags(tiny):
    path, _, _ = tiny
    base = ["generate", "-m", str(path), "-p", "Hello world", "-n", "16"]
    expected = CliRunner().invoke(cli, base).stdout
    for flags in (
        ["--prompt-lookup"],
        ["--self-draft-layers", "2", "--num-draft", "3"],
        ["--draft-model", str(path)],
    ):
        result = CliRunner().invoke(cli, base + flags + ["-v"])
        assert result.exit_code == 0, result.stderr
        assert result.stdout == expected
        assert "draft accepted" in result.stderr and "tokens per step" in result.stderr
        assert "by position" in result.stderr and "draft / verify" in result.stderr
    result = CliRunner().invoke(cli, base + ["--prompt-lookup", "--self-draft-layers", "2"])
    assert result.exit_code == 2 and "choose one draft source" in result.stderr


# --- The real SmolLM2-135M-Instruct -------------------------------------------------------------

REWRITE = [
    {
        "role": "user",
        "content": "Add type hints to this function, keeping its logic:\n\n"
        "def scale(values, factor):\n    out = []\n    for v in values:\n        out.append(v * factor)\n"
        "    return out\n",
    }
]


@pytest.fixture(scope="module")
def smollm2(smollm2_f32_dir):
    model, tok = load(smollm2_f32_dir)
    ref = list(stream_generate(model, tok, REWRITE, max_tokens=24))
    return model, tok, ref


@pytest.mark.real
@pytest.mark.parametrize("source", ["prompt-lookup", "self-draft", "draft-4bit"])
def test_real_model_greedy_is_token_identical(smollm2, smollm2_mlx_dir, source):
    model, tok, ref = smollm2
    if source == "prompt-lookup":
        draft = PromptLookup()
    elif source == "self-draft":
        draft = SelfDraft(24)  # of 30: earlier exits of this small model are rarely right
    else:  # the 4-bit GGUF import drafting for the f32 conversion: same vocabulary, other weights
        draft = DraftModel(*load(smollm2_mlx_dir))
    out = list(stream_generate(model, tok, REWRITE, max_tokens=24, draft=draft, num_draft=2))
    assert [(r.token, r.text) for r in out] == [(r.token, r.text) for r in ref]
    assert out[-1].stats.speculative_steps < len(out)  # some drafts were accepted


def test_speculative_example_runs(tiny, capsys):
    from fixtures import load_script

    path, _, _ = tiny
    example = load_script("examples/speculative.py")
    example.main(
        str(path), str(path), max_tokens=24
    )  # asserts that every run prints the plain text
    err = capsys.readouterr().err
    assert "[prompt lookup]" in err and "[draft model]" in err and "of drafts accepted" in err
