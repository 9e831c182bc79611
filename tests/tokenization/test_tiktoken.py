"""tiktoken-format vocabularies: encode / decode / special tokens match transformers 5, which
converts a tiktoken ``tokenizer.model`` itself; text the merges do not cover falls back to
single bytes and round-trips; ``*.tiktoken`` files and a config ``pat_str`` are honoured;
bad files fail with one-line TokenizerErrors.

The vocabulary is built here: the 256 single bytes, then merges learned greedily from a
small corpus (most frequent adjacent pair first), so most CJK and every emoji stay bytes.
"""

from __future__ import annotations

import base64
import json
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_fixtures import CORPUS

from mlxinfer.errors import TokenizerError
from mlxinfer.tokenization import Tokenizer
from mlxinfer.tokenization.tiktoken_backend import DEFAULT_PATTERN

transformers = pytest.importorskip("transformers")
regex = pytest.importorskip("regex")

SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
SAMPLES = [
    "",
    "Hello world",
    "Hello world, this is a test. It's 2024; we'll see 1234567!",
    " leading space",
    "two  spaces and trailing ",
    "line\nbreaks\n\n\tand tabs\r\n",
    "Café naïve résumé straße",
    "日本語のテキスト 中文 한국어 龘",
    "emoji 😀🎉 family 👨‍👩‍👧 flag 🇯🇵",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "control \x00\x01\x7f chars",
]


def learn_ranks(n_merges: int) -> dict[bytes, int]:
    """256 byte tokens, then ``n_merges`` greedy BPE merges over the corpus' pre-tokenized words."""
    words = Counter(
        piece.encode() for text in CORPUS for piece in regex.findall(DEFAULT_PATTERN, text)
    )
    ranks = {bytes([b]): b for b in range(256)}
    seqs = {word: [bytes([b]) for b in word] for word in words}
    for _ in range(n_merges):
        pairs = Counter()
        for word, seq in seqs.items():
            for pair in zip(seq, seq[1:]):
                pairs[pair] += words[word]
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        ranks[a + b] = len(ranks)
        for word, seq in seqs.items():
            merged, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            seqs[word] = merged
    return ranks


def build_tiktoken(
    directory: Path,
    *,
    file_name: str = "tokenizer.model",
    add_bos: bool = True,
    n_merges: int = 120,
    **config,
) -> Path:
    """A checkpoint directory with a tiktoken vocabulary and Llama-3-style special tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    ranks = learn_ranks(n_merges)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    (directory / file_name).write_text("\n".join(lines) + "\n")
    n = len(ranks)
    added = {
        str(n + i): {
            "content": s,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for i, s in enumerate(SPECIALS)
    }
    added[str(n + len(SPECIALS))] = {
        "content": "<tool>",
        "special": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
    }
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "added_tokens_decoder": added,
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
                "add_bos_token": add_bos,
                **config,
            }
        )
    )
    return directory


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory) -> Path:
    return build_tiktoken(tmp_path_factory.mktemp("tiktoken") / "llama3")


@pytest.fixture(scope="module")
def ours(vocab_dir) -> Tokenizer:
    return Tokenizer.from_dir(vocab_dir)


@pytest.fixture(scope="module")
def theirs(vocab_dir):
    return transformers.AutoTokenizer.from_pretrained(str(vocab_dir))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours, theirs, add_special_tokens):
    for text in SAMPLES:
        assert ours.encode(text, add_special_tokens) == theirs.encode(
            text, add_special_tokens=add_special_tokens
        ), text


@settings(max_examples=150, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=40))
def test_encode_matches_transformers_on_random_text(ours, theirs, text):
    assert ours.encode(text) == theirs.encode(text)


def test_decode_matches_transformers_on_arbitrary_ids(ours, theirs):
    rng = random.Random(7)
    for _ in range(300):  # random byte tokens make invalid UTF-8 too: U+FFFD like transformers
        ids = [rng.randrange(ours.vocab_size + 3) for _ in range(rng.randint(1, 10))]
        for skip in (False, True):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), ids


def test_special_tokens_and_token_strings_match_transformers(ours, theirs):
    assert ours.vocab_size == len(theirs)
    assert ours.bos_token_id == theirs.bos_token_id
    assert theirs.eos_token_id in ours.eos_token_ids
    for token_id in range(ours.vocab_size):
        token = theirs.convert_ids_to_tokens(token_id)
        assert ours.id_to_token(token_id) == token
        assert ours.token_to_id(token) == token_id
    assert ours.token_to_id("東京") is None and ours.id_to_token(10**6) is None


def test_text_outside_the_vocabulary_round_trips_through_bytes(ours):
    text = "龘 饕餮 😀🎉 👨‍👩‍👧 \x00\x7f e\u0301 Ελληνικά"
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text
    assert len(ids) > len(text)  # the merges cover none of it: byte tokens
    detok = ours.detokenizer()  # streaming never splits a character
    segments = [detok.add_token(i) for i in ids] + [detok.finalize()]
    assert "".join(segments) == text and "\ufffd" not in "".join(segments)


def test_special_tokens_are_one_id_and_skipped_when_asked(ours):
    ids = ours.encode("<|start_header_id|>a<tool>b<|eot_id|>", add_special_tokens=False)
    assert ids[0] == ours.token_to_id("<|start_header_id|>") and ids[-1] == ours.token_to_id(
        "<|eot_id|>"
    )
    # transformers' tiktoken converter makes every added token special, "special": false or not
    assert ours.decode(ids, skip_special_tokens=True) == "ab"


def test_dot_tiktoken_file_and_bos_flag(vocab_dir, ours, tmp_path):
    other = tmp_path / "qwen-style"
    other.mkdir()
    shutil.copy(vocab_dir / "tokenizer.model", other / "vocab.tiktoken")
    config = json.loads((vocab_dir / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    tokenizer = Tokenizer.from_dir(other)
    assert tokenizer.encode("Hello world") == ours.encode("Hello world")[1:]


def test_split_pattern_from_config(tmp_path, ours):
    directory = build_tiktoken(
        tmp_path / "chars", add_bos=False, pat_str=r"\S|\s"
    )  # a piece per character
    tokenizer = Tokenizer.from_dir(directory)
    ids = tokenizer.encode("the cat")
    assert ids == [ord(c) for c in "the cat"]  # nothing to merge within one character
    assert ours.encode("the cat", add_special_tokens=False) != ids


def test_sentencepiece_tokenizer_model_is_not_mistaken_for_tiktoken(tmp_path):
    from tokenizer_fixtures import build_sentencepiece

    from mlxinfer.tokenization.sentencepiece_backend import SentencePieceBackend

    tokenizer = Tokenizer.from_dir(build_sentencepiece(tmp_path / "spm"))
    assert isinstance(tokenizer._backend, SentencePieceBackend)


def test_lone_surrogate_is_a_tokenizer_error(ours):
    with pytest.raises(TokenizerError, match=r"lone surrogate '\\ud800' at index 1"):
        ours.encode("a\ud800b")


@pytest.mark.parametrize(
    "content, expected",
    [
        ("aGVsbG8= 0\nd29ybGQ=\n", r"line 2 is not '<base64 token> <rank>'"),
        ("aGVsbG8= 0\n!!!! 1\n", r"line 2 is not '<base64 token> <rank>'"),
        ("aGVsbG8= 0\naGVsbG8= 1\n", r"line 2 repeats token b'hello'"),
        ("aGVsbG8= 0\n", r"lacks 256 single bytes \(first: 0x00\)"),
    ],
)
def test_bad_vocabulary_files(tmp_path, content, expected):
    (tmp_path / "vocab.tiktoken").write_text(content)
    with pytest.raises(TokenizerError, match=expected):
        Tokenizer.from_dir(tmp_path)


def test_conversion_keeps_the_tiktoken_file(tmp_path, vocab_dir):
    from hf_models import make_tiny

    from mlxinfer.loading.convert import convert

    path, _ = make_tiny(tmp_path / "hf")
    shutil.copy(vocab_dir / "tokenizer_config.json", path / "tokenizer_config.json")
    shutil.copy(vocab_dir / "tokenizer.model", path / "vocab.tiktoken")
    convert(path, tmp_path / "out", dtype="float32")
    assert (tmp_path / "out" / "vocab.tiktoken").is_file()
    assert Tokenizer.from_dir(tmp_path / "out").encode("Hello") == Tokenizer.from_dir(path).encode(
        "Hello"
    )
