"""One request around the token loop: its prompt prepared, its tokens turned into text.

Before the loop, ``_prepare`` turns a prompt (text, token ids or chat messages, through
``prepare_prompt``) into a ``_Request``: the ids fitted in the context and the KV budget,
the sampling settings checked, the processors built, the cache found. After it, ``_results``
turns the loop's ``Step``s into ``GenerationResult``s: the UTF-8-safe detokenizer, stop
strings, EOS and the length, and the per-request timeline, finished on the last result.
The single-request loop (loop.py) and the batch engine's text side share both, so a request
reads the same whichever runs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import mlx.core as mx

from ..cache.prompt import PromptCache
from ..errors import PromptTooLongError
from ..loading.memory import KVLimit, kv_limit, size_text
from .prefill import check_token_ids, token_ids
from .prompt import clean_prompt, fit_context
from .results import GenerationResult, GenerationStats, Step
from .sampling import LogitsProcessor, SamplingParams
from .speculative import MAX_DRAFT
from .stop import StopMatcher

if TYPE_CHECKING:
    from ..output.constraints import Constraint
    from .drafts import Draft


def prepare_prompt(
    tokenizer,
    prompt: str | Sequence[int] | Sequence[dict[str, Any]],
    *,
    chat_template: bool = True,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids for a prompt given as text, ids, or chat messages.

    Text and message contents are cleaned first; messages go through the
    tokenizer's chat template (which supplies BOS itself when the model wants one),
    with ``tools`` as its ``tools`` variable when given and ``chat_template_kwargs`` as more
    variables (``enable_thinking``, ``reasoning_effort``, …).
    """
    extra = dict(chat_template_kwargs or {})
    if tools is not None:
        extra["tools"] = tools
    if isinstance(prompt, str):
        text = clean_prompt(prompt)
        if chat_template and tokenizer.has_chat_template:
            messages = [{"role": "user", "content": text}]
            return tokenizer.encode(
                tokenizer.apply_chat_template(messages, **extra), add_special_tokens=False
            )
        if tools is not None:
            raise ValueError("tools: they reach the model through its chat template (none used)")
        return tokenizer.encode(text)
    items = list(prompt)
    if items and isinstance(items[0], dict):
        messages = [
            {**m, "content": clean_prompt(m["content"])} if isinstance(m.get("content"), str) else m
            for m in items
        ]
        return tokenizer.encode(
            tokenizer.apply_chat_template(messages, **extra), add_special_tokens=False
        )
    if tools is not None:
        raise ValueError("tools: they reach the model through its chat template (none used)")
    return token_ids(items)


@dataclass
class _Request:
    """One request, prepared: its prompt ids, settings and the per-request state of its stream."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    processors: list[LogitsProcessor]  # the sampling's, then the constraint's
    prompt_cache: PromptCache
    stats: GenerationStats
    detok: Any  # the tokenizer's StreamingDetokenizer
    stops: StopMatcher
    eos: frozenset[int]
    t0: float


def _prepare(
    model,
    tokenizer,
    prompt,
    *,
    max_tokens: int,
    sampling: SamplingParams,
    stop: Sequence[str],
    chat_template: bool,
    truncate_prompt: bool,
    prompt_cache: PromptCache | None,
    max_kv_size: int | None,
    kv_bits: int | None,
    constraint: Constraint | None = None,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    kv_budget: float | None = None,
    draft: Draft | None = None,
    num_draft: int | None = None,
) -> _Request:
    """Tokenize and fit the prompt (in the context and the KV budget), check the settings,
    and find the request's cache."""
    t0 = time.perf_counter()
    ids = prepare_prompt(
        tokenizer,
        prompt,
        chat_template=chat_template,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
    )
    context = model.args.max_position_embeddings
    ids = fit_context(ids, context, max_tokens, truncate=truncate_prompt)
    check_token_ids(model, ids)  # from the tokenizer (a BOS it adds) or the caller's ids
    stats = GenerationStats(prompt_tokens=len(ids), tokenize_ms=(time.perf_counter() - t0) * 1000)
    sampling.check()
    processors = sampling.processors()
    if constraint is not None:
        processors.append(constraint.processor(tokenizer))
    if prompt_cache is None:
        prompt_cache = PromptCache(model.make_cache(max_kv_size=max_kv_size, kv_bits=kv_bits))
    limit = kv_limit(
        model,
        prompt_cache.cache,
        kv_budget,
        max_kv_size=max_kv_size,
        kv_bits=kv_bits,
        draft_model=getattr(draft, "model", None),
    )
    # A speculative step holds its drafted tokens until it rewinds: room for them too.
    room = limit.tokens - (max(num_draft or 0, MAX_DRAFT) if draft is not None else 0)
    ids = _fit_kv(ids, room, limit, max_tokens, truncate_prompt)
    stats.prompt_tokens = len(ids)
    stats.cached_tokens = len(ids) - len(prompt_cache.reuse(ids))
    n_new = min(max_tokens, context - len(ids))
    if room - len(ids) < n_new:
        n_new, stats.limited_by = int(room - len(ids)), "kv_budget"
    return _Request(
        ids,
        n_new,
        sampling,
        processors,
        prompt_cache,
        stats,
        tokenizer.detokenizer(),
        StopMatcher(stop),
        tokenizer.eos_token_ids,
        t0,
    )


def _fit_kv(ids: list[int], room: float, limit: KVLimit, max_tokens: int, truncate: bool):
    """``ids`` if the KV budget holds them and one new token; else left-truncated or refused."""
    if len(ids) < room:
        return ids
    if not truncate or room < 2:
        raise PromptTooLongError(
            f"prompt: {len(ids)} tokens, but the KV budget holds {max(int(room), 0)} tokens "
            f"({size_text(limit.budget)}: {limit.source}); shorten it, left-truncate "
            "(--truncate-prompt), or give the cache more room (kv_budget, a smaller or quantized "
            "cache: --kv-bits, --max-kv-size)"
        )
    keep = int(room) - max(1, min(max_tokens, int(room) // 2))
    return ids[-keep:]


def _results(
    request: _Request, steps: Iterator[Step], *, count_passes: bool
) -> Iterator[GenerationResult]:
    """Tokens to text: detokenize, hold back and cut at stop strings, end at EOS or the length,
    and keep the timeline (finished on the last result)."""
    stats, detok, stops = request.stats, request.detok, request.stops
    mx.reset_peak_memory()
    t_prefill = t_first = time.perf_counter()
    n = 0
    for step in steps:
        n += 1
        if n == 1:
            t_first = time.perf_counter()
            stats.prefill_tps = len(request.ids) / max(t_first - t_prefill, 1e-9)
            stats.time_to_first_token_s = t_first - request.t0
        if count_passes:
            stats.count(step)
        finish = None
        if step.token in request.eos:
            text, finish = detok.finalize(), "stop"
        else:
            text = detok.add_token(step.token)
            if n == request.max_tokens:
                text, finish = text + detok.finalize(), "length"
        text, hit = stops.push(text)
        if hit:
            finish = "stop"
        elif finish is not None:
            text += stops.flush()
        stats.generation_tokens = n
        if finish is not None:
            _finish_stats(stats, n, t_first)
        yield GenerationResult(
            text, step.token, step.logprobs, finish, step.from_draft, stats=stats
        )
        if finish is not None:
            return
    if n == 0:  # max_tokens == 0, or no room left in the context
        _finish_stats(stats, 0, t_first)
        yield GenerationResult("", -1, None, "length", stats=stats)


def _finish_stats(stats: GenerationStats, n: int, t_first: float) -> None:
    elapsed = time.perf_counter() - t_first
    stats.decode_tps = (n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
