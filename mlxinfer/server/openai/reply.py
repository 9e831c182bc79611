"""Engine results turned into an OpenAI response: a whole JSON body, or its stream of
server-sent events (the JSON objects themselves are :mod:`.objects`').

An OpenAI request with ``n`` > 1 is ``n`` requests in the engine (decoded together, the prompt
prefilled once and shared from the prefix cache); its chunks are interleaved, each with its
choice's ``index``.

The engine's results come parsed (``Routes.start``): a chat reply's calls held back from its
text and parsed on its last result (``tool_calls``), what a reasoning model thinks apart from its
answer (``reasoning``). Here they become OpenAI's ``tool_calls``, ``reasoning_content`` and
content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

from fastapi.responses import JSONResponse

from ...batch import EngineError
from ...generation.results import GenerationResult, GenerationStats
from ..api_errors import OpenAIError
from . import objects
from .request import CompletionRequest


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

    def take(self, ask: CompletionRequest, tokenizer, r: GenerationResult) -> None:
        self.tokens += 1
        self.last, self.finish = r, r.finish_reason or self.finish
        if ask.logprobs and r.logprobs is not None:
            self.entries.append(
                objects.token_logprobs(tokenizer, r.token, r.logprobs, ask.top_logprobs)
            )

    def logprobs(self, ask: CompletionRequest):
        """The entries taken since the last call, in the endpoint's shape."""
        out, self.offset = objects.logprobs_field(ask, self.entries, self.offset)
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


def openai_whole(ask: CompletionRequest, tokenizer, choices: list[Choice]) -> JSONResponse:
    out = []
    try:
        for c in choices:
            text, reasoning = [], []
            for r in c.each():
                c.take(ask, tokenizer, r)
                text.append(r.text)
                reasoning.append(r.reasoning)
            calls = c.last.tool_calls if c.last is not None else None
            out.append(
                objects.choice(
                    ask,
                    c.index,
                    "".join(text),
                    c.finish,
                    c.logprobs(ask),
                    calls,
                    "".join(reasoning),
                )
            )
    except (EngineError, TimeoutError) as e:
        raise OpenAIError(500, str(e), type="server_error") from None
    finally:
        _close(choices)
    tokens = sum(c.tokens for c in choices)
    return JSONResponse(objects.response(ask, out, _stats(choices), tokens))


def openai_events(ask: CompletionRequest, tokenizer, choices: list[Choice]) -> Iterator[str]:
    """SSE ``data:`` lines: a first chunk per choice (with the role), one per piece of text
    (with the log-probs of the tokens since the last, if asked), each choice's finish, the
    usage if asked, then ``[DONE]``. The choices' streams are read in turn, a token each."""
    for c in choices:
        yield sse(objects.chunk(ask, None, index=c.index, first=True))
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
                if r.text or r.reasoning:
                    logprobs = c.logprobs(ask)
                    yield sse(
                        objects.chunk(
                            ask, r.text, index=c.index, logprobs=logprobs, reasoning=r.reasoning
                        )
                    )
    except (EngineError, TimeoutError) as e:
        yield sse(OpenAIError(500, str(e), type="server_error").body())
        yield "data: [DONE]\n\n"
        return
    finally:
        _close(choices)  # also when the client went away: the requests are cancelled
    if ask.include_usage:
        usage = objects.usage(_stats(choices), sum(c.tokens for c in choices))
        yield sse({**objects.chunk(ask, None), "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _ended(ask: CompletionRequest, c: Choice) -> Iterator[str]:
    """A choice's last chunks: its calls (one delta, each call whole), its finish."""
    finish, calls = c.finish, c.last.tool_calls if c.last is not None else None
    if calls:
        yield sse(objects.chunk(ask, None, index=c.index, tool_calls=calls))
        finish = "tool_calls"
    yield sse(objects.chunk(ask, None, finish, index=c.index, logprobs=c.logprobs(ask)))


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
