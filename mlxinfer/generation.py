"""The token loop and the streaming layer.

``generate_step`` is the engine: chunked prefill, then a decode loop that
builds step n+1's graph and starts it (``mx.async_eval``) before handing step
n's token to the caller. ``stream_generate`` wraps it with the tokenizer:
prompt cleaning, context checks, the UTF-8-safe detokenizer, stop strings and
the per-request timeline. ``generate`` just joins the stream.

Thread safety: a model and tokenizer may be shared by threads that each run
their own ``stream_generate`` with their own cache, one after another or at
the same time; each runs on its thread's own MLX streams (threads.py). A
``PromptCache`` must not be shared between concurrent requests. Stats use
MLX's process-wide peak-memory counter, which concurrent requests also share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import mlx.core as mx

from .device import wired_limit
from .prompt_cache import DEFAULT_PREFILL_STEP, PromptCache
from .sampling import LogitsProcessor, Sampler, make_logits_processors, make_sampler
from .speculative import speculative_generate_step
from .stop import StopMatcher
from .text import clean_prompt, fit_context
from .threads import release_at_thread_exit

if TYPE_CHECKING:
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
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt: empty (expected at least one token)")
    todo = pc.reuse(ids)
    history = mx.array(ids, dtype=mx.int32)
    cache = pc.cache

    # Prefill all but the last prompt token; the last one starts decoding.
    pc.prefill(model, todo[:-1], prefill_step_size, then=max_tokens)
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


@dataclass
class GenerationStats:
    """One request's timeline: tokenize → prefill → first token → decode."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a reused PromptCache
    generation_tokens: int = 0
    tokenize_ms: float = 0.0
    prefill_tps: float = 0.0
    time_to_first_token_s: float = 0.0
    decode_tps: float = 0.0
    peak_memory_gb: float = 0.0
    # speculative decoding (zero without a draft)
    draft_tokens: int = 0  # proposed by the draft
    accepted_tokens: int = 0  # of those, accepted by the target
    speculative_steps: int = 0  # target forward passes while decoding

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per target forward pass (1.0 for plain decoding)."""
        return self.generation_tokens / self.speculative_steps if self.speculative_steps else 0.0

    def table(self) -> str:
        rows = [
            ("prompt tokens", f"{self.prompt_tokens} ({self.cached_tokens} cached)"),
            ("tokenize", f"{self.tokenize_ms:.1f} ms"),
            ("prefill", f"{self.prefill_tps:.1f} tok/s"),
            ("time to first token", f"{self.time_to_first_token_s * 1000:.1f} ms"),
            ("generated tokens", f"{self.generation_tokens}"),
            ("decode", f"{self.decode_tps:.1f} tok/s"),
            ("peak memory", f"{self.peak_memory_gb:.3f} GB"),
        ]
        if self.speculative_steps:
            accepted = f"{self.accepted_tokens}/{self.draft_tokens} ({self.acceptance_rate:.0%})"
            rows[-1:-1] = [
                ("draft accepted", accepted),
                ("tokens per step", f"{self.tokens_per_step:.2f}"),
            ]
        return "\n".join(f"{k:<20} {v:>14}" for k, v in rows)


@dataclass
class GenerationResult:
    """One generated token and the text it completes."""

    text: str  # new text segment: may be "" (a partial character or a held-back stop prefix)
    token: int
    logprobs: mx.array | None = None  # (V,) log-probs the token was drawn from (before filtering)
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", or None while running
    from_draft: bool = False  # speculative decoding: proposed by the draft and accepted
    stats: GenerationStats = field(default_factory=GenerationStats)


def prepare_prompt(
    tokenizer, prompt: str | Sequence[int] | Sequence[dict[str, Any]], *, chat_template: bool = True
) -> list[int]:
    """Token ids for a prompt given as text, ids, or chat messages.

    Text and message contents are cleaned first; messages go through the
    tokenizer's chat template (which supplies BOS itself when the model wants one).
    """
    if isinstance(prompt, str):
        text = clean_prompt(prompt)
        if chat_template and tokenizer.has_chat_template:
            messages = [{"role": "user", "content": text}]
            return tokenizer.encode(
                tokenizer.apply_chat_template(messages), add_special_tokens=False
            )
        return tokenizer.encode(text)
    items = list(prompt)
    if items and isinstance(items[0], dict):
        messages = [
            {**m, "content": clean_prompt(m["content"])} if isinstance(m.get("content"), str) else m
            for m in items
        ]
        return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    return [int(t) for t in items]


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
    stop: Sequence[str] = (),
    chat_template: bool = False,
    truncate_prompt: bool = False,
    prompt_cache: PromptCache | None = None,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    prefill_step_size: int | None = None,
    draft: Draft | None = None,
    num_draft: int | None = None,
) -> Iterator[GenerationResult]:
    """Stream a completion, one result per generated token.

    Args:
        prompt: text, token ids, or a list of chat messages (``{"role", "content"}``).
        chat_template: wrap a text prompt as one user message in the model's template.
        temperature, top_p, top_k, min_p, seed: sampling (temperature 0 is greedy).
        repetition_penalty, repetition_context_size: transformers' repetition penalty.
        stop: strings that end generation; they never appear in the output.
        truncate_prompt: left-truncate a prompt longer than the context instead of raising.
        prompt_cache: reuse (and update) caches across calls, e.g. chat turns.
        max_kv_size, kv_bits: bound the cache (rotating) or quantize it.
        prefill_step_size: prompt tokens per prefill chunk (None: ``DEFAULT_PREFILL_STEP``).
        draft: speculative decoding with this draft source (``DraftModel``,
            ``PromptLookup``, ``SelfDraft``): same output, fewer target passes.
        num_draft: tokens drafted per step; None adapts it to the acceptance rate.
    Yields:
        GenerationResult; the last one has ``finish_reason`` set and full ``stats``.
    """
    t0 = time.perf_counter()
    prefill_step_size = prefill_step_size or DEFAULT_PREFILL_STEP
    ids = prepare_prompt(tokenizer, prompt, chat_template=chat_template)
    context = model.args.max_position_embeddings
    ids = fit_context(ids, context, max_tokens, truncate=truncate_prompt)
    max_tokens = min(max_tokens, context - len(ids))
    stats = GenerationStats(prompt_tokens=len(ids), tokenize_ms=(time.perf_counter() - t0) * 1000)
    sampler = make_sampler(temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    processors = make_logits_processors(
        repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size
    )
    if prompt_cache is None:
        prompt_cache = PromptCache(model.make_cache(max_kv_size=max_kv_size, kv_bits=kv_bits))
    stats.cached_tokens = len(ids) - len(prompt_cache.reuse(ids))
    detok = tokenizer.detokenizer()
    stops = StopMatcher(stop)
    eos = tokenizer.eos_token_ids
    mx.reset_peak_memory()
    t_prefill = time.perf_counter()
    t_first = t_prefill
    n = 0
    if draft is None:
        steps = generate_step(
            ids,
            model,
            prompt_cache=prompt_cache,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=processors,
            prefill_step_size=prefill_step_size,
        )
        tokens = ((t, lp, False) for t, lp in steps)
    else:
        draft.check(model, tokenizer)
        steps = tokens = speculative_generate_step(
            ids,
            model,
            draft,
            prompt_cache=prompt_cache,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=processors,
            prefill_step_size=prefill_step_size,
            num_draft=num_draft,
            stats=stats,
        )
    with wired_limit():  # Metal: keep the weights resident for the run (no-op elsewhere)
        try:
            for token, logprobs, from_draft in tokens:
                n += 1
                if n == 1:
                    t_first = time.perf_counter()
                    stats.prefill_tps = len(ids) / max(t_first - t_prefill, 1e-9)
                    stats.time_to_first_token_s = t_first - t0
                finish = None
                if token in eos:
                    text, finish = detok.finalize(), "stop"
                else:
                    text = detok.add_token(token)
                    if n == max_tokens:
                        text, finish = text + detok.finalize(), "length"
                text, hit = stops.push(text)
                if hit:
                    finish = "stop"
                elif finish is not None:
                    text += stops.flush()
                stats.generation_tokens = n
                if finish is not None:
                    _finish_stats(stats, n, t_first)
                yield GenerationResult(text, token, logprobs, finish, from_draft, stats=stats)
                if finish is not None:
                    return
            if n == 0:  # max_tokens == 0, or no room left in the context
                _finish_stats(stats, 0, t_first)
                yield GenerationResult("", -1, None, "length", stats=stats)
        finally:
            steps.close()


def _finish_stats(stats: GenerationStats, n: int, t_first: float) -> None:
    elapsed = time.perf_counter() - t_first
    stats.decode_tps = (n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """Generate and return the whole completion; takes ``stream_generate``'s options."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))
