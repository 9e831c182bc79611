"""What a ``/v1/embeddings`` body asks for, checked: ``input`` (a string, a list of strings, or
a list of token-id lists: checked against the model's tokenizer and context once it is known),
``model``, ``encoding_format`` ("float" or "base64"), ``dimensions``; ``user`` and unknown
fields are ignored (:mod:`mlxinfer.server.fields`). Errors are OpenAI's shape, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..api_errors import OpenAIError
from ..fields import Fields

ENCODINGS = ("float", "base64")
FIELDS = Fields.of(
    "/v1/embeddings", used={"input", "model", "encoding_format", "dimensions"}, ignored={"user"}
)


@dataclass
class EmbeddingsRequest:
    model: str
    inputs: Any  # checked against the model's tokenizer and context once it is known
    encoding: str = "float"
    dimensions: int | None = None


def parse(body: Any) -> EmbeddingsRequest:
    """The request's fields, type-checked; a 400 in OpenAI's shape naming the field."""
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the body should be a JSON object, found {type(body).__name__}")
    FIELDS.screen(body)  # ``user`` and unknown fields: ignored, logged once
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, f"model: expected a model name, found {model!r:.60}", param="model")
    if "input" not in body:
        raise OpenAIError(400, "input: required", param="input")
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ENCODINGS:
        raise OpenAIError(
            400,
            f"encoding_format: expected 'float' or 'base64', found {encoding!r:.40}",
            param="encoding_format",
        )
    dimensions = body.get("dimensions")  # its bound, the model's width, once the model is known
    if dimensions is not None and (
        not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions <= 0
    ):
        message = f"dimensions: expected a positive int, found {dimensions!r:.40}"
        raise OpenAIError(400, message, param="dimensions")
    return EmbeddingsRequest(model, body["input"], encoding, dimensions)
