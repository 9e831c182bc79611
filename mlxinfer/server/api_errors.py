"""Each API's error: one exception, its HTTP status (and headers, such as Retry-After), and the
JSON body in that API's own shape.

- OpenAI's (and the Responses and embeddings routes'): ``{"error": {"message", "type", "param",
  "code"}}``;
- Anthropic's: ``{"type": "error", "error": {"type", "message"}}``, the type from the status;
- Ollama's: ``{"error": "message"}``.

``make_app`` answers any :class:`APIError` with its ``body()``, ``status`` and ``headers``;
:mod:`.shapes` picks the shape by path for the responses no route builds.
"""

from __future__ import annotations

from ..errors import MlxInferError

# HTTP status -> Anthropic's error type (other 4xx: invalid_request_error, 5xx: api_error)
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    431: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(MlxInferError):
    """An error answered in one API's shape: ``body()`` (each API's own), ``status``,
    ``headers``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers

    def body(self) -> dict:
        raise NotImplementedError


class OpenAIError(APIError):
    """An error in OpenAI's shape, with its HTTP status (and headers, such as Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(status, message, headers)
        self.param, self.type, self.code = param, type, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class AnthropicError(APIError):
    """An error in Anthropic's shape, with its HTTP status (and headers, such as Retry-After)."""

    def body(self) -> dict:
        default = "invalid_request_error" if self.status < 500 else "api_error"
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, default)
        return {"type": "error", "error": {"type": kind, "message": self.message}}


class OllamaError(APIError):
    """An error in Ollama's shape, ``{"error": message}``, with its HTTP status."""

    def body(self) -> dict:
        return {"error": self.message}
