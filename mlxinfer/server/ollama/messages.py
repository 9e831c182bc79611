"""Ollama's chat messages as the chat template takes them (OpenAI's shape, which the other
routes give it too): an assistant's ``tool_calls`` with ids and their arguments as objects, a
tool result (role ``tool``) with the id and name of the call it answers. A ValueError names the
first bad field (the request makes it Ollama's 400).

The official client drops empty fields: an assistant turn with calls and no ``content``, calls
without ids, tool results with only ``tool_name``. Calls without ids get ids here, the same for
the same conversation (so that the prefix cache still matches the next turn), and a tool result
without a ``tool_call_id`` answers the earliest call of its name not answered yet.
"""

from __future__ import annotations

from typing import Any

from ..quoting import shown

ROLES = ("system", "user", "assistant", "tool")


def with_images(content: str, images: Any, where: str) -> str | list[dict]:
    """A turn's text with its ``images`` (base64, as Ollama's clients send them) as the common
    image parts (``server/image_parts.py``), the images first (Ollama renders them before the
    text); the text alone when there are none."""
    from ..image_parts import base64_url, image_part

    if images is None or images == []:
        return content
    if not isinstance(images, list):
        raise ValueError(f"{where}: expected a list of base64 images, found {kind(images)}")
    parts = []
    for k, data in enumerate(images):
        if not isinstance(data, str) or not data.strip():
            raise ValueError(f"{where}[{k}]: expected base64 image data, found {kind(data)}")
        parts.append(image_part(data if data.startswith("data:") else base64_url(data)))
    return parts + ([{"type": "text", "text": content}] if content else [])


def turns(messages: Any) -> list[dict]:
    """Ollama's messages as the chat template takes them (OpenAI's shape): calls with ids,
    arguments as objects; a tool result with the id of the call it answers and its name."""
    from ...output.toolcalls import template_messages

    if not isinstance(messages, list):
        raise ValueError(f"messages: expected a list, found {kind(messages)}")
    out, pending = [], []  # pending: (id, name) of the calls not answered yet
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise ValueError(
                f"{where}.role: expected one of {', '.join(ROLES)}, found {shown(role)}"
            )
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"{where}.content: expected a string, found {kind(content)}")
        if m["role"] in ("user", "tool"):
            content = with_images(content, m.get("images"), f"{where}.images")
        elif m.get("images"):
            raise ValueError(f"{where}.images: images go in user (or tool) messages")
        item: dict = {"role": m["role"], "content": content}
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls:
            item["tool_calls"] = _calls(calls, where, i)
            pending += [(c["id"], c["function"]["name"]) for c in item["tool_calls"]]
        if m["role"] == "tool":
            item.update(_answered(m, where, pending))
        out.append(item)
    return template_messages(out)


def _calls(calls: Any, where: str, turn: int) -> list[dict]:
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls: expected a list of calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(
                f"{where}.tool_calls[{j}]: expected {{'function': {{'name', 'arguments'}}}}"
            )
        arguments = fn.get("arguments")
        arguments = {} if arguments is None else arguments
        if not isinstance(arguments, (dict, str)):
            raise ValueError(f"{where}.tool_calls[{j}].function.arguments: expected an object")
        # Nine alphanumerics (Mistral's templates want that), the same for the same turn.
        given = call.get("id")
        ident = given if isinstance(given, str) and given else f"call{turn % 1000:03d}{j % 100:02d}"
        out.append({"id": ident, "type": "function", "function": {**fn, "arguments": arguments}})
    return out


def _answered(m: dict, where: str, pending: list[tuple[str, str]]) -> dict:
    """A tool result's ``tool_call_id`` and ``name``: as given, else the earliest pending call
    of its ``tool_name`` (or the earliest pending call)."""
    name, ident = m.get("tool_name", m.get("name")), m.get("tool_call_id")
    for key, value in (("tool_name", name), ("tool_call_id", ident)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}.{key}: expected a string, found {kind(value)}")
    match = next(
        (
            p
            for p in pending
            if (ident is not None and p[0] == ident) or (ident is None and p[1] == name)
        ),
        None,
    )
    if match is None and ident is None and name is None and pending:
        match = pending[0]
    if match is not None:
        pending.remove(match)
    out = {"tool_call_id": ident or (match[0] if match else None)}
    name = name or (match[1] if match else None)
    if name is not None:
        out["name"] = name
    return out


def kind(value: Any) -> str:
    """A JSON value's kind, for an error message."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)
