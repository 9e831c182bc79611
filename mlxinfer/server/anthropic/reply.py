"""Engine results turned into an Anthropic message: whole, or Anthropic's stream of events
(the JSON objects themselves are :mod:`.objects`').

The text passes the tool-call stream first (calls held back), then the reasoning splitter
(:mod:`mlxinfer.output.reasoning`): what a reasoning model thinks goes to a ``thinking``
block, its answer to a ``text`` block.
"""

from __future__ import annotations

import json
from typing import Iterator

from ...batch import EngineError
from ...generation.results import GenerationStats
from ...output.reasoning import splitter_for
from ...output.toolcalls import ToolStream, tool_format
from . import objects
from .request import AnthropicError, MessagesRequest


class AnthropicReply:
    """A /v1/messages reply, whole or as Anthropic's stream of events."""

    def __init__(self, ask: MessagesRequest, tokenizer, first, results: Iterator):
        self.ask, self.tokenizer, self.first, self.results = ask, tokenizer, first, results
        self.tokens: list[int] = []
        self.finish, self.last = "stop", first
        self.calls: list = []
        offered = ask.tools is not None and ask.tool_choice != "none"
        self.tools = ToolStream(tool_format(tokenizer)) if offered else None
        self.thinking = splitter_for(tokenizer)
        self.block: tuple[int, str] | None = None  # the content block being streamed

    def _pieces(self) -> Iterator[str]:
        try:
            for r in _chain(self.first, self.results):
                self.tokens.append(r.token)
                self.last, self.finish = r, r.finish_reason or self.finish
                yield r.text
        finally:
            self.results.close()

    def _end(self) -> tuple[str, str | None, dict]:
        eos = bool(self.tokens) and self.tokens[-1] in self.tokenizer.eos_token_ids
        matched = None
        if self.finish == "stop" and not eos and self.ask.stop:
            raw = self.tokenizer.decode(self.tokens)
            found = [(raw.find(s), s) for s in self.ask.stop if s in raw]
            matched = min(found)[1] if found else None
        stats = self.last.stats if self.last is not None else GenerationStats()
        reason = objects.stop_reason(self.finish, eos, matched, self.calls)
        return reason, matched, objects.usage(stats, len(self.tokens), self.ask.cache_block)

    def whole(self) -> dict:
        text = "".join(self._pieces())
        if self.tools is not None:
            text, self.calls = self.tools.fmt.parse(text)
        reasoning, text = self.thinking.split(text)
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
            for text in self._pieces():
                if self.tools is not None:
                    text = self.tools.feed(text)
                yield from self._deltas(*self.thinking.feed(text))
        except (EngineError, TimeoutError) as e:
            yield objects.event("error", {"error": AnthropicError(500, str(e)).body()["error"]})
            return
        if self.tools is not None:
            rest, self.calls = self.tools.finish()
            yield from self._deltas(*self.thinking.feed(rest))
        yield from self._deltas(*self.thinking.finish())
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
