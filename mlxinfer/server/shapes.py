"""Errors in each API's own JSON shape, for the responses no route builds: the limits'
refusals (``limits``), unknown routes, unexpected exceptions.

``/v1/messages`` (and below) is Anthropic's API, ``{"type": "error", "error": {"type",
"message"}}``; ``/api/`` is Ollama's, ``{"error": "message"}``; every other path answers in
OpenAI's, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .api_errors import AnthropicError, OllamaError, OpenAIError


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def is_ollama(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


def error_body(path: str, status: int, message: str, code: str | None = None) -> dict:
    if is_ollama(path):
        return OllamaError(status, message).body()
    if is_anthropic(path):
        return AnthropicError(status, message).body()
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return OpenAIError(status, message, type=kind, code=code).body()


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
