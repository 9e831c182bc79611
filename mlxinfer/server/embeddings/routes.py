"""``/v1/embeddings``: OpenAI's embeddings API, for embedding checkpoints only.

An embedding checkpoint (sentence-transformers' ``modules.json`` + ``1_Pooling/config.json``:
:mod:`mlxinfer.embeddings`) is served under its directory's name, from ``serve
--embedding-model DIR`` or found under ``--models-dir``; the registry holds it with an
:class:`~mlxinfer.embeddings.Embedder` in place of a generation engine. A chat or completion
request to it is a 400 saying so, and so is an embeddings request to a generative model
(:func:`mlxinfer.server.routes.kind_error`).

The checkpoint may be a decoder (Qwen3-Embedding) or an encoder (BERT: all-MiniLM-L6-v2);
texts are cut at its ``max_seq_length`` (sentence_bert_config.json) as sentence-transformers
cuts them, and lower-cased where it says ``do_lower_case``.

Request (:mod:`.request`): ``input`` (a string, a list of strings, or a list of token-id
lists), ``model``, ``encoding_format`` ("float" or "base64": little-endian float32),
``dimensions`` (the leading ones, normalised again: meaningful for Matryoshka-trained models
such as Qwen3-Embedding); ``user`` and unknown fields are ignored. Bounds: ``MAX_INPUTS``
inputs, each within the model's context, ``MAX_REQUEST_TOKENS`` tokens in all.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ...embeddings import (
    Embedder,
    EmbeddingError,
    check_dimensions,
    encode_inputs,
    hidden_size,
    read_pooling,
)
from ...errors import ConfigError, PromptTooLongError, TokenIdError, TokenizerError
from ..api_errors import OpenAIError
from ..models import Models
from ..routes import Routes, openai_busy, openai_not_found
from . import request as embeddings_request
from .reply import reply
from .request import EmbeddingsRequest

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request
MAX_REQUEST_TOKENS = 1 << 17  # tokens per request, all inputs together


class _Cancelled:
    """Set when the client hangs up (``Streams.add``); the embedder asks between batches."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def cancel(self) -> None:
        self.event.set()


def add_embedding_model(registry: Models, embedding_model: str | Path, load: Callable) -> None:
    """The ``embedding_model`` directory (``serve --embedding-model DIR``) loaded now with
    ``load`` and served under its name."""
    path = Path(embedding_model)
    pooling = read_pooling(path)
    if path.name in registry.entries:
        raise ConfigError(f"{path}: a model named '{path.name}' is served already")
    model, tokenizer = load(str(path))
    registry.add_loaded(path.name, model, tokenizer, Embedder(model, tokenizer, pooling))
    registry.entries[path.name].embedding = True


class EmbeddingsRoutes:
    """The embeddings endpoint on the shared :class:`Routes`."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/embeddings", self.embeddings, methods=["POST"])

    async def embeddings(self, request: Request):
        ask = embeddings_request.parse(await self.routes.body(request))
        return await self.routes.generation(request, 1, self.embed, ask, openai_busy)

    def embed(self, ask: EmbeddingsRequest, streams) -> JSONResponse:
        """The vectors (in a worker thread), the inputs encoded in batches; cancelled between
        batches when the client hangs up."""
        if self.routes.stopping:  # a SIGTERM: as the generation routes, a 503
            raise OpenAIError(503, "the server is shutting down", type="server_error")
        entry = self.routes.served(ask.model, openai_not_found, embedding=True)
        cancelled = _Cancelled()
        streams.add(cancelled)
        try:
            check_dimensions(ask.dimensions, hidden_size(entry.model))
        except EmbeddingError as e:
            raise OpenAIError(400, str(e), param="dimensions") from None
        try:
            rows = encode_inputs(
                entry.model,
                entry.tokenizer,
                ask.inputs,
                max_inputs=MAX_INPUTS,
                pooling=entry.engine.pooling,  # the checkpoint's max_seq_length, lower-casing
            )
        except PromptTooLongError as e:
            raise OpenAIError(400, str(e), param="input", code="context_length_exceeded") from None
        except (EmbeddingError, TokenIdError, TokenizerError) as e:
            raise OpenAIError(400, str(e), param="input") from None
        total = sum(len(r) for r in rows)
        if total > MAX_REQUEST_TOKENS:
            raise OpenAIError(
                400,
                f"input: {total} tokens in all, at most {MAX_REQUEST_TOKENS} per request",
                param="input",
            )
        try:
            vectors = entry.engine.embed(rows, ask.dimensions, cancelled.event.is_set)
        except EmbeddingError as e:
            raise OpenAIError(499, str(e)) from None  # the client has gone: no one reads it
        self.routes.registry.touch(entry)
        return JSONResponse(reply(ask, vectors, total))
