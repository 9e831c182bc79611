"""A stand-in for the batching engine that answers every request with a fixed text, for the
tests of what the server and the chat page do with a stream (not of what a model writes)."""

from __future__ import annotations

import threading
import time

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
        """:meth:`stream`'s results as ``Engine.start`` gives them: a stream any thread may
        cancel (it ends before its next piece)."""
        return _Stream(self.stream(tokenizer, prompt, **options))

    def metrics(self) -> dict:
        return {}

    def close(self, timeout: float = 10.0) -> None:
        self.alive = False


class _Stream:
    def __init__(self, results) -> None:
        self._results, self._cancelled = results, threading.Event()

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> GenerationResult:
        if self._cancelled.is_set():
            self._results.close()
            raise StopIteration
        return next(self._results)

    def cancel(self) -> None:
        self._cancelled.set()
        try:
            self._results.close()
        except ValueError:  # being read on another thread: it ends at its next piece
            pass
