"""What every API's routes are built on (:class:`Routes`): the model a request names, its
JSON body, its engine requests started and counted in the work in flight. Each API's own
routes are a class of its folder (``openai``, ``anthropic``, ``responses``, ``embeddings``)
holding one :class:`Routes`, one method per endpoint.

Every request runs through one :class:`~mlxinfer.batch.Engine` (continuous batching):
a response iterates ``Engine.start``'s stream in worker threads of its own (``limits.Work``:
never the pool other routes use; ``/health`` and ``/metrics`` run on the event loop and wait
for nothing). A client that goes away cancels its requests and frees their blocks: before a
response is ready (a whole one, or a stream's first token) the handler polls for the hang-up
(``hangup``), and during a stream ``sse`` does.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..batch import EngineError, PoolFullError
from ..errors import InsufficientMemoryError, MlxInferError, PromptTooLongError, TokenizerError
from .aliases import resolve
from .api_errors import OpenAIError
from .hangup import Streams, watched
from .images import ImageLimit, image_sources, start_with_images
from .limits import (
    RETRY_AFTER_S,
    BadJSON,
    Overloaded,
    check_prompt_length,
    is_json_type,
    parse_json,
)
from .quoting import shown
from .sse import streamed
from .templating import fit_messages

WAIT_S = 600.0  # most seconds a request waits with no progress (no token, no prefill chunk)
BODY_IN_THREAD = 1 << 18  # bodies larger than this are parsed off the event loop


class Routes:
    """The served models (``app.state.models``) and the work in flight (``app.state.work``)
    as every route uses them (built by ``make_app`` after it set both). ``aliases``:
    ``--model-alias``'s, parsed; ``draft``: every request drafts with it, checked against a
    model once per load (``checked``: name -> the load checked); ``max_output_tokens``: a cap
    on every request's output."""

    def __init__(
        self,
        app: FastAPI,
        aliases: list[tuple[str, str]],
        draft,
        checked: dict[str, int],
        max_output_tokens: int | None,
    ) -> None:
        self.app, self.registry, self.work = app, app.state.models, app.state.work
        self.aliases, self.draft, self.checked = aliases, draft, checked
        self.max_output_tokens = max_output_tokens

    @property
    def stopping(self) -> bool:
        """Set by a SIGTERM (``serve``): requests then fail with a 503."""
        return self.app.state.stopping

    def served(self, requested: str, error, embedding: bool = False):
        """The registry's entry for the model a request names (or its ``--model-alias``
        target); ``error(message)``: the API's 404, raised when there is none."""
        try:
            entry = self.registry.get(requested)
            if entry is None and resolve(requested, self.aliases) is not None:
                entry = self.registry.get(resolve(requested, self.aliases))
        except InsufficientMemoryError as e:  # models-dir: no room even after unloading idle ones
            raise _with_status(error(str(e)), 503) from None
        if entry is None:
            names = ", ".join(self.registry.names())
            raise error(f"model '{requested}' not found (this server has: {names})")
        if entry.embedding != embedding:  # a chat request to an embedding model, or the reverse
            raise kind_error(error, entry.name, entry.embedding)
        return entry

    async def body(self, request: Request, error=OpenAIError) -> Any:
        """The request's JSON body; ``error``: the API's error class, for a 415 or a 400."""
        kind = request.headers.get("content-type")
        if not is_json_type(kind):
            found = shown(kind) if kind is not None else "none"
            message = f"Content-Type: expected application/json, found {found}"
            raise error(415, message, **_code(error, "unsupported_media_type"))
        raw = await request.body()
        try:
            if len(raw) > BODY_IN_THREAD:
                return await anyio.to_thread.run_sync(parse_json, raw, limiter=self.work.limiter)
            return parse_json(raw)
        except BadJSON as e:
            raise error(400, str(e)) from None

    async def generation(
        self, request: Request, n: int, fn: Callable, ask, overloaded, *keep_alive
    ):
        """``fn(ask, streams)``'s response, counted in the work in flight (``n`` engine
        requests) until it ends; ``overloaded(message)``: the 503 when the queue is full."""
        try:
            release = self.work.enter(n)
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

    def start(
        self, entry, prompt, ask, chat_template: bool, bad, failed, streams: Streams, sampling=None
    ):
        """The request's results and its first one (None for a stream: its headers and
        keep-alives go out during the prefill, so that clients with idle timeouts wait for a
        long prompt). The results come parsed, as the library's are: a chat reply's reasoning
        split from its answer, its tool calls held back and parsed (``reasoning``, ``text``,
        ``tool_calls``), the stop string that ended it named: the replies only shape them into
        each API's JSON. A prompt that does not fit fails here, before any byte is sent
        (``bad``: a 400 of the API's shape, ``failed``: a 500). The engine's stream goes to
        ``streams``, to be cancelled if the client hangs up."""
        draft, cap = self.draft, self.max_output_tokens
        try:
            if draft is not None and self.checked.get(entry.name) != entry.loads:
                draft.check(entry.model, entry.tokenizer)  # a directory's model, loaded now
                self.checked[entry.name] = entry.loads
            options: dict[str, Any] = dict(
                max_tokens=min(ask.max_tokens, cap or ask.max_tokens),
                sampling=sampling or ask.sampling,
                stop=ask.stop,
                chat_template=chat_template,
                constraint=getattr(ask, "constraint", None),
                tools=ask.tools,
                tool_choice=ask.tool_choice,
                split_reasoning=chat_template,  # a chat reply's thoughts apart from its answer
                chat_template_kwargs=getattr(ask, "template_kwargs", None),
            )
            if sources := (image_sources(prompt) if chat_template else []):
                # Decoded here (a bad image is a 400), run by the engine (server/images.py);
                # a draft does not take images.
                limits = self.app.state.limits  # serve's caps on images (--max-images ...)
                stream = start_with_images(entry, prompt, sources, WAIT_S, options, limits)
            else:
                check_prompt_length(entry.model, prompt, ask.tools)  # before the tokenizer runs
                if chat_template and not isinstance(prompt, str):
                    prompt = fit_messages(entry.tokenizer, prompt, ask.tools, ask.tool_choice)
                stream = entry.engine.start(
                    entry.tokenizer, prompt, timeout=WAIT_S, draft=draft, **options
                )
            streams.add(stream)
            results = _cancelling(stream)
            if getattr(ask, "stream", False):  # headers and keep-alives during the prefill
                return None, results
            return next(results, None), results
        except ImageLimit as e:  # a 413 or 400, naming the cap and its flag
            raise e.shaped(bad(e)) from None
        except (PromptTooLongError, PoolFullError, ValueError, TokenizerError) as e:
            raise bad(e) from None  # TokenizerError: the chat template refused the messages
        except (EngineError, TimeoutError, MlxInferError) as e:
            if not self.stopping:
                raise failed(e) from None
            error = failed(EngineError("the server is shutting down"))
            error.status = 503
            raise error from None


def openai_busy(message: str) -> OpenAIError:
    """OpenAI's 503 when the queue is full (every OpenAI-shaped route's)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    return OpenAIError(503, message, type="server_error", code="overloaded", headers=headers)


def openai_not_found(message: str) -> OpenAIError:
    """OpenAI's 404 for a model this server does not have."""
    return OpenAIError(404, message, param="model", code="model_not_found")


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
    if isinstance(e, OpenAIError):
        e.code = "model_not_supported"
    return e


def _code(error, code: str) -> dict:
    """``code=`` for an OpenAI error (Anthropic's shape has none)."""
    return {"code": code} if error is OpenAIError else {}


def _with_status(e, status: int):
    """An API error of either shape, answered with ``status`` instead."""
    e.status = status
    if isinstance(e, OpenAIError):
        e.type, e.code, e.param = "server_error", "model_not_loadable", None
    return e


def _cancelling(stream) -> Iterator:
    """``stream``'s results; cancels it when closed early (as ``Engine.stream`` does)."""
    try:
        yield from stream
    finally:
        stream.cancel()
