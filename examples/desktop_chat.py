"""A desktop chat window: PySide6 (Qt) over mlxinfer's app API.

    pip install PySide6-Essentials
    python examples/desktop_chat.py [MODEL_DIR ...] [--models-dir DIR]

Tokens stream into the view while the window stays responsive: the request runs on a worker
thread (the model itself on the engine's thread) and each piece of text reaches the UI thread
as a Qt signal. A reasoning model's thoughts stream in grey before its answer, and only the
answer goes back into the conversation. Stop cancels the request at its next decode step. The model picker lists the
default model, the directories given and the converted models in ``--models-dir``; choosing
one loads it on a worker thread with a progress bar. The status line shows the memory the
model, its KV cache and MLX use.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtGui import QColor, QTextCharFormat
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from mlxinfer import ModelHandle

DEFAULT = "SmolLM2-135M-Instruct (default)"


class Bridge(QObject):
    """Signals from worker threads to the UI thread (Qt queues them across threads)."""

    piece = Signal(str)
    thought = Signal(str)  # a reasoning model's thinking, before its answer
    finished = Signal(str)  # why it ended: "stop", "length", "cancelled" or an error
    progress = Signal(int, int)
    loaded = Signal(str)


class ChatWindow(QMainWindow):
    def __init__(
        self, models: dict[str, str | None], handles: dict | None = None, **options
    ) -> None:
        """``options``: more ``ModelHandle.start`` options for every request (a constraint)."""
        super().__init__()
        self.options = options
        self.setWindowTitle("mlxinfer chat")
        self.models, self.handles = models, handles if handles is not None else {}
        self.handle: ModelHandle | None = None
        self.stream = None
        self.messages: list[dict] = []
        self.reply, self.thinking = "", False
        self.bridge = Bridge()
        self.bridge.piece.connect(self._on_piece)
        self.bridge.thought.connect(self._on_thought)
        self.bridge.finished.connect(self._on_finished)
        self.bridge.progress.connect(self._on_progress)
        self.bridge.loaded.connect(self._on_loaded)

        self.picker = QComboBox()
        self.picker.addItems(list(models))
        self.picker.currentTextChanged.connect(self.choose)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.view = QTextBrowser()
        self.prompt = QLineEdit()
        self.prompt.setPlaceholderText("Message")
        self.prompt.returnPressed.connect(self.send)
        self.send_button = QPushButton("Send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        self.memory = QLabel()

        top = QHBoxLayout()
        top.addWidget(QLabel("Model"))
        top.addWidget(self.picker, 1)
        top.addWidget(self.bar)
        ask = QHBoxLayout()
        ask.addWidget(self.prompt, 1)
        ask.addWidget(self.send_button)
        ask.addWidget(self.stop_button)
        layout = QVBoxLayout()
        layout.addLayout(top)
        layout.addWidget(self.view, 1)
        layout.addLayout(ask)
        layout.addWidget(self.memory)
        body = QWidget()
        body.setLayout(layout)
        self.setCentralWidget(body)
        self.resize(720, 520)

        self.timer = QTimer(self)
        self.timer.timeout.connect(self._show_memory)
        self.timer.start(500)
        self.choose(self.picker.currentText())

    # --- the model ---------------------------------------------------------------------------

    def choose(self, name: str) -> None:
        """Load the chosen model on a worker thread, with the progress bar."""
        self.send_button.setEnabled(False)
        self.bar.setValue(0)
        handle = self.handles.get(name)
        if handle is None:
            report = lambda stage, done, total: self.bridge.progress.emit(done, total)  # noqa: E731
            handle = self.handles[name] = ModelHandle(
                self.models[name], keep_alive=600, progress=report
            )
        self.handle = handle
        threading.Thread(target=self._load, args=(handle, name), daemon=True).start()

    def _load(self, handle: ModelHandle, name: str) -> None:
        try:
            handle.load()
            self.bridge.loaded.emit(name)
        except Exception as e:  # shown, not raised on a worker thread
            self.bridge.finished.emit(f"error: {e}")

    def _on_progress(self, done: int, total: int) -> None:
        self.bar.setValue(int(1000 * done / max(total, 1)))

    def _on_loaded(self, name: str) -> None:
        self.bar.setValue(1000)
        self.send_button.setEnabled(self.stream is None)
        self.view.append(f"<i>{name} loaded</i>")

    # --- a turn ------------------------------------------------------------------------------

    def send(self) -> None:
        text = self.prompt.text().strip()
        if not text or self.stream is not None or self.handle is None:
            return
        self.prompt.clear()
        self.messages.append({"role": "user", "content": text})
        self.view.append(f"<b>You:</b> {_escape(text)}")
        self.view.append("<b>Model:</b> ")
        self.reply, self.thinking = "", False
        self.send_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        try:
            self.stream = self.handle.start(
                self.messages,
                chat_template=True,
                max_tokens=512,
                split_reasoning=True,
                **self.options,
            )
        except Exception as e:  # a prompt over the context, a model that failed to load
            self.messages.pop()
            self._on_finished(f"error: {e}")
            return
        threading.Thread(target=self._run, args=(self.stream,), daemon=True).start()

    def _run(self, stream) -> None:
        reason = "cancelled"
        try:
            for r in stream:
                if r.reasoning:
                    self.bridge.thought.emit(r.reasoning)
                if r.text:
                    self.bridge.piece.emit(r.text)
                if r.finish_reason:
                    reason = r.finish_reason
        except Exception as e:
            reason = f"error: {e}"
        self.bridge.finished.emit(reason)

    def stop(self) -> None:
        if self.stream is not None:
            self.stream.cancel()  # the engine drops it at its next step

    def _on_piece(self, text: str) -> None:
        if self.thinking:  # the answer starts on its own line after the thoughts
            self.thinking = False
            self._insert("\n", QTextCharFormat())
        self.reply += text
        self._insert(text, QTextCharFormat())

    def _on_thought(self, text: str) -> None:
        self.thinking = True
        shade = QTextCharFormat()
        shade.setForeground(QColor("gray"))
        shade.setFontItalic(True)
        self._insert(text, shade)

    def _insert(self, text: str, style: QTextCharFormat) -> None:
        cursor = self.view.textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        cursor.insertText(text, style)
        self.view.setTextCursor(cursor)

    def _on_finished(self, reason: str) -> None:
        if self.reply:
            self.messages.append({"role": "assistant", "content": self.reply})
        if reason not in ("stop", "length"):
            self.view.append(f"<i>{_escape(reason)}</i>")
        self.stream = None
        self.send_button.setEnabled(self.handle is not None and self.handle.loaded)
        self.stop_button.setEnabled(False)

    def _show_memory(self) -> None:
        if self.handle is None:
            return
        m = self.handle.memory()
        self.memory.setText(
            f"weights {m['weights'] / 1e6:.0f} MB · KV {m['kv_in_use'] / 1e6:.1f} MB · "
            f"MLX active {m['active'] / 1e6:.0f} MB, peak {m['peak'] / 1e6:.0f} MB"
        )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", type=Path, help="model directories")
    ap.add_argument("--models-dir", type=Path, default=None)
    args = ap.parse_args()
    models: dict[str, str | None] = {DEFAULT: None}
    found = list(args.models)
    if args.models_dir is not None:
        found += sorted(p for p in args.models_dir.iterdir() if (p / "config.json").is_file())
    models.update({p.name: str(p) for p in found})
    app = QApplication(sys.argv)
    window = ChatWindow(models)
    window.show()
    code = app.exec()
    for handle in window.handles.values():
        handle.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
