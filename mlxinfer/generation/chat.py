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
        self.messages: list[dict[str, Any]] = (
            [{"role": "system", "content": system}] if system else []
        )
        self.prompt_cache = PromptCache(model.make_cache(max_kv_size=max_kv_size, kv_bits=kv_bits))

    def send(self, text: str) -> Iterator[GenerationResult]:
        """Add a user turn and stream the reply; the reply joins the history when done."""
        self.messages.append({"role": "user", "content": text})
        reply, calls = [], None
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
                calls = r.tool_calls if r.tool_calls is not None else calls
                yield r
        finally:
            # With tools, the text holds no call: the calls join the message as the Hugging
            # Face chat templates take them back (arguments as objects: toolcalls.template_messages).
            message: dict[str, Any] = {"role": "assistant", "content": "".join(reply)}
            if calls:
                message["tool_calls"] = [
                    {
                        "type": "function",
                        "id": c.id,
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in calls
                ]
            self.messages.append(message)

    def reset(self) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]
