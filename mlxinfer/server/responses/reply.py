"""A /v1/responses reply: the ``response`` object whole, or its stream of events.

The engine's results come parsed, as a chat reply's do (:mod:`mlxinfer.server.openai.reply`):
the reasoning apart from the answer, the calls held back and parsed on the last result. They
become ``output`` items in order: a ``reasoning`` item (the thoughts as ``reasoning_text`` content), a ``message`` (its
``output_text``), then each call, a ``function_call`` (with the ``namespace`` of a namespaced
tool) or a ``custom_tool_call``.

The stream is the sequence the official ``openai`` client's ``responses.stream`` accumulates and
Codex parses, every event with its ``sequence_number``: ``response.created``,
``response.in_progress``; per item ``response.output_item.added``, for text
``response.content_part.added``, its deltas (``response.reasoning_text.delta``,
``response.output_text.delta``), their ``.done``, ``response.content_part.done``; for a call
``response.function_call_arguments.delta`` / ``.done`` (``custom_tool_call_input`` for a
custom tool); ``response.output_item.done``; and last ``response.completed``. A reply cut off
by ``max_output_tokens`` ends with ``response.completed`` too, its response's ``status``
``incomplete`` (``incomplete_details.reason``: ``max_output_tokens``): Codex and the client's
stream helper both wait for ``response.completed``. An engine failure mid-stream is
``response.failed``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Iterator

from ...batch import EngineError
from ...generation.results import GenerationStats
from ...output.toolcalls import ToolCall
from ..api_errors import OpenAIError
from .request import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Reply:
    """One response: :meth:`events` streams it, :meth:`whole` returns the object."""

    def __init__(self, ask: ResponsesRequest, tokenizer, first, results: Iterator) -> None:
        self.ask, self.first, self.results = ask, first, results
        self.seq, self.quiet = 0, False
        self.output: list[dict] = []  # the items done
        self.current: dict | None = None  # the reasoning or message item being streamed
        self.text = ""  # its text so far
        self.tokens = self.before_answer = 0
        self.answered = self.thought = False
        self.finish, self.last = "stop", first
        self.error: str | None = None

    # -- the response object --------------------------------------------------------------

    def status(self) -> str:
        if self.error is not None:
            return "failed"
        return "incomplete" if self.finish == "length" else "completed"

    def response(self, status: str) -> dict:
        ask, done = self.ask, status not in ("in_progress", "queued")
        out = {
            "id": ask.id,
            "object": "response",
            "created_at": ask.created,
            "status": status,
            "background": False,
            "error": {"code": "server_error", "message": self.error} if self.error else None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "model": ask.model,
            "output": list(self.output) if done else [],
            "previous_response_id": None,
            "truncation": "disabled",
            "usage": self.usage() if done else None,
            **ask.echo,
        }
        if status == "completed":
            out["completed_at"] = int(time.time())
        return out

    def usage(self) -> dict:
        stats = self.last.stats if self.last is not None else GenerationStats()
        reasoning = self.before_answer if self.thought else 0
        return {
            "input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": self.tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": stats.prompt_tokens + self.tokens,
        }

    def whole(self) -> dict:
        self.quiet = True
        for _ in self.events():
            pass
        if self.error is not None:
            raise OpenAIError(500, self.error, type="server_error")
        return self.response(self.status())

    # -- the events -----------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> str:
        self.seq += 1
        if self.quiet:
            return ""
        payload = {"type": kind, "sequence_number": self.seq - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def events(self) -> Iterator[str]:
        yield self._event("response.created", response=self.response("in_progress"))
        yield self._event("response.in_progress", response=self.response("in_progress"))
        calls: list[ToolCall] = []
        try:
            for r in _chain(self.first, self.results):
                self.tokens += 1
                self.last, self.finish = r, r.finish_reason or self.finish
                yield from self._pieces(r.reasoning, r.text)
                if r.in_tool_call:  # a call is an answer too
                    self.answered = True
                if not self.answered:
                    self.before_answer += 1
                calls = r.tool_calls or []
        except (EngineError, TimeoutError) as e:
            self.error = str(e) or type(e).__name__
            yield from self._close()
            yield self._event("response.failed", response=self.response("failed"))
            return
        finally:
            self.results.close()  # the request is cancelled if it was still running
        if not self.output and self.current is None and not calls:
            yield from self._open("message")  # an empty answer is still a message
        yield from self._close()
        for call in calls:
            yield from self._call(call)
        yield self._event("response.completed", response=self.response(self.status()))

    def _pieces(self, reasoning: str, text: str) -> Iterator[str]:
        for kind, piece in (("reasoning", reasoning), ("message", text)):
            if not piece:
                continue
            if kind == "reasoning":
                self.thought = True
            else:
                self.answered = True
            if self.current is None or self.current["type"] != kind:
                yield from self._close()
                yield from self._open(kind)
            self.text += piece
            where = {"item_id": self.current["id"], "output_index": len(self.output)}
            if kind == "reasoning":
                yield self._event(
                    "response.reasoning_text.delta", **where, content_index=0, delta=piece
                )
            else:
                yield self._event(
                    "response.output_text.delta", **where, content_index=0, delta=piece, logprobs=[]
                )

    def _open(self, kind: str) -> Iterator[str]:
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.current, self.text = {**item, "status": "in_progress"}, ""
        index = len(self.output)
        yield self._event("response.output_item.added", output_index=index, item=self.current)
        yield self._event(
            "response.content_part.added",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            part=part,
        )

    def _close(self) -> Iterator[str]:
        """End the item being streamed: its text's ``.done``, its part's, its own."""
        item = self.current
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            yield self._event("response.reasoning_text.done", **where, text=self.text)
        else:
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            yield self._event("response.output_text.done", **where, text=self.text, logprobs=[])
        yield self._event("response.content_part.done", **where, part=part)
        status = "incomplete" if self.finish == "length" or self.error else "completed"
        done = {**item, "content": [part], "status": status}
        self.current = None
        yield self._event("response.output_item.done", output_index=len(self.output), item=done)
        self.output.append(done)

    def _call(self, call: ToolCall) -> Iterator[str]:
        """A call's item: its arguments (a custom tool's input) in one delta."""
        tool = self.ask.names.get(call.name)
        index = len(self.output)
        if tool is not None and tool.kind == "custom":
            given = call.arguments.get("input") if isinstance(call.arguments, dict) else None
            text = given if isinstance(given, str) else json.dumps(call.arguments)
            item = {"type": "custom_tool_call", "id": _id("ctc"), "call_id": call.id}
            item.update(name=tool.name, input="")
            kind, key = "response.custom_tool_call_input", "input"
        else:
            text = json.dumps(call.arguments, ensure_ascii=False)
            item = {"type": "function_call", "id": _id("fc"), "call_id": call.id}
            item.update(name=tool.name if tool is not None else call.name, arguments="")
            if tool is not None and tool.namespace is not None:
                item["namespace"] = tool.namespace
            item["status"] = "in_progress"
            kind, key = "response.function_call_arguments", "arguments"
        yield self._event("response.output_item.added", output_index=index, item=item)
        where = {"item_id": item["id"], "output_index": index}
        yield self._event(f"{kind}.delta", **where, delta=text)
        yield self._event(f"{kind}.done", **where, **{key: text})
        done = {**item, key: text}
        if "status" in done:
            done["status"] = "completed"
        yield self._event("response.output_item.done", output_index=index, item=done)
        self.output.append(done)


def _chain(first, results: Iterator):
    if first is not None:
        yield first
    yield from results
