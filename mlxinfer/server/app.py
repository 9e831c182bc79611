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
from pathlib import Path
from typing import Any, Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..batch import Engine, EngineError, PoolFullError
from ..errors import MlxInferError, PromptTooLongError
from . import anthropic as an
from . import openai as oa
from .models import Models
from .page import add_page
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
    (none by default)."""
    if model is None and models_dir is None:
        raise ValueError("make_app: give a model, a models_dir, or both")
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

    def start(entry, prompt, ask, chat_template: bool, bad, failed):
        """The request's results and its first one: a prompt that does not fit fails here,
        before any byte is sent (``bad``: a 400 of the API's shape, ``failed``: a 500)."""
        results = entry.engine.stream(
            entry.tokenizer,
            prompt,
            max_tokens=ask.max_tokens,
            sampling=ask.sampling,
            stop=ask.stop,
            chat_template=chat_template,
            timeout=WAIT_S,
            draft=draft,
        )
        try:
            return next(results, None), results
        except (PromptTooLongError, PoolFullError, ValueError) as e:
            raise bad(e) from None
        except (EngineError, TimeoutError, MlxInferError) as e:
            raise failed(e) from None

    def complete(ask: oa.Ask):
        entry = served(
            ask.model,
            lambda m: oa.APIError(404, m, param="model", code="model_not_found"),
        )
        first, results = start(
            entry,
            ask.prompt,
            ask,
            ask.chat,
            lambda e: oa.APIError(
                400,
                str(e),
                code="context_length_exceeded" if isinstance(e, PromptTooLongError) else None,
            ),
            lambda e: oa.APIError(500, str(e), type="server_error"),
        )
        if ask.stream:
            return _events(ask, entry.tokenizer, first, results)
        return _whole(ask, entry.tokenizer, first, results)

    def messages(ask: an.Ask):
        entry = served(ask.model, lambda m: an.APIError(404, f"model: {m}"))
        first, results = start(
            entry,
            ask.messages,
            ask,
            True,
            lambda e: an.APIError(400, str(e)),
            lambda e: an.APIError(500, str(e)),
        )
        reply = _Reply(ask, entry.tokenizer, first, results)
        if ask.stream:
            return reply.events()
        try:
            return JSONResponse(reply.whole())
        except (EngineError, TimeoutError) as e:
            raise an.APIError(500, str(e)) from None

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request):
        out = await _run(messages, an.parse(await body_of(request, an.APIError)))
        return out if isinstance(out, JSONResponse) else streamed(request, out, PING)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        ask = an.parse(await body_of(request, an.APIError), count_only=True)
        from ..generation.loop import prepare_prompt

        entry = served(ask.model, lambda m: an.APIError(404, f"model: {m}"))
        ids = prepare_prompt(entry.tokenizer, ask.messages, chat_template=True)
        return {"input_tokens": len(ids)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return _respond(request, await _run(complete, oa.parse(await body_of(request), chat=True)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return _respond(request, await _run(complete, oa.parse(await body_of(request), chat=False)))

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
    "kv_blocks_in_use": ("gauge", "KV blocks referenced by running requests."),
    "kv_blocks_cached": ("gauge", "Unreferenced KV blocks kept for prefix hits."),
    "kv_blocks_free": ("gauge", "KV blocks free within the budget."),
    "kv_bytes": ("gauge", "Bytes the KV pool's arrays hold."),
    "prefix_hit_ratio": (
        "gauge",
        "Prompt blocks served from the prefix cache, of those looked up.",
    ),
    "draft_tokens": ("counter", "Tokens proposed by prompt lookup."),
    "draft_accepted_tokens": ("counter", "Proposed tokens accepted."),
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


def _respond(request: Request, out):
    """A whole response as it is; a stream's SSE lines as a response that cancels the request
    when the client goes away."""
    return out if isinstance(out, JSONResponse) else streamed(request, out)


async def _run(fn, *args):
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)


def _entry(ask: oa.Ask, tokenizer, r) -> list[dict]:
    if not ask.logprobs or r.logprobs is None:
        return []
    return [oa.token_logprobs(tokenizer, r.token, r.logprobs, ask.top_logprobs)]


def _whole(ask: oa.Ask, tokenizer, first, results: Iterator) -> JSONResponse:
    parts, n, finish, last, logprobs = [], 0, "stop", first, []
    try:
        for r in _chain(first, results):
            parts.append(r.text)
            logprobs += _entry(ask, tokenizer, r)
            n += 1
            last = r
            finish = r.finish_reason or finish
    except (EngineError, TimeoutError) as e:
        raise oa.APIError(500, str(e), type="server_error") from None
    finally:
        results.close()
    stats = last.stats if last is not None else oa.GenerationStats()
    return JSONResponse(oa.response(ask, "".join(parts), finish, stats, n, logprobs))


def _events(ask: oa.Ask, tokenizer, first, results: Iterator) -> Iterator[str]:
    """SSE ``data:`` lines: a first chunk with the role, one per text piece (with the log-probs
    of the tokens since the last one, if asked), the finish, the usage if asked, then ``[DONE]``."""
    n, finish, last, pending = 0, "stop", first, []
    yield _sse(oa.chunk(ask, None, first=True) if ask.chat else oa.chunk(ask, ""))
    try:
        for r in _chain(first, results):
            n += 1
            last = r
            finish = r.finish_reason or finish
            pending += _entry(ask, tokenizer, r)
            if r.text:
                yield _sse(oa.chunk(ask, r.text, logprobs=pending))
                pending = []
    except (EngineError, TimeoutError) as e:
        yield _sse(oa.APIError(500, str(e), type="server_error").body())
        yield "data: [DONE]\n\n"
        return
    finally:
        results.close()  # also when the client went away: the request is cancelled
    yield _sse(oa.chunk(ask, None, finish, logprobs=pending))
    if ask.include_usage and last is not None:
        yield _sse({**oa.chunk(ask, None), "choices": [], "usage": oa.usage(last.stats, n)})
    yield "data: [DONE]\n\n"


class _Reply:
    """A /v1/messages reply, whole or as Anthropic's stream of events."""

    def __init__(self, ask: an.Ask, tokenizer, first, results: Iterator):
        self.ask, self.tokenizer, self.first, self.results = ask, tokenizer, first, results
        self.tokens: list[int] = []
        self.finish, self.last = "stop", first

    def _pieces(self) -> Iterator[str]:
        try:
            for r in _chain(self.first, self.results):
                self.tokens.append(r.token)
                self.last, self.finish = r, r.finish_reason or self.finish
                yield r.text
        finally:
            self.results.close()

    def _end(self) -> tuple[str, str | None, dict]:
        eos = bool(self.tokens) and self.tokens[-1] in self.tokenizer.eos_token_ids
        matched = None
        if self.finish == "stop" and not eos and self.ask.stop:
            raw = self.tokenizer.decode(self.tokens)
            found = [(raw.find(s), s) for s in self.ask.stop if s in raw]
            matched = min(found)[1] if found else None
        stats = self.last.stats if self.last is not None else an.GenerationStats()
        reason = an.stop_reason(self.finish, eos, matched)
        return reason, matched, an.usage(stats, len(self.tokens))

    def whole(self) -> dict:
        text = "".join(self._pieces())
        reason, matched, usage = self._end()
        return an.message(self.ask, text, reason, matched, usage)

    def events(self) -> Iterator[str]:
        stats = self.first.stats if self.first is not None else an.GenerationStats()
        start = an.message(self.ask, "", None, None, an.usage(stats, 0))
        yield an.event("message_start", {"message": start})
        block = {"type": "text", "text": ""}
        yield an.event("content_block_start", {"index": 0, "content_block": block})
        yield an.event("ping", {})
        try:
            for text in self._pieces():
                if text:
                    delta = {"type": "text_delta", "text": text}
                    yield an.event("content_block_delta", {"index": 0, "delta": delta})
        except (EngineError, TimeoutError) as e:
            yield an.event("error", {"error": an.APIError(500, str(e)).body()["error"]})
            return
        reason, matched, usage = self._end()
        yield an.event("content_block_stop", {"index": 0})
        delta = {"stop_reason": reason, "stop_sequence": matched}
        yield an.event(
            "message_delta", {"delta": delta, "usage": {"output_tokens": usage["output_tokens"]}}
        )
        yield an.event("message_stop", {})


def _chain(first, results: Iterator):
    if first is not None:
        yield first
    yield from results


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
