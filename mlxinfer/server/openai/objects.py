"""The JSON the OpenAI routes send back: a whole response and its choices, a stream's chunks,
``usage``, llama.cpp's ``timings``, and log-probs in the chat and the legacy shapes."""

from __future__ import annotations

from typing import Any

from ...generation.results import GenerationStats
from .request import CompletionRequest


def logprobs_field(ask: CompletionRequest, entries: list[dict], offset: int = 0) -> tuple[Any, int]:
    """A choice's ``logprobs`` for these tokens' entries (from :func:`token_logprobs`) and the
    text offset after them. Chat: ``{"content": entries}``; completions: the legacy shape,
    ``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> log-prob) and ``text_offset``
    (from the completion's start). None when not asked or, streamed, for no token."""
    if not ask.logprobs or (ask.stream and not entries):
        return None, offset
    if ask.chat:
        return {"content": entries}, offset
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    legacy = {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }
    return legacy, offset


def token_logprobs(tokenizer, token: int, logprobs, top: int) -> dict:
    """One token's entry of a chat ``logprobs.content``: its text, log-prob and bytes, and the
    ``top`` most likely tokens at its position (from the (V,) log-probs it was drawn from)."""
    import numpy as np

    values = np.asarray(logprobs, dtype=np.float32)

    def entry(t: int) -> dict:
        text = tokenizer.decode([t])
        return {"token": text, "logprob": float(values[t]), "bytes": list(text.encode("utf-8"))}

    out = entry(token)
    best = np.argsort(-values)[:top] if top else []
    out["top_logprobs"] = [entry(int(t)) for t in best]
    return out


def usage(stats: GenerationStats, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": stats.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def timings(stats: GenerationStats, completion_tokens: int) -> dict:
    """Per-response timings as llama.cpp's server reports them."""
    prompt_ms = stats.time_to_first_token_s * 1000
    predicted_ms = completion_tokens / stats.decode_tps * 1000 if stats.decode_tps else 0.0
    return {
        "prompt_n": stats.prompt_tokens,
        "cache_n": stats.cached_tokens,
        "prompt_ms": prompt_ms,
        "prompt_per_second": stats.prefill_tps,
        "predicted_n": completion_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_second": stats.decode_tps,
    }


def choice(
    ask: CompletionRequest,
    index: int,
    text: str,
    finish: str,
    logprobs: Any = None,
    tool_calls=None,
    reasoning: str = "",
) -> dict:
    """One choice of a whole (non-streamed) response; ``logprobs`` from :func:`logprobs_field`;
    ``tool_calls``: the calls parsed from the output (then its finish is ``tool_calls``);
    ``reasoning``: what the model thought before it answered, as ``reasoning_content`` (the
    field llama.cpp's and vLLM's servers use)."""
    if ask.chat:
        message: dict = {"role": "assistant", "content": text}
        if tool_calls:
            message = {
                "role": "assistant",
                "content": text or None,
                "tool_calls": [c.openai() for c in tool_calls],
            }
            finish = "tool_calls"
        if reasoning:
            message["reasoning_content"] = reasoning
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def response(
    ask: CompletionRequest, choices: list[dict], stats: GenerationStats, n_tokens: int
) -> dict:
    """The whole (non-streamed) response; ``n_tokens``: generated over all choices."""
    return {
        "id": ask.id,
        "object": "chat.completion" if ask.chat else "text_completion",
        "created": ask.created,
        "model": ask.model,
        "choices": choices,
        "usage": usage(stats, n_tokens),
        "timings": timings(stats, n_tokens),
    }


def chunk(
    ask: CompletionRequest,
    text: str | None,
    finish: str | None = None,
    *,
    index: int = 0,
    first: bool = False,
    logprobs: Any = None,
    tool_calls=None,
    reasoning: str = "",
) -> dict:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``) of choice
    ``index``; ``logprobs`` from :func:`logprobs_field`; ``reasoning`` as the delta's
    ``reasoning_content``."""
    if ask.chat:
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [c.openai(i) for i, c in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        kind = "text_completion"
    return {
        "id": ask.id,
        "object": kind,
        "created": ask.created,
        "model": ask.model,
        "choices": [choice],
    }
