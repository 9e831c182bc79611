"""The token loop and the streaming layer.

``generate_step`` is the engine: chunked prefill (prefill.py), then a decode
loop that builds step n+1's graph and starts it (``mx.async_eval``) before
handing step n's token to the caller. ``stream_generate`` wraps it, or the
speculative loop, with the tokenizer, in three parts: ``_prepare`` (prompt
cleaning, template, context checks, the cache), ``_steps`` (the token loop,
yielding ``results.Step``) and ``_results`` (the UTF-8-safe detokenizer, stop
strings, and the per-request timeline, finished on the last result). Sampling
settings travel as one ``SamplingParams``. ``generate`` just joins the stream.
Data flows one way: the loops import the shared types (results.py) and
prefill, and report what they did in what they yield.

Thread safety: a model and tokenizer may be shared by threads that each run
their own ``stream_generate`` with their own cache, one after another or at
the same time; each runs on its thread's own MLX streams (threads.py). A
``PromptCache`` must not be shared between concurrent requests. Stats use
MLX's process-wide peak-memory counter, which concurrent requests also share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import mlx.core as mx

from ..device import wired_limit
from ..errors import PromptTooLongError
from ..memory import KVLimit, kv_limit, size_text
from ..prompt_cache import PromptCache
from ..reasoning import split_results, splitter_for
from ..text import clean_prompt, fit_context
from ..threads import release_at_thread_exit
from ..toolcalls import output_rules
from .prefill import DEFAULT_PREFILL_STEP, check_token_ids, prefill, token_ids
from .results import GenerationResult, GenerationStats, Step
from .sampling import SAMPLING_FIELDS, LogitsProcessor, Sampler, SamplingParams, make_sampler
from .speculative import MAX_DRAFT, speculative_generate_step
from .stop import StopMatcher

if TYPE_CHECKING:
    from ..constraints import Constraint
    from .drafts import Draft


def generate_step(
    prompt: Sequence[int],
    model,
    *,
    prompt_cache: PromptCache | None = None,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
) -> Iterator[tuple[int, mx.array]]:
    """Yield ``(token, logprobs)`` for up to ``max_tokens`` new tokens.

    ``prompt_cache`` (reused when given) ends holding exactly the tokens fed
    to the model, whether the loop ran out or the caller stopped early.
    """
    release_at_thread_exit()
    sampler = sampler or make_sampler(0.0)
    pc = prompt_cache if prompt_cache is not None else PromptCache(model.make_cache())
    ids = token_ids(prompt)
    if not ids:
        raise ValueError("prompt: empty (expected at least one token)")
    check_token_ids(model, ids)
    todo = pc.reuse(ids)
    history = mx.array(ids, dtype=mx.int32)
    cache = pc.cache

    # Prefill all but the last prompt token; the last one starts decoding.
    prefill(model, pc, todo[:-1], prefill_step_size, then=max_tokens)
    todo = todo[-1:]
    fed = pc.tokens
    y = mx.array(todo, dtype=mx.int32)

    def step(tokens: mx.array) -> tuple[mx.array, mx.array]:
        nonlocal history
        logits = model(tokens[None], cache)[:, -1, :]  # (1, V): only the last position
        for process in logits_processors:
            logits = process(history, logits)
        # Samplers are shift-invariant, so they take the logits as they are; the
        # normalised log-probs are only computed if the caller reads them.
        token = sampler(logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if logits_processors:
            history = mx.concatenate([history, token])
        return token, logprobs[0]

    started: list[mx.array] = []  # the steps handed to mx.async_eval, newest last
    try:
        token, logprobs = step(y)
        # Start the first token now: otherwise it is only computed inside the
        # next step's async_eval, and `.item()` below waits for both.
        mx.async_eval(token)
        started.append(token)
        fed.extend(todo)
        n = 0
        while n < max_tokens:
            if n + 1 < max_tokens:
                next_token, next_logprobs = step(token)
                # Start computing step n+1 now; the host waits on step n below
                # (`.item()`) while the device already works on n+1.
                mx.async_eval(next_token)
                started[:] = [next_token]
            t = token.item()
            if n + 1 < max_tokens:
                fed.append(t)
            yield t, logprobs
            token, logprobs = (next_token, next_logprobs) if n + 1 < max_tokens else (None, None)
            n += 1
    finally:
        pc.tokens = fed
        # A caller that stops early (EOS, a stop string, break, an exception) leaves
        # step n+1 running on MLX's threads. Wait for it, so that no work of this
        # request outlives it: the next request, another thread or process exit
        # would otherwise meet it half done. At exit that hangs OpenBLAS 0.3.21:
        # its shutdown (gotoblas_quit, in _dl_fini) tells each worker to quit and
        # joins it, and a worker still inside a BLAS call overwrites that order
        # when the call ends, then sleeps forever (docs/blas.md).
        mx.eval(started)


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


_SAMPLING_DEFAULTS = {field: getattr(SamplingParams(), field) for field in SAMPLING_FIELDS}


def stream_generate(
    model,
    tokenizer,
    prompt: str | Sequence[int] | Sequence[dict[str, Any]],
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    repetition_context_size: int | None = None,
    seed: int | None = None,
    sampling: SamplingParams | None = None,
    stop: Sequence[str] = (),
    chat_template: bool = False,
    truncate_prompt: bool = False,
    prompt_cache: PromptCache | None = None,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_budget: float | None = None,
    prefill_step_size: int | None = None,
    draft: Draft | None = None,
    num_draft: int | None = None,
    response_format: dict | None = None,
    json_schema: dict | str | None = None,
    regex: str | None = None,
    choices: Sequence[str] | None = None,
    grammar: str | None = None,
    constraint: Constraint | None = None,
    tools: list[dict] | None = None,
    tool_choice: Any = None,
    split_reasoning: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Iterator[GenerationResult]:
    """Stream a completion, one result per generated token.

    Args:
        prompt: text, token ids, or a list of chat messages (``{"role", "content"}``).
        chat_template: wrap a text prompt as one user message in the model's template.
        temperature, top_p, top_k, min_p, seed: sampling (temperature 0 is greedy).
        repetition_penalty, repetition_context_size: transformers' repetition penalty.
        sampling: all of the above as one :class:`SamplingParams` (then leave them unset).
        stop: strings that end generation; they never appear in the output.
        truncate_prompt: left-truncate a prompt longer than the context instead of raising.
        prompt_cache: reuse (and update) caches across calls, e.g. chat turns.
        max_kv_size, kv_bits: bound the cache (rotating) or quantize it.
        kv_budget: bytes the KV cache (and a draft model's) may hold; None: what the machine
            can give when the request starts (``memory.kv_limit``); ``math.inf``: no limit. A
            prompt that cannot fit is a PromptTooLongError; a generation that reaches it ends
            with ``finish_reason="length"`` and ``stats.limited_by == "kv_budget"``.
        prefill_step_size: prompt tokens per prefill chunk (None: ``DEFAULT_PREFILL_STEP``).
        draft: speculative decoding with this draft source (``DraftModel``,
            ``PromptLookup``, ``SelfDraft``): same output, fewer target passes.
        num_draft: tokens drafted per step; None adapts it to the acceptance rate.
        response_format, json_schema, regex, choices, grammar, constraint: structured output,
            enforced token by token (at most one): OpenAI's ``response_format``, a JSON Schema,
            a regular expression, a list of strings to choose from, a Lark or GBNF grammar,
            or a :class:`~mlxinfer.constraints.Constraint`. Generation ends when the output
            is complete and the model ends it (EOS is masked until then).
        tools: functions the model may call (OpenAI's shape), shown to it by its chat template;
            the last result's ``tool_calls`` holds the calls parsed from the output.
        tool_choice: ``"auto"`` (default), ``"none"``, ``"required"`` or
            ``{"type": "function", "function": {"name": ...}}``: the last two generate a call
            constrained by the function's parameter schema.
        split_reasoning: for a model that reasons before it answers (``<think>`` tags, gpt-oss's
            harmony channels; read from its chat template): each result's ``reasoning`` gets the
            reasoning's text and ``text`` only the answer's, the markers in neither
            (:mod:`mlxinfer.reasoning`). Off: ``text`` is the output as the model wrote it.
        chat_template_kwargs: more variables for the chat template, as transformers'
            ``apply_chat_template(**kwargs)`` takes them: ``{"enable_thinking": False}``
            (Qwen3), ``{"reasoning_effort": "high"}`` (gpt-oss).
    Yields:
        GenerationResult; the last one has ``finish_reason`` set and full ``stats``.
    """
    given = dict(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        repetition_penalty=repetition_penalty,
        repetition_context_size=repetition_context_size,
    )
    if sampling is None:
        sampling = SamplingParams(**given)
    elif clash := [k for k, v in given.items() if v != _SAMPLING_DEFAULTS[k]]:
        raise ValueError(f"sampling: given as one SamplingParams, and also as {', '.join(clash)}")
    constraint, tooling = output_rules(
        tokenizer,
        tools,
        tool_choice,
        constraint=constraint,
        response_format=response_format,
        json_schema=json_schema,
        regex=regex,
        choices=choices,
        grammar=grammar,
    )
    request = _prepare(
        model,
        tokenizer,
        prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        constraint=constraint,
        tools=tooling.tools if tooling is not None else None,
        chat_template_kwargs=chat_template_kwargs,
        stop=stop,
        chat_template=chat_template,
        truncate_prompt=truncate_prompt,
        prompt_cache=prompt_cache,
        max_kv_size=max_kv_size,
        kv_bits=kv_bits,
        kv_budget=kv_budget,
        draft=draft,
        num_draft=num_draft,
    )
    steps = _steps(
        model, tokenizer, request, prefill_step_size or DEFAULT_PREFILL_STEP, draft, num_draft
    )
    with wired_limit():  # Metal: keep the weights resident for the run (no-op elsewhere)
        try:
            results = _results(request, steps, count_passes=draft is not None)
            if tooling is not None:
                results = tooling.results(results)
            if split_reasoning:
                results = split_results(results, splitter_for(tokenizer, request.ids))
            yield from results
        finally:
            steps.close()


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


def _steps(
    model,
    tokenizer,
    request: _Request,
    prefill_step_size: int,
    draft: Draft | None,
    num_draft: int | None,
) -> Iterator[Step]:
    """The token loop for the request: plain decoding, or speculative with ``draft``."""
    options = dict(
        prompt_cache=request.prompt_cache,
        max_tokens=request.max_tokens,
        sampler=request.sampling.sampler(),
        logits_processors=request.processors,
        prefill_step_size=prefill_step_size,
    )
    if draft is None:
        return (Step(t, lp) for t, lp in generate_step(request.ids, model, **options))
    draft.check(model, tokenizer)
    if getattr(draft, "model", None) is not None:  # a DraftModel is fed the prompt too
        check_token_ids(draft.model, request.ids, "prompt (for the draft model)")
    return speculative_generate_step(request.ids, model, draft, num_draft=num_draft, **options)


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


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """Generate and return the whole completion; takes ``stream_generate``'s options."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))
