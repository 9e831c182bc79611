"""examples/desktop_chat.py, driven offscreen (``QT_QPA_PLATFORM=offscreen``): text streams in
without stalling Qt's event loop, Stop stops it, and a reasoning model's thoughts are shown apart
and left out of the history. Needs PySide6 (the test extras)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import pytest
from hf_models import add_tokenizer, make_tiny

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
QtWidgets = pytest.importorskip(
    "PySide6.QtWidgets", reason="PySide6 is not installed (pip install PySide6-Essentials)"
)
from PySide6.QtCore import QTimer  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "desktop_chat.py"
ARTIFACTS = Path(os.environ.get("MLXINFER_ARTIFACTS", "test-artifacts"))


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("desktop_chat", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path, _ = make_tiny(
        tmp_path_factory.mktemp("desktop"),
        vocab_size=320,
        hidden_size=64,
        max_position_embeddings=4096,
    )
    add_tokenizer(path)
    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication([])
    window = module.ChatWindow({"tiny": str(path)})
    window.show()
    _until(app, lambda: window.send_button.isEnabled(), 60, "the model did not load")
    yield app, window
    window.close()
    for handle in window.handles.values():
        handle.close()


def _until(app, done, seconds: float, message: str) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, message
        app.processEvents()
        time.sleep(0.002)


def test_text_streams_in_while_the_event_loop_keeps_ticking(chat):
    app, window = chat
    assert window.bar.value() == 1000  # the load's progress reached its end
    ticks, pieces = [], []
    timer = QTimer()
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    timer.start(10)
    window.bridge.piece.connect(pieces.append)
    window.prompt.setText("Tell me a story")
    window.send_button.click()
    assert window.stream is not None and window.stop_button.isEnabled()
    _until(app, lambda: window.stream is None, 60, "the reply did not end")
    timer.stop()
    window.bridge.piece.disconnect()
    assert len(pieces) >= 5, pieces  # several increments, not one block
    assert window.reply == "".join(pieces) and window.reply in window.view.toPlainText()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(gaps) > 5 and max(gaps) < 0.1, max(gaps)
    assert window.messages[-1] == {"role": "assistant", "content": window.reply}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    window.grab().save(str(ARTIFACTS / "desktop-chat.png"))


def test_stop_ends_generation_within_two_tokens(chat):
    app, window = chat
    counted = {"n": 0}
    window.bridge.piece.connect(lambda _: counted.__setitem__("n", counted["n"] + 1))
    window.prompt.setText("Write a very long story")
    window.send_button.click()
    stream = window.stream
    _until(app, lambda: counted["n"] >= 3, 30, "no text arrived")
    at_stop = _generated(stream)
    window.stop_button.click()
    _until(app, lambda: window.stream is None, 10, "Stop did not end the reply")
    window.bridge.piece.disconnect()
    assert _generated(stream) - at_stop <= 2
    assert _generated(stream) < 512  # it did not run to max_tokens
    assert "cancelled" in window.view.toPlainText()
    assert window.send_button.isEnabled() and not window.stop_button.isEnabled()


def _generated(stream) -> int:
    """Tokens the engine has generated for the stream's request."""
    return stream.handle._request.generated


def test_a_reasoning_models_thoughts_are_shown_apart_and_not_kept(tmp_path):
    """A model with a think-tag template, forced to think then answer: the view shows both, the
    reply and the history hold only the answer."""
    from test_reasoning import THINK_REGEX
    from tool_templates import THINK

    spec = importlib.util.spec_from_file_location("desktop_chat", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path, _ = make_tiny(tmp_path, vocab_size=320, hidden_size=64, max_position_embeddings=4096)
    add_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINK}))
    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication([])
    window = module.ChatWindow({"think": str(path)}, regex=THINK_REGEX)
    window.show()
    try:
        _until(app, lambda: window.send_button.isEnabled(), 60, "the model did not load")
        thoughts = []
        window.bridge.thought.connect(thoughts.append)
        window.prompt.setText("Where?")
        window.send_button.click()
        _until(app, lambda: window.stream is None, 60, "the reply did not end")
        thought = "".join(thoughts)
        assert re.fullmatch("[a-z]{3,8}", thought) and re.fullmatch("[A-Z][a-z]{2,6}", window.reply)
        shown = window.view.toPlainText()
        assert f"{thought}\n{window.reply}" in shown and "<think>" not in shown
        assert window.messages[-1] == {"role": "assistant", "content": window.reply}
    finally:
        window.close()
        for handle in window.handles.values():
            handle.close()
