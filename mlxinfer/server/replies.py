"""Engine results turned into each API's responses: a whole JSON body, or its stream of
server-sent events.

An OpenAI request with ``n`` > 1 is ``n`` requests in the engine (decoded together, the prompt
prefilled once and shared from the prefix cache); its chunks are interleaved, each with its
choice's ``index``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

from fastapi.responses import JSONResponse

from ..batch import EngineError
from ..generation.results import GenerationResult
from . import anthropic as an
from . import openai as oa


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
            self.entries.append(oa.token_logprobs(tokenizer, r.token, r.logprobs, ask.top_logprobs))

    def logprobs(self, ask: oa.Ask):
        """The entries taken since the last call, in the endpoint's shape."""
        out, self.offset = oa.logprobs_field(ask, self.entries, self.offset)
        self.entries = []
        return out

    def close(self) -> None:
        self.results.close()  # the request is cancelled if it was still running


def _stats(choices: list[Choice]):
    last = choices[0].last
    return last.stats if last is not None else oa.GenerationStats()


def _close(choices: list[Choice]) -> None:
    for c in choices:
        c.close()


def openai_whole(ask: oa.Ask, tokenizer, choices: list[Choice]) -> JSONResponse:
    out = []
    try:
        for c in choices:
            text = []
            for r in c.each():
                c.take(ask, tokenizer, r)
                text.append(r.text)
            out.append(oa.choice(ask, c.index, "".join(text), c.finish, c.logprobs(ask)))
    except (EngineError, TimeoutError) as e:
        raise oa.APIError(500, str(e), type="server_error") from None
    finally:
        _close(choices)
    tokens = sum(c.tokens for c in choices)
    return JSONResponse(oa.response(ask, out, _stats(choices), tokens))


def openai_events(ask: oa.Ask, tokenizer, choices: list[Choice]) -> Iterator[str]:
    """SSE ``data:`` lines: a first chunk per choice (with the role), one per piece of text
    (with the log-probs of the tokens since the last, if asked), each choice's finish, the
    usage if asked, then ``[DONE]``. The choices' streams are read in turn, a token each."""
    for c in choices:
        yield sse(oa.chunk(ask, None, index=c.index, first=True))
    running = [(c, c.each()) for c in choices]
    try:
        while running:
            for c, results in list(running):
                r = next(results, None)
                if r is None:
                    running.remove((c, results))
                    yield sse(
                        oa.chunk(ask, None, c.finish, index=c.index, logprobs=c.logprobs(ask))
                    )
                    continue
                c.take(ask, tokenizer, r)
                if r.text:
                    yield sse(oa.chunk(ask, r.text, index=c.index, logprobs=c.logprobs(ask)))
    except (EngineError, TimeoutError) as e:
        yield sse(oa.APIError(500, str(e), type="server_error").body())
        yield "data: [DONE]\n\n"
        return
    finally:
        _close(choices)  # also when the client went away: the requests are cancelled
    if ask.include_usage:
        usage = oa.usage(_stats(choices), sum(c.tokens for c in choices))
        yield sse({**oa.chunk(ask, None), "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


class AnthropicReply:
    """A /v1/messages reply, whole or as Anthropic's stream of events."""

    def __init__(self, ask: an.Ask, tokenizer, first, results: Iterator):
        self.ask, self.tokenizer, self.first, self.results = ask, tokenizer, first, results
        self.tokens: list[int] = []
        self.finish, self.last = "stop", first

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
        stats = self.last.stats if self.last is not None else an.GenerationStats()
        reason = an.stop_reason(self.finish, eos, matched)
        return reason, matched, an.usage(stats, len(self.tokens))

    def whole(self) -> dict:
        text = "".join(self._pieces())
        reason, matched, usage = self._end()
        return an.message(self.ask, text, reason, matched, usage)

    def events(self) -> Iterator[str]:
        stats = self.first.stats if self.first is not None else an.GenerationStats()
        start = an.message(self.ask, "", None, None, an.usage(stats, 0))
        yield an.event("message_start", {"message": start})
        block = {"type": "text", "text": ""}
        yield an.event("content_block_start", {"index": 0, "content_block": block})
        yield an.event("ping", {})
        try:
            for text in self._pieces():
                if text:
                    delta = {"type": "text_delta", "text": text}
                    yield an.event("content_block_delta", {"index": 0, "delta": delta})
        except (EngineError, TimeoutError) as e:
            yield an.event("error", {"error": an.APIError(500, str(e)).body()["error"]})
            return
        reason, matched, usage = self._end()
        yield an.event("content_block_stop", {"index": 0})
        delta = {"stop_reason": reason, "stop_sequence": matched}
        yield an.event(
            "message_delta", {"delta": delta, "usage": {"output_tokens": usage["output_tokens"]}}
        )
        yield an.event("message_stop", {})


def _chain(first, results: Iterator):
    if first is not None:
        yield first
    yield from results


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
