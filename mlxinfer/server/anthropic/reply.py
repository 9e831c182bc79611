"""Engine results turned into an Anthropic message: whole, or Anthropic's stream of events
(the JSON objects themselves are :mod:`.objects`').

The engine's results come parsed (``Routes.start``): what a reasoning model thinks
(``reasoning``) goes to a ``thinking`` block, its answer (``text``, the calls held back) to a
``text`` block, the calls of its last result (``tool_calls``) to ``tool_use`` blocks, the stop
string that ended it (``stop_string``) to ``stop_sequence``.
"""

from __future__ import annotations

import json
from typing import Iterator

from ...batch import EngineError
from ...generation.results import GenerationStats
from ..api_errors import AnthropicError
from . import objects
from .request import MessagesRequest


class AnthropicReply:
    """A /v1/messages reply, whole or as Anthropic's stream of events."""

    def __init__(self, ask: MessagesRequest, tokenizer, first, results: Iterator):
        self.ask, self.tokenizer, self.first, self.results = ask, tokenizer, first, results
        self.tokens = 0
        self.finish, self.last = "stop", first
        self.calls: list = []
        self.block: tuple[int, str] | None = None  # the content block being streamed

    def _pieces(self) -> Iterator[tuple[str, str]]:
        """Each result's ``(reasoning, text)``; its calls, on the last one, to ``calls``."""
        try:
            for r in _chain(self.first, self.results):
                self.tokens += 1
                self.last, self.finish = r, r.finish_reason or self.finish
                self.calls = r.tool_calls or []
                yield r.reasoning, r.text
        finally:
            self.results.close()

    def _end(self) -> tuple[str, str | None, dict]:
        last = self.last
        eos = last is not None and last.token in self.tokenizer.eos_token_ids
        matched = last.stop_string if last is not None and not eos else None
        stats = last.stats if last is not None else GenerationStats()
        reason = objects.stop_reason(self.finish, eos, matched, self.calls)
        return reason, matched, objects.usage(stats, self.tokens, self.ask.cache_block)

    def whole(self) -> dict:
        reasoning, text = [], []
        for thought, piece in self._pieces():
            reasoning.append(thought)
            text.append(piece)
        reasoning, text = "".join(reasoning), "".join(text)
        reason, matched, usage = self._end()
        return objects.message(self.ask, text, reason, matched, usage, self.calls, reasoning)

    def _deltas(self, reasoning: str, text: str) -> Iterator[str]:
        """Events for a piece: a thinking block's and a text block's deltas, each block opened
        when its first piece comes (and the one before it closed)."""
        for kind, piece in (("thinking", reasoning), ("text", text)):
            if not piece:
                continue
            if self.block is None or self.block[1] != kind:
                yield from self._open(kind)
            delta = (
                {"type": "thinking_delta", "thinking": piece}
                if kind == "thinking"
                else {"type": "text_delta", "text": piece}
            )
            yield objects.event("content_block_delta", {"index": self.block[0], "delta": delta})

    def _open(self, kind: str) -> Iterator[str]:
        """Close the block being streamed, if any, and start a ``kind`` block after it."""
        index = 0 if self.block is None else self.block[0] + 1
        if self.block is not None:
            yield objects.event("content_block_stop", {"index": self.block[0]})
        self.block = (index, kind)
        block = objects.thinking("") if kind == "thinking" else {"type": "text", "text": ""}
        yield objects.event("content_block_start", {"index": index, "content_block": block})

    def events(self) -> Iterator[str]:
        if self.first is None:  # a stream starts before its first token: pings until it comes
            try:
                self.first = self.last = next(self.results, None)
            except (EngineError, TimeoutError) as e:
                self.results.close()
                yield objects.event("error", {"error": AnthropicError(500, str(e)).body()["error"]})
                return
        stats = self.first.stats if self.first is not None else GenerationStats()
        start = objects.message(
            self.ask, "", None, None, objects.usage(stats, 0, self.ask.cache_block)
        )
        yield objects.event("message_start", {"message": start})
        yield objects.event("ping", {})
        try:
            for reasoning, text in self._pieces():
                yield from self._deltas(reasoning, text)
        except (EngineError, TimeoutError) as e:
            yield objects.event("error", {"error": AnthropicError(500, str(e)).body()["error"]})
            return
        if self.block is None or (self.block[1] != "text" and not self.calls):
            yield from self._open("text")  # the message's text block, even if empty
        reason, matched, usage = self._end()
        yield objects.event("content_block_stop", {"index": self.block[0]})
        for i, call in enumerate(self.calls, start=self.block[0] + 1):
            block = {**objects.tool_use(call), "input": {}}
            yield objects.event("content_block_start", {"index": i, "content_block": block})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}
            yield objects.event("content_block_delta", {"index": i, "delta": delta})
            yield objects.event("content_block_stop", {"index": i})
        delta = {"stop_reason": reason, "stop_sequence": matched}
        yield objects.event(
            "message_delta", {"delta": delta, "usage": {"output_tokens": usage["output_tokens"]}}
        )
        yield objects.event("message_stop", {})


def _chain(first, results: Iterator):
    if first is not None:
        yield first
    yield from results
