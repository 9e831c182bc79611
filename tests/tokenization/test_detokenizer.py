"""Streaming detokenizer specification.

For any token stream: the segments plus ``finalize()`` are exactly ``decode(ids)``;
no segment carries a broken character (U+FFFD) unless ``decode`` itself has one;
each step decodes only a few tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_fixtures import (
    CORPUS,
    build_byte_fallback_json,
    build_byte_level_bpe,
    build_sentencepiece,
)

from mlxinfer.tokenization import Tokenizer
from mlxinfer.tokenization.detokenizer import StreamingDetokenizer

KINDS = [
    "bpe",
    "spm",
    "spm_json",
]  # byte-level BPE, SentencePiece byte fallback, the same as tokenizer.json


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("detok")
    spm = build_sentencepiece(root / "spm")
    dirs = {
        "bpe": build_byte_level_bpe(root / "bpe"),
        "spm": spm,
        "spm_json": build_byte_fallback_json(spm, root / "spm_json"),
    }
    return {kind: Tokenizer.from_dir(path) for kind, path in dirs.items()}


def stream(detokenizer: StreamingDetokenizer, ids: list[int]) -> list[str]:
    segments = [detokenizer.add_token(i) for i in ids]
    segments.append(detokenizer.finalize())
    return segments


def check_stream(
    tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = False
) -> list[str]:
    detokenizer = tokenizer.detokenizer(skip_special_tokens=skip_special_tokens)
    segments = stream(detokenizer, ids)
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(segments) == full
    assert detokenizer.text == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in segment for segment in segments), segments
    return segments


# Characters that stress the detokenizer, mixed into otherwise arbitrary Unicode.
TRICKY = list("日本語中文한국어龘饕餮😀🎉👍🚀❤éßñ ▁\n\t\r") + [
    "\u0301",
    "\u0308",
    "\u200d",
    "\ufe0f",
    "\U0001f1ef",
    "\U0001f1f5",
    "\x00",
    "\x1b",
    "\x7f",
    "\u3000",
]
TEXT = st.text(
    alphabet=st.one_of(st.sampled_from(TRICKY), st.characters(codec="utf-8")), max_size=60
)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=200, deadline=None)
@given(text=TEXT)
def test_stream_of_any_text_equals_decode(toks, kind, text):
    tokenizer = toks[kind]
    check_stream(tokenizer, tokenizer.encode(text))


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_stream_of_any_ids_equals_decode(toks, kind, data):
    # Arbitrary ids: lone continuation bytes, invalid byte runs, special tokens anywhere.
    tokenizer = toks[kind]
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=30))
    check_stream(tokenizer, ids)
    check_stream(tokenizer, ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=100, deadline=None)
@given(text=TEXT, data=st.data())
def test_skipping_special_tokens_equals_decode_with_skip(toks, kind, text, data):
    tokenizer = toks[kind]
    ids = tokenizer.encode(text)
    specials = sorted(tokenizer.special_token_ids)
    for _ in range(data.draw(st.integers(0, 4))):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(specials)))
    segments = check_stream(tokenizer, ids, skip_special_tokens=True)
    assert not any(
        tokenizer.decode([s]) in "".join(segments) for s in specials if tokenizer.decode([s])
    )


def test_byte_level_character_split_across_tokens_comes_out_whole(toks):
    tokenizer = toks["bpe"]
    ids = tokenizer.encode("a😀b", add_special_tokens=False)
    assert len(ids) > 3  # the emoji is several byte tokens
    segments = check_stream(tokenizer, ids)
    assert any("😀" in segment for segment in segments)
    assert segments[1] == ""  # first byte of the emoji: nothing to show yet


def test_byte_fallback_character_comes_out_whole(toks):
    tokenizer = toks["spm"]
    ids = tokenizer.encode("龘!", add_special_tokens=False)
    pieces = [tokenizer.id_to_token(i) for i in ids]
    assert pieces[1:4] == ["<0xE9>", "<0xBE>", "<0x98>"]
    detokenizer = tokenizer.detokenizer()
    segments = [detokenizer.add_token(i) for i in ids]
    # "▁" at the very start is the dummy prefix: no text. The byte run is held until it ends.
    assert segments == ["", "", "", "", "龘!"]
    assert detokenizer.finalize() == ""


def test_unfinished_character_is_flushed_by_finalize(toks):
    for tokenizer in toks.values():
        ids = tokenizer.encode("x龘", add_special_tokens=False)[:-1]  # drop the last byte
        segments = check_stream(tokenizer, ids)
        assert segments[-1].endswith("\ufffd")


def test_sentencepiece_spaces_between_words_are_kept(toks):
    for kind in ("spm", "spm_json"):
        tokenizer = toks[kind]
        ids = tokenizer.encode("Hello world  again", add_special_tokens=False)
        segments = check_stream(tokenizer, ids)
        assert "".join(segments) == "Hello world  again"
        assert segments[0] == ""  # the lone dummy-prefix "▁" means nothing at the start


def test_each_token_is_shown_as_soon_as_it_is_complete(toks):
    tokenizer = toks["bpe"]
    ids = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    detokenizer = tokenizer.detokenizer()
    assert all(detokenizer.add_token(i) for i in ids)  # plain ASCII: never held back


@pytest.mark.parametrize("kind", KINDS)
def test_work_per_token_is_bounded(toks, kind):
    tokenizer = toks[kind]
    ids = tokenizer.encode(" ".join(CORPUS * 6))
    assert len(ids) > 900
    windows = []

    def decode(window: list[int]) -> str:
        windows.append(len(window))
        return tokenizer.decode(window)

    # The same detokenizer Tokenizer.detokenizer() builds, with a decode that records its window sizes.
    segments = stream(
        StreamingDetokenizer(decode, byte_fallback_ids=tokenizer._backend.byte_fallback_ids), ids
    )
    assert "".join(segments) == tokenizer.decode(ids)
    assert len(windows) <= 2 * len(ids) + 1
    assert (
        max(windows) <= 16
    )  # a few tokens of context plus a held-back character, never the whole text


def test_text_accumulates(toks):
    tokenizer = toks["bpe"]
    detokenizer = tokenizer.detokenizer()
    assert detokenizer.text == ""
    for i in tokenizer.encode("one two three", add_special_tokens=False):
        detokenizer.add_token(i)
        assert tokenizer.decode(detokenizer.token_ids).startswith(detokenizer.text)
    detokenizer.finalize()
    assert detokenizer.text == "one two three"


def test_custom_decode_function():
    # The detokenizer only needs a decode function: here one from ids to UTF-8 bytes.
    data = "añ😀".encode()

    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    detokenizer = StreamingDetokenizer(decode)
    segments = stream(detokenizer, list(data))
    assert segments == ["a", "", "ñ", "", "", "", "😀", ""]
