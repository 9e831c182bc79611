"""One request around the token loop: its prompt prepared, its tokens turned into text.

Before the loop, :func:`prepare_request` turns a prompt (text, token ids or chat messages,
through :func:`prepare_prompt`) and its options into a :class:`PreparedRequest`: the output
rules (an :class:`~.rules.OutputRules`: a constraint, tools), the ids fitted in the context and
the KV room, the sampling settings checked. After it, :meth:`PreparedRequest.results` turns the
loop's ``Step``s into ``GenerationResult``s: the UTF-8-safe detokenizer, stop strings (the one
hit named), EOS and the length, the per-request timeline (finished on the last result), then tool
calls (held back from the text while streaming) and reasoning. The
single-request loop (loop.py) and the batch engine's text side (batch/frontend.py) both prepare
a request here, so a request reads the same whichever runs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence, cast

import mlx.core as mx

from ..errors import MediaError, PromptTooLongError
from ..loading.memory import KVLimit, size_text
from ..output.reasoning import split_results, splitter_for
from ..output.tooling import Tooling, output_rules
from .prefill import check_token_ids, token_ids
from .prompt import clean_prompt, fit_context
from .results import GenerationResult, GenerationStats, Step
from .rules import OutputRules
from .sampling import LogitsProcessor, SamplingParams
from .stop import StopMatcher

if TYPE_CHECKING:
    from .images import PromptImages


def prepare_prompt(
    tokenizer,
    prompt: str | Sequence[int] | Sequence[dict[str, Any]],
    *,
    chat_template: bool = True,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    images: PromptImages | None = None,
) -> list[int]:
    """Token ids for a prompt given as text, ids, or chat messages.

    Text and message contents are cleaned first; messages go through the
    tokenizer's chat template (which supplies BOS itself when the model wants one),
    with ``tools`` as its ``tools`` variable when given and ``chat_template_kwargs`` as more
    variables (``enable_thinking``, ``reasoning_effort``, …). ``images``: the template renders
    their parts as markers, each expanded into its image's placeholder tokens (images.py).
    """
    extra = dict(chat_template_kwargs or {})
    if tools is not None:
        extra["tools"] = tools
    if images is not None:
        return _prompt_with_images(tokenizer, prompt, images, chat_template, extra)
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
        # Chat messages: the first item tells which of the two sequences the prompt is.
        messages = [
            {**m, "content": clean_prompt(m["content"])} if isinstance(m.get("content"), str) else m
            for m in cast("list[dict[str, Any]]", items)
        ]
        return tokenizer.encode(
            tokenizer.apply_chat_template(messages, **extra), add_special_tokens=False
        )
    if tools is not None:
        raise ValueError("tools: they reach the model through its chat template (none used)")
    return token_ids(items)


def _prompt_with_images(
    tokenizer, prompt, images: PromptImages, chat_template: bool, extra: dict[str, Any]
) -> list[int]:
    if isinstance(prompt, str):
        if not (chat_template and tokenizer.has_chat_template):
            raise MediaError(
                "prompt: images need the chat template's image markers (a text prompt without "
                "the template has none)"
            )
        messages = [{"role": "user", "content": clean_prompt(prompt)}]
    else:
        items = list(prompt)
        if not (items and isinstance(items[0], dict)):
            raise MediaError("prompt: images need a text prompt or chat messages, not token ids")
        messages = [
            {**m, "content": clean_prompt(m["content"])} if isinstance(m.get("content"), str) else m
            for m in cast("list[dict[str, Any]]", items)
        ]
    text = images.expand(tokenizer.apply_chat_template(images.messages(messages), **extra))
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass(frozen=True)
class KVRoom:
    """The tokens a request's KV cache may hold: its prompt and its new tokens (a speculative
    step's drafts already taken off).

    ``limit`` is the single-request loop's budget (``memory.kv_limit``): a prompt that leaves no
    room is left-truncated or refused here (PromptTooLongError), and a generation the room cuts
    short says so (``stats.limited_by``). Without one (the batch engine's pool), the room only
    caps ``max_tokens``: the pool refuses a prompt it could never hold when it is submitted
    (PoolFullError).
    """

    tokens: float
    limit: KVLimit | None = None


@dataclass
class PreparedRequest:
    """One request, prepared: its prompt ids fitted, its settings checked, and what turns the
    token loop's steps into its results (:meth:`results`)."""

    tokenizer: Any
    ids: list[int]  # the prompt, fitted in the context and the KV room
    max_tokens: int  # new tokens at most: as asked, capped by the context and the KV room
    sampling: SamplingParams  # checked
    # The request's own processors, run after its sampling's: a constraint's, when it has one.
    logits_processors: list[LogitsProcessor]
    stop: Sequence[str]
    tooling: Tooling | None  # the tools shown to the model, and how its calls are parsed
    split_reasoning: bool
    stats: GenerationStats  # the prompt's part now; the rest filled in as the results stream
    t0: float  # when the request started (perf_counter)

    @property
    def eos(self) -> frozenset[int]:
        return self.tokenizer.eos_token_ids

    def results(
        self, steps: Iterator[Step], *, count_passes: bool = False
    ) -> Iterator[GenerationResult]:
        """The token loop's ``steps`` as results: text cut at stop strings and ended at EOS or
        the length, then :meth:`shaped`. ``count_passes``: add each step's speculative counts
        to the stats."""
        return self.shaped(_results(self, steps, count_passes=count_passes))

    def shaped(self, results: Iterator[GenerationResult]) -> Iterator[GenerationResult]:
        """``results`` (their ``text`` as the model wrote it) with the tool calls held back and
        parsed (with tools), then the reasoning split from the answer (``split_reasoning``),
        told from the prompt's real ids (a template switch such as ``enable_thinking=False``
        decides whether the reply starts inside the reasoning). The one place a request's
        output is parsed: the library's streams and the server's replies read these fields."""
        if self.tooling is not None:
            results = self.tooling.results(results)
        if self.split_reasoning:
            results = split_results(results, splitter_for(self.tokenizer, self.ids))
        return results


def prepare_request(
    model,
    tokenizer,
    prompt: str | Sequence[int] | Sequence[dict[str, Any]],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    output: OutputRules | None = None,
    chat_template: bool = False,
    truncate_prompt: bool = False,
    kv_room: KVRoom | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    images: PromptImages | None = None,
    **rules,
) -> PreparedRequest:
    """Prepare one request for a token loop: ``stream_generate``'s and the batch engine's.

    The output rules first (the constraint, or the call ``tool_choice`` asks for, and the
    tools), then the prompt's token ids (:func:`prepare_prompt`, with the tools), fitted in the
    model's context and in ``kv_room`` (left-truncated with ``truncate_prompt``, else refused
    with PromptTooLongError), the sampling settings checked and the constraint's processor built.

    Args:
        max_tokens: new tokens at most; capped by what the context and ``kv_room`` leave.
        sampling: the request's :class:`SamplingParams` (None: greedy).
        output: the request's :class:`OutputRules` (stop strings, structured output, tools,
            reasoning); or, in ``rules``, its fields as keywords (not both: a TypeError).
        kv_room: what the request's KV cache may hold (None: the context only).
        chat_template, truncate_prompt, chat_template_kwargs: as for ``stream_generate``.
        images: the request's images, processed (``images.load_images``).
    """
    t0 = time.perf_counter()
    output = OutputRules.merge(output, rules)
    constraint, tooling = output_rules(
        tokenizer, output.tools, output.tool_choice, **output.constraint_options()
    )
    ids = prepare_prompt(
        tokenizer,
        prompt,
        chat_template=chat_template,
        tools=tooling.tools if tooling is not None else None,
        chat_template_kwargs=chat_template_kwargs,
        images=images,
    )
    context = model.args.max_position_embeddings
    ids = fit_context(ids, context, max_tokens, truncate=truncate_prompt)
    check_token_ids(model, ids)  # from the tokenizer (a BOS it adds) or the caller's ids
    stats = GenerationStats(prompt_tokens=len(ids), tokenize_ms=(time.perf_counter() - t0) * 1000)
    sampling = sampling or SamplingParams()
    sampling.check()
    processors = [constraint.processor(tokenizer)] if constraint is not None else []
    if kv_room is not None and kv_room.limit is not None:
        ids = _fit_kv(ids, kv_room.tokens, kv_room.limit, max_tokens, truncate_prompt)
        stats.prompt_tokens = len(ids)
    n_new = min(max_tokens, context - len(ids))
    if kv_room is not None and 0 < kv_room.tokens - len(ids) < n_new:
        n_new = int(kv_room.tokens - len(ids))
        if kv_room.limit is not None:
            stats.limited_by = "kv_budget"
    return PreparedRequest(
        tokenizer,
        ids,
        n_new,
        sampling,
        processors,
        output.stop,
        tooling,
        output.split_reasoning,
        stats,
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
    request: PreparedRequest, steps: Iterator[Step], *, count_passes: bool
) -> Iterator[GenerationResult]:
    """Tokens to text: detokenize, hold back and cut at stop strings, end at EOS or the length,
    and keep the timeline (finished on the last result)."""
    stats, detok, stops = request.stats, request.tokenizer.detokenizer(), StopMatcher(request.stop)
    eos = request.eos
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
        if step.token in eos:
            text, finish = detok.finalize(), "stop"
        else:
            text = detok.add_token(step.token)
            if n == request.max_tokens:
                text, finish = text + detok.finalize(), "length"
        text, hit = stops.push(text)
        if hit is not None:
            finish = "stop"
        elif finish is not None:
            text += stops.flush()
        stats.generation_tokens = n
        if finish is not None:
            _finish_stats(stats, n, t_first)
        yield GenerationResult(
            text, step.token, step.logprobs, finish, step.from_draft, stats=stats, stop_string=hit
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
