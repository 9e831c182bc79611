"""A rank's copies of the requests rank 0 sends, and how they draft (``batching.py``'s Turns).

With ``rank0_requests`` (``serve``) the other ranks build their copy of each of rank 0's
requests from what it sent (:func:`mirror`: the prompt, ``max_tokens``, EOS tokens, how it
drafts: :func:`drafting`). A request drafting with a draft model drafts on rank 0 alone, with
``serve`` or where every rank submits it: the others' copies hold a :class:`Rank0Drafts`, and
take rank 0's drafts and what it kept of them each step.
"""

from __future__ import annotations

import mlx.core as mx


def model_drafting(rows: list) -> list[int]:
    """The rows of a step drafting with rank 0's draft model (the same on every rank)."""
    return [
        b
        for b, r in enumerate(rows)
        if r.draft_model is not None or isinstance(r.drafter, Rank0Drafts)
    ]


class Rank0Drafts:
    """The drafter of a rank's copy of a request that drafts with rank 0's draft model: it
    proposes nothing itself (:meth:`Turns.adopt_drafts` puts rank 0's drafts in its place) and
    holds no cache to rewind."""

    def propose(self, tokens, k, sampler):
        return mx.array([], dtype=mx.int32), None

    def rewind(self, kept) -> None:
        pass


def mirror(engine, ids: list[int], max_tokens: int, eos: list[int], lookup=None, rank0=None):
    """On a rank other than 0 (``rank0_requests``): ``engine``'s copy of a request rank 0 sent,
    fed rank 0's tokens (its sampler is never asked); ``lookup``: ``[max_ngram, min_ngram,
    num_draft or 0]`` where it drafts by prompt lookup; ``rank0``: ``[num_draft or 0]`` where
    it drafts with rank 0's draft model. A ValueError (or the prompt's own error) for what does
    not read as a request."""
    from ..batch import rows
    from ..batch.requests import _Request
    from ..generation.drafts import PromptLookup
    from ..generation.prefill import check_token_ids, token_ids
    from ..generation.sampling import SamplingParams

    ids = token_ids(ids)
    check_token_ids(engine.model, ids)
    if not ids or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"a request of {len(ids)} tokens and max_tokens {max_tokens!r}")
    request = _Request(ids, max_tokens, SamplingParams().sampler(), [], frozenset(token_ids(eos)))
    if lookup is not None:
        longest, shortest, fixed = token_ids(lookup, "lookup")
        draft = PromptLookup(longest, shortest)
        rows.start_drafting(request, engine.model, draft, fixed or None, 0, engine.max_draft)
    elif rank0 is not None:
        (fixed,) = token_ids(rank0, "rank0")
        if engine.max_draft == 0 or not 0 <= fixed <= engine.max_draft:
            raise ValueError(f"num_draft {fixed} (max_draft {engine.max_draft})")
        take_rank0_drafts(request, fixed or None)
    return request


def take_rank0_drafts(request, num_draft: int | None) -> None:
    """``request`` (a rank's copy) drafts with rank 0's draft model: :class:`Rank0Drafts`."""
    from ..generation.speculative import DraftLength

    request.drafter = Rank0Drafts()
    request.draft_length = DraftLength(num_draft)
    request.key = mx.random.key(0)  # its acceptance is rank 0's (Turns.adopt_kept)
    request.tokens = list(request.ids)


def drafting(request) -> dict:
    """How ``request`` drafts, for the other ranks' copies: by prompt lookup (its sizes), with
    rank 0's draft model, or not ({})."""
    drafter = request.drafter
    if drafter is None:
        return {}
    if request.draft_model is not None:
        return {"rank0": [request.draft_length.fixed or 0]}
    sizes = sorted(drafter.index)
    return {"lookup": [sizes[-1], sizes[0], request.draft_length.fixed or 0]}
