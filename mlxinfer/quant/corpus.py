"""The texts shipped in ``texts/``: an evaluation corpus and a separate calibration corpus.

Each corpus is plain documents (English prose, technical prose, the Universal Declaration of
Human Rights in several languages, source code, worked maths, tool-call JSON) in
``texts/{evaluation,calibration}.jsonl``, and conversations in ``texts/*_chats.json`` kept as
messages, so each model sees them through its own chat template (:func:`rendered`). The two
corpora share no passage (tests/quant/test_corpus.py checks it); ``texts/README.md`` names
every source, its license, what was cut, and each file's SHA-256.

Calibrate on :func:`calibration_documents`, measure on :func:`evaluation_documents`: never the
other way round, or the measurement flatters the calibration.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from importlib import resources
from typing import Any

from ..errors import TokenizerError

EVALUATION, CALIBRATION = "evaluation", "calibration"


def evaluation_text() -> str:
    """The evaluation corpus's plain documents, joined by blank lines."""
    return "\n\n".join(_plain(EVALUATION))


def calibration_text() -> str:
    """The calibration corpus's plain documents, joined by blank lines."""
    return "\n\n".join(_plain(CALIBRATION))


def evaluation_chats() -> list[list[dict]]:
    """The evaluation conversations: each a list of ``{"role", "content", ...}`` messages (an
    assistant turn may carry ``tool_calls``, with arguments as a JSON object; a ``tool`` turn
    answers it by ``tool_call_id``). A fresh copy each call."""
    return copy.deepcopy(_chats(EVALUATION)["conversations"])


def calibration_chats() -> list[list[dict]]:
    """The calibration conversations, shaped as :func:`evaluation_chats`'."""
    return copy.deepcopy(_chats(CALIBRATION)["conversations"])


def evaluation_documents(tokenizer) -> list[str]:
    """The evaluation corpus as separate documents: each plain text, then each conversation
    rendered through ``tokenizer``'s chat template (:func:`render_chat`). Tokenize each on its
    own (:func:`document_tokens`)."""
    return _documents(tokenizer, EVALUATION)


def calibration_documents(tokenizer) -> list[str]:
    """The calibration corpus as separate documents, as :func:`evaluation_documents`."""
    return _documents(tokenizer, CALIBRATION)


def rendered(tokenizer, chats: list[list[dict]]) -> str:
    """Every conversation of ``chats`` rendered by :func:`render_chat`, one after the other."""
    return "".join(render_chat(tokenizer, chat) for chat in chats)


def render_chat(tokenizer, messages: list[dict]) -> str:
    """One whole conversation (no generation prompt) through ``tokenizer``'s chat template.

    The definitions of the tools the conversation calls are passed as ``tools``. A template that
    refuses the conversation, or drops its tool calls, gets it again without tools, then with the
    system turn folded into the first user turn, tool calls written into the assistant's text and
    tool turns as user turns (templates that know no system, tool call or tool role);
    a tokenizer without a template, or one that refuses all three, gives a plain rendering: one
    ``role: content`` block per message (tool calls as JSON).
    """
    if getattr(tokenizer, "has_chat_template", False):
        called = {c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
        tools = _tools_called(called)
        attempts = [(messages, tools)] if tools else []
        attempts += [(messages, None), (_folded(messages), None)]
        for chat, given in attempts:
            try:
                kwargs = {"tools": given} if given else {}
                text = tokenizer.apply_chat_template(
                    copy.deepcopy(chat), add_generation_prompt=False, **kwargs
                )
            except TokenizerError:
                continue
            if all(name in text for name in called):  # else the template dropped the calls
                return text
    return _plain_chat(messages)


def document_tokens(tokenizer, documents: list[str]) -> list[int]:
    """``documents`` tokenized one by one and joined into one stream.

    Each is encoded without special tokens (a rendered chat carries its own); a tokenizer that
    adds BOS gets BOS at each document's start (unless its template already wrote it), which
    also separates documents; one that adds none gets its EOS token between documents.
    """
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("a")[:1] == [bos]
    eos = tokenizer.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None
    if eos is None and tokenizer.eos_token_ids:
        eos = min(tokenizer.eos_token_ids)
    out: list[int] = []
    for i, text in enumerate(documents):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if adds_bos:
            if ids[:1] != [bos]:
                ids = [bos, *ids]
        elif i > 0 and eos is not None:
            out.append(eos)
        out += ids
    return out


# --- reading the files ---------------------------------------------------------------------------


def _read(name: str) -> str:
    return resources.files("mlxinfer.quant").joinpath("texts", name).read_text("utf-8")


@cache
def _records(which: str) -> tuple[dict, ...]:
    out = []
    for line in _read(f"{which}.jsonl").splitlines():
        record = json.loads(line)
        if "file" in record:  # a text kept in its own file (english.txt)
            record["text"] = _read(record["file"])
        out.append(record)
    return tuple(out)


def _plain(which: str) -> list[str]:
    return [r["text"] for r in _records(which)]


@cache
def _chats(which: str) -> dict[str, Any]:
    return json.loads(_read(f"{which}_chats.json"))


def _documents(tokenizer, which: str) -> list[str]:
    chats = _chats(which)["conversations"]
    return _plain(which) + [render_chat(tokenizer, c) for c in chats]


def _tools_called(names: set[str]) -> list[dict] | None:
    if not names:
        return None
    catalog = _chats(EVALUATION)["tools"] + _chats(CALIBRATION)["tools"]
    return [copy.deepcopy(t) for t in catalog if t["function"]["name"] in names] or None


def _folded(messages: list[dict]) -> list[dict]:
    """The system turn prepended to the first user turn; tool results as user turns; tool calls
    written into the assistant's text."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    out: list[dict] = []
    for m in messages:
        if m["role"] == "system":
            continue
        if m["role"] == "tool":
            content = f"[{m.get('name', 'tool')} returned] {m['content']}"
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n" + content
            else:
                out.append({"role": "user", "content": content})
            continue
        content = m.get("content") or ""
        if m.get("tool_calls"):
            content = "\n".join(
                [content] * bool(content) + [json.dumps(c["function"]) for c in m["tool_calls"]]
            )
        if out and out[-1]["role"] == m["role"]:  # two assistant turns in a row: one
            out[-1]["content"] += "\n" + content
            continue
        if system and m["role"] == "user" and not out:
            content = "\n\n".join([*system, content])
        out.append({"role": m["role"], "content": content})
    return out


def _plain_chat(messages: list[dict]) -> str:
    blocks = []
    for m in messages:
        content = m.get("content") or ""
        for call in m.get("tool_calls") or ():
            content += ("\n" if content else "") + json.dumps(call["function"], ensure_ascii=False)
        blocks.append(f"{m['role']}: {content}")
    return "\n\n".join(blocks) + "\n"
