"""Engine results turned into each API's responses: a whole JSON body, or its stream of
server-sent events.

An OpenAI request with ``n`` > 1 is ``n`` requests in the engine (decoded together, the prompt
prefilled once and shared from the prefix cache); its chunks are interleaved, each with its
choice's ``index``.

A chat reply's text passes the tool-call stream first (calls held back), then the reasoning
splitter (:mod:`mlxinfer.output.reasoning`): what a reasoning model thinks goes to OpenAI's
``reasoning_content`` and Anthropic's ``thinking`` block, its answer to the content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

from fastapi.responses import JSONResponse

from ..batch import EngineError
from ..generation.results import GenerationResult, GenerationStats
from ..output.reasoning import Plain, Splitter, splitter_for
from ..output.toolcalls import ToolStream, tool_format
from . import anthropic as an
from . import anthropic_replies as anr
from . import openai as oa
from . import openai_replies as oar


@dataclass
class Choice:
    """One of an OpenAI request's choices: its engine stream and what it has produced."""

    index: int
    first: GenerationResult | None
    results: Iterator[GenerationResult]
    tokens: int = 0
    finish: str = "stop"
    last: GenerationResult | None = None
    entries: list[dict] = field(default_factory=list)  # log-prob entries not yet sent
    offset: int = 0  # the legacy completions log-probs: text offset of the next token
    tools: ToolStream | None = None  # with tools: the text shown, the calls held back
    thinking: Splitter = field(default_factory=Plain)  # the reasoning told from the answer

    def __post_init__(self) -> None:
        self.last = self.first

    def each(self) -> Iterator[GenerationResult]:
        if self.first is not None:
            yield self.first
        yield from self.results

    def take(self, ask: oa.Ask, tokenizer, r: GenerationResult) -> None:
        self.tokens += 1
        self.last, self.finish = r, r.finish_reason or self.finish
        if ask.logprobs and r.logprobs is not None:
            self.entries.append(
                oar.token_logprobs(tokenizer, r.token, r.logprobs, ask.top_logprobs)
            )

    def logprobs(self, ask: oa.Ask):
        """The entries taken since the last call, in the endpoint's shape."""
        out, self.offset = oar.logprobs_field(ask, self.entries, self.offset)
        self.entries = []
        return out

    def close(self) -> None:
        self.results.close()  # the request is cancelled if it was still running


def _stats(choices: list[Choice]):
    last = choices[0].last
    return last.stats if last is not None else GenerationStats()


def _close(choices: list[Choice]) -> None:
    for c in choices:
        c.close()


def tool_streams(ask: oa.Ask, tokenizer, choices: list[Choice]) -> None:
    """Give each choice a :class:`ToolStream` when the request offers tools."""
    if ask.tools is not None and ask.tool_choice != "none":
        fmt = tool_format(tokenizer)
        for c in choices:
            c.tools = ToolStream(fmt)


def _splitters(ask: oa.Ask, tokenizer, choices: list[Choice]) -> None:
    """Give each chat choice the splitter of this model's reasoning format."""
    if ask.chat:
        for c in choices:
            c.thinking = splitter_for(tokenizer)


def openai_whole(ask: oa.Ask, tokenizer, choices: list[Choice]) -> JSONResponse:
    out = []
    tool_streams(ask, tokenizer, choices)
    _splitters(ask, tokenizer, choices)
    try:
        for c in choices:
            text = []
            for r in c.each():
                c.take(ask, tokenizer, r)
                text.append(r.text)
            text, calls = "".join(text), None
            if c.tools is not None:
                text, calls = c.tools.fmt.parse(text)
            reasoning, text = c.thinking.split(text)
            out.append(oar.choice(ask, c.index, text, c.finish, c.logprobs(ask), calls, reasoning))
    except (EngineError, TimeoutError) as e:
        raise oa.APIError(500, str(e), type="server_error") from None
    finally:
        _close(choices)
    tokens = sum(c.tokens for c in choices)
    return JSONResponse(oar.response(ask, out, _stats(choices), tokens))


def openai_events(ask: oa.Ask, tokenizer, choices: list[Choice]) -> Iterator[str]:
    """SSE ``data:`` lines: a first chunk per choice (with the role), one per piece of text
    (with the log-probs of the tokens since the last, if asked), each choice's finish, the
    usage if asked, then ``[DONE]``. The choices' streams are read in turn, a token each."""
    tool_streams(ask, tokenizer, choices)
    _splitters(ask, tokenizer, choices)
    for c in choices:
        yield sse(oar.chunk(ask, None, index=c.index, first=True))
    running = [(c, c.each()) for c in choices]
    try:
        while running:
            for c, results in list(running):
                r = next(results, None)
                if r is None:
                    running.remove((c, results))
                    yield from _ended(ask, c)
                    continue
                c.take(ask, tokenizer, r)
                text = c.tools.feed(r.text) if c.tools is not None else r.text
                reasoning, text = c.thinking.feed(text)
                if text or reasoning:
                    logprobs = c.logprobs(ask)
                    yield sse(
                        oar.chunk(ask, text, index=c.index, logprobs=logprobs, reasoning=reasoning)
                    )
    except (EngineError, TimeoutError) as e:
        yield sse(oa.APIError(500, str(e), type="server_error").body())
        yield "data: [DONE]\n\n"
        return
    finally:
        _close(choices)  # also when the client went away: the requests are cancelled
    if ask.include_usage:
        usage = oar.usage(_stats(choices), sum(c.tokens for c in choices))
        yield sse({**oar.chunk(ask, None), "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


class AnthropicReply:
    """A /v1/messages reply, whole or as Anthropic's stream of events."""

    def __init__(self, ask: an.Ask, tokenizer, first, results: Iterator):
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
        reason = anr.stop_reason(self.finish, eos, matched, self.calls)
        return reason, matched, anr.usage(stats, len(self.tokens), self.ask.cache_block)

    def whole(self) -> dict:
        text = "".join(self._pieces())
        if self.tools is not None:
            text, self.calls = self.tools.fmt.parse(text)
        reasoning, text = self.thinking.split(text)
        reason, matched, usage = self._end()
        return anr.message(self.ask, text, reason, matched, usage, self.calls, reasoning)

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
            yield anr.event("content_block_delta", {"index": self.block[0], "delta": delta})

    def _open(self, kind: str) -> Iterator[str]:
        """Close the block being streamed, if any, and start a ``kind`` block after it."""
        index = 0 if self.block is None else self.block[0] + 1
        if self.block is not None:
            yield anr.event("content_block_stop", {"index": self.block[0]})
        self.block = (index, kind)
        block = anr.thinking("") if kind == "thinking" else {"type": "text", "text": ""}
        yield anr.event("content_block_start", {"index": index, "content_block": block})

    def events(self) -> Iterator[str]:
        if self.first is None:  # a stream starts before its first token: pings until it comes
            try:
                self.first = self.last = next(self.results, None)
            except (EngineError, TimeoutError) as e:
                self.results.close()
                yield anr.event("error", {"error": an.APIError(500, str(e)).body()["error"]})
                return
        stats = self.first.stats if self.first is not None else GenerationStats()
        start = anr.message(self.ask, "", None, None, anr.usage(stats, 0, self.ask.cache_block))
        yield anr.event("message_start", {"message": start})
        yield anr.event("ping", {})
        try:
            for text in self._pieces():
                if self.tools is not None:
                    text = self.tools.feed(text)
                yield from self._deltas(*self.thinking.feed(text))
        except (EngineError, TimeoutError) as e:
            yield anr.event("error", {"error": an.APIError(500, str(e)).body()["error"]})
            return
        if self.tools is not None:
            rest, self.calls = self.tools.finish()
            yield from self._deltas(*self.thinking.feed(rest))
        yield from self._deltas(*self.thinking.finish())
        if self.block is None or (self.block[1] != "text" and not self.calls):
            yield from self._open("text")  # the message's text block, even if empty
        reason, matched, usage = self._end()
        yield anr.event("content_block_stop", {"index": self.block[0]})
        for i, call in enumerate(self.calls, start=self.block[0] + 1):
            block = {**anr.tool_use(call), "input": {}}
            yield anr.event("content_block_start", {"index": i, "content_block": block})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}
            yield anr.event("content_block_delta", {"index": i, "delta": delta})
            yield anr.event("content_block_stop", {"index": i})
        delta = {"stop_reason": reason, "stop_sequence": matched}
        yield anr.event(
            "message_delta", {"delta": delta, "usage": {"output_tokens": usage["output_tokens"]}}
        )
        yield anr.event("message_stop", {})


def _ended(ask: oa.Ask, c: Choice) -> Iterator[str]:
    """A choice's last chunks: the text held back that is not a call, its calls (one delta,
    each call whole), its finish."""
    finish, calls, rest = c.finish, None, ""
    if c.tools is not None:
        rest, calls = c.tools.finish()
    reasoning, text = c.thinking.split(rest)
    if text or reasoning:
        yield sse(oar.chunk(ask, text, index=c.index, reasoning=reasoning))
    if c.tools is not None:
        if calls:
            yield sse(oar.chunk(ask, None, index=c.index, tool_calls=calls))
            finish = "tool_calls"
    yield sse(oar.chunk(ask, None, finish, index=c.index, logprobs=c.logprobs(ask)))


def _chain(first, results: Iterator):
    if first is not None:
        yield first
    yield from results


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
