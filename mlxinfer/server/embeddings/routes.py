"""``/v1/embeddings``: OpenAI's embeddings API, for embedding checkpoints only.

An embedding checkpoint (sentence-transformers' ``modules.json`` + ``1_Pooling/config.json``:
:mod:`mlxinfer.embeddings`) is served under its directory's name, from ``serve
--embedding-model DIR`` or found under ``--models-dir``; the registry holds it with an
:class:`~mlxinfer.embeddings.Embedder` in place of a generation engine. A chat or completion
request to it is a 400 saying so, and so is an embeddings request to a generative model.

Request: ``input`` (a string, a list of strings, or a list of token-id lists), ``model``,
``encoding_format`` ("float" or "base64": little-endian float32), ``dimensions`` (the leading
ones, normalised again: meaningful for Matryoshka-trained models such as Qwen3-Embedding);
``user`` and unknown fields are ignored. Bounds: ``MAX_INPUTS`` inputs, each within the
model's context, ``MAX_REQUEST_TOKENS`` tokens in all.
"""

from __future__ import annotations

import base64
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..embeddings import (
    Embedder,
    EmbeddingError,
    check_dimensions,
    encode_inputs,
    hidden_size,
    read_pooling,
)
from ..errors import ConfigError, PromptTooLongError, TokenIdError, TokenizerError
from . import openai as oa
from .fields import Fields

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request
MAX_REQUEST_TOKENS = 1 << 17  # tokens per request, all inputs together
ENCODINGS = ("float", "base64")
FIELDS = Fields.of(
    "/v1/embeddings", used={"input", "model", "encoding_format", "dimensions"}, ignored={"user"}
)


@dataclass
class EmbedAsk:
    model: str
    inputs: Any  # checked against the model's tokenizer and context once it is known
    encoding: str = "float"
    dimensions: int | None = None


def parse(body: Any) -> EmbedAsk:
    """The request's fields, type-checked; a 400 in OpenAI's shape naming the field."""
    if not isinstance(body, dict):
        raise oa.APIError(400, f"the body should be a JSON object, found {type(body).__name__}")
    FIELDS.screen(body)  # ``user`` and unknown fields: ignored, logged once
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise oa.APIError(400, f"model: expected a model name, found {model!r:.60}", param="model")
    if "input" not in body:
        raise oa.APIError(400, "input: required", param="input")
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ENCODINGS:
        raise oa.APIError(
            400,
            f"encoding_format: expected 'float' or 'base64', found {encoding!r:.40}",
            param="encoding_format",
        )
    dimensions = body.get("dimensions")  # its bound, the model's width, once the model is known
    if dimensions is not None and (
        not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions <= 0
    ):
        message = f"dimensions: expected a positive int, found {dimensions!r:.40}"
        raise oa.APIError(400, message, param="dimensions")
    return EmbedAsk(model, body["input"], encoding, dimensions)


def kind_error(error: Callable[[str], Exception], name: str, embedding: bool) -> Exception:
    """The 400 for a request to a model of the other kind, in the API's own shape (``error``
    makes the route's 404 for an unknown model)."""
    if embedding:
        message = (
            f"model '{name}' is an embedding model: it serves /v1/embeddings only, not "
            "chat or completions"
        )
    else:
        message = (
            f"model '{name}' is not an embedding model: /v1/embeddings serves embedding "
            "checkpoints only (sentence-transformers' modules.json and 1_Pooling/config.json)"
        )
    e = error(message)
    e.status = 400
    if isinstance(e, oa.APIError):
        e.code = "model_not_supported"
    return e


class _Cancelled:
    """Set when the client hangs up (``Streams.add``); the embedder asks between batches."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def cancel(self) -> None:
        self.event.set()


def add_embeddings(app: FastAPI, embedding_model: str | Path | None, load: Callable) -> None:
    """``/v1/embeddings`` on ``app`` (after ``make_app`` built ``app.state.routes``), and the
    ``embedding_model`` directory loaded now with ``load`` and served under its name."""
    routes, registry = app.state.routes, app.state.models
    if embedding_model is not None:
        path = Path(embedding_model)
        pooling = read_pooling(path)
        if path.name in registry.entries:
            raise ConfigError(f"{path}: a model named '{path.name}' is served already")
        model, tokenizer = load(str(path))
        registry.add_loaded(path.name, model, tokenizer, Embedder(model, tokenizer, pooling))
        registry.entries[path.name].embedding = True

    def not_found(message: str) -> oa.APIError:
        return oa.APIError(404, message, param="model", code="model_not_found")

    def run(ask: EmbedAsk, streams) -> JSONResponse:
        if app.state.stopping:  # a SIGTERM: as the generation routes, a 503
            raise oa.APIError(503, "the server is shutting down", type="server_error")
        entry = routes.served(ask.model, not_found, embedding=True)
        cancelled = _Cancelled()
        streams.add(cancelled)
        try:
            check_dimensions(ask.dimensions, hidden_size(entry.model))
        except EmbeddingError as e:
            raise oa.APIError(400, str(e), param="dimensions") from None
        try:
            rows = encode_inputs(entry.model, entry.tokenizer, ask.inputs, max_inputs=MAX_INPUTS)
        except PromptTooLongError as e:
            raise oa.APIError(400, str(e), param="input", code="context_length_exceeded") from None
        except (EmbeddingError, TokenIdError, TokenizerError) as e:
            raise oa.APIError(400, str(e), param="input") from None
        total = sum(len(r) for r in rows)
        if total > MAX_REQUEST_TOKENS:
            raise oa.APIError(
                400,
                f"input: {total} tokens in all, at most {MAX_REQUEST_TOKENS} per request",
                param="input",
            )
        try:
            vectors = entry.engine.embed(rows, ask.dimensions, cancelled.event.is_set)
        except EmbeddingError as e:
            raise oa.APIError(499, str(e)) from None  # the client has gone: no one reads it
        registry.touch(entry)
        return JSONResponse(reply(ask, vectors, total))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        ask = parse(await routes.body_of(request))
        return await routes.generation(request, 1, run, ask, routes.oa_busy)


def reply(ask: EmbedAsk, vectors, tokens: int) -> dict:
    """OpenAI's response: one ``embedding`` object per input, in order, with the usage."""
    import numpy as np

    array = np.asarray(vectors, dtype=np.float32)  # (N, D)
    if ask.encoding == "base64":
        rows = [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in array]
    else:
        rows = array.tolist()
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(rows)],
        "model": ask.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
