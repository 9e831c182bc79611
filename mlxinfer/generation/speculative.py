"""Speculative decoding: draft, verify, rewind.

A sibling of ``generation.generate_step`` with the same outputs plus a flag
saying which tokens came from the draft. Each step:

1. the draft proposes up to k tokens after the last token y (``drafts.py``:
   a second model, prompt lookup, the target's own first layers, or its MTP
   head, which reads the target's final hidden states of the tokens kept);
2. the target runs once over [y, d1 … dk] and so scores k+1 positions;
3. the acceptance rule keeps a prefix d1 … da and adds one token of the
   target's own (a correction at a+1, or a bonus token when all k passed);
4. both caches are trimmed back to the tokens kept. A model with recurrent
   layers (state caches, which cannot drop tokens) snapshots its caches
   before the pass instead, and its recurrent layers keep their state after
   each position of the pass (lazily): a rejection takes the state at the last
   token kept, with no other forward (``prefill.rewind``; a layer that cannot
   falls back to restoring the snapshot and feeding y and the accepted drafts
   again).

Greedy output is token-identical to plain greedy decoding, and sampled output
has exactly the target's distribution (the draft only changes the speed): the
target and the draft draw from the same processed distribution the plain
sampler uses (logits processors, temperature, top-k, top-p, min-p).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Generator, Sequence, cast

import mlx.core as mx

from ..cache.kv import LayerCache, StateCache, is_trimmable
from ..cache.prompt import PromptCache
from ..cache.rotating import RotatingKVCache
from ..errors import DraftError
from ..platform.threads import release_at_thread_exit
from . import draft_length
from .draft_length import MAX_DRAFT, DraftLength, StepCosts, nominal_costs, timed
from .prefill import DEFAULT_PREFILL_STEP, prefill, rewind
from .results import Step
from .sampling import LogitsProcessor, Sampler, SamplingParams

if TYPE_CHECKING:
    from .drafts import Draft, DraftSampler


def speculative_generate_step(
    prompt: Sequence[int],
    model,
    draft: Draft,
    *,
    prompt_cache: PromptCache | None = None,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    num_draft: int | None = None,
) -> Generator[Step, None, None]:
    """Yield ``(token, logprobs, from_draft)`` for up to ``max_tokens`` new tokens.

    Args:
        draft: a draft source (``DraftModel``, ``PromptLookup``, ``SelfDraft``).
        sampler: from ``make_sampler``; its ``params`` define the distribution
            both models draw from (greedy when None).
        num_draft: draft exactly this many tokens per step; None chooses k from the
            measured step costs and acceptance (0 … ``MAX_DRAFT``; 0 is plain decoding:
            ``draft_length.py``).
    Yields:
        A :class:`~mlxinfer.results.Step` per token: the token and the (V,)
        log-probs it was drawn from (after logits processors, before
        filtering), whether the draft proposed it and it was accepted, and on
        the first token of each target pass that pass's counts (``passes``,
        ``drafted``, ``accepted``).

    ``prompt_cache`` (reused when given) ends holding exactly the tokens fed
    to the model, whether the loop ran out or the caller stopped early.
    """
    release_at_thread_exit()
    params = _sampling_params(sampler)
    if num_draft is not None and num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    pc = prompt_cache if prompt_cache is not None else PromptCache(model.make_cache())
    ids = list(prompt)
    _require_rewindable(pc.cache, len(ids) + max_tokens)
    todo = pc.reuse(ids)
    drafter = draft.start(model, pc.cache, ids)
    # An MTP head reads the target's final hidden states (drafts.Observer): those of the
    # prompt as it is prefilled, then those of each verified token kept. It may take a reused
    # prefix's pairs from its last request (MTP(keep_cache=True)): then one more token is fed.
    observe = getattr(drafter, "observe", None)
    if (resume := getattr(drafter, "resume", None)) is not None:
        todo = resume(pc, ids, todo)

    def prime(hidden: mx.array, start: int) -> list[mx.array]:
        assert observe is not None  # passed to prefill only then
        return observe(hidden, todo[start + 1 : start + 1 + hidden.shape[0]])

    # Room for every token and the longest draft verified past the last one.
    prefill(
        model,
        pc,
        todo[:-1],
        prefill_step_size,
        then=max_tokens + max(num_draft or 0, MAX_DRAFT),
        observe=prime if observe is not None else None,
    )
    key = mx.random.key(secrets.randbits(63) if params.seed is None else params.seed)
    # Across ranks every rank must draft the same k: timings differ, so nominal costs there.
    alone = getattr(model, "backend", None) != "distributed"
    # While drafting does not pay (k = 0), steps run as plain decoding does: pipelined, without
    # the drafting bookkeeping (so a request never decodes slower than without a draft). Not for
    # a request whose tokens must not depend on timings (seeded), with logits processors, or on
    # state caches (their passes record states by position).
    plain_ok = num_draft is None and timed(params) and alone and not logits_processors
    plain_ok = plain_ok and is_trimmable(pc.cache)
    k_policy = DraftLength(
        num_draft,
        _costs(model, draft) if timed(params) and alone else nominal_costs(),
        measure_plain=plain_ok,
    )
    history = list(ids)  # every token so far; the last one is in no cache yet
    n = 0
    # State caches cannot drop rejected drafts: each pass starts from a snapshot (cheap), and
    # those that can keep the pass's states by position (a rejection goes back to one of them).
    restorable = not is_trimmable(pc.cache)
    snapshot = None
    _record(pc.cache, True)
    try:
        while n < max_tokens:
            k = min(k_policy.k, max_tokens - n - 1)  # a step emits up to k+1 tokens
            if k == 0 and plain_ok:
                count = min(k_policy.plain_steps(), max_tokens - n)
                k_policy.start()
                key, run_key = mx.random.split(key)
                ran = 0
                try:
                    for step in _plain_run(model, pc, history, count, params, run_key, observe):
                        ran += 1
                        n += 1
                        yield step
                finally:
                    k_policy.ran_plain(ran)
                drafter.rewind(pc.tokens)
                continue
            key, draft_key, accept_key = mx.random.split(key, 3)
            seen = mx.array(history, dtype=mx.int32) if logits_processors else None
            k_policy.start()
            if k > 0:
                drafts, q = drafter.propose(
                    history, k, _draft_sampler(params, logits_processors, seen, draft_key)
                )
                # Evaluated apart from the verification only to time the two (k's costs).
                mx.eval(drafts, q if q is not None else [])
            else:
                drafts, q = mx.array([], dtype=mx.int32), None
            draft_s = k_policy.drafted()
            drafts, q = allowed_drafts(logits_processors, history, drafts, q)
            m = drafts.shape[0]
            if restorable:
                snapshot = pc.snapshot()
            logprobs, hidden = _verify(
                model, pc.cache, history[-1], drafts, logits_processors, seen, observe is not None
            )  # (m+1, V), (m+1, H) or None
            accepted, token = accept_drafts(logprobs, drafts, q, params, accept_key)
            # The one sync per step: the host needs the accepted count and the
            # tokens to know what to feed next.
            mx.eval(accepted, token, drafts, logprobs)
            # int32 arrays: ints and a list of ints (MLX's stubs say any scalar, any nesting).
            a = cast(int, accepted.item())
            emitted = cast("list[int]", drafts[:a].tolist()) + [cast(int, token.item())]
            pc.tokens = history + emitted[:-1]  # y and the accepted drafts are in the cache
            rewind(model, pc, len(pc.tokens), snapshot)  # drop the m - a rejected drafts
            history += emitted
            if observe is not None:
                # The target's states at y and the accepted drafts, each followed by its token.
                assert hidden is not None
                observe(hidden[: a + 1], emitted)
            drafter.rewind(pc.tokens)
            verify_s = k_policy.verified(k, draft_s, m + 1)
            k_policy.update(a, m)
            for j, t in enumerate(emitted):
                n += 1
                if j == 0:  # the pass's counts travel with its first token
                    yield Step(t, logprobs[j], j < a, 1, m, a, draft_s, verify_s)
                else:
                    yield Step(t, logprobs[j], j < a, 0)
    finally:
        # Keep at most the tokens the caller received (plain decoding's rule).
        rewind(model, pc, min(len(pc.tokens), len(ids) + n), snapshot)
        drafter.rewind(pc.tokens)
        if (flush := getattr(drafter, "flush", None)) is not None:
            mx.eval(flush())  # an MTP head's waiting pairs: its cache whole for a kept head
        _record(pc.cache, False)


def _plain_run(model, pc: PromptCache, history: list[int], count: int, params, key, observe):
    """``count`` tokens of plain decoding after ``history`` (its last token not in the cache
    yet), pipelined like ``generate_step``: step i+1 is handed to MLX before token i is read.
    Appends to ``history`` and keeps ``pc.tokens`` to what the cache holds (an early stop leaves
    one token fed past the last read, as plain decoding does). With ``observe`` (an MTP head),
    the states of the tokens read go to the head in one call at the end."""
    cache = pc.cache
    states: list[mx.array] = []
    read: list[int] = []

    def step(y: mx.array, key: mx.array) -> tuple[mx.array, mx.array, mx.array | None]:
        if observe is not None:
            hidden, logits = model.trunk(y[None], cache)
            hidden = hidden[0, -1]  # (H,)
        else:
            logits, hidden = model(y[None], cache), None
        row = logits[0, -1]  # (V,)
        logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)  # lazy: read if asked for
        if params.greedy:
            token = mx.argmax(row, axis=-1, keepdims=True).astype(mx.int32)
        else:
            filtered = params.filter(logprobs.astype(mx.float32))
            token = mx.random.categorical(filtered, key=key)[None].astype(mx.int32)
        return token, logprobs, hidden

    keys = mx.random.split(key, count) if not params.greedy else [key] * count
    clock = draft_length.perf_counter  # looked up now: the tests' fake clock, if they set one
    last = clock()
    current = step(mx.array(history[-1:], dtype=mx.int32), keys[0])
    mx.async_eval(current[0])
    pc.tokens = list(history)  # the last token is fed now
    started = [current[0]]
    try:
        for i in range(count):
            token, logprobs, hidden = current
            if i + 1 < count:
                current = step(token, keys[i + 1])
                mx.async_eval(current[0])
                started[:] = [current[0]]
            t = cast(int, token.item())
            history.append(t)
            if i + 1 < count:
                pc.tokens.append(t)  # fed to step i + 1
            if hidden is not None:
                states.append(hidden)
            read.append(t)
            now = clock()
            # A plain pass: its seconds are those since the last token was read (pipelined).
            seconds, last = now - last, now
            yield Step(t, logprobs, False, 1, 0, 0, 0.0, seconds)
    finally:
        mx.eval(started)  # no work of this request outlives it (generate_step's rule)
        if observe is not None and read:
            # The state at each fed token, followed by the token read after it.
            observe(mx.stack(states), read)


def _record(cache: list[LayerCache], on: bool) -> None:
    """State caches keep (or stop keeping) each pass's states by position (``StateCache``)."""
    for c in cache:
        if isinstance(c, StateCache):
            c.recording = on


def allowed_drafts(
    processors: Sequence[LogitsProcessor], history, drafts: mx.array, q: mx.array | None
) -> tuple[mx.array, mx.array | None]:
    """The drafts a constraint among ``processors`` allows after ``history``, up to the first
    it forbids (which could never be accepted): they are dropped before verification."""
    for process in processors:
        allowed = getattr(process, "allowed_prefix", None)
        if allowed is not None and drafts.shape[0]:
            n = allowed(history, drafts.tolist())
            if n < drafts.shape[0]:
                drafts, q = drafts[:n], q[:n] if q is not None else None
    return drafts, q


def _verify(
    model,
    cache: list[LayerCache],
    y: int,
    drafts: mx.array,
    processors: Sequence[LogitsProcessor],
    seen: mx.array | None,
    with_hidden: bool = False,
) -> tuple[mx.array, mx.array | None]:
    """The target's log-probs at the k+1 positions after y, d1 … dk: (k+1, V); with
    ``with_hidden`` also its final hidden states there (k+1, H) (``model.trunk``), else None."""
    inputs = mx.concatenate([mx.array([y], dtype=mx.int32), drafts])  # (k+1,)
    hidden = None
    if with_hidden:
        hidden, logits = model.trunk(inputs[None], cache)
        hidden, logits = hidden[0], logits[0]  # (k+1, H), (k+1, V)
    else:
        logits = model(inputs[None], cache)[0]  # (k+1, V)
    if processors:
        # Row i continues history + d1 … di, exactly as plain decoding would see it.
        assert seen is not None  # the history, given whenever there are processors
        rows = []
        for i in range(logits.shape[0]):
            row, tokens = logits[i : i + 1], mx.concatenate([seen, drafts[:i]])
            for process in processors:
                row = process(tokens, row)
            rows.append(row)
        logits = mx.concatenate(rows)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True), hidden


def accept_drafts(
    logprobs: mx.array, drafts: mx.array, q: mx.array | None, params: SamplingParams, key: mx.array
) -> tuple[mx.array, mx.array]:
    """How many drafts to keep, and the target's token after them (both lazy scalars).

    ``logprobs``: the target's (k+1, V); ``q``: the (k, V) log-probs the drafts
    were drawn from, or None for a point-mass draft (prompt lookup, greedy).
    """
    k = drafts.shape[0]
    if params.greedy:
        # Greedy: the target's choice at each position is its argmax. Keep the
        # longest prefix of drafts equal to it; the first position that differs
        # (or position k+1 when none does) contributes the target's argmax.
        best = mx.argmax(logprobs, axis=-1).astype(mx.int32)  # (k+1,)
        a = mx.sum(mx.cumprod((drafts == best[:k]).astype(mx.int32)))
        return a, best[a]
    # Sampling (Leviathan et al. 2023; Chen et al. 2023). With p the target's
    # and q the draft's processed distribution at position i and d ~ q the draft:
    #   accept d with probability min(1, p(d) / q(d));
    #   on rejection, draw from max(0, p - q) / Σ max(0, p - q) and stop.
    # Then P(emit x) = min(p(x), q(x)) + (1 - Σ min(p, q)) · max(0, p(x) - q(x)) / Σ max(0, p - q)
    #               = min(p, q)(x) + max(0, p(x) - q(x)) = p(x): exactly the target's.
    # A deterministic draft is q = point mass on d: accept with probability p(d),
    # else draw from p with d removed. When all k pass, the extra (bonus) token
    # is drawn from the target's p at position k+1 (q = 0 there).
    p = mx.exp(params.filter(logprobs.astype(mx.float32)))  # (k+1, V)
    V = p.shape[-1]
    q = (
        mx.exp(q.astype(mx.float32))
        if q is not None
        else (mx.arange(V)[None] == drafts[:, None]).astype(mx.float32)
    )
    u_key, r_key = mx.random.split(key)
    p_d = mx.take_along_axis(p[:k], drafts[:, None], axis=-1)[:, 0]  # (k,)
    q_d = mx.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]  # (k,)
    ok = _accepts(p_d, q_d, mx.random.uniform(shape=(k,), key=u_key))
    a = mx.sum(mx.cumprod(ok.astype(mx.int32)))
    q_next = mx.concatenate([q, mx.zeros((1, V), mx.float32)])[a]  # (V,)
    r = _residual(p[a], q_next)
    return a, mx.random.categorical(mx.log(r), key=r_key).astype(mx.int32)


def _accepts(p_d: mx.array, q_d: mx.array, u: mx.array) -> mx.array:
    """u < p(d) / q(d) with u ~ U[0, 1): probability min(1, p(d) / q(d)) (q(d) > 0: d was drawn from q)."""
    return u * q_d < p_d


def _residual(p: mx.array, q: mx.array) -> mx.array:
    """max(0, p - q), unnormalised (categorical normalises). Falls back to p in
    the measure-zero case that nothing is left (p == q and yet rejected)."""
    r = mx.maximum(p - q, 0.0)
    return mx.where(mx.sum(r) > 0, r, p)


def _draft_sampler(
    params: SamplingParams,
    processors: Sequence[LogitsProcessor],
    seen: mx.array | None,
    key: mx.array,
) -> DraftSampler:
    """Draw draft tokens from the processed distribution the target uses (one step's worth)."""
    drafted: list[mx.array] = []

    def sample(logits: mx.array) -> tuple[mx.array, mx.array | None]:
        nonlocal key
        if processors:
            assert seen is not None  # the history, given whenever there are processors
            tokens = mx.concatenate([seen, *drafted])
            for process in processors:
                logits = process(tokens, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (1, V)
        if params.greedy:
            token, dist = mx.argmax(logprobs, axis=-1).astype(mx.int32), None
        else:
            key, sub = mx.random.split(key)
            dist = params.filter(logprobs.astype(mx.float32))
            token = mx.random.categorical(dist, axis=-1, key=sub).astype(mx.int32)
        drafted.append(token)
        return token, dist

    return sample


def _costs(model, draft: Draft) -> StepCosts:
    """The measured step costs of ``model`` drafting with ``draft``: one table per model object
    and kind of draft (its model, if it has one), kept on the model, since they depend on the
    model, the draft and the backend, not on the request."""
    tables = getattr(model, "__dict__", {}).get("_step_costs")
    if not isinstance(tables, dict):
        tables = {}
        try:  # a plain attribute: set as a module's, a dict would join its parameter tree
            object.__setattr__(model, "_step_costs", tables)
        except (AttributeError, TypeError):  # a model that takes no attributes: this request's
            pass
    key = (type(draft).__name__, id(getattr(draft, "model", None)))
    return tables.setdefault(key, StepCosts())


def _sampling_params(sampler: Sampler | None) -> SamplingParams:
    if sampler is None:
        return SamplingParams()
    params = getattr(sampler, "params", None)
    if not isinstance(params, SamplingParams):
        raise ValueError(
            "speculative decoding needs a sampler from make_sampler: its settings define the "
            "distribution both models draw from"
        )
    return params


def _require_rewindable(cache: list[LayerCache], needed: int) -> None:
    """Refuse caches that could not drop rejected drafts during this request."""
    for c in cache:
        if isinstance(c, RotatingKVCache) and c.max_size < needed:
            raise DraftError(
                f"speculative decoding rewinds the KV cache, but this rotating cache "
                f"(--max-kv-size or sliding window) keeps {c.max_size} tokens and the request "
                f"may hold {needed}; drop --max-kv-size or the draft"
            )
        if not c.is_trimmable() and not isinstance(c, StateCache):  # those restore snapshots
            raise DraftError(
                f"speculative decoding rewinds the KV cache, but this {type(c).__name__} "
                "cannot be trimmed"
            )
