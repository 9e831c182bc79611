"""Streaming detokenization: token ids in, text out, one token at a time.

Three things make this harder than ``decode(ids[-1:])``:

* A character can be split across tokens. Byte-level BPE (GPT-2 style) and
  SentencePiece byte-fallback tokens (``<0xE4>``) carry single UTF-8 bytes, so
  "中" may arrive as three tokens; decoding them one by one gives U+FFFD.
* Byte-fallback decoding is not even prefix-stable: a run of ``<0xNN>`` tokens is
  decoded as a whole, and if the run is not valid UTF-8 *every* byte of it becomes
  U+FFFD -- including an "a" or a "中" that looked complete before the bad byte
  came. So text from such a run is held until the run ends (the next other token).
* Decoding is not token-local at the edges. SentencePiece writes a space as "▁"
  and strips the one at the very start of the text, so ``decode([▁world])`` is
  "world" while in the middle of a sentence that token means " world".

So each step decodes a short window: the tokens of the last emitted segment (the
context) plus the tokens not emitted yet, and emits what the window added beyond
the context's own text. Text ending in U+FFFD is held back until the next token
completes the character (or ``finalize`` gives up on it). Windows only ever start
after a token whose text was emitted, never inside a character or a byte run, so
decoding a window agrees with decoding everything. The window is a handful of
tokens, so each step costs O(1) decoding work, never a re-decode of the whole
sequence, and the segments add up to exactly ``decode(all ids)``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

_REPLACEMENT = "\ufffd"


class StreamingDetokenizer:
    """Turns token ids into text segments that never split a character.

    ``"".join(add_token(t) for t in ids) + finalize() == decode(ids)``, where
    ``decode`` is the function given here.

    Args:
        decode: decodes a list of token ids to text (the tokenizer's own decode).
        skip_ids: ids to drop from the stream, e.g. special tokens when the text
            should match ``decode(ids, skip_special_tokens=True)``.
        byte_fallback_ids: the ``<0xNN>`` byte tokens, when ``decode`` fuses runs
            of them as described above (empty for byte-level BPE, whose decoding
            is prefix-stable).
        vocab_size: ids outside ``0..vocab_size-1`` are dropped, as ``decode`` drops
            them (a model's embedding may have more rows than its tokenizer has ids):
            kept, one would end a run of byte tokens that ``decode`` fuses across it.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        skip_ids: Collection[int] = (),
        byte_fallback_ids: Collection[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        self._decode = decode
        self._vocab_size = vocab_size
        self._skip_ids = frozenset(skip_ids)
        self._byte_ids = frozenset(byte_fallback_ids)
        self._ids: list[int] = []
        # The window is ids[_start:]. ids[_start:_read] is the context: tokens whose
        # text is already out; _emitted counts the window's characters already out.
        self._start = 0
        self._read = 0
        self._emitted = 0
        self._segments: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._segments) > 1:
            self._segments = ["".join(self._segments)]  # compact, so repeated reads stay cheap
        return self._segments[0] if self._segments else ""

    @property
    def token_ids(self) -> list[int]:
        """The ids added so far (without skipped ones)."""
        return list(self._ids)

    def add_token(self, token_id: int) -> str:
        """Add one token; return the newly completed text ("" when nothing is complete yet)."""
        token_id = int(token_id)
        if token_id in self._skip_ids:
            return ""
        if self._vocab_size is not None and not 0 <= token_id < self._vocab_size:
            return ""
        self._ids.append(token_id)
        if token_id in self._byte_ids:
            return ""  # the run of byte tokens may still turn invalid (see the module docstring)
        window = self._decode(self._ids[self._start :])
        if window.endswith(_REPLACEMENT):
            # Most likely a character cut between byte tokens: wait for the rest.
            return ""
        segment = window[self._emitted :]
        if not segment:
            # Keep the window where it is: moving it onto tokens that decode to
            # nothing would let a leading-space strip act on the next token.
            return ""
        # The tokens just emitted become the context of the next window.
        old_start, self._start, self._read = self._start, self._read, len(self._ids)
        if self._start == old_start:
            self._emitted = len(window)
        else:
            self._emitted = len(self._decode(self._ids[self._start :]))
        self._segments.append(segment)
        return segment

    def finalize(self) -> str:
        """Flush whatever is held back (an unfinished character comes out as U+FFFD) and return it.

        Call it once, when the stream ends.
        """
        window = self._decode(self._ids[self._start :])
        segment = window[self._emitted :]
        self._emitted = len(window)
        if segment:
            self._segments.append(segment)
        return segment
