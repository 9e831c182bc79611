"""Engine results turned into an Ollama reply: one JSON object, or its NDJSON stream (one object
a line, never a blank line or a comment: the clients parse every line).

The engine's results come parsed (``Routes.start``): what a reasoning model thinks goes to
``thinking``, its answer to ``content`` (chat) or ``response`` (generate), the calls of its last
result to ``message.tool_calls`` with their arguments as objects. The last object says
``done: true``, why (``done_reason``: stop or length) and the counts and durations in
nanoseconds. Asked for, each piece carries the ``logprobs`` of its tokens (``token``,
``logprob``, ``bytes``, ``top_logprobs``), a whole reply all of them.
"""

from __future__ import annotations

import json
import time
from typing import Iterator

from ...batch import EngineError
from ...generation.results import GenerationStats
from ..api_errors import OllamaError
from ..openai.objects import token_logprobs
from . import objects
from .request import OllamaRequest


def line(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


class OllamaReply:
    """An ``/api/chat`` or ``/api/generate`` reply, whole or as NDJSON lines."""

    def __init__(self, ask: OllamaRequest, tokenizer, first, results: Iterator) -> None:
        self.ask, self.tokenizer, self.first, self.results = ask, tokenizer, first, results
        self.tokens, self.finish, self.last = 0, "stop", first
        self.calls: list = []
        self.entries: list[dict] = []  # log-prob entries not yet sent

    def _pieces(self) -> Iterator[tuple[str, str]]:
        """Each result's ``(reasoning, text)``; its calls, on the last one, to ``calls``."""
        try:
            if self.first is not None:
                yield self._take(self.first)
            for r in self.results:
                yield self._take(r)
        finally:
            self.results.close()  # the request is cancelled if it was still running

    def _take(self, r) -> tuple[str, str]:
        self.tokens += 1
        self.last, self.finish = r, r.finish_reason or self.finish
        self.calls = r.tool_calls or []
        if self.ask.logprobs and r.logprobs is not None:  # OpenAI's entry is Ollama's shape too
            entry = token_logprobs(self.tokenizer, r.token, r.logprobs, self.ask.top_logprobs)
            self.entries.append(entry)
        return r.reasoning, r.text

    def _logprobs(self, out: dict) -> dict:
        """``out`` with the log-prob entries taken since the last piece sent, if asked."""
        if self.ask.logprobs and self.entries:
            out["logprobs"], self.entries = self.entries, []
        return out

    def _done(self) -> dict:
        stats = self.last.stats if self.last is not None else GenerationStats()
        end = objects.chunk(self.ask, "")
        end["done"] = True
        end["done_reason"] = "length" if self.finish == "length" else "stop"
        total = time.perf_counter() - self.ask.started
        return {**end, **objects.durations(stats, self.tokens, total)}

    def whole(self) -> dict:
        thinking, text = [], []
        try:
            for thought, piece in self._pieces():
                thinking.append(thought)
                text.append(piece)
        except (EngineError, TimeoutError) as e:
            raise OllamaError(500, str(e)) from None
        out = self._done()
        whole = objects.chunk(self.ask, "".join(text), "".join(thinking), self.calls)
        key = "message" if self.ask.chat else "response"
        out[key] = whole[key]
        if "thinking" in whole:
            out["thinking"] = whole["thinking"]
        return self._logprobs(out)

    def lines(self) -> Iterator[str]:
        """A line per piece of text or thought, the calls in one line, then the end."""
        try:
            for thought, piece in self._pieces():
                if thought or piece:
                    yield line(self._logprobs(objects.chunk(self.ask, piece, thought)))
        except (EngineError, TimeoutError) as e:
            yield line(OllamaError(500, str(e)).body())  # the clients raise it
            return
        if self.calls:
            yield line(objects.chunk(self.ask, "", calls=self.calls))
        yield line(self._logprobs(self._done()))  # the tokens of no text (an end token) too


def keep_alive_line(ask: OllamaRequest) -> str:
    """What a stream sends while the first token is slow to come (a long prefill, a full
    batch): an empty piece, which every client takes as nothing."""
    return line(objects.chunk(ask, ""))
