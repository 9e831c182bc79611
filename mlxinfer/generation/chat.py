"""A multi-turn chat that keeps its history and reuses the KV cache across turns."""

from __future__ import annotations

from typing import Any, Iterator

from ..cache.prompt import PromptCache
from . import stream_generate
from .results import GenerationResult


class ChatSession:
    """Keeps messages and a :class:`PromptCache`; each turn feeds only new tokens.

    Args:
        system: optional system message.
        split_reasoning: a reasoning model's thoughts go to each result's ``reasoning`` and
            the history keeps only its answers (as its chat template wants them back);
            False keeps the output as written.
        **options: ``stream_generate`` options used for every turn.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        system: str | None = None,
        max_kv_size: int | None = None,
        kv_bits: int | None = None,
        split_reasoning: bool = True,
        **options: Any,
    ):
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.split_reasoning = split_reasoning
        self.max_kv_size, self.kv_bits = max_kv_size, kv_bits
        self.messages: list[dict[str, str]] = (
            [{"role": "system", "content": system}] if system else []
        )
        self.prompt_cache = PromptCache(model.make_cache(max_kv_size=max_kv_size, kv_bits=kv_bits))

    def send(self, text: str) -> Iterator[GenerationResult]:
        """Add a user turn and stream the reply; the reply joins the history when done."""
        self.messages.append({"role": "user", "content": text})
        reply = []
        try:
            for r in stream_generate(
                self.model,
                self.tokenizer,
                self.messages,
                prompt_cache=self.prompt_cache,
                split_reasoning=self.split_reasoning,
                # the cache is made: these size its KV budget in tokens (memory.kv_limit)
                max_kv_size=self.max_kv_size,
                kv_bits=self.kv_bits,
                **self.options,
            ):
                reply.append(r.text)
                yield r
        finally:
            self.messages.append({"role": "assistant", "content": "".join(reply)})

    def reset(self) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]
