"""The scheduler's side of drafting rows (speculative decoding in the batch): a step in which
the rows verify their drafts in the batch's one forward, keep what their acceptance keeps plus
one token of the target's, and rewind the rest from the pools; and a draft model fed what the
target's pool holds of a prompt. Proposing and accepting a row's drafts are ``rows.py``'s.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..generation.results import Step
from . import rows as rows_mod
from .requests import _Request


class DraftingRows:
    """Mixed into :class:`~.scheduler.Scheduler` (which has the model, the pools, the turns
    across ranks and the counters)."""

    def _feed_draft(self, request: _Request) -> None:
        t0 = time.perf_counter()
        rows_mod.feed_draft(request)
        self.draft_s += time.perf_counter() - t0

    def _verify_rows(self, rows: list[_Request]) -> None:
        """One decode step in which drafting rows verify their drafts: every row feeds its
        token, its drafts and padding up to the longest (one forward), keeps the drafts its
        acceptance keeps plus one token of the target's, and the rest is rewound from the pool.
        Each row's acceptance reads only its own logits and its own key."""
        proposals, tokens = self._drafts_for(rows)
        starts = [r.seq.length for r in rows]
        # A recurrent row's states before the step: they will read every token fed, padding and
        # rejected drafts too (a state is never written in place: references are a snapshot).
        saved = [[c.snapshot() for c in r.states] for r in rows] if self.recurrent else None
        batch = self._batch(rows, tokens, self.attention)
        logits = self.model(mx.array(tokens, dtype=mx.int32), batch.views())  # (B, L, V)
        self.steps_run += 1
        self._verified(rows, logits, proposals, starts, saved)

    def _drafts_for(self, rows: list[_Request]) -> tuple[list, list[list[int]]]:
        """The rows' proposals (rank 0's where it drafts alone) and the tokens each row feeds:
        its token, its drafts, and padding up to the longest."""
        t0 = time.perf_counter()
        # The rows of one draft pool propose together (k forwards of all of them).
        proposals, forwards = rows_mod.propose(rows, self.max_draft)
        # Across ranks, rank 0's draft model's, where it drafts alone (batching.py).
        proposals = self.turns.adopt_drafts(rows, proposals)
        if forwards:
            self.draft_steps += forwards
            self.draft_s += time.perf_counter() - t0
        L = 1 + max(len(p.tokens) for p in proposals)
        tokens = [
            [r.pending] + p.tokens + [r.pending] * (L - 1 - len(p.tokens))
            for r, p in zip(rows, proposals)
        ]
        return proposals, tokens

    def _verified(self, rows, logits, proposals, starts, saved, flown: bool = False) -> None:
        """The rows' acceptance of their drafts from the step's ``logits`` (B, L, V); the
        rejected ones rewound (``starts``: each row's length before the step); the kept tokens
        emitted. ``flown``: a flight's rows (flights.py), whose blocks are hashed after the
        rewind."""
        drafts = [p.tokens for p in proposals]
        picks = [rows_mod.verify(r, logits[b], p) for b, (r, p) in enumerate(zip(rows, proposals))]
        # Each token's log-probs as an array of its own, evaluated here like the rest: a slice
        # made later, on this thread, would fail in the consumer's thread (not its stream).
        per_token = [[lp[j] for j in range(lp.shape[0])] for _, _, lp in picks]
        mx.eval(picks, per_token, self._stores(), [rows_mod.draft_state(r) for r in rows])
        kept = [int(a.item()) for a, _, _ in picks]
        after = [int(t.item()) for _, t, _ in picks]
        kept, after = self.turns.adopt_kept(rows, kept, after)  # across ranks, rank 0's
        for r, start, a in zip(rows, starts, kept):
            self._rewind(r, start + 1 + a)  # the fed token and the accepted drafts
            if flown:
                self._hash_full(r)
        if saved is not None:
            self._refeed_states(rows, drafts, saved, starts, kept, logits.shape[1])
            for r in rows:
                self._mark_block(r)
        for r, d, a, t, logprobs in zip(rows, drafts, kept, after, per_token):
            emitted = d[:a] + [t]
            if r.draft_length is not None:
                r.draft_length.update(a, len(d))
                rows_mod.rewind_draft(r, r.tokens + emitted[:-1])  # what the pool now holds
            self._emit(r, emitted, logprobs, a, len(d))

    def _emit(self, r: _Request, emitted: list[int], logprobs, a: int, m: int) -> None:
        """Hand the step's tokens to the consumer, up to EOS or max_tokens; retire if done."""
        self.draft_tokens += m
        self.accepted_tokens += a
        for j, t in enumerate(emitted):
            first = j == 0
            r.generated += 1
            self.decode_tokens += 1
            r.tokens.append(t)
            if r.history is not None:
                r.history = mx.concatenate([r.history, mx.array([t], mx.int32)])
            r.out.put(Step(t, logprobs[j], j < a, int(first), m if first else 0, a if first else 0))
            if t in r.eos or r.generated >= r.max_tokens:
                self._retire(r)
                return
        r.pending = emitted[-1]
