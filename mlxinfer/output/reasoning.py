"""Reasoning: the part of a model's output that thinks before it answers, told apart from the answer.

Two ways a model marks it, read from its chat template:

- **think tags** (Qwen3, SmolLM3, DeepSeek-R1, GLM-4.5, OLMo 3 Think): ``<think>…</think>`` at the
  start of the reply, the answer after it. A template whose generation prompt already opens the
  tag (DeepSeek-R1's, Qwen3's with thinking forced) leaves the reply starting inside it: the
  prompt says so (:meth:`ReasoningFormat.started_by`).
- **harmony** (gpt-oss): messages ``<|channel|>NAME<|message|>BODY<|end|>`` separated by
  ``<|start|>assistant``; the ``analysis`` channel is the reasoning, ``final`` the answer, and
  ``commentary`` is shown as answer text unless it is a tool call (``to=functions.…``: the
  tool-call format in toolcalls.py takes those).

A :class:`Splitter` splits streamed text as it comes, holding back only what may still become a
marker; :meth:`ReasoningFormat.split` does a whole output. The API, the server
(``reasoning_content``, Anthropic's ``thinking`` blocks) and the CLI use them; the tokens and the
raw text stay as the model wrote them.
"""

from __future__ import annotations

import re

from ..errors import MlxInferError

REASONING, CONTENT = "reasoning", "content"


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could be the start of one of ``markers``."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


class Splitter:
    """Streamed text in, ``(reasoning, content)`` deltas out."""

    def feed(self, piece: str) -> tuple[str, str]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        """What is still held back (a marker that never completed is text after all)."""
        raise NotImplementedError

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of the rest of a reply given whole: ``feed`` then ``finish``."""
        a, b = self.feed(text)
        c, d = self.finish()
        return a + c, b + d


class Plain(Splitter):
    """A model that marks no reasoning: everything is the answer."""

    def feed(self, piece: str) -> tuple[str, str]:
        return "", piece

    def finish(self) -> tuple[str, str]:
        return "", ""


class ReasoningFormat:
    name = ""

    def splitter(self, started: bool = False) -> Splitter:
        raise NotImplementedError

    def started_by(self, prompt: str) -> bool:
        """Whether a reply to ``prompt`` starts inside the reasoning (the prompt opened it)."""
        return False

    def split(self, text: str, started: bool = False) -> tuple[str, str]:
        """(reasoning, answer) of a whole output."""
        return self.splitter(started).split(text)


class ThinkTags(ReasoningFormat):
    name, opener, closer = "think", "<think>", "</think>"

    def splitter(self, started: bool = False) -> Splitter:
        return _ThinkSplitter(self, started)

    def started_by(self, prompt: str) -> bool:
        tail = prompt.rstrip()
        return tail.endswith(self.opener) or (
            self.opener in tail and self.closer not in tail[tail.rindex(self.opener) :]
        )


class _ThinkSplitter(Splitter):
    """States: ``start`` (before any text: a reply may open with the tag), ``reasoning``,
    ``content``. Whitespace right after either tag is dropped, as is the answer's leading
    whitespace after the reasoning."""

    def __init__(self, fmt: ThinkTags, started: bool) -> None:
        self.fmt, self.held = fmt, ""
        self.state = REASONING if started else "start"
        self.trim = started  # drop whitespace at the start of the next part

    def feed(self, piece: str) -> tuple[str, str]:
        text, reasoning, content = self.held + piece, [], []
        self.held = ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(self.fmt.opener):
                    text, self.state, self.trim = stripped[len(self.fmt.opener) :], REASONING, True
                    continue
                if not stripped or self.fmt.opener.startswith(stripped):
                    self.held = text  # may still open the tag
                    break
                self.state = CONTENT
            if self.trim:
                text = text.lstrip()
                if not text:
                    break
                self.trim = False
            if self.state == CONTENT:
                content.append(text)
                break
            at = text.find(self.fmt.closer)
            if at >= 0:
                reasoning.append(text[:at].rstrip() if at else "")
                text, self.state, self.trim = text[at + len(self.fmt.closer) :], CONTENT, True
                continue
            # Held back: what may be the closer's start, and the whitespace before it (the
            # reasoning's trailing whitespace is dropped, as in a whole split).
            keep = _partial(text, (self.fmt.closer,))
            body = text[: len(text) - keep]
            shown = body.rstrip()
            reasoning.append(shown)
            self.held = text[len(shown) :]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == REASONING:
            return held, ""
        return "", held.lstrip() if self.state == "start" else held


class Harmony(ReasoningFormat):
    name = "harmony"
    MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|return|>")

    def splitter(self, started: bool = False) -> Splitter:
        return _HarmonySplitter()


class _HarmonySplitter(Splitter):
    """A message's header (``<|channel|>`` up to ``<|message|>``: the channel, a recipient, a
    content type) is never shown; its body goes to the reasoning (``analysis``), nowhere (a
    message to a recipient, ``to=functions.…``: a tool call, which toolcalls.py parses), or the
    answer (every other channel). Text outside any message (a reply that skipped the format)
    is answer text."""

    def __init__(self) -> None:
        self.held, self.header, self.kind = "", None, CONTENT
        self.to = False  # the message's role named a recipient (``<|start|>assistant to=…``)

    def feed(self, piece: str) -> tuple[str, str]:
        text, out = self.held + piece, {REASONING: [], CONTENT: [], None: []}
        self.held = ""
        while text:
            if self.header is not None:  # inside a header: wait for <|message|>
                text = self.header + text
                at = text.find("<|message|>")
                if at < 0:
                    self.header = text
                    break
                words = text[:at].split()
                if self.to or any(w.startswith("to=") for w in words):
                    self.kind = None
                else:
                    self.kind = REASONING if words[:1] == ["analysis"] else CONTENT
                self.header, self.to, text = None, False, text[at + len("<|message|>") :]
                continue
            at = text.find("<|")
            if at < 0:
                keep = 1 if text.endswith("<") else 0  # may become "<|"
                out[self.kind].append(text[: len(text) - keep])
                self.held = text[len(text) - keep :]
                break
            out[self.kind].append(text[:at])
            text = text[at:]
            marker = next((m for m in Harmony.MARKERS if text.startswith(m)), None)
            if marker is None:
                if _partial(text, Harmony.MARKERS) == len(text):
                    self.held = text  # may still become a marker
                    break
                out[self.kind].append("<|")
                text = text[2:]
                continue
            text = text[len(marker) :]
            if marker == "<|channel|>":
                self.header = ""
            elif marker == "<|start|>":  # the next message's role ("assistant"), up to its channel
                at = text.find("<|")
                if at < 0:
                    self.held = "<|start|>" + text
                    break
                self.to = "to=" in text[:at]
                text = text[at:]
            else:  # <|end|>, <|call|>, <|return|>, <|message|> out of place: a message ends
                self.kind = CONTENT
        return "".join(out[REASONING]), "".join(out[CONTENT])

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if held.startswith("<|start|>") or self.header is not None or self.kind is None:
            return "", ""  # a message that never got its body, or a call's
        return ("", held) if self.kind == CONTENT else (held, "")


FORMATS = (ThinkTags(), Harmony())
_THINK_IN_TEMPLATE = re.compile(r"<think>|</think>")


def reasoning_format(tokenizer) -> ReasoningFormat | None:
    """The way this model marks its reasoning, read from its chat template; None if it does not."""
    source = tokenizer.chat_template_source() or ""
    if "<|channel|>" in source:
        return FORMATS[1]
    if _THINK_IN_TEMPLATE.search(source):
        return FORMATS[0]
    return None


def split_results(results, splitter: Splitter):
    """``results`` (GenerationResults) with each one's ``text`` split by ``splitter``:
    ``reasoning`` gets the reasoning's part, ``text`` keeps the answer's; the last one also
    what was held back."""
    for r in results:
        r.reasoning, r.text = splitter.feed(r.text)
        if r.finish_reason is not None:
            rest_reasoning, rest_text = splitter.finish()
            r.reasoning += rest_reasoning
            r.text += rest_text
        yield r


def splitter_for(tokenizer, prompt_ids=None) -> Splitter:
    """A splitter for one reply of this model: its format's (starting inside the reasoning when
    the prompt opened it: ``prompt_ids``, or else a one-message chat rendered to see), or
    :class:`Plain`."""
    fmt = reasoning_format(tokenizer)
    if fmt is None:
        return Plain()
    if prompt_ids is not None:
        prompt = tokenizer.decode(list(prompt_ids)[-32:])
    else:
        try:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        except MlxInferError:
            prompt = ""
    return fmt.splitter(fmt.started_by(prompt))
