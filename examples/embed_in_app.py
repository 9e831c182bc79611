"""Embedding mlxinfer in an app: load once, stream into a UI, stop early on demand.

    python examples/embed_in_app.py [MODEL_DIR_OR_REPO]

A GUI would call ``Assistant.ask`` from a worker thread and append each chunk
to a text view; here the "view" is stdout and the "stop button" is a word limit.
"""

from __future__ import annotations

import sys
from typing import Callable

from mlxinfer.platform.blas import preload_openblas

preload_openblas()  # Linux only, before MLX loads: use the system OpenBLAS if there is one

import mlxinfer  # noqa: E402


class Assistant:
    def __init__(self, model: str | None = None):
        self.model, self.tokenizer = mlxinfer.load(model, log=lambda m: print(m, file=sys.stderr))
        self.chat = mlxinfer.ChatSession(
            self.model, self.tokenizer, system="Answer briefly.", max_tokens=128
        )

    def ask(
        self, question: str, on_text: Callable[[str], None], should_stop: Callable[[], bool]
    ) -> str:
        """Stream the answer to ``on_text``; returns why it finished."""
        for r in self.chat.send(question):
            on_text(r.text)
            if should_stop():
                return "stopped"  # leaving the loop closes the stream; the chat stays usable
            if r.finish_reason:
                return r.finish_reason
        return "stop"


def main(model: str | None = None) -> None:
    assistant = Assistant(model)
    shown: list[str] = []

    def on_text(text: str) -> None:
        shown.append(text)
        print(text, end="", flush=True)

    reason = assistant.ask("What is the capital of France?", on_text, lambda: False)
    print(f"\n[{reason}]")
    shown.clear()
    reason = assistant.ask("Tell me about it.", on_text, lambda: len("".join(shown).split()) >= 10)
    print(f"\n[{reason}]")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
