"""A request's tool calls: its tools checked and the constraint its ``tool_choice`` asks for
(:class:`Tooling`, :func:`output_rules`), and its streamed output with the calls held back
(:class:`ToolStream`). How each family writes a call, and the parsing: ``toolcalls.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConstraintError
from .toolcalls import (
    Harmony,
    Llama3,
    ToolCall,
    ToolFormat,
    call_constraint,
    check_tools,
    tool_format,
)


class ToolStream:
    """Streamed text with the calls held back: :meth:`feed` gives the text to show now (up to
    where a call may start, and the whitespace before it: a parse drops it when a call follows),
    :meth:`finish` what is left and the calls: joined, the text :meth:`ToolFormat.parse` leaves
    of the whole output (but for whitespace the text starts with, when a call follows)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt, self.text, self.shown = fmt, "", 0
        self.holding = self.decided = False

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        if isinstance(self.fmt, Harmony):
            return self._harmony()
        opener = self.fmt.opener
        rest = self.text[self.shown :]
        if isinstance(self.fmt, Llama3):  # a call is the whole output: decided at its start
            if not self.decided:
                stripped, tag = self.text.lstrip(), "<|python_tag|>"
                if not stripped:
                    return ""
                if stripped.startswith(("{", tag)):
                    self.holding = True
                    return ""
                if tag.startswith(stripped):
                    return ""  # may still become the tag
                self.decided = True
            return self._show(len(self.text))
        at = rest.find(opener)
        if at >= 0:
            self.holding = True
            return self._show(self.shown + at)
        return self._show(len(self.text) - _prefix_at_end(rest, opener))

    def _harmony(self) -> str:
        """gpt-oss: a message's head (from ``<|start|>`` or ``<|channel|>`` to ``<|message|>``)
        is held until it is whole; one that names a function (``to=functions.``) begins a
        call, held from its head on."""
        end, heads = self.shown, ("<|start|>", "<|channel|>")
        while True:
            rest = self.text[end:]
            found = [i for i in (rest.find(h) for h in heads) if i >= 0]
            if not found:
                keep = max(_prefix_at_end(rest, h) for h in heads)
                return self._show(len(self.text) - keep)
            at = end + min(found)
            body = self.text.find("<|message|>", at)
            if body < 0:
                return self._show(at)
            if self.fmt.opener in self.text[at:body]:
                self.holding = True
                return self._show(at)
            end = body + len("<|message|>")

    def _show(self, end: int) -> str:
        out = self.text[self.shown : end]
        if not isinstance(self.fmt, (Llama3, Harmony)):  # hold the whitespace a call may follow
            out = out.rstrip()
        self.shown += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the text not yet shown that is not a call, the calls)."""
        content, calls = self.fmt.parse(self.text)
        if not calls:
            return self.text[self.shown :], []
        shown = self.text[: self.shown]
        return (content[len(shown) :] if content.startswith(shown) else ""), calls


def _prefix_at_end(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` begin ``marker`` (a marker that may be coming)."""
    return next((k for k in range(len(marker) - 1, 0, -1) if text.endswith(marker[:k])), 0)


@dataclass
class Tooling:
    """A request's tools: checked, the model's call format, and the constraint its
    ``tool_choice`` asks for (None for ``"auto"``)."""

    tools: list[dict]
    fmt: ToolFormat
    constraint: Any = None

    @classmethod
    def make(cls, tokenizer, tools: Any, tool_choice: Any = None) -> Tooling | None:
        """None without tools or with ``tool_choice="none"`` (then the tools are not shown)."""
        if tools is None or tool_choice == "none":
            return None
        tools = check_tools(tools)
        fmt = tool_format(tokenizer)
        return cls(tools, fmt, call_constraint(fmt, tools, tool_choice, tokenizer))

    def results(self, results):
        """``results`` with their calls held back (:class:`ToolStream`): each one's ``text`` is
        what may be shown now (``in_tool_call`` once a call has begun); the last one also has
        the text held back that is not a call, and ``tool_calls`` the calls parsed from the
        whole output."""
        stream = ToolStream(self.fmt)
        for r in results:
            r.text = stream.feed(r.text)
            r.in_tool_call = stream.holding
            if r.finish_reason is not None:
                rest, r.tool_calls = stream.finish()
                r.text += rest
            yield r


def output_rules(tokenizer, tools: Any = None, tool_choice: Any = None, **constraint_options):
    """A request's ``(constraint, tooling)`` from its options: the constraint given
    (``constraint``, ``response_format``, ``json_schema``, ``regex``, ``choices``, ``grammar``)
    or the one its ``tool_choice`` asks for, and its tools (None without)."""
    from .constraints.spec import from_options

    constraint = from_options(**constraint_options)
    tooling = Tooling.make(tokenizer, tools, tool_choice)
    if tooling is None or tooling.constraint is None:
        return constraint, tooling
    if constraint is not None:
        raise ConstraintError("tool_choice asks for a call, and a constraint was given too")
    return tooling.constraint, tooling
