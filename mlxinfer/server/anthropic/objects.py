"""The JSON the Anthropic route sends back: a message, its content blocks, ``usage`` with the
prefix cache's counts, the stream's events (the request side is :mod:`.request`)."""

from __future__ import annotations

import json
from typing import Any

from ...generation.results import GenerationStats


def stop_reason(finish: str, eos: bool, matched: str | None, calls=()) -> str:
    if calls:
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if matched is not None and not eos else "end_turn"


def usage(stats: GenerationStats, output_tokens: int, block: int = 0) -> dict:
    """Anthropic's usage: ``cache_read_input_tokens``, the prompt's tokens read from the prefix
    cache; ``cache_creation_input_tokens``, those this request wrote into it (the rest of the
    prompt's full ``block``-token blocks: the engine keeps every full block; 0 where it caches
    no prefix); ``input_tokens``, the others (as Anthropic counts, it excludes both)."""
    read = stats.cached_tokens
    written = max(0, stats.prompt_tokens // block * block - read) if block > 0 else 0
    return {
        "input_tokens": max(0, stats.prompt_tokens - read - written),
        "output_tokens": output_tokens,
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": written,
    }


def thinking(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use(call) -> dict:
    return {
        "type": "tool_use",
        "id": call.id.replace("call_", "toolu_"),
        "name": call.name,
        "input": call.arguments,
    }


def message(
    ask: Any,  # a MessagesRequest: its id and model
    text: str,
    reason: str | None,
    matched: str | None,
    usage_: dict,
    calls=(),
    reasoning: str = "",
) -> dict:
    content = [{"type": "text", "text": text}] if text or (reason and not calls) else []
    if reasoning:  # what the model thought before it answered: a thinking block, unsigned
        content = [thinking(reasoning)] + content
    return {
        "id": ask.id,
        "type": "message",
        "role": "assistant",
        "model": ask.model,
        "content": content + [tool_use(c) for c in calls],
        "stop_reason": reason,
        "stop_sequence": matched,
        "usage": usage_,
    }


def event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"
