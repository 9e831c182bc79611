"""The scheduler's side of drafting rows (speculative decoding in the batch): a step in which
the rows verify their drafts in the batch's one forward, keep what their acceptance keeps plus
one token of the target's, and rewind the rest from the pools; and a draft model fed what the
target's pool holds of a prompt. Proposing and accepting a row's drafts are ``rows.py``'s.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx

from ..generation.draft_length import MIN_PROBE, StepCosts, timed
from ..generation.results import Step
from . import rows as rows_mod
from .metrics import Counters
from .pools import Pools
from .recurrent import RecurrentRows
from .requests import _Request


class Verification:
    """The drafting rows' steps of ``model``'s engine (its ``verification`` member): over
    ``pools``, read with ``attention``; ``turns`` (across ranks, rank 0's drafts and what it
    kept); ``recurrent`` (None: no recurrent layers); ``max_draft`` drafts a row at most; the
    step's numbers counted in ``counters``; a row done (EOS, ``max_tokens``) handed to
    ``retire``."""

    def __init__(
        self,
        model,
        pools: Pools,
        turns,
        recurrent: RecurrentRows | None,
        counters: Counters,
        *,
        max_draft: int,
        attention: str,
        retire: Callable[[_Request], None],
    ) -> None:
        self.model, self.pools, self.turns, self.recurrent = model, pools, turns, recurrent
        self.counters, self.max_draft, self.attention = counters, max_draft, attention
        self.retire = retire
        # Measured step costs by batch size (a power of two at most the rows': bucketed), read
        # by the drafting rows' k (generation/draft_length.py).
        # Kept on the model (as the single-request loop keeps its own), so that an engine made
        # later for the same model starts from what the earlier ones measured.
        self.costs: dict[int, StepCosts] = _model_tables(model)
        self._last: StepCosts | None = None  # the costs of the last step's batch size

    def costs_for(self, rows: int) -> StepCosts:
        """The step costs of a batch of ``rows`` (bucketed to the power of two at most it). A
        batch size met for the first time starts from the last one's costs, acceptance and
        probe interval (re-measured as it runs), not from nothing: else, as rows finish and the
        batch shrinks, each new size would time a plain step and a drafting step again."""
        bucket = 1 << (rows.bit_length() - 1)
        known, last = self.costs.get(bucket), self._last
        # A size met before any draft was timed (the first rows admitted, before the rest came)
        # takes the last size's costs once they time a draft: else, as the batch shrinks to
        # it, it would time a drafting step again (8 rows: ~4 plain steps' time on a CPU).
        if known is None or (known.draft is None and last is not None and last.draft is not None):
            fresh = StepCosts()
            if last is not None:
                fresh.verify, fresh.draft = dict(last.verify), last.draft
                fresh.accepted, fresh.decided = list(last.accepted), list(last.decided)
                fresh.probe = last.probe
            self.costs[bucket] = fresh
        self._last = self.costs[bucket]
        return self._last

    def feed_draft(self, request: _Request) -> None:
        t0 = time.perf_counter()
        rows_mod.feed_draft(request)
        self.counters.draft_s += time.perf_counter() - t0

    def verify_rows(self, rows: list[_Request]) -> None:
        """One decode step in which drafting rows verify their drafts: every row feeds its
        token, its drafts and padding up to the longest (one forward), keeps the drafts its
        acceptance keeps plus one token of the target's, and the rest is rewound from the pool.
        Each row's acceptance reads only its own logits and its own key. The step's draft and
        verification are timed into the costs of its batch size, which the rows' k reads."""
        costs = self.costs_for(len(rows))
        # A row's k from them, but for seeded sampling and across ranks, whose k must not
        # depend on timings (the same draws every run; the same k on every rank): nominal costs.
        alone = getattr(self.turns, "alone", False)
        for r in rows:
            if r.draft_length is not None and alone and timed(r.sampler.params):
                if r.draft_length.costs is not costs:  # the probe interval reached goes too
                    r.draft_length.probe = max(r.draft_length.probe, costs.probe)
                    r.draft_length.costs = costs
                    r.draft_length.changed()  # a k chosen on other costs is chosen again
                # its k = 0 steps run as plain ones (plain_step): time one before drafting
                r.draft_length.measure_plain = True
                r.draft_length.probe_now = self.probe_step
                if r.draft_length.batch != len(rows):  # the others' tokens weigh in its k
                    r.draft_length.batch = len(rows)
                    r.draft_length.changed()
        # Each row's k this step (chosen now, read again by its plan; its update forgets it).
        drafted = sum(r.draft_length.k for r in rows if r.draft_length is not None)
        t0 = time.perf_counter()
        proposals, tokens = self.drafts_for(rows)
        t1 = time.perf_counter()
        starts = [r.seq.length for r in rows]
        # A recurrent row's states before the step: they will read every token fed, padding and
        # rejected drafts too (a state is never written in place: references are a snapshot).
        saved = (
            [[c.snapshot() for c in r.states] for r in rows] if self.recurrent is not None else None
        )
        batch = self.pools.batch(rows, tokens, self.attention)
        x, hidden = mx.array(tokens, dtype=mx.int32), None
        if self.recurrent is not None:  # their states by position: a rejection takes one
            self.recurrent.record(rows, True)
        if any(rows_mod.observer(r) is not None for r in rows):  # MTP rows read the states
            hidden, logits = self.model.trunk(x, batch.views())  # (B, L, H), (B, L, V)
        else:
            logits = self.model(x, batch.views())  # (B, L, V)
        self.counters.steps_run += 1
        timing = (t1 - t0, t1)
        if not self.plain_step(rows, logits, proposals, saved, hidden, timing):
            self.verified(rows, logits, proposals, starts, saved, hidden=hidden, timing=timing)
        if self.recurrent is not None:
            self.recurrent.record(rows, False)
        verify_s = time.perf_counter() - t1
        costs.record(drafted, t1 - t0, len(tokens[0]), verify_s)
        self.counters.verify_s += verify_s

    def drafts_for(self, rows: list[_Request]) -> tuple[list, list[list[int]]]:
        """The rows' proposals (rank 0's where it drafts alone) and the tokens each row feeds:
        its token, its drafts, and padding up to the longest."""
        t0 = time.perf_counter()
        # The rows of one draft pool propose together (k forwards of all of them).
        proposals, forwards = rows_mod.propose(rows, self.max_draft)
        # Across ranks, rank 0's draft model's, where it drafts alone (batching.py).
        proposals = self.turns.adopt_drafts(rows, proposals)
        self.counters.draft_steps += forwards
        self.counters.draft_s += time.perf_counter() - t0
        L = 1 + max(len(p.tokens) for p in proposals)
        tokens = [
            [r.pending] + p.tokens + [r.pending] * (L - 1 - len(p.tokens))
            for r, p in zip(rows, proposals)
        ]
        return proposals, tokens

    def verified(
        self,
        rows,
        logits,
        proposals,
        starts,
        saved,
        flown: bool = False,
        hidden=None,
        timing: tuple[float, float] | None = None,
    ) -> None:
        """The rows' acceptance of their drafts from the step's ``logits`` (B, L, V); the
        rejected ones rewound (``starts``: each row's length before the step); the kept tokens
        emitted. ``flown``: a flight's rows (flights.py), whose blocks are hashed after the
        rewind. ``hidden`` (B, L, H): the step's final hidden states, for MTP rows' heads.
        ``timing``: (the draft's seconds, when the verification began), for the rows' steps."""
        drafts = [p.tokens for p in proposals]
        picks = [rows_mod.verify(r, logits[b], p) for b, (r, p) in enumerate(zip(rows, proposals))]
        # Each token's log-probs as an array of its own, evaluated here like the rest: a slice
        # made later, on this thread, would fail in the consumer's thread (not its stream).
        per_token = [[lp[j] for j in range(lp.shape[0])] for _, _, lp in picks]
        mx.eval(picks, per_token, self.pools.stores(), [rows_mod.draft_state(r) for r in rows])
        kept = [int(a.item()) for a, _, _ in picks]
        after = [int(t.item()) for _, t, _ in picks]
        kept, after = self.turns.adopt_kept(rows, kept, after)  # across ranks, rank 0's
        for r, start, a in zip(rows, starts, kept):
            self.pools.rewind(r, start + 1 + a)  # the fed token and the accepted drafts
            if flown:
                self.pools.hash_full(r)
        if saved is not None:
            self.recurrent.refeed_states(rows, drafts, saved, starts, kept, logits.shape[1])
            for r in rows:
                self.recurrent.mark_block(r)
        for b, (r, d, a, t, logprobs) in enumerate(zip(rows, drafts, kept, after, per_token)):
            emitted = d[:a] + [t]
            if r.draft_length is not None:
                r.draft_length.update(a, len(d))
                rows_mod.rewind_draft(r, r.tokens + emitted[:-1])  # what the pool now holds
            if (observe := rows_mod.observer(r)) is not None:
                if hidden is None:
                    raise ValueError("an MTP row verified without the step's hidden states")
                observe(hidden[b, : a + 1], emitted)  # the kept positions, each with its next
            self.emit(r, emitted, logprobs, a, len(d), timing)

    def probe_step(self) -> bool:
        """Whether rows whose drafting is off may probe this step: every MIN_PROBE-th, so that
        their probes share steps (a probe makes its whole step verify two positions)."""
        return self.counters.steps_run % MIN_PROBE == 0

    def plain_step(self, rows, logits, proposals, saved, hidden, timing) -> bool:
        """A step in which no row drafted, for rows whose tokens may depend on timings (greedy
        or unseeded; not across ranks, not recurrent rows): every row's token sampled at once,
        as a step without drafters samples (``sample_rows``), instead of each row's acceptance
        on its own. Returns whether it was one (else nothing was done)."""
        if saved is not None or any(p.tokens for p in proposals):
            return False
        if not getattr(self.turns, "alone", False):
            return False
        if not all(r.draft_length is None or r.draft_length.measure_plain for r in rows):
            return False
        picked, logprobs = rows_mod.sample_rows(rows, logits[:, -1, :])
        states = [rows_mod.draft_state(r) for r in rows]
        mx.eval(picked, logprobs, self.pools.stores(), states)
        for b, (r, t, lp) in enumerate(zip(rows, picked.tolist(), logprobs)):
            if r.draft_length is not None:
                r.draft_length.update(0, 0)
                rows_mod.rewind_draft(r, list(r.tokens))
            if (observe := rows_mod.observer(r)) is not None:
                if hidden is None:
                    raise ValueError("an MTP row stepped without the step's hidden states")
                observe(hidden[b, :1], [t])  # kept until its head drafts (drafts.py)
            self.emit(r, [t], [lp], 0, 0, timing)
        return True

    def emit(
        self,
        r: _Request,
        emitted: list[int],
        logprobs,
        a: int,
        m: int,
        timing: tuple[float, float] | None = None,
    ) -> None:
        """Hand the step's tokens to the consumer, up to EOS or max_tokens; retire if done.
        ``timing``: (the draft's seconds, when the verification began): the step's first token
        carries those and the verification's seconds so far."""
        self.counters.count_drafts(m, a, r.drafter is not None)
        draft_s, verify_s = 0.0, 0.0
        if timing is not None:
            draft_s, verify_s = timing[0], time.perf_counter() - timing[1]
        for j, t in enumerate(emitted):
            first = j == 0
            r.generated += 1
            self.counters.decode_tokens += 1
            r.tokens.append(t)
            if r.history is not None:
                r.history = mx.concatenate([r.history, mx.array([t], mx.int32)])
            if first:
                r.out.put(Step(t, logprobs[j], j < a, 1, m, a, draft_s, verify_s))
            else:
                r.out.put(Step(t, logprobs[j], j < a, 0))
            if t in r.eos or r.generated >= r.max_tokens:
                self.retire(r)
                return
        r.pending = emitted[-1]


def _model_tables(model) -> dict[int, StepCosts]:
    """The batch engines' measured step costs of ``model``, by batch size: a plain attribute
    of the model object (a dict set as a module's would join its parameters), or a dict of
    this engine's own for a model that takes no attributes."""
    tables = getattr(model, "__dict__", {}).get("_batch_step_costs")
    if isinstance(tables, dict):
        return tables
    tables = {}
    try:
        object.__setattr__(model, "_batch_step_costs", tables)
    except (AttributeError, TypeError):
        pass
    return tables
