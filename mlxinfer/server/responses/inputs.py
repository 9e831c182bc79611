"""The ``input`` of a /v1/responses request (and its ``instructions``) as chat messages for
the model's template.

A string is one user message. Items: a ``message`` (roles user, assistant, system, developer;
a developer's is a system message; content a string or text parts: ``input_text``,
``output_text``, ``refusal`` ..., and in a user message ``input_image`` parts: data URLs), an assistant's ``function_call`` or ``custom_tool_call``
(consecutive calls are one assistant message, as parallel calls), their
``function_call_output`` / ``custom_tool_call_output`` (a ``tool`` message), and ``reasoning``
(checked, left out of the prompt: templates drop past thoughts). ``instructions`` is a system
message first. System messages a template cannot take where they stand (Codex sends two
developer messages) are folded by ``Routes.start``, as for every chat route
(:mod:`mlxinfer.server.templating`).
"""

from __future__ import annotations

from typing import Any

from ..api_errors import OpenAIError
from ..quoting import shown

MAX_ITEMS = 10_000  # input items: hours of an agent's turns
MAX_PARTS = 1_000  # content parts of one message
SEPARATOR = "__"  # NAMESPACE__NAME, as Codex flattens its namespaced tools
ROLES = ("user", "assistant", "system", "developer")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")


def bad(where: str, message: str) -> OpenAIError:
    """A 400 naming the field ``where`` (``input[3].content[0].text``)."""
    return OpenAIError(400, f"{where}: {message}", param=where)


def flat_name(space: str, name: str) -> str:
    """A namespace's function as the model sees it: Codex's flat spelling, ``NS__NAME`` (the
    namespace's trailing and the name's leading underscores trimmed)."""
    return f"{space.rstrip('_')}{SEPARATOR}{name.lstrip('_')}"


def resolve(name: Any, space: Any, names: dict) -> str | None:
    """The flat name of the tool a client names (a namespaced one with its namespace, by its
    flat name, or by its own name when no other tool has it), or None."""
    if not isinstance(name, str):
        return None
    if isinstance(space, str) and space:
        name = flat_name(space, name)
    if name in names:
        return name
    matches = [flat for flat, tool in names.items() if tool.name == name]
    return matches[0] if len(matches) == 1 else None


def input_messages(value: Any, instructions: str | None, names: dict) -> list[dict]:
    """``instructions`` and ``input`` as chat messages; ``names``: the tools' flat names."""
    messages = _items(value, names)
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    return messages


def _items(value: Any, names: dict) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}] if value else []
    if not isinstance(value, list):
        raise bad("input", f"expected a string or a list of items, found {type(value).__name__}")
    if len(value) > MAX_ITEMS:
        raise bad("input", f"{len(value)} items (at most {MAX_ITEMS})")
    out: list[dict] = []
    called: dict[str, str] = {}  # call_id -> the flat name called
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "expected an item object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(
                    f"{where}.role", f"expected one of {', '.join(ROLES)}, found {shown(role)}"
                )
            text = _content(item.get("content"), f"{where}.content", images=role == "user")
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            call_id = _string(item, "call_id", where)
            name = _string(item, "name", where)
            space = item.get("namespace")
            flat = resolve(name, space, names) or (
                f"{space.rstrip('_')}{SEPARATOR}{name}"
                if isinstance(space, str) and space
                else name
            )
            if kind == "function_call":
                arguments = _string(item, "arguments", where)
            else:
                arguments = {"input": _string(item, "input", where)}
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": flat, "arguments": arguments},
            }
            called[call_id] = flat
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _string(item, "call_id", where)
            output = item.get("output")
            text = (
                output
                if isinstance(output, str)
                else _content(output, f"{where}.output", tool=True)
            )
            message = {"role": "tool", "content": text, "tool_call_id": call_id}
            if call_id in called:
                message["name"] = called[call_id]
            out.append(message)
        elif kind == "reasoning":  # past thoughts: checked, left out of the prompt
            for key in ("summary", "content"):
                parts = item.get(key)
                if parts is not None:
                    _content(parts, f"{where}.{key}")
        elif kind == "item_reference":
            raise bad(f"{where}.type", "item_reference needs stored items: send the item itself")
        else:
            raise bad(
                f"{where}.type",
                f"expected message, function_call, function_call_output, custom_tool_call, "
                f"custom_tool_call_output or reasoning, found {shown(kind)}",
            )
    from ...output.toolcalls import template_messages

    return template_messages(out)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key}", f"expected a string, found {type(value).__name__}")
    return value


def _content(
    content: Any, where: str, *, tool: bool = False, images: bool = False
) -> str | list[dict]:
    """A message's text: a string, or text parts joined; with an ``input_image`` part (in a user
    message, ``images``, or a tool's output, ``tool``: Codex's view_image returns one) its text
    and image parts, the images as the common image part (``image_parts``: a text-only model
    gets a tool output's image as a one-line note, so that the session goes on). Files and
    audio are refused, but in a tool's output each stands as a one-line note."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"expected a string or a list of parts, found {type(content).__name__}")
    if len(content) > MAX_PARTS:
        raise bad(where, f"{len(content)} parts (at most {MAX_PARTS})")
    parts: list[dict] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad(at, "expected a content part object")
        kind = part.get("type")
        if kind == "input_image" and (images or tool):
            parts.append(_image(part, at))
            continue
        if kind == "input_image":
            raise bad(f"{at}.type", "input_image parts go in user messages (or a tool's output)")
        if tool and kind in MEDIA_PARTS:
            parts.append({"type": "text", "text": f"[{kind} omitted: this server reads text only]"})
            continue
        if kind not in TEXT_PARTS:
            raise bad(f"{at}.type", f"only text and image parts are read here, found {shown(kind)}")
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise bad(f"{at}.{key}", f"expected a string, found {type(part.get(key)).__name__}")
        parts.append({"type": "text", "text": part[key]})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _image(part: dict, where: str) -> dict:
    """An ``input_image`` part (``image_url``: a data URL, or an ``http(s)`` one that only
    ``serve --allow-remote-images`` fetches) as the common image part; ``detail`` is checked and
    ignored (the checkpoint's processor sets the resolution). A ``file_id`` is refused: this
    server keeps no files."""
    from ..image_parts import image_part
    from ..openai.messages import DETAILS

    if part.get("file_id") is not None:
        raise bad(f"{where}.file_id", "this server keeps no files: send the image as image_url")
    url = part.get("image_url")
    if not isinstance(url, str):
        raise bad(f"{where}.image_url", f"expected a data URL, found {type(url).__name__}")
    detail = part.get("detail")
    if detail is not None and detail not in DETAILS:
        raise bad(f"{where}.detail", f"expected one of {', '.join(DETAILS)}, found {shown(detail)}")
    if not url.startswith("data:") and not url[:8].lower().startswith(("http://", "https://")):
        raise OpenAIError(
            400,
            f"{where}.image_url: only data URLs (data:image/...;base64,...) are accepted, found "
            f"{shown(url[:40])} (http(s) URLs with serve --allow-remote-images)",
            param=f"{where}.image_url",
            code="invalid_image_url",
        )
    return image_part(url)
