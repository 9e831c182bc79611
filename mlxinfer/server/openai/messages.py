"""The OpenAI API's chat ``messages``, checked, as the chat template's turns (the rest of a
body is :mod:`.request`)."""

from __future__ import annotations

from typing import Any

from ..api_errors import OpenAIError
from ..quoting import shown

ROLES = ("system", "user", "assistant", "developer", "tool")
DETAILS = ("low", "high", "auto")  # image_url.detail: checked, then ignored


def chat_messages(messages: Any) -> list[dict]:
    """A chat body's ``messages`` as the chat template takes them: a ``developer`` turn as a
    system turn, text parts joined, an assistant's ``tool_calls`` and a tool turn's
    ``tool_call_id`` kept, image parts as the common image part; OpenAIError (400) naming the
    first bad message."""
    from ...output.toolcalls import template_messages

    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise OpenAIError(400, f"{where}: expected a role of {', '.join(ROLES)}", param=where)
        content = m.get("content")
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            raise OpenAIError(400, f"{where}.tool_calls must be a list of calls", param=where)
        if content is None and calls:
            content = ""
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in content
        ):
            content = _image_parts(content, where, m["role"])
        elif isinstance(content, list):  # text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise OpenAIError(
                    400, f"{where}.content: only text parts are supported", param=f"{where}.content"
                )
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, (str, list)):
            raise OpenAIError(400, f"{where}.content must be a string", param=f"{where}.content")
        role = "system" if m["role"] == "developer" else m["role"]
        item = {"role": role, "content": content}
        if calls:
            item["tool_calls"] = calls
        if role == "tool":
            item["tool_call_id"] = m.get("tool_call_id")
        out.append(item)
    return template_messages(out)


def _image_parts(content: list, where: str, role: str) -> list[dict]:
    """A user message's text and ``image_url`` parts as the chat templates take them: text
    parts, and ``{"type": "image", "image": url}`` (decoded when the request starts, for a
    model with a vision tower, within ``serve``'s caps: server/images.py). The URL is a data URL,
    or an ``http(s)`` one (fetched only with ``serve --allow-remote-images``; else that request's
    400). ``detail`` is checked and ignored: the checkpoint's processor sets the resolution."""
    from ..image_parts import image_part

    if role != "user":
        raise OpenAIError(400, f"{where}: image parts go in user messages", param=where)
    out: list[dict] = []
    for j, part in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append({"type": "text", "text": str(part.get("text", ""))})
            continue
        if kind != "image_url":
            raise OpenAIError(400, f"{here}: expected a text or image_url part", param=here)
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str):
            raise OpenAIError(400, f"{here}.image_url.url must be a string", param=here)
        detail = image.get("detail") if isinstance(image, dict) else None
        if detail is not None and detail not in DETAILS:
            raise OpenAIError(
                400,
                f"{here}.image_url.detail: expected one of {', '.join(DETAILS)}, found "
                f"{shown(detail)}",
                param=f"{here}.image_url.detail",
            )
        if not url.startswith("data:") and not url[:8].lower().startswith(("http://", "https://")):
            raise OpenAIError(
                400,
                f"{here}.image_url.url: only data URLs (data:image/...;base64,...) are accepted, "
                f"found {shown(url[:40])} (http(s) URLs with serve --allow-remote-images)",
                param=here,
                code="invalid_image_url",
            )
        out.append(image_part(url))
    return out
