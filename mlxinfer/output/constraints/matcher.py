"""A constraint enforced token by token: a logits processor holding one request's llguidance
matcher, which masks the tokens the grammar forbids at each step.

The processor follows the tokens it is shown rather than being told what was sampled: each
call brings the sequence so far (prompt + generated, and in speculative decoding the drafts
up to the position being scored), and the matcher is rolled back to where that sequence
departs from what it consumed, then fed the rest. So it serves plain decoding, the batching
engine and speculative verification alike, and a rejected draft rolls the matcher back.
A position past a draft the grammar forbids is left unmasked: that draft has probability
zero at its own position, so verification never keeps what follows it.

The mask is built on the host (llguidance, in Rust) as a bitmask of 32-bit words and applied
with plain MLX ops, on every backend.
"""

from __future__ import annotations

import weakref
from typing import Any

import mlx.core as mx
import numpy as np

from ...errors import ConstraintError

_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BITS: dict[int, tuple[mx.array, mx.array]] = {}  # vocabulary size -> (word index, bit) per id


class Vocabulary:
    """A tokenizer as llguidance sees it (built once per tokenizer: about a second)."""

    def __init__(self, tokenizer) -> None:
        import llguidance

        eos = sorted(tokenizer.eos_token_ids)
        if not eos:
            raise ConstraintError(
                f"{getattr(tokenizer, 'path', 'tokenizer')}: constraints need an EOS token, "
                "found none in the tokenizer's config"
            )
        source = tokenizer.tokenizer_json()
        if source is None:
            source = _wrapper_class()(tokenizer)
        self.llg = llguidance.LLTokenizer(source, eos_token=eos)
        self.size = self.llg.vocab_size
        self.words = (self.size + 31) // 32


def _wrapper_class():
    import llguidance

    class Wrapper(llguidance.TokenizerWrapper):
        """A SentencePiece or tiktoken tokenizer, as a token table and an encoder."""

        def __init__(self, tokenizer) -> None:
            self.eos_token_id = min(tokenizer.eos_token_ids)
            self.bos_token_id = tokenizer.bos_token_id
            self.tokens = tokenizer.token_bytes()
            self.special_token_ids = sorted(tokenizer.special_token_ids)
            self.is_tokenizer_wrapper = True
            self._tokenizer = tokenizer

            self._ids: dict[bytes, int] = {}
            for i, b in enumerate(self.tokens):
                if b and i not in tokenizer.special_token_ids:
                    self._ids.setdefault(b, i)
            self._longest = max(map(len, self._ids), default=1)

        def __call__(self, data: bytes | str) -> list[int]:
            """Tokens whose bytes are exactly ``data``: the tokenizer's own encoding when it
            is (SentencePiece adds a leading space to a text; then not), else the longest
            token at each point."""
            if isinstance(data, str):
                data = data.encode("utf-8")
            try:
                ids = self._tokenizer.encode(data.decode("utf-8"), add_special_tokens=False)
            except UnicodeDecodeError:
                ids = None
            if ids is not None and b"".join(self.tokens[i] for i in ids) == data:
                return ids
            out, i = [], 0
            while i < len(data):
                for n in range(min(self._longest, len(data) - i), 0, -1):
                    found = self._ids.get(data[i : i + n])
                    if found is not None:
                        out.append(found)
                        i += n
                        break
                else:
                    raise ConstraintError(f"the vocabulary has no token for byte {data[i]:#04x}")
            return out

    return Wrapper


def vocabulary(tokenizer) -> Vocabulary:
    """The tokenizer's :class:`Vocabulary`, built on first use and kept with it."""
    found = _VOCABULARIES.get(tokenizer)
    if found is None:
        found = _VOCABULARIES[tokenizer] = Vocabulary(tokenizer)
    return found


class ConstraintProcessor:
    """A ``LogitsProcessor`` ``(tokens so far, (1, V) logits) -> logits`` for one request."""

    def __init__(self, constraint: Any, vocab: Vocabulary) -> None:
        import llguidance

        self.constraint, self.vocab = constraint, vocab
        self.matcher = llguidance.LLMatcher(vocab.llg, constraint.grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"{constraint.kind}: {self.matcher.get_error()}")
        self.start: int | None = None  # the prompt's length: what follows it is matched
        self.fed: list[int] = []  # tokens the matcher has consumed
        self.dead = False  # the last sequence shown holds a token the grammar forbids
        self.mask = np.zeros(vocab.words, dtype=np.int32)
        self.mask_s = 0.0  # host seconds spent building masks (for the benchmark)

    def sync(self, tokens: mx.array | list[int]) -> None:
        """Bring the matcher to the end of ``tokens`` (the prompt, then what follows it)."""
        if self.start is None:
            self.start = len(tokens)
            return
        tail = tokens[self.start :]
        tail = tail.tolist() if isinstance(tail, mx.array) else list(tail)
        fed = self.fed
        if tail[: len(fed)] == fed:
            same = len(fed)
        else:  # a rewind (rejected drafts): back to where the two part
            same = 0
            for a, b in zip(fed, tail):
                if a != b:
                    break
                same += 1
        if same < len(fed):
            if not self.matcher.rollback(len(fed) - same):
                raise ConstraintError(f"{self.constraint.kind}: {self.matcher.get_error()}")
            del fed[same:]
        new = tail[same:]
        self.dead = False
        if new:
            ok = self.matcher.validate_tokens(new)
            if ok and not self.matcher.consume_tokens(new[:ok]):
                raise ConstraintError(f"{self.constraint.kind}: {self.matcher.get_error()}")
            fed.extend(new[:ok])
            self.dead = ok < len(new)

    def allowed_prefix(self, tokens: mx.array | list[int], proposed: list[int]) -> int:
        """How many of ``proposed`` (drafts after ``tokens``) the grammar allows in a row."""
        self.sync(tokens)
        return 0 if self.dead else self.matcher.validate_tokens(list(proposed))

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        import time

        import llguidance.numpy as llg_np

        self.sync(tokens)
        if self.dead:
            return logits
        if self.matcher.is_error():
            raise ConstraintError(f"{self.constraint.kind}: {self.matcher.get_error()}")
        t0 = time.perf_counter()
        llg_np.fill_next_token_bitmask(self.matcher, self.mask[None], 0)
        self.mask_s += time.perf_counter() - t0
        return apply_mask(logits, self.mask)

    @property
    def accepting(self) -> bool:
        """The matched output is complete (it may go on, or end here)."""
        return self.matcher.is_accepting()


def apply_mask(logits: mx.array, words: np.ndarray) -> mx.array:
    """``logits`` (..., V) with every token whose bit is clear in ``words`` set to -inf; ids
    past the mask's end (a model's padded vocabulary) are forbidden."""
    V = logits.shape[-1]
    index = _BITS.get(V)
    if index is None:
        ids = mx.arange(V, dtype=mx.uint32)
        index = _BITS[V] = (ids >> 5, ids & 31)
    word, bit = index
    have = words.shape[-1]
    need = (V + 31) // 32
    if have < need:
        words = np.concatenate([words, np.zeros(need - have, dtype=words.dtype)])
    w = mx.array(words[:need].view(np.uint32))
    allowed = ((mx.take(w, word) >> bit) & 1).astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(float("-inf"), logits.dtype))
