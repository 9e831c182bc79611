"""Ollama's routes, so that apps that speak only Ollama's API work unchanged: ``GET``/``HEAD
/`` (for clients that do not ask for HTML: browsers get the chat page), ``/api/version``,
``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/chat``, ``/api/generate``, ``/api/embed`` and
``/api/embeddings``; ``/api/pull``, ``/api/delete`` and ``/api/copy`` on mlxinfer's model store
(:mod:`.store`).

Generation goes through the same engine calls as the OpenAI routes (``Routes.start``: the
batch, the prefix cache, stop strings, tools, structured output, a hang-up cancelling the
request). A body is read as JSON whatever its ``Content-Type``: Ollama's own examples post
with ``curl -d``, which sends a form type.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ...embeddings import (
    EmbeddingError,
    check_dimensions,
    encode_inputs,
    hidden_size,
    truncate,
)
from ...errors import MlxInferError, PromptTooLongError, TokenIdError, TokenizerError
from ..aliases import resolve
from ..api_errors import OllamaError
from ..embeddings.routes import MAX_INPUTS, MAX_REQUEST_TOKENS  # /v1/embeddings' bounds
from ..hangup import Streams
from ..image_parts import for_model, has_images, model_takes_images
from ..limits import RETRY_AFTER_S, BadJSON, check_prompt_length, in_worker, parse_json
from ..routes import BODY_IN_THREAD, Routes
from ..templating import fit_messages
from . import objects
from .reply import OllamaReply, keep_alive_line
from .request import (
    EmbedRequest,
    OllamaRequest,
    parse_chat,
    parse_embed,
    parse_generate,
    parse_model,
)
from .store import StoreRoutes

RUNNING = "Ollama is running"  # what Ollama answers at /, and what its clients look for
NDJSON = "application/x-ndjson"
MAX_TOKENIZERS = 8  # tokenizers of unloaded models kept for /api/show


class OllamaRoutes:
    """Ollama's endpoints, one method each, on the shared :class:`Routes`."""

    def __init__(self, routes: Routes, chat_template: str | None = None) -> None:
        self.routes = routes
        self.chat_template = chat_template  # serve --chat-template: for models without one
        self._tokenizers: dict[Path, Any] = {}
        self._lock = threading.Lock()

    def add_to(self, app: FastAPI) -> None:
        get = ["GET", "HEAD"]
        app.add_api_route("/api/version", self.version, methods=get)
        app.add_api_route("/api/tags", self.tags, methods=get)
        app.add_api_route("/api/ps", self.ps, methods=get)
        app.add_api_route("/api/show", self.show, methods=["POST"])
        app.add_api_route("/api/chat", self.chat, methods=["POST"])
        app.add_api_route("/api/generate", self.generate, methods=["POST"])
        app.add_api_route("/api/embed", self.embed, methods=["POST"])
        app.add_api_route("/api/embeddings", self.embeddings, methods=["POST"])
        store = StoreRoutes(self.routes.registry, self._body)  # mlxinfer's model store
        app.add_api_route("/api/pull", store.pull, methods=["POST"])
        app.add_api_route("/api/delete", store.delete, methods=["DELETE"])
        app.add_api_route("/api/copy", store.copy, methods=["POST"])

    # --- probes: what is served --------------------------------------------------------------

    @staticmethod
    def root() -> Response:
        """``/`` for a client that does not ask for HTML."""
        return PlainTextResponse(RUNNING)

    def version(self) -> dict:
        return {"version": objects.VERSION}

    def tags(self) -> dict:
        registry, started = self.routes.registry, self.routes.app.state.started
        out = []
        for name in registry.names():
            entry = registry.entries.get(name)
            if entry is not None:
                directory = _directory(entry)
                config = objects.read_config(directory)
                out.append(objects.entry(name, directory, config, started, entry.model))
        return {"models": out}

    def ps(self) -> dict:
        """The models loaded now, each with its unload time and context."""
        import mlx.core as mx

        registry, started = self.routes.registry, self.routes.app.state.started
        unified = mx.metal.is_available()
        out = []
        for entry in list(registry.entries.values()):
            if entry.engine is None:
                continue
            directory = _directory(entry)
            config = objects.read_config(directory)
            base = objects.entry(entry.name, directory, config, started, entry.model)
            context = objects.context_length(config, entry.model)
            out.append(objects.running(base, context, self._expires(entry), unified))
        return {"models": out}

    def _expires(self, entry) -> float:
        keep = entry.keep_alive if entry.keep_alive is not None else self.routes.registry.keep_alive
        if entry.path is None or keep is None or math.isinf(keep):
            return float("inf")  # the model the server started with: kept for its life
        idle = time.monotonic() - entry.last_used
        return time.time() + max(0.0, keep - idle)

    async def show(self, request: Request):
        name = parse_model(await self._body(request))
        return await in_worker(request, self._show, name)  # reads files: off the event loop

    def _show(self, requested: str) -> dict:
        entry = self._find(requested)
        directory = _directory(entry)
        config = objects.read_config(directory)
        tokenizer = None if entry.embedding else self._tokenizer(entry)
        started = self.routes.app.state.started
        return objects.show(
            entry.name,
            directory,
            config,
            tokenizer,
            entry.embedding,
            started,
            entry.model,
            vision=not entry.embedding and model_takes_images(entry),
        )

    def _find(self, requested: str):
        """The registry's entry a client's model name means, loaded or not (404 if none)."""
        registry = self.routes.registry
        names = registry.names()
        name = objects.canonical(requested, names)
        if name not in registry.entries:
            target = resolve(requested, self.routes.aliases)
            name = objects.canonical(target, names) if target is not None else name
        entry = registry.entries.get(name)
        if entry is None:
            raise not_found(f"model '{requested}' not found (this server has: {', '.join(names)})")
        return entry

    def _tokenizer(self, entry):
        """The tokenizer in use for ``entry``: its own when loaded, else read from its folder
        (the chat template ``serve --chat-template`` gives a model without one, as loading
        would)."""
        if entry.tokenizer is not None or entry.path is None:
            return entry.tokenizer
        from ...tokenization import Tokenizer

        with self._lock:
            if entry.path in self._tokenizers:
                return self._tokenizers[entry.path]
        try:
            tokenizer = Tokenizer.from_dir(entry.path)
            if self.chat_template is not None and not tokenizer.has_chat_template:
                tokenizer.set_chat_template(self.chat_template)
        except (MlxInferError, OSError) as e:
            raise OllamaError(500, f"model '{entry.name}': its tokenizer: {e}") from None
        with self._lock:
            if len(self._tokenizers) >= MAX_TOKENIZERS:
                self._tokenizers.pop(next(iter(self._tokenizers)))
            self._tokenizers[entry.path] = tokenizer
        return tokenizer

    # --- generation ----------------------------------------------------------------------------

    async def chat(self, request: Request):
        return await self._generation(request, parse_chat(await self._body(request)))

    async def generate(self, request: Request):
        return await self._generation(request, parse_generate(await self._body(request)))

    async def _generation(self, request: Request, ask: OllamaRequest):
        if ask.empty:  # load (or with keep_alive 0, unload) the model, as clients preload
            return await in_worker(request, self._load, ask)
        out = await self.routes.generation(request, 1, self._reply, ask, busy, keep_alive_line(ask))
        if isinstance(out, StreamingResponse):
            out.headers["content-type"] = NDJSON
        return out

    def _reply(self, ask: OllamaRequest, streams: Streams):
        """The reply (in a worker thread): whole, or its NDJSON lines."""
        entry = self._served(ask.model)
        entry.keep_alive = ask.keep_alive  # Ollama's: each request sets it (None: serve's)
        if ask.think and ask.templated:
            from ...output.reasoning import reasoning_format

            if reasoning_format(entry.tokenizer) is None:
                raise OllamaError(400, f"'{ask.model}' does not support thinking")
        if ask.num_ctx is not None and not has_images(
            ask.prompt
        ):  # a prompt with images is not measured
            self._fit(entry, ask)
        first, results = self.routes.start(
            entry,
            for_model(entry, ask.prompt),  # a text-only model: tool turns' images as notes
            ask,
            ask.templated,
            lambda e: OllamaError(400, str(e)),
            lambda e: OllamaError(500, str(e)),
            streams,
        )
        reply = OllamaReply(ask, entry.tokenizer, first, results)
        if ask.stream:
            return reply.lines()
        return JSONResponse(reply.whole())

    def _fit(self, entry, ask: OllamaRequest) -> None:
        """``num_ctx`` as an upper bound: a prompt that does not fit in it is a 400 (never cut
        silently), and the reply gets what it leaves. Past the model's own context it changes
        nothing."""
        from ...generation.request import prepare_prompt

        context = objects.context_length({}, entry.model)
        if context is not None and ask.num_ctx >= context:
            return
        tokenizer = entry.tokenizer
        tools = ask.tools if ask.tool_choice != "none" else None
        try:
            check_prompt_length(entry.model, ask.prompt, ask.tools)
            prompt = ask.prompt
            if ask.templated:
                prompt = fit_messages(tokenizer, prompt, ask.tools, ask.tool_choice)
            ids = prepare_prompt(
                tokenizer,
                prompt,
                chat_template=ask.templated,
                tools=tools,
                chat_template_kwargs=ask.template_kwargs,
            )
        except (PromptTooLongError, TokenizerError, ValueError) as e:
            raise OllamaError(400, str(e)) from None
        if len(ids) >= ask.num_ctx:
            raise OllamaError(
                400,
                f"the prompt is {len(ids)} tokens, which leaves no room in options.num_ctx = "
                f"{ask.num_ctx}: raise num_ctx (this model's context is {context}) or shorten it",
            )
        ask.max_tokens = min(ask.max_tokens, ask.num_ctx - len(ids))

    def _load(self, ask: OllamaRequest) -> JSONResponse:
        """An empty request: the model loaded (``done_reason`` "load"), or with ``keep_alive``
        0 unloaded (a model loaded from ``--models-dir`` only; "unload"), as ``ollama stop``
        asks."""
        if ask.keep_alive == 0:
            entry = self._find(ask.model)
            unloaded = entry.path is not None and self.routes.registry.unload(entry.name)
            reason = "unload" if unloaded or entry.engine is None else "load"
        else:
            self._served(ask.model).keep_alive = ask.keep_alive
            reason = "load"
        out = objects.chunk(ask, "")
        return JSONResponse({**out, "done": True, "done_reason": reason})

    def _served(self, requested: str, embedding: bool = False):
        """The loaded entry (loaded now if it was not) a client's model name means."""
        name = self._find(requested).name
        return self.routes.served(name, not_found, embedding)

    # --- embeddings ----------------------------------------------------------------------------

    async def embed(self, request: Request):
        ask = parse_embed(await self._body(request))
        return await self.routes.generation(request, 1, self._embed, ask, busy)

    async def embeddings(self, request: Request):
        ask = parse_embed(await self._body(request), legacy=True)
        return await self.routes.generation(request, 1, self._embed_one, ask, busy)

    def _embed_one(self, ask: EmbedRequest, streams: Streams) -> JSONResponse:
        vectors, _ = self._vectors(ask, streams)
        return JSONResponse({"embedding": vectors[0]})

    def _embed(self, ask: EmbedRequest, streams: Streams) -> JSONResponse:
        vectors, tokens = self._vectors(ask, streams)
        total = time.perf_counter() - ask.started
        return JSONResponse(
            {
                "model": ask.model,
                "embeddings": vectors,
                "total_duration": objects.nanoseconds(total),
                "load_duration": 0,
                "prompt_eval_count": tokens,
            }
        )

    def _vectors(self, ask: EmbedRequest, streams: Streams) -> tuple[list, int]:
        """The inputs' vectors (the embedding path ``/v1/embeddings`` takes), and their tokens;
        with ``truncate`` an input past the context is cut to it, else it is a 400."""
        if self.routes.stopping:
            raise OllamaError(503, "the server is shutting down")
        entry = self._served(ask.model, embedding=True)
        cancelled = _Cancelled()
        streams.add(cancelled)
        try:
            check_dimensions(ask.dimensions, hidden_size(entry.model))
            pooling = entry.engine.pooling  # the checkpoint's max_seq_length, lower-casing
            try:
                rows = encode_inputs(
                    entry.model, entry.tokenizer, ask.inputs, max_inputs=MAX_INPUTS, pooling=pooling
                )
            except PromptTooLongError:
                if not ask.truncate:
                    raise
                rows = _truncated(entry.model, entry.tokenizer, ask.inputs)
                rows = encode_inputs(entry.model, entry.tokenizer, rows, max_inputs=MAX_INPUTS)
        except (EmbeddingError, PromptTooLongError, TokenIdError, TokenizerError) as e:
            raise OllamaError(400, str(e)) from None
        total = sum(len(r) for r in rows)
        if total > MAX_REQUEST_TOKENS:
            raise OllamaError(
                400, f"input: {total} tokens in all, at most {MAX_REQUEST_TOKENS} per request"
            )
        try:
            vectors = entry.engine.embed(rows, ask.dimensions, cancelled.event.is_set)
        except EmbeddingError as e:
            raise OllamaError(499, str(e)) from None  # the client has gone: no one reads it
        self.routes.registry.touch(entry)
        import numpy as np

        return np.asarray(vectors, dtype=np.float32).tolist(), total

    async def _body(self, request: Request) -> Any:
        """The body's JSON, whatever its Content-Type (``curl -d`` sends a form type)."""
        raw = await request.body()
        try:
            if len(raw) > BODY_IN_THREAD:
                work = self.routes.work.limiter
                return await anyio.to_thread.run_sync(parse_json, raw, limiter=work)
            return parse_json(raw)
        except BadJSON as e:
            raise OllamaError(400, str(e)) from None


class _Cancelled:
    """Set when the client hangs up (``Streams.add``); the embedder asks between batches."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def cancel(self) -> None:
        self.event.set()


def _directory(entry) -> Path | None:
    """A served model's folder: its own, or for the model the server started with, the one
    its tokenizer was read from."""
    if entry.path is not None:
        return entry.path
    path = getattr(entry.tokenizer, "path", None)
    return Path(path) if path is not None and Path(path).is_dir() else None


def _truncated(model, tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's tokens cut to the model's context as transformers' tokenizers cut (the
    special tokens around the text kept: last-token pooling reads the closing one). Called
    for texts past the context only: the checkpoint's own cut (``max_seq_length``) comes
    first."""
    context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    rows = []
    for i, text in enumerate(texts):
        if isinstance(context, int) and len(text) > 64 * context:  # before the tokenizer runs
            raise PromptTooLongError(f"input[{i}]: {len(text)} characters, too long to truncate")
        row = tokenizer.encode(text, add_special_tokens=True)
        rows.append(truncate(tokenizer, text, row, context) if isinstance(context, int) else row)
    return rows


def not_found(message: str) -> OllamaError:
    return OllamaError(404, message)


def busy(message: str) -> OllamaError:
    """Ollama's 503 when the queue is full."""
    return OllamaError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})
