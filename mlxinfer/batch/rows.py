"""How each row of a step picks its tokens: through its own processors and sampler, or by
verifying the drafts it proposed (the engine runs the forward and the rewind).

A row drafts by prompt lookup (copying from its own history), with the model's own MTP head
(``MTP``: the row's head cache, a sequence of the head's pool inside ``kv_budget``,
``head_pool``, fed the row's final hidden states by the prefill and verification forwards,
``observer``), or with a draft model: then its
draft keys are a sequence of that model's pool (``draft_pool``: the rows drafting with one model
propose together, k forwards of all of them), or, for a draft model a pool cannot hold, a cache
of its own (``DraftModel.drafter``, k forwards of the row alone); either is fed the prompt as the
target's prefill goes and rewound to the tokens the target kept.

A row's pick reads only its own logits and its own random key, so a seeded request draws
the same tokens whoever shares its steps.
"""

from __future__ import annotations

import secrets
from typing import Callable, NamedTuple

import mlx.core as mx

from ..backends import log_probs, log_probs_argmax
from ..generation.draft_length import DraftLength, nominal_costs
from ..generation.drafts import Draft, DraftModel, PromptLookup
from ..generation.mtp_drafts import MTP
from ..generation.speculative import _draft_sampler, accept_drafts, allowed_drafts
from .draft_pool import DraftPool
from .head_pool import PooledCache
from .requests import _Request


def start_drafting(
    request: _Request,
    model,
    draft: Draft | None,
    num_draft: int | None,
    seed: int | None,
    max_draft: int,
    pool_for: Callable[[DraftModel], DraftPool | None] = lambda draft: None,
) -> None:
    """Make ``request`` draft by prompt lookup or with a draft model (``num_draft`` tokens a
    step, or adaptive). A draft model drafts in the engine's pool for it (``pool_for``), or
    else in a cache of its own made here, empty; the engine feeds either."""
    if draft is None:
        raise ValueError("num_draft: given without a draft (draft=PromptLookup() or DraftModel)")
    if not isinstance(draft, (PromptLookup, DraftModel, MTP)):
        raise ValueError(
            "draft: the batching engine drafts by prompt lookup or with a draft model or the "
            f"model's MTP head (PromptLookup, DraftModel, MTP), found {type(draft).__name__}"
        )
    if isinstance(draft, DraftModel) and draft.prompt_cache is not None:
        raise ValueError(
            "draft: a DraftModel with a prompt_cache serves one request at a time; in the "
            "batching engine each request keeps its own draft cache (expected prompt_cache=None)"
        )
    if max_draft == 0:
        raise ValueError("draft: this engine was made with max_draft=0 (no drafting)")
    if num_draft is not None and not 1 <= num_draft <= max_draft:
        raise ValueError(f"num_draft must be in 1..{max_draft} (max_draft), got {num_draft}")
    if isinstance(draft, DraftModel):
        request.drafter = pool_for(draft) or draft.drafter(model)
        request.draft_model = draft.model
    elif isinstance(draft, MTP):
        request.drafter = draft.drafter(model)
    else:
        request.drafter = draft.start(model, [], request.ids)
    # Its k from nominal costs until the engine hands it measured ones (``Verification``).
    request.draft_length = DraftLength(num_draft, nominal_costs())
    request.key = mx.random.key(secrets.randbits(63) if seed is None else seed)
    request.tokens = list(request.ids)


def observer(r: _Request):
    """``r``'s drafter's ``observe`` when it reads the target's final hidden states (an MTP
    head), else None."""
    return getattr(r.drafter, "observe", None)


def feed_draft(r: _Request) -> None:
    """Catch ``r``'s draft model up with what the target's pool holds of its prompt (its
    shared prefix blocks too)."""
    if isinstance(r.drafter, DraftPool):
        r.drafter.feed(r, r.seq.length)
        return
    ids = r.ids[len(r.drafter.pc.tokens) : r.seq.length]
    if ids:
        r.drafter.feed(ids)


class Proposal(NamedTuple):
    tokens: list[int]  # the drafts, (m,)
    q: mx.array | None  # (m, V) log-probs they were drawn from; None: a point mass on each


def propose(rows: list[_Request], max_draft: int) -> tuple[list[Proposal], int]:
    """The drafts each row proposes this step (none for a plain row, or near ``max_tokens``),
    and the draft-model forwards they took: the rows drafting in one draft pool share each
    forward (k of them), the others take k each."""
    plans = [_plan(r, max_draft) for r in rows]
    drawn: list[tuple[mx.array, mx.array | None] | None] = [None] * len(rows)
    pooled: dict[int, list[int]] = {}
    forwards = 0
    for b, (r, plan) in enumerate(zip(rows, plans)):
        if plan is None:
            continue
        if isinstance(r.drafter, DraftPool):
            pooled.setdefault(id(r.drafter), []).append(b)
        else:
            drawn[b] = r.drafter.propose(r.tokens, *plan)
            forwards += plan[0] if r.draft_model is not None else 0
    for group in pooled.values():
        ks, samplers = zip(*(plans[b] for b in group))
        pool = rows[group[0]].drafter
        for b, out in zip(group, pool.propose([rows[b] for b in group], ks, samplers)):
            drawn[b] = out
        forwards += max(ks)
    proposals = []
    for r, out in zip(rows, drawn):
        if out is None:
            proposals.append(Proposal([], None))
            continue
        proposed, q = allowed_drafts(r.processors, r.tokens, *out)
        proposals.append(Proposal(proposed.tolist(), q))
    return proposals, forwards


def _plan(r: _Request, max_draft: int) -> tuple[int, Callable] | None:
    """(k, the sampler of its drafts) for a row drafting this step, else None."""
    if r.drafter is None:
        return None
    k = min(r.draft_length.k, max_draft, r.max_tokens - r.generated - 1)
    if r.sampler.params.greedy:  # no draws: no keys (a split a step would be an op a row)
        draft_key = r.key
    else:  # one split a step, drafts or not, as speculative_generate_step splits its key
        r.key, draft_key, r.accept_key = mx.random.split(r.key, 3)
    if k <= 0:
        return None
    # A draft model draws from the processed distribution the target uses (its own key).
    return k, _draft_sampler(r.sampler.params, r.processors, r.history, draft_key)


def rewind_draft(r: _Request, kept: list[int]) -> None:
    """The target's pool now holds ``kept`` for ``r``: its draft model's cache keeps at most
    that (drafts the target rejected go)."""
    if isinstance(r.drafter, DraftPool):
        r.drafter.rewind(r, kept)
    elif r.drafter is not None:
        r.drafter.rewind(kept)


def draft_state(r: _Request) -> list[mx.array]:
    """The arrays of ``r``'s own draft cache, to evaluate with the step that wrote them (a
    draft pool evaluates its own)."""
    if r.draft_model is None or isinstance(r.drafter, DraftPool):
        return []
    return [a for c in r.drafter.pc.cache for a in c.state]


def draft_nbytes(r: _Request) -> int:
    """The bytes of ``r``'s own draft cache (a draft pool and the MTP heads' pool count their
    blocks themselves): a draft model's, or an MTP head's a pool cannot hold (outside the
    budget)."""
    if observer(r) is not None:
        return 0 if isinstance(r.drafter.cache, PooledCache) else r.drafter.cache.nbytes
    if r.draft_model is None or isinstance(r.drafter, DraftPool):
        return 0
    return r.drafter.nbytes


def verify(
    r: _Request, logits: mx.array, proposal: Proposal
) -> tuple[mx.array, mx.array, mx.array]:
    """(drafts kept, the token after them, log-probs by position) for row ``r`` from its (L, V)
    ``logits``, all lazy. A plain row takes its first position through its own sampler."""
    if r.drafter is None:
        picked, logprobs = sample_rows([r], logits[:1])
        return mx.array(0), picked[0], logprobs[0][None]
    drafts = proposal.tokens
    logprobs = row_logprobs(r, logits[: len(drafts) + 1], drafts)  # (m+1, V)
    drafted = mx.array(drafts, dtype=mx.int32)
    a, t = accept_drafts(logprobs, drafted, proposal.q, r.sampler.params, r.accept_key)
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
    return log_probs(logits)


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
    normalised, picked = log_probs_argmax(logits)  # one pass over the rows for both
    picked = picked.astype(mx.int32)
    if not all(r.sampler.params.greedy for r in rows):
        picked = mx.concatenate(
            [
                picked[b : b + 1]
                if r.sampler.params.greedy
                else r.sampler(logits[b : b + 1]).astype(mx.int32)
                for b, r in enumerate(rows)
            ]
        )
    return picked, [normalised[b] for b in range(len(rows))]
