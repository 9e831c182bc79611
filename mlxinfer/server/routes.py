"""The generation routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages`` and
``/v1/messages/count_tokens``), and what every route module builds its handlers from
(``app.state.routes``: the model a request names, its JSON body, its engine requests).

Every request runs through one :class:`~mlxinfer.batch.Engine` (continuous batching):
a response iterates ``Engine.start``'s stream in worker threads of its own (``limits.Work``:
never the pool other routes use; ``/health`` and ``/metrics`` run on the event loop and wait
for nothing). A client that goes away cancels its requests and frees their blocks: before a
response is ready (a whole one, or a stream's first token) the handler polls for the hang-up
(``hangup``), and during a stream ``sse`` does.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Iterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..batch import EngineError, PoolFullError
from ..errors import InsufficientMemoryError, MlxInferError, PromptTooLongError, TokenizerError
from . import anthropic as an
from . import openai as oa
from .aliases import resolve
from .embeddings import kind_error
from .hangup import Streams, watched
from .limits import (
    RETRY_AFTER_S,
    BadJSON,
    Overloaded,
    check_prompt_length,
    in_worker,
    is_json_type,
    parse_json,
)
from .quoting import shown
from .replies import AnthropicReply, Choice, openai_events, openai_whole
from .sse import streamed
from .templating import fit_messages, prefix_block

WAIT_S = 600.0  # most seconds a request waits with no progress (no token, no prefill chunk)
BODY_IN_THREAD = 1 << 18  # bodies larger than this are parsed off the event loop


def add_routes(
    app: FastAPI,
    aliases: list[tuple[str, str]],
    draft,
    checked: dict[str, int],
    max_output_tokens: int | None,
) -> None:
    """The generation routes on ``app`` (after ``make_app`` set ``app.state.models`` and
    ``app.state.work``), and ``app.state.routes`` for the route modules of their own.
    ``aliases``: ``--model-alias``'s, parsed; ``draft``: every request drafts with it, checked
    against a model once per load (``checked``: name -> the load checked);
    ``max_output_tokens``: a cap on every request's output."""
    registry, work = app.state.models, app.state.work

    def served(requested: str, error, embedding: bool = False):
        try:
            entry = registry.get(requested)
            if entry is None and resolve(requested, aliases) is not None:  # --model-alias
                entry = registry.get(resolve(requested, aliases))
        except InsufficientMemoryError as e:  # models-dir: no room even after unloading idle ones
            raise _with_status(error(str(e)), 503) from None
        if entry is None:
            names = ", ".join(registry.names())
            raise error(f"model '{requested}' not found (this server has: {names})")
        if entry.embedding != embedding:  # a chat request to an embedding model, or the reverse
            raise kind_error(error, entry.name, entry.embedding)
        return entry

    async def body_of(request: Request, error=oa.APIError) -> Any:
        kind = request.headers.get("content-type")
        if not is_json_type(kind):
            found = shown(kind) if kind is not None else "none"
            message = f"Content-Type: expected application/json, found {found}"
            raise error(415, message, **_code(error, "unsupported_media_type"))
        raw = await request.body()
        try:
            if len(raw) > BODY_IN_THREAD:
                return await anyio.to_thread.run_sync(parse_json, raw, limiter=work.limiter)
            return parse_json(raw)
        except BadJSON as e:
            raise error(400, str(e)) from None

    async def generation(request: Request, n: int, fn: Callable, ask, overloaded, *keep_alive):
        """``fn(ask, streams)``'s response, counted in the work in flight (``n`` engine
        requests) until it ends; ``overloaded(message)``: the 503 when the queue is full."""
        try:
            release = work.enter(n)
        except Overloaded as e:
            raise overloaded(str(e)) from None
        try:
            out = await watched(request, fn, ask)
        except BaseException:
            release()
            raise
        if isinstance(out, Response):
            release()
            return out
        return streamed(request, out, *keep_alive, on_close=release)

    def start(entry, prompt, ask, chat_template: bool, bad, failed, streams, sampling=None):
        """The request's results and its first one (None for a stream: its headers and
        keep-alives go out during the prefill, so that clients with idle timeouts wait for a
        long prompt): a prompt that does not fit fails here, before any byte is sent
        (``bad``: a 400 of the API's shape, ``failed``: a 500). The engine's stream goes to
        ``streams``, to be cancelled if the client hangs up."""
        try:
            if draft is not None and checked.get(entry.name) != entry.loads:
                draft.check(entry.model, entry.tokenizer)  # a directory's model, loaded now
                checked[entry.name] = entry.loads
            check_prompt_length(entry.model, prompt, ask.tools)  # before the tokenizer runs
            if chat_template and not isinstance(prompt, str):
                prompt = fit_messages(entry.tokenizer, prompt, ask.tools, ask.tool_choice)
            stream = entry.engine.start(
                entry.tokenizer,
                prompt,
                max_tokens=min(ask.max_tokens, max_output_tokens or ask.max_tokens),
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
            if getattr(ask, "stream", False):  # headers and keep-alives during the prefill
                return None, results
            return next(results, None), results
        except (PromptTooLongError, PoolFullError, ValueError, TokenizerError) as e:
            raise bad(e) from None  # TokenizerError: the chat template refused the messages
        except (EngineError, TimeoutError, MlxInferError) as e:
            if not app.state.stopping:
                raise failed(e) from None
            error = failed(EngineError("the server is shutting down"))
            error.status = 503
            raise error from None

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
        ask.cache_block = prefix_block(entry.engine)
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

    def busy(message: str) -> an.APIError:
        return an.APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})

    def oa_busy(message: str) -> oa.APIError:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        return oa.APIError(503, message, type="server_error", code="overloaded", headers=headers)

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request):
        ask = an.parse(await body_of(request, an.APIError))
        return await generation(request, 1, messages, ask, busy, PING)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        ask = an.parse(await body_of(request, an.APIError), count_only=True)
        from ..generation.loop import prepare_prompt

        def count():
            entry = served(ask.model, lambda m: an.APIError(404, f"model: {m}"))
            try:
                check_prompt_length(entry.model, ask.messages, ask.tools)
                messages = fit_messages(entry.tokenizer, ask.messages, ask.tools, ask.tool_choice)
                ids = prepare_prompt(
                    entry.tokenizer,
                    messages,
                    chat_template=True,
                    tools=ask.tools if ask.tool_choice != "none" else None,  # as generation
                    chat_template_kwargs=ask.template_kwargs,
                )
            except (PromptTooLongError, TokenizerError, ValueError) as e:
                raise an.APIError(400, str(e)) from None
            return {"input_tokens": len(ids)}

        return await in_worker(request, count)  # a long prompt never holds the event loop

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ask = oa.parse(await body_of(request), chat=True)
        return await generation(request, ask.n, complete, ask, oa_busy)

    @app.post("/v1/completions")
    async def completions(request: Request):
        ask = oa.parse(await body_of(request), chat=False)
        return await generation(request, ask.n, complete, ask, oa_busy)

    # What route modules of their own (responses, embeddings) build their handlers from.
    app.state.routes = SimpleNamespace(
        served=served, body_of=body_of, generation=generation, start=start, oa_busy=oa_busy
    )


def _code(error, code: str) -> dict:
    """``code=`` for an OpenAI error (Anthropic's shape has none)."""
    return {"code": code} if error is oa.APIError else {}


def _with_status(e, status: int):
    """An API error of either shape, answered with ``status`` instead."""
    e.status = status
    if isinstance(e, oa.APIError):
        e.type, e.code, e.param = "server_error", "model_not_loadable", None
    return e


PING = an.event("ping", {})  # Anthropic's stream keeps alive with its own event


def _cancelling(stream) -> Iterator:
    """``stream``'s results; cancels it when closed early (as ``Engine.stream`` does)."""
    try:
        yield from stream
    finally:
        stream.cancel()
