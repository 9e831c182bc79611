"""A multi-turn chat that keeps its history and reuses the KV cache across turns."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from ..cache.prompt import PromptCache
from ..errors import MlxInferError
from . import stream_generate
from .images import images_in_messages
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
        self.images: list[Any] = []  # every image of the history, in order

    def send(
        self, text: str | list[dict[str, Any]], images: Sequence[Any] = ()
    ) -> Iterator[GenerationResult]:
        """Add a user turn (``images`` before its text) and stream the reply; the reply joins
        the history when done. ``text`` may be content parts instead, text and images in their
        order (``{"type": "image", "image": source}``, OpenAI's ``image_url`` parts). Once the
        history holds an image, each turn sends them all again and runs on a fresh cache
        (generation/images.py: no cache is reused across images)."""
        content: Any = text
        if isinstance(text, list):
            [turn], in_parts = images_in_messages([{"role": "user", "content": text}])
            content = [{"type": "image"} for _ in images] + turn["content"]  # images= first
            images = [*images, *in_parts]
        elif images:
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        kept = len(self.images)
        self.images.extend(images)
        self.messages.append({"role": "user", "content": content})
        reply, calls, refused = [], None, False
        try:
            for r in stream_generate(
                self.model,
                self.tokenizer,
                self.messages,
                images=self.images or None,
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
        except MlxInferError:
            # Refused before any reply (an image that does not decode, a prompt past the budget):
            # the turn is undone, so the next one does not carry it.
            refused = not reply
            if refused:
                del self.messages[-1], self.images[kept:]
            raise
        finally:
            if not refused:
                self.messages.append(self._reply(reply, calls))

    @staticmethod
    def _reply(reply: list[str], calls) -> dict[str, Any]:
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
        return message

    def reset(self) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self.images = []
