"""The HTTP app (:func:`make_app`): the served models, the API key, errors in each API's shape,
and each API's routes (its folder's ``routes``, on the shared :class:`~.routes.Routes`).

What a request may be (size, headers, host, body time, queue) is ``limits``'.
"""

from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..batch import Engine
from ..generation.drafts import DraftModel
from ..tokenization.chat_template import named_chat_template
from .aliases import check_targets, parse_aliases
from .anthropic.routes import AnthropicRoutes
from .api_errors import AnthropicError, APIError, OllamaError, OpenAIError
from .embeddings.routes import EmbeddingsRoutes, add_embedding_model
from .limits import Guard, Limits, Work
from .metrics import add_status
from .models import Models
from .ollama.routes import OllamaRoutes
from .openai.routes import OpenAIRoutes
from .page import add_page
from .responses.routes import ResponsesRoutes
from .routes import Routes
from .shapes import error_response, is_ollama
from .templating import templated

ANTHROPIC_HEADERS = ["anthropic-version", "anthropic-beta"]  # the beta values: accepted, ignored


def make_app(
    model=None,
    tokenizer=None,
    name: str | None = None,
    *,
    api_key: str | None = None,
    draft=None,
    engine: Engine | None = None,
    models_dir: Path | None = None,
    store: Path | None = None,
    keep_alive: float | None = None,
    load: Callable | None = None,
    cors_origins: list[str] | None = None,
    max_body: int = Limits.max_body,
    max_header_bytes: int = Limits.max_header_bytes,
    max_headers: int = Limits.max_headers,
    body_timeout: float = Limits.body_timeout,
    max_queue: int = Limits.max_queue,
    allowed_hosts: list[str] | None = None,
    shutdown_timeout: float = Limits.shutdown_timeout,
    max_images: int = Limits.max_images,
    max_image_bytes: int = Limits.max_image_bytes,
    max_image_pixels: int = Limits.max_image_pixels,
    allow_remote_images: bool = Limits.allow_remote_images,
    chat_template: str | None = None,
    model_aliases: list[str] | None = None,
    max_output_tokens: int | None = None,
    embedding_model: str | Path | None = None,
    **engine_options,
) -> FastAPI:
    """An app serving ``model`` as ``name``, the converted models under ``models_dir`` and
    those in the model store whose root is ``store`` (``mlxinfer.store.store_root()``), the
    last two loaded with ``load`` on first use and unloaded after ``keep_alive`` idle seconds;
    ``engine_options`` go to each :class:`Engine`. Browsers on ``cors_origins`` may call it
    (none by default). ``draft``: every request drafts with it (``PromptLookup()``, or a
    ``DraftModel`` sharing the models' vocabulary: checked here for ``model``, and for a
    directory's model when it loads). ``max_body`` ... ``allow_remote_images``: the request
    limits (images: per request, bytes and pixels per image, http(s) URLs fetched or not),
    :class:`~mlxinfer.server.limits.Limits`. ``chat_template`` (a name or a Jinja
    file): ``model``'s chat template, and that of a directory's model without one;
    ``model_aliases``: ``["GLOB=NAME", ...]``, client model names served as NAME;
    ``max_output_tokens``: a cap on every request's output."""
    if model is None and models_dir is None and store is None:
        raise ValueError("make_app: give a model, a models_dir, a store, or several")
    limits = Limits(
        max_body=max_body,
        max_header_bytes=max_header_bytes,
        max_headers=max_headers,
        body_timeout=body_timeout,
        max_queue=max_queue,
        allowed_hosts=tuple(allowed_hosts) if allowed_hosts is not None else None,
        shutdown_timeout=shutdown_timeout,
        max_images=max_images,
        max_image_bytes=max_image_bytes,
        max_image_pixels=max_image_pixels,
        allow_remote_images=allow_remote_images,
    )
    if draft is not None and model is not None:
        draft.check(model, tokenizer)  # a draft model's vocabulary: DraftError naming both
    checked = {name: 1} if draft is not None and model is not None else {}  # name -> loads
    if isinstance(draft, DraftModel):  # its pool inside each engine's kv_budget (the Engine's)
        engine_options = {**engine_options, "draft_models": [draft.model]}
    if load is None:
        from ..loading.loader import load
    aliases = parse_aliases(model_aliases)
    if chat_template is not None:
        named_chat_template(chat_template)  # a bad name or file fails at start
        if tokenizer is not None:
            tokenizer.set_chat_template(chat_template)
        load = templated(load, chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.models.close()

    app = FastAPI(
        title="mlxinfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    registry = Models(
        engine_options=engine_options,
        models_dir=models_dir,
        keep_alive=keep_alive,
        load=load,
        store=store,
    )
    if model is not None:
        registry.add_loaded(name, model, tokenizer, engine)
    check_targets(aliases, registry.names())
    app.state.models = registry
    app.state.started = int(time.time())
    app.state.limits = limits
    app.state.work = work = Work(limits.max_queue, lambda: _running(registry))
    app.state.stopping = False  # set by a SIGTERM (``serve``): requests then fail with a 503
    add_page(app, other=OllamaRoutes.root)  # "Ollama is running" to clients not asking for HTML
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", "x-api-key", *ANTHROPIC_HEADERS],
        )

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):  # OpenAI's, Anthropic's, Ollama's shape
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown routes, methods
        return error_response(request.url.path, e.status_code, str(e.detail), None, e.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):  # logged by uvicorn as well
        message = f"internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return error_response(request.url.path, 500, message[:500], "internal_error")

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        path = request.url.path
        if api_key is not None and is_ollama(path) and path != "/api/version":
            # Ollama's clients send "Authorization: Bearer KEY" (OLLAMA_API_KEY).
            given = request.headers.get("authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return JSONResponse(OllamaError(401, "unauthorized: invalid API key").body(), 401)
        if api_key is not None and path.startswith("/v1/"):
            # OpenAI clients send "Authorization: Bearer KEY"; Anthropic's send "x-api-key: KEY".
            bearer = request.headers.get("authorization", "").removeprefix("Bearer ")
            given = request.headers.get("x-api-key") or bearer
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                if path.startswith("/v1/messages"):
                    return JSONResponse(AnthropicError(401, "invalid x-api-key").body(), 401)
                e = OpenAIError(
                    401, "invalid API key", type="authentication_error", code="invalid_api_key"
                )
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    add_status(app, registry, work)  # /health and /metrics, on the event loop (metrics.py)
    if embedding_model is not None:  # serve --embedding-model DIR
        add_embedding_model(registry, embedding_model, load)
    routes = Routes(app, aliases, draft, checked, max_output_tokens)
    for api in (OpenAIRoutes, AnthropicRoutes, EmbeddingsRoutes, ResponsesRoutes):
        api(routes).add_to(app)  # each API's folder: /v1/models, /v1/chat/completions ...
    OllamaRoutes(routes, chat_template).add_to(app)  # /api/tags, /api/chat ...
    app.add_middleware(Guard, limits=limits)  # added last: the outermost, before CORS and keys
    return app


def _running(registry: Models) -> int:
    """Engine requests running in every loaded model's batch."""
    engines = [e.engine for e in list(registry.entries.values()) if e.engine is not None]
    return sum(int(engine.metrics().get("requests_running", 0)) for engine in engines)
