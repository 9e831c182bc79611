"""Byte-level BPE GGUF vocabularies split as llama.cpp splits them, for every pre-tokenizer name
mlxinfer knows (``tokenizer.ggml.pre``: gpt-2, smollm, qwen2, qwen35, llama-bpe, lfm2, dbrx,
glm4, gpt-4o, tekken, deepseek-v3, deepseek-llm, starcoder): one trained vocabulary written once per name, each text encoded to llama.cpp's
ids (frozen by tools/make_vocab_fixtures.py with llama-cpp-python; the texts tell the splits
apart: contractions, digit runs, CJK and kana, combining marks, punctuation before letters,
newlines and trailing spaces, a piece of each kind of the evaluation corpus)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
from gguf_tiny import finish  # noqa: E402

from mlxinfer.errors import TokenizerError  # noqa: E402
from mlxinfer.gguf.container import read_gguf_header  # noqa: E402
from mlxinfer.gguf.vocab import build_tokenizer  # noqa: E402

FIXTURE = json.loads(
    (Path(__file__).resolve().parent.parent / "fixtures" / "gguf" / "vocab_pre.json").read_text()
)


def vocab_file(path: Path, pre: str) -> Path:
    tokens = FIXTURE["tokens"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(FIXTURE["merges"])
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    finish(w)
    return path


def our_tokenizer(path: Path):
    from tokenizers import Tokenizer

    with open(path, "rb") as f:
        import mmap

        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        md, _ = read_gguf_header(path, buf)
    tok_json, _ = build_tokenizer(path, md)
    return Tokenizer.from_str(tok_json)


# Where llama.cpp's adapted regex departs from the model's own tokenizer.json, which mlxinfer
# follows (as transformers does): its gpt-4o split leaves out o200k's \p{M}, so a combining mark
# does not stay with its letter (llama-vocab.cpp says so of GRANITE_EMB_MULTI, "the same
# lookaheads as GPT4O but with \p{M} added").
DEPARTS = {"gpt-4o": "\u0308", "tekken": "\u0308"}  # (Tekken's adaptation drops it too)


@pytest.mark.parametrize("pre", sorted(FIXTURE["ids"]))
def test_split_and_merges_give_llama_cpps_ids(pre, tmp_path):
    tok = our_tokenizer(vocab_file(tmp_path / "v.gguf", pre))
    checked = 0
    for text, want in zip(FIXTURE["texts"], FIXTURE["ids"][pre]):
        if pre in DEPARTS and DEPARTS[pre] in text:
            assert tok.encode(text, add_special_tokens=False).ids != want  # still departs
            continue
        assert tok.encode(text, add_special_tokens=False).ids == want, text[:60]
        checked += 1
    assert checked >= len(FIXTURE["texts"]) - 1


# Names llama.cpp splits alike: GLM-4's, LFM2's and DBRX's (OLMo 2) split is Llama 3's (DBRX
# without ignore_merges, which no text here shows); StarCoder's is SmolLM's.
ALIKE = ({"glm4", "lfm2", "dbrx", "llama-bpe"}, {"smollm", "starcoder"})


def test_the_texts_tell_the_splits_apart():
    """Each name's ids differ from every other's somewhere, but for names split alike (so each
    split is really checked)."""
    ids = FIXTURE["ids"]
    same = {(a, b) for a in ids for b in ids if a < b and ids[a] == ids[b]}
    assert same == {(a, b) for group in ALIKE for a in group for b in group if a < b}


def test_an_unknown_pre_tokenizer_is_our_error(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.pre is 'kimi-k2'; supported: "):
        our_tokenizer(vocab_file(tmp_path / "v.gguf", "kimi-k2"))
