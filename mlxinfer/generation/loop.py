"""The token loop and the streaming layer.

``generate_step`` is the engine: chunked prefill (prefill.py), then a decode
loop that builds step n+1's graph and starts it (``mx.async_eval``) before
handing step n's token to the caller. ``stream_generate`` wraps it, or the
speculative loop, with the tokenizer, in three parts: ``prepare_request``
(output rules, prompt cleaning, template, context and KV checks), ``_steps``
(the token loop, yielding ``results.Step``) and ``PreparedRequest.results``
(the UTF-8-safe detokenizer, stop strings, the per-request timeline, tool calls
and reasoning); the first and the last are the request's, in request.py, shared
with the batch engine. Sampling settings travel as one ``SamplingParams``, output rules as one
``OutputRules``.
``generate`` just joins the stream.
Data flows one way: the loops import the shared types (results.py) and
prefill, and report what they did in what they yield.

Thread safety: a model and tokenizer may be shared by threads that each run
their own ``stream_generate`` with their own cache, one after another or at
the same time; each runs on its thread's own MLX streams (threads.py). A
``PromptCache`` must not be shared between concurrent requests. Stats use
MLX's process-wide peak-memory counter, which concurrent requests also share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator, Iterator, Sequence, cast

import mlx.core as mx

from ..cache.prompt import PromptCache
from ..loading.memory import kv_limit
from ..platform.device import wired_limit
from ..platform.threads import release_at_thread_exit
from .images import (
    PromptImages,
    image_inputs,
    images_in_messages,
    load_images,
    prefill_images,
)
from .prefill import DEFAULT_PREFILL_STEP, check_token_ids, prefill, token_ids
from .request import KVRoom, PreparedRequest, prepare_prompt, prepare_request
from .results import GenerationResult, Step
from .rules import OutputRules
from .sampling import SAMPLING_FIELDS, LogitsProcessor, Sampler, SamplingParams, make_sampler
from .speculative import MAX_DRAFT, speculative_generate_step

if TYPE_CHECKING:
    from ..output.constraints import Constraint
    from .drafts import Draft

# prepare_prompt is imported from here too (the server).
__all__ = ["generate", "generate_step", "prepare_prompt", "stream_generate"]


def generate_step(
    prompt: Sequence[int],
    model,
    *,
    prompt_cache: PromptCache | None = None,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    inputs: dict[str, mx.array] | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Yield ``(token, logprobs)`` for up to ``max_tokens`` new tokens.

    ``prompt_cache`` (reused when given) ends holding exactly the tokens fed
    to the model, whether the loop ran out or the caller stopped early. ``inputs``: the
    model's extra inputs for the prompt's positions (images.py: ``embeds`` and ``blocks``);
    the cache must then be fresh.
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
    if inputs is None:
        prefill(model, pc, todo[:-1], prefill_step_size, then=max_tokens)
    else:  # a prompt with images (its last token is text: the template's generation prompt)
        prefill_images(model, pc, todo[:-1], inputs, prefill_step_size, then=max_tokens)
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
    token: mx.array | None  # the step handed to the caller next; None after the last
    logprobs: mx.array | None
    try:
        token, logprobs = step(y)
        # Start the first token now: otherwise it is only computed inside the
        # next step's async_eval, and `.item()` below waits for both.
        mx.async_eval(token)
        started.append(token)
        fed.extend(todo)
        n = 0
        while n < max_tokens:
            assert token is not None and logprobs is not None  # None only after the last step
            if n + 1 < max_tokens:
                next_token, next_logprobs = step(token)
                # Start computing step n+1 now; the host waits on step n below
                # (`.item()`) while the device already works on n+1.
                mx.async_eval(next_token)
                started[:] = [next_token]
            t = cast(int, token.item())  # an int32 scalar: an int (MLX's stub says any scalar)
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
    output: OutputRules | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    images: Sequence[Any] | None = None,
) -> Iterator[GenerationResult]:
    """Stream a completion, one result per generated token.

    Args:
        prompt: text, token ids, or a list of chat messages (``{"role", "content"}``).
        chat_template: wrap a text prompt as one user message in the model's template.
        temperature, top_p, top_k, min_p, seed: sampling (temperature 0 is greedy).
        repetition_penalty, repetition_context_size: transformers' repetition penalty.
        sampling: all of the above as one :class:`SamplingParams` (then leave them unset).
        stop: strings that end generation; they never appear in the output (the last
            result's ``stop_string`` names the one that ended it).
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
            or a :class:`~mlxinfer.output.constraints.Constraint`. Generation ends when the output
            is complete and the model ends it (EOS is masked until then).
        tools: functions the model may call (OpenAI's shape), shown to it by its chat template;
            the last result's ``tool_calls`` holds the calls parsed from the output, whose text
            is held back from ``text`` (``in_tool_call`` once a call has begun).
        tool_choice: ``"auto"`` (default), ``"none"``, ``"required"`` or
            ``{"type": "function", "function": {"name": ...}}``: the last two generate a call
            constrained by the function's parameter schema.
        split_reasoning: for a model that reasons before it answers (``<think>`` tags, gpt-oss's
            harmony channels; read from its chat template): each result's ``reasoning`` gets the
            reasoning's text and ``text`` only the answer's, the markers in neither
            (:mod:`mlxinfer.output.reasoning`). Off: ``text`` is the output as the model wrote it.
        output: ``stop`` to ``split_reasoning`` above as one :class:`OutputRules` (then leave
            them unset: a setting given both ways is a ValueError naming it).
        chat_template_kwargs: more variables for the chat template, as transformers'
            ``apply_chat_template(**kwargs)`` takes them: ``{"enable_thinking": False}``
            (Qwen3), ``{"reasoning_effort": "high"}`` (gpt-oss).
        images: images for a model with a vision tower (Gemma 3): paths, bytes, data URLs or
            Pillow images, put before the text of the (last) user message unless the messages
            hold one ``{"type": "image"}`` part each. Messages may carry their images instead, as
            content parts (``{"type": "image", "image": source}``, OpenAI's ``image_url``
            parts), used when ``images`` is not given. The prompt goes through the chat template
            (a text prompt needs ``chat_template=True``). Such a request runs on a fresh cache,
            never ``prompt_cache``: a cache keyed by token ids cannot tell images apart.
    Yields:
        GenerationResult; the last one has ``finish_reason`` set and full ``stats``.
    """
    given: dict[str, Any] = dict(
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
    prompt_images: PromptImages | None = None
    prompt, in_parts = images_in_messages(prompt)  # image parts of the messages: markers
    images = images or in_parts or None
    if images:
        prompt_images = load_images(model, tokenizer, images)
        if draft is not None:
            raise ValueError("draft: speculative decoding does not take images yet")
        prompt_cache = None  # never reused across images (images.py)
    # The request's cache, and what its budget holds: a prompt past it is refused or truncated.
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
    reserve = max(num_draft or 0, MAX_DRAFT) if draft is not None else 0
    request = prepare_request(
        model,
        tokenizer,
        prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        output=output,
        chat_template=chat_template,
        truncate_prompt=truncate_prompt,
        kv_room=KVRoom(limit.tokens - reserve, limit),
        stop=stop,
        constraint=constraint,
        response_format=response_format,
        json_schema=json_schema,
        regex=regex,
        choices=choices,
        grammar=grammar,
        tools=tools,
        tool_choice=tool_choice,
        split_reasoning=split_reasoning,
        chat_template_kwargs=chat_template_kwargs,
        images=prompt_images,
    )
    request.stats.cached_tokens = len(request.ids) - len(prompt_cache.reuse(request.ids))
    inputs = None if prompt_images is None else image_inputs(model, request.ids, prompt_images)
    steps = _steps(
        model,
        tokenizer,
        request,
        prompt_cache,
        prefill_step_size or DEFAULT_PREFILL_STEP,
        draft,
        num_draft,
        inputs,
    )
    with wired_limit():  # Metal: keep the weights resident for the run (no-op elsewhere)
        try:
            yield from request.results(steps, count_passes=draft is not None)
        finally:
            steps.close()


def _steps(
    model,
    tokenizer,
    request: PreparedRequest,
    prompt_cache: PromptCache,
    prefill_step_size: int,
    draft: Draft | None,
    num_draft: int | None,
    inputs: dict[str, mx.array] | None = None,
) -> Generator[Step, None, None]:
    """The token loop for the request: plain decoding, or speculative with ``draft``."""
    options: dict[str, Any] = dict(
        prompt_cache=prompt_cache,
        max_tokens=request.max_tokens,
        sampler=request.sampling.sampler(),
        logits_processors=request.sampling.processors() + request.logits_processors,
        prefill_step_size=prefill_step_size,
    )
    if draft is None:  # the only loop that takes images (stream_generate refuses a draft)
        steps = generate_step(request.ids, model, inputs=inputs, **options)
        return (Step(t, lp) for t, lp in steps)
    draft.check(model, tokenizer)
    draft_model = getattr(draft, "model", None)
    if draft_model is not None:  # a DraftModel is fed the prompt too
        check_token_ids(draft_model, request.ids, "prompt (for the draft model)")
    return speculative_generate_step(request.ids, model, draft, num_draft=num_draft, **options)


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """Generate and return the whole completion; takes ``stream_generate``'s options."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))
