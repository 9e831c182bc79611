"""Errors in each API's own JSON shape, for the responses no route builds: the limits'
refusals (``limits``), unknown routes, unexpected exceptions.

``/v1/messages`` (and below) is Anthropic's API, ``{"type": "error", "error": {"type",
"message"}}``; every other path answers in OpenAI's, ``{"error": {"message", "type", "param",
"code"}}``.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

SHOWN_CHARS = 80  # of a value quoted in an error message


def shown(value: Any) -> str:
    """``value`` for a one-line error message: its repr, cut short (a huge integer by its size)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def named(name: str) -> str:
    """A field's name for an error message: as it is when printable and short, else ``shown``."""
    return name if name and name.isprintable() and len(name) <= SHOWN_CHARS else shown(name)


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, status: int, message: str, code: str | None = None) -> dict:
    from . import anthropic as an
    from . import openai as oa

    if is_anthropic(path):
        return an.APIError(status, message).body()
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return oa.APIError(status, message, type=kind, code=code).body()


def error_response(
    path: str,
    status: int,
    message: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(path, status, message, code), status_code=status, headers=headers
    )
