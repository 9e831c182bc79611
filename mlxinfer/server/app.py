"""The HTTP side: routes, the API key, errors in OpenAI's shape, and SSE streaming.

Every request runs through one :class:`~mlxinfer.batch.Engine` (continuous batching):
a response iterates ``Engine.start``'s stream in Starlette's thread pool. A client that goes
away cancels its requests and frees their blocks: before a response is ready (a whole one,
or a stream's first token) the handler polls for the hang-up (``hangup``), and during a
stream ``sse`` does.
"""

from __future__ import annotations

import hmac
import json
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..batch import Engine, EngineError, PoolFullError
from ..errors import MlxInferError, PromptTooLongError
from ..generation.drafts import DraftModel
from . import anthropic as an
from . import openai as oa
from .hangup import Streams, watched
from .models import Models
from .page import add_page
from .replies import AnthropicReply, Choice, openai_events, openai_whole
from .sse import streamed

WAIT_S = 600.0  # most seconds a request waits for any one token before it fails


def make_app(
    model=None,
    tokenizer=None,
    name: str | None = None,
    *,
    api_key: str | None = None,
    draft=None,
    engine: Engine | None = None,
    models_dir: Path | None = None,
    keep_alive: float | None = None,
    load: Callable | None = None,
    cors_origins: list[str] | None = None,
    **engine_options,
) -> FastAPI:
    """An app serving ``model`` as ``name`` and/or the converted models under ``models_dir``
    (loaded with ``load`` on first use, unloaded after ``keep_alive`` idle seconds);
    ``engine_options`` go to each :class:`Engine`. Browsers on ``cors_origins`` may call it
    (none by default). ``draft``: every request drafts with it (``PromptLookup()``, or a
    ``DraftModel`` sharing the models' vocabulary: checked here for ``model``, and for a
    directory's model when it loads)."""
    if model is None and models_dir is None:
        raise ValueError("make_app: give a model, a models_dir, or both")
    if draft is not None and model is not None:
        draft.check(model, tokenizer)  # a draft model's vocabulary: DraftError naming both
    checked = {name: 1} if draft is not None and model is not None else {}  # name -> loads
    if isinstance(draft, DraftModel):  # its pool inside each engine's kv_budget
        engine_options = {**engine_options, "draft_models": [draft.model]}
    if load is None:
        from ..loader import load

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.models.close()

    app = FastAPI(
        title="mlxinfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    registry = Models(
        engine_options=engine_options, models_dir=models_dir, keep_alive=keep_alive, load=load
    )
    if model is not None:
        registry.add_loaded(name, model, tokenizer, engine)
    app.state.models = registry
    app.state.started = int(time.time())
    add_page(app)
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
        )

    def served(requested: str, error):
        entry = registry.get(requested)
        if entry is None:
            names = ", ".join(registry.names())
            raise error(f"model '{requested}' not found (this server has: {names})")
        return entry

    @app.exception_handler(oa.APIError)
    async def api_error(request: Request, e: oa.APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(an.APIError)
    async def anthropic_error(request: Request, e: an.APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        path = request.url.path
        if api_key is not None and path.startswith("/v1/"):
            # OpenAI clients send "Authorization: Bearer KEY"; Anthropic's send "x-api-key: KEY".
            bearer = request.headers.get("authorization", "").removeprefix("Bearer ")
            given = request.headers.get("x-api-key") or bearer
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                if path.startswith("/v1/messages"):
                    return JSONResponse(an.APIError(401, "invalid x-api-key").body(), 401)
                e = oa.APIError(
                    401, "invalid API key", type="authentication_error", code="invalid_api_key"
                )
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    def health():
        report, ok, errors = {}, True, []
        for entry in list(registry.entries.values()):
            if entry.loaded and not entry.engine.alive and entry.engine.failure is not None:
                registry.get(entry.name)  # a failed engine is replaced now
            item = {"loaded": entry.loaded, "restarts": len(entry.failures)}
            if entry.failures:
                item["last_failure"] = entry.failures[-1]
            if entry.loaded and not entry.engine.alive:
                ok = False
                errors.append(f"{entry.name}: {entry.engine.failure or 'engine closed'}")
            report[entry.name] = item
        if ok:
            return {"status": "ok", "models": report}
        return JSONResponse(
            {"status": "error", "error": "; ".join(errors), "models": report}, status_code=503
        )

    @app.get("/metrics")
    def metrics():
        from fastapi.responses import PlainTextResponse

        return PlainTextResponse(prometheus(registry), media_type=PROMETHEUS)

    @app.get("/v1/models")
    def models():
        data = [
            {"id": n, "object": "model", "created": app.state.started, "owned_by": "mlxinfer"}
            for n in registry.names()
        ]
        return {"object": "list", "data": data}

    async def body_of(request: Request, error=oa.APIError) -> Any:
        try:
            return json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise error(400, "the request body is not valid JSON") from None

    def start(entry, prompt, ask, chat_template: bool, bad, failed, streams, sampling=None):
        """The request's results and its first one: a prompt that does not fit fails here,
        before any byte is sent (``bad``: a 400 of the API's shape, ``failed``: a 500). The
        engine's stream goes to ``streams``, to be cancelled if the client hangs up."""
        try:
            if draft is not None and checked.get(entry.name) != entry.loads:
                draft.check(entry.model, entry.tokenizer)  # a directory's model, loaded now
                checked[entry.name] = entry.loads
            stream = entry.engine.start(
                entry.tokenizer,
                prompt,
                max_tokens=ask.max_tokens,
                sampling=sampling or ask.sampling,
                stop=ask.stop,
                chat_template=chat_template,
                timeout=WAIT_S,
                draft=draft,
                constraint=getattr(ask, "constraint", None),
                tools=ask.tools,
                tool_choice=ask.tool_choice,
                chat_template_kwargs=getattr(ask, "template_kwargs", None),
            )
            streams.add(stream)
            results = _cancelling(stream)
            return next(results, None), results
        except (PromptTooLongError, PoolFullError, ValueError) as e:
            raise bad(e) from None
        except (EngineError, TimeoutError, MlxInferError) as e:
            raise failed(e) from None

    def complete(ask: oa.Ask, streams: Streams):
        entry = served(
            ask.model,
            lambda m: oa.APIError(404, m, param="model", code="model_not_found"),
        )

        def bad(e):
            code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else None
            return oa.APIError(400, str(e), code=code)

        choices: list[Choice] = []
        try:
            for i in range(ask.n):
                sampling = oa.choice_sampling(ask.sampling, i)
                first, results = start(
                    entry,
                    ask.prompt,
                    ask,
                    ask.chat,
                    bad,
                    lambda e: oa.APIError(500, str(e), type="server_error"),
                    streams,
                    sampling,
                )
                choices.append(Choice(i, first, results))
        except BaseException:
            for c in choices:
                c.close()
            raise
        if ask.stream:
            return openai_events(ask, entry.tokenizer, choices)
        return openai_whole(ask, entry.tokenizer, choices)

    def messages(ask: an.Ask, streams: Streams):
        entry = served(ask.model, lambda m: an.APIError(404, f"model: {m}"))
        first, results = start(
            entry,
            ask.messages,
            ask,
            True,
            lambda e: an.APIError(400, str(e)),
            lambda e: an.APIError(500, str(e)),
            streams,
        )
        reply = AnthropicReply(ask, entry.tokenizer, first, results)
        if ask.stream:
            return reply.events()
        try:
            return JSONResponse(reply.whole())
        except (EngineError, TimeoutError) as e:
            raise an.APIError(500, str(e)) from None

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request):
        ask = an.parse(await body_of(request, an.APIError))
        out = await watched(request, messages, ask)
        return _respond(request, out, PING)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        ask = an.parse(await body_of(request, an.APIError), count_only=True)
        from ..generation.loop import prepare_prompt

        entry = served(ask.model, lambda m: an.APIError(404, f"model: {m}"))
        ids = prepare_prompt(
            entry.tokenizer,
            ask.messages,
            chat_template=True,
            tools=ask.tools,
            chat_template_kwargs=ask.template_kwargs,
        )
        return {"input_tokens": len(ids)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ask = oa.parse(await body_of(request), chat=True)
        return _respond(request, await watched(request, complete, ask))

    @app.post("/v1/completions")
    async def completions(request: Request):
        ask = oa.parse(await body_of(request), chat=False)
        return _respond(request, await watched(request, complete, ask))

    return app


PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
# engine metric -> (Prometheus type, help)
METRICS = {
    "requests_running": ("gauge", "Requests admitted: prefilling or decoding."),
    "requests_waiting": ("gauge", "Requests waiting for room in the batch or the KV pool."),
    "requests_done": ("counter", "Requests finished or cancelled."),
    "prompt_tokens": ("counter", "Prompt tokens prefilled (not counting prefix-cache hits)."),
    "generated_tokens": ("counter", "Tokens generated."),
    "prefill_tokens_per_second": ("gauge", "Prefill throughput since start."),
    "decode_tokens_per_second": ("gauge", "Aggregate decode throughput since start."),
    "decode_steps": ("counter", "Batched decode forwards."),
    "prefill_steps": ("counter", "Prefill forwards (short prompt chunks share one)."),
    "kv_blocks_in_use": ("gauge", "KV blocks referenced by running requests."),
    "kv_blocks_cached": ("gauge", "Unreferenced KV blocks kept for prefix hits."),
    "kv_blocks_free": ("gauge", "KV blocks free within the budget."),
    "kv_window_blocks_in_use": (
        "gauge",
        "Window-pool KV blocks (sliding-window layers) referenced by running requests.",
    ),
    "kv_bytes": ("gauge", "Bytes the KV pools' arrays hold (the window pool's too)."),
    "prefix_hit_ratio": (
        "gauge",
        "Prompt blocks served from the prefix cache, of those looked up.",
    ),
    "draft_tokens": ("counter", "Tokens proposed by drafts (prompt lookup or a draft model)."),
    "draft_accepted_tokens": ("counter", "Proposed tokens accepted."),
    "draft_steps": ("counter", "Draft-model forwards, each over the requests drafting with it."),
    "draft_seconds": ("counter", "Seconds spent in the draft model (prefill and proposals)."),
    "draft_kv_bytes": ("gauge", "Bytes of the draft-model keys held for running requests."),
    "draft_model_bytes": ("gauge", "Bytes of the draft models' weights."),
}


def prometheus(registry: Models) -> str:
    """Each loaded model's engine counters in Prometheus' text format, ``mlxinfer_<name>``
    labelled with the model."""
    kinds = {"up": ("gauge", "1 while the model's engine thread is alive."), **METRICS}
    samples: dict[str, list[str]] = {key: [] for key in kinds}
    loaded = 0
    for entry in list(registry.entries.values()):
        engine = entry.engine
        if engine is None:
            continue
        loaded += 1
        label = '{model="' + entry.name.replace("\\", "\\\\").replace('"', '\\"') + '"}'
        for key, value in {"up": float(engine.alive), **engine.metrics()}.items():
            samples[key].append(f"{_metric(key, kinds)}{label} {value:g}")
    lines = [
        "# HELP mlxinfer_models_loaded Models loaded now.",
        "# TYPE mlxinfer_models_loaded gauge",
        f"mlxinfer_models_loaded {loaded}",
    ]
    for key, (kind, text) in kinds.items():
        name = _metric(key, kinds)
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples[key]]
    return "\n".join(lines) + "\n"


def _metric(key: str, kinds: dict) -> str:
    return f"mlxinfer_{key}" + ("_total" if kinds[key][0] == "counter" else "")


PING = an.event("ping", {})  # Anthropic's stream keeps alive with its own event


def _respond(request: Request, out, *keep_alive):
    """A whole response as it is; a stream's SSE lines as a response that cancels the request
    when the client goes away."""
    return out if isinstance(out, Response) else streamed(request, out, *keep_alive)


def _cancelling(stream) -> Iterator:
    """``stream``'s results; cancels it when closed early (as ``Engine.stream`` does)."""
    try:
        yield from stream
    finally:
        stream.cancel()
