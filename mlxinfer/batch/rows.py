"""How each row of a step picks its tokens: through its own processors and sampler, or by
verifying the drafts it proposed by prompt lookup (the engine runs the forward and the rewind).

A row's pick reads only its own logits and its own random key, so a seeded request draws
the same tokens whoever shares its steps.
"""

from __future__ import annotations

import secrets

import mlx.core as mx

from ..generation.drafts import Draft, PromptLookup
from ..generation.speculative import DraftLength, accept_drafts, allowed_drafts
from .requests import _Request


def start_drafting(
    request: _Request,
    model,
    draft: Draft | None,
    num_draft: int | None,
    seed: int | None,
    max_draft: int,
) -> None:
    """Make ``request`` draft by prompt lookup (``num_draft`` tokens a step, or adaptive)."""
    if draft is None:
        raise ValueError("num_draft: given without a draft (draft=PromptLookup())")
    if not isinstance(draft, PromptLookup):
        raise ValueError(
            "draft: the batching engine drafts by prompt lookup (PromptLookup), "
            f"found {type(draft).__name__}"
        )
    if max_draft == 0:
        raise ValueError("draft: this engine was made with max_draft=0 (no drafting)")
    if num_draft is not None and not 1 <= num_draft <= max_draft:
        raise ValueError(f"num_draft must be in 1..{max_draft} (max_draft), got {num_draft}")
    request.drafter = draft.start(model, [], request.ids)
    request.draft_length = DraftLength(num_draft)
    request.key = mx.random.key(secrets.randbits(63) if seed is None else seed)
    request.tokens = list(request.ids)


def propose(r: _Request, max_draft: int) -> list[int]:
    """The drafts ``r`` proposes this step (none for a plain row, or near ``max_tokens``)."""
    if r.drafter is None:
        return []
    k = min(r.draft_length.k, max_draft, r.max_tokens - r.generated - 1)
    if k <= 0:
        return []
    proposed, _ = r.drafter.propose(r.tokens, k, None)
    proposed, _ = allowed_drafts(r.processors, r.tokens, proposed, None)
    return proposed.tolist()


def verify(r: _Request, logits: mx.array, drafts: list[int]) -> tuple[mx.array, mx.array, mx.array]:
    """(drafts kept, the token after them, log-probs by position) for row ``r`` from its (L, V)
    ``logits``, all lazy. A plain row takes its first position through its own sampler."""
    if r.drafter is None:
        picked, logprobs = sample_rows([r], logits[:1])
        return mx.array(0), picked[0], logprobs[0][None]
    logprobs = row_logprobs(r, logits[: len(drafts) + 1], drafts)  # (m+1, V)
    r.key, _, accept_key = mx.random.split(r.key, 3)  # as speculative_generate_step splits it
    drafted = mx.array(drafts, dtype=mx.int32)
    a, t = accept_drafts(logprobs, drafted, None, r.sampler.params, accept_key)
    return a, t, logprobs


def row_logprobs(r: _Request, logits: mx.array, drafts: list[int]) -> mx.array:
    """A drafting row's log-probs at its m+1 positions, position i after its history and the
    first i drafts, through its processors (as ``speculative._verify``)."""
    if r.processors:
        rows = []
        for i in range(logits.shape[0]):
            row = logits[i : i + 1]
            seen = mx.concatenate([r.history, mx.array(drafts[:i], dtype=mx.int32)])
            for process in r.processors:
                row = process(seen, row)
            rows.append(row)
        logits = mx.concatenate(rows)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sample_rows(rows: list[_Request], logits: mx.array) -> tuple[mx.array, list[mx.array]]:
    """Each row's token and log-probs, through its own processors and sampler (with its own
    random key). Greedy rows are one argmax over the batch, the log-probs one normalisation."""
    if any(r.processors for r in rows):
        processed = []
        for b, r in enumerate(rows):
            row = logits[b : b + 1]
            for process in r.processors:
                row = process(r.history, row)
            processed.append(row)
        logits = mx.concatenate(processed)
    picked = mx.argmax(logits, axis=-1).astype(mx.int32)
    if not all(r.sampler.params.greedy for r in rows):
        picked = mx.concatenate(
            [
                picked[b : b + 1]
                if r.sampler.params.greedy
                else r.sampler(logits[b : b + 1]).astype(mx.int32)
                for b, r in enumerate(rows)
            ]
        )
    normalised = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return picked, [normalised[b] for b in range(len(rows))]
