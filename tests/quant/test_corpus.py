"""The texts shipped in mlxinfer/quant/texts: hashed as README.md records, the evaluation and
calibration corpora sharing no passage, every conversation rendered through a chat template."""

import hashlib
import json
import re
from pathlib import Path

import pytest
from hf_models import add_tokenizer

import mlxinfer.quant.corpus as corpus
from mlxinfer.tokenization.tokenizer import Tokenizer

TEXTS = Path(corpus.__file__).parent / "texts"


def shipped():
    return sorted(p for p in TEXTS.iterdir() if p.is_file() and p.name != "README.md")


def test_every_shipped_file_has_the_sha256_the_readme_records():
    readme = (TEXTS / "README.md").read_text("utf-8")
    recorded = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{64})` \|", readme, re.M))
    assert set(recorded) == {p.name for p in shipped()}
    for p in shipped():
        assert hashlib.sha256(p.read_bytes()).hexdigest() == recorded[p.name], p.name


def test_sizes_two_corpora_of_a_few_hundred_kb_under_a_megabyte_in_all():
    assert sum(p.stat().st_size for p in TEXTS.rglob("*") if p.is_file()) < 1_000_000
    for text in (corpus.evaluation_text(), corpus.calibration_text()):
        assert 200_000 < len(text.encode()) < 450_000


def passages(text_parts):
    return {
        line.strip() for part in text_parts for line in part.splitlines() if len(line.strip()) >= 80
    }


def chat_parts(chats):
    return [json.dumps(m, ensure_ascii=False) for c in chats for m in c] + [
        m.get("content") or "" for c in chats for m in c
    ]


def test_evaluation_and_calibration_share_no_line_of_80_characters():
    ev = passages([corpus.evaluation_text(), *chat_parts(corpus.evaluation_chats())])
    cal = passages([corpus.calibration_text(), *chat_parts(corpus.calibration_chats())])
    assert len(ev) > 500 and len(cal) > 500
    assert not ev & cal, sorted(ev & cal)[:3]


def test_each_corpus_mixes_the_kinds_of_text():
    for which in (corpus.EVALUATION, corpus.CALIBRATION):
        kinds = {r["kind"] for r in corpus._records(which)}
        assert {"prose-en", "prose-multilingual", "math", "tool-json"} <= kinds
        assert {"code-python", "code-go", "code-javascript", "code-c"} <= kinds
        chats = corpus._chats(which)["conversations"]
        assert len(chats) >= 12 and any(m.get("tool_calls") for c in chats for m in c)
        text = "".join(r["text"] for r in corpus._records(which))
        for script in ("[\u4e00-\u9fff]", "[\u3040-\u30ff]", "[\u0400-\u04ff]", "[\u0600-\u06ff]"):
            assert re.search(script, text), script  # Chinese, Japanese, Cyrillic, Arabic


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(add_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("which", [corpus.EVALUATION, corpus.CALIBRATION])
def test_each_conversation_renders_through_the_template(tokenizer, which):
    chats = corpus.evaluation_chats() if which == corpus.EVALUATION else corpus.calibration_chats()
    documents = getattr(corpus, f"{which}_documents")(tokenizer)
    plain = corpus._plain(which)
    assert documents[: len(plain)] == plain and len(documents) == len(plain) + len(chats)
    for chat, text in zip(chats, documents[len(plain) :]):
        assert text.startswith("<|im_start|>") and text.count("<|im_end|>") >= len(chat) - 1
        for m in chat:
            assert (m["content"] or "")[:200] in text
            for call in m.get("tool_calls") or ():  # the tiny ChatML template drops calls: folded
                assert json.dumps(call["function"]["arguments"])[:50] in text
    assert corpus.rendered(tokenizer, chats) == "".join(documents[len(plain) :])


def test_without_a_template_a_plain_role_content_rendering(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "_chat_templates", {})
    chat = corpus.evaluation_chats()[0]
    text = corpus.render_chat(tokenizer, chat)
    assert text.startswith(f"system: {chat[0]['content']}\n\nuser: {chat[1]['content']}")


def test_documents_are_tokenized_apart_and_joined_by_eos(tokenizer):
    docs = ["first document", "second"]
    eos = tokenizer.token_to_id("<|im_end|>")
    assert corpus.document_tokens(tokenizer, docs) == [
        *tokenizer.encode(docs[0]),
        eos,
        *tokenizer.encode(docs[1]),
    ]
