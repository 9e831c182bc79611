"""A stand-in for the batching engine that answers every request with a fixed text, for the
tests of what the server and the chat page do with a stream (not of what a model writes).

Its text is parsed as the engine's is (``PreparedRequest.shaped``: tool calls held back and
parsed, reasoning split from the real prompt's ids), so the server reads the same fields."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from mlxinfer.generation.request import prepare_request
from mlxinfer.generation.results import GenerationResult, GenerationStats

REPLY = (
    "Here is Python:\n\n```python\ndef square(x):\n    return x * x\n```\n\n"
    "Euler's identity is $e^{i\\pi}+1=0$.\n\n"
    '<script>window.__ran = 1</script><img src=x onerror="window.__ran = 2">\n\n'
    "Done."
)


class ScriptedEngine:
    """Answers every request with ``REPLY``, in pieces ``delay`` seconds apart (``LONG`` for a
    prompt containing "long") and ``pause`` seconds after the first (``first_pause`` before
    it: a long prefill), and records what was asked and which streams were closed."""

    LONG = "word " * 400

    def __init__(self, delay: float = 0.01, pause: float = 0.0, first_pause: float = 0.0) -> None:
        self.delay, self.pause, self.prompts = delay, pause, []
        self.first_pause = first_pause
        self.closed = threading.Event()
        self.alive, self.failure = True, None

    def stream(self, tokenizer, prompt, *, max_tokens, **options):
        self.prompts.append(prompt)
        text = self.LONG if "long" in prompt[-1]["content"] else REPLY
        pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
        stats = GenerationStats(prompt_tokens=7)
        try:
            for i, piece in enumerate(pieces):
                if i == 0 and self.first_pause:
                    time.sleep(self.first_pause)
                time.sleep(self.pause if i == 1 else self.delay if text is REPLY else 0.05)
                last = i == len(pieces) - 1
                yield GenerationResult(
                    piece, i, finish_reason="stop" if last else None, stats=stats
                )
        finally:
            self.closed.set()

    def start(self, tokenizer, prompt, **options) -> _Stream:
        """:meth:`stream`'s results as ``Engine.start`` gives them: parsed as the engine's are
        (the options ``tools``, ``tool_choice``, ``split_reasoning``, ``chat_template``,
        ``chat_template_kwargs``), a stream any thread may cancel (it ends before its next
        piece)."""
        raw = self.stream(tokenizer, prompt, **options)
        return _Stream(shaped(tokenizer, prompt, raw, options), raw)

    def metrics(self) -> dict:
        return {}

    def close(self, timeout: float = 10.0) -> None:
        self.alive = False


# The model ``prepare_request`` sees: any prompt fits, any id is in its vocabulary.
UNBOUNDED = SimpleNamespace(args=SimpleNamespace(max_position_embeddings=1 << 30))
OUTPUT_OPTIONS = (
    "chat_template",
    "tools",
    "tool_choice",
    "split_reasoning",
    "chat_template_kwargs",
)


def shaped(tokenizer, prompt, results, options: dict):
    """``results`` (raw text) parsed as the engine parses a request's with these options."""
    given = {k: options[k] for k in OUTPUT_OPTIONS if k in options}
    return prepare_request(UNBOUNDED, tokenizer, prompt, **given).shaped(results)


class _Stream:
    def __init__(self, results, raw=None) -> None:
        self._results, self._cancelled = results, threading.Event()
        self._raw = raw  # the unparsed results under ``results``: closed with them

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> GenerationResult:
        if self._cancelled.is_set():
            self._close()
            raise StopIteration
        return next(self._results)

    def cancel(self) -> None:
        self._cancelled.set()
        try:
            self._close()
        except ValueError:  # being read on another thread: it ends at its next piece
            pass

    def _close(self) -> None:
        self._results.close()
        if self._raw is not None:
            self._raw.close()
