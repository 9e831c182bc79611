"""The HTTP side: routes, the API key, errors in OpenAI's shape, and SSE streaming.

Every request runs through one :class:`~mlxinfer.batch.Engine` (continuous batching):
a streamed response iterates ``Engine.stream`` in Starlette's thread pool, and a client
that goes away closes that iterator, which cancels the request and frees its blocks.
"""

from __future__ import annotations

import hmac
import json
import time
from contextlib import asynccontextmanager
from typing import Any, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..batch import Engine, EngineError, PoolFullError
from ..errors import MlxInferError, PromptTooLongError
from . import openai as oa

WAIT_S = 600.0  # most seconds a request waits for any one token before it fails


def make_app(
    model,
    tokenizer,
    name: str,
    *,
    api_key: str | None = None,
    draft=None,
    engine: Engine | None = None,
    **engine_options,
) -> FastAPI:
    """An app serving ``model`` as ``name``; ``engine_options`` go to :class:`Engine`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.engine.close()

    app = FastAPI(
        title="mlxinfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.engine = engine or Engine(model, **engine_options)
    app.state.started = int(time.time())

    @app.exception_handler(oa.APIError)
    async def api_error(request: Request, e: oa.APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            expected = f"Bearer {api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                e = oa.APIError(
                    401, "invalid API key", type="authentication_error", code="invalid_api_key"
                )
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    def health():
        engine = app.state.engine
        if engine.alive:
            return {"status": "ok", "model": name}
        return JSONResponse(
            {"status": "error", "error": str(engine.failure or "engine closed")}, status_code=503
        )

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": app.state.started,
                    "owned_by": "mlxinfer",
                }
            ],
        }

    async def body_of(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise oa.APIError(400, "the request body is not valid JSON") from None

    def complete(ask: oa.Ask):
        if ask.model != name:
            raise oa.APIError(
                404,
                f"model '{ask.model}' not found (this server has '{name}')",
                param="model",
                code="model_not_found",
            )
        results = app.state.engine.stream(
            tokenizer,
            ask.prompt,
            max_tokens=ask.max_tokens,
            sampling=ask.sampling,
            stop=ask.stop,
            chat_template=ask.chat,
            timeout=WAIT_S,
            draft=draft,
        )
        try:  # the first result: a prompt that does not fit fails here, before any byte is sent
            first = next(results, None)
        except (PromptTooLongError, PoolFullError, ValueError) as e:
            raise oa.APIError(
                400,
                str(e),
                code="context_length_exceeded" if isinstance(e, PromptTooLongError) else None,
            ) from None
        except (EngineError, TimeoutError, MlxInferError) as e:
            raise oa.APIError(500, str(e), type="server_error") from None
        if ask.stream:
            return StreamingResponse(_events(ask, first, results), media_type="text/event-stream")
        return _whole(ask, first, results)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _run(complete, oa.parse(await body_of(request), chat=True))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _run(complete, oa.parse(await body_of(request), chat=False))

    return app


async def _run(fn, *args):
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)


def _whole(ask: oa.Ask, first, results: Iterator) -> JSONResponse:
    parts, n, finish, last = [], 0, "stop", first
    try:
        for r in _chain(first, results):
            parts.append(r.text)
            n += 1
            last = r
            finish = r.finish_reason or finish
    except (EngineError, TimeoutError) as e:
        raise oa.APIError(500, str(e), type="server_error") from None
    finally:
        results.close()
    stats = last.stats if last is not None else oa.GenerationStats()
    return JSONResponse(oa.response(ask, "".join(parts), finish, stats, n))


def _events(ask: oa.Ask, first, results: Iterator) -> Iterator[str]:
    """SSE ``data:`` lines: a first chunk with the role, one per text piece, the finish, the
    usage if asked, then ``[DONE]``."""
    n, finish, last = 0, "stop", first
    yield _sse(oa.chunk(ask, None, first=True) if ask.chat else oa.chunk(ask, ""))
    try:
        for r in _chain(first, results):
            n += 1
            last = r
            finish = r.finish_reason or finish
            if r.text:
                yield _sse(oa.chunk(ask, r.text))
    except (EngineError, TimeoutError) as e:
        yield _sse(oa.APIError(500, str(e), type="server_error").body())
        yield "data: [DONE]\n\n"
        return
    finally:
        results.close()  # also when the client went away: the request is cancelled
    yield _sse(oa.chunk(ask, None, finish))
    if ask.include_usage and last is not None:
        yield _sse({**oa.chunk(ask, None), "choices": [], "usage": oa.usage(last.stats, n)})
    yield "data: [DONE]\n\n"


def _chain(first, results: Iterator):
    if first is not None:
        yield first
    yield from results


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
