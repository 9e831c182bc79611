"""Anthropic's Messages API: a body's ``system`` and ``messages`` as the chat template's turns
(the rest of the body is :mod:`.request`).

System blocks (or leading lines of a system string) that begin ``x-anthropic-billing-header:``
(Claude Code's, with a nonce that changes every request) are dropped before templating, so
that they do not defeat the prefix cache. An assistant's ``tool_use`` blocks become its
``tool_calls``, a user's ``tool_result`` blocks ``tool`` turns, ``image`` blocks the common
image part (:mod:`mlxinfer.server.image_parts`).
"""

from __future__ import annotations

from typing import Any

from ..api_errors import AnthropicError

BILLING = "x-anthropic-billing-header:"


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        for b in content
    ):
        return "".join(b["text"] for b in content)
    raise AnthropicError(400, f"{where}: a string or a list of text blocks is required")


def system_messages(system: Any) -> list[dict]:
    """The ``system`` prompt as the template's first message, without Claude Code's billing
    header (blocks, or a string's leading lines, beginning ``x-anthropic-billing-header:``)."""
    if system is None:
        return []
    if isinstance(system, list):
        system = [b for b in system if not _billing(b)]
    text = _text(system, "system")
    while text.startswith(BILLING):
        text = text.partition("\n")[2]
    return [{"role": "system", "content": text}] if text else []


def _billing(block: Any) -> bool:
    text = block.get("text") if isinstance(block, dict) else None
    return isinstance(text, str) and text.lstrip().startswith(BILLING)


def turns(messages: Any) -> list[dict]:
    """The turns as the chat template takes them: an assistant's ``tool_use`` blocks as its
    ``tool_calls``, a user's ``tool_result`` blocks as ``tool`` turns before its text; a
    ``system`` turn (the mid-conversation-system beta) as a system message in its place
    (``templating.fit_messages`` folds it where the template cannot take it there)."""
    if not isinstance(messages, list) or not messages:
        raise AnthropicError(400, "messages: a non-empty list is required")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise AnthropicError(
                400, f"messages.{i}.role: 'user', 'assistant' or 'system' is required"
            )
        content, where = m.get("content"), f"messages.{i}.content"
        if not isinstance(content, list) or m["role"] == "system":
            out.append({"role": m["role"], "content": _text(content, where)})
            continue
        text: list[dict] = []  # text and image parts, in order
        calls = []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append({"type": "text", "text": b["text"]})
            elif kind == "image" and m["role"] == "user":
                text.append(_image(b, f"{where}.{j}"))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append(
                    {
                        "id": b.get("id"),
                        "type": "function",
                        "function": {"name": b.get("name"), "arguments": b.get("input", {})},
                    }
                )
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue  # an earlier turn's reasoning: chat templates drop it from the prompt
            elif kind == "tool_result" and m["role"] == "user":
                result = _tool_result(b.get("content", ""), f"{where}.{j}.content")
                out.append(
                    {"role": "tool", "content": result, "tool_call_id": b.get("tool_use_id")}
                )
            else:
                raise AnthropicError(
                    400,
                    f"{where}.{j}: text blocks, tool_use and thinking blocks (assistant) or "
                    "text, image and tool_result blocks (user) are supported",
                )
        turn = {"role": m["role"], "content": _joined(text)}
        if calls:
            turn["tool_calls"] = calls
        if turn["content"] or calls or m["role"] == "assistant":
            out.append(turn)
    return out


def _joined(parts: list[dict]) -> str | list[dict]:
    """Text parts as one string; with an image among them, the parts as they are."""
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _tool_result(content: Any, where: str) -> str | list[dict]:
    """A ``tool_result``'s content: a string, or text and image blocks (Claude Code's Read of a
    picture returns one)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise AnthropicError(
            400, f"{where}: a string or a list of text and image blocks is required"
        )
    parts = []
    for k, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image":
            parts.append(_image(b, f"{where}.{k}"))
        else:
            raise AnthropicError(400, f"{where}.{k}: text and image blocks are supported")
    return _joined(parts)


def _image(block: dict, where: str) -> dict:
    """An ``image`` block as the common image part: a base64 ``source`` as a data URL, a
    ``url`` source (``http(s)``) as it is, fetched only with ``serve --allow-remote-images``
    (else that request's 400). A ``file`` source (Files API) is refused: this server keeps no
    files."""
    from ..image_parts import data_url, image_part

    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise AnthropicError(
                400, f"{where}.source: media_type and data (base64) strings are required"
            )
        return image_part(data_url(media, data))
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url[:8].lower().startswith(("http://", "https://")):
            raise AnthropicError(400, f"{where}.source.url: an http(s) URL string is required")
        return image_part(url)
    if kind == "file":
        raise AnthropicError(
            400,
            f"{where}.source: file image sources are not accepted here (this server keeps no "
            "files): send the image as a base64 source",
        )
    raise AnthropicError(
        400, f"{where}.source: {{'type': 'base64', 'media_type', 'data'}} is required"
    )
