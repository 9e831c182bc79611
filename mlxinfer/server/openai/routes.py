"""OpenAI's routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (a request with
``n`` choices is ``n`` engine requests) and ``GET /v1/models``."""

from __future__ import annotations

from fastapi import FastAPI, Request

from ...errors import PromptTooLongError
from ..api_errors import OpenAIError
from ..hangup import Streams
from ..image_parts import model_takes_images
from ..routes import Routes, openai_busy, openai_not_found
from . import request as openai_request
from .reply import Choice, openai_events, openai_whole
from .request import CompletionRequest


class OpenAIRoutes:
    """OpenAI's endpoints, one method each, on the shared :class:`Routes`."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])

    def models(self):
        """OpenAI's model list, each with ``input_modalities`` (OpenRouter's name):
        ``["text", "image"]`` for a model that reads images, else ``["text"]``."""
        started = self.routes.app.state.started
        registry = self.routes.registry
        data = []
        for n in registry.names():
            entry = registry.entries.get(n)
            vision = entry is not None and not entry.embedding and model_takes_images(entry)
            data.append(
                {
                    "id": n,
                    "object": "model",
                    "created": started,
                    "owned_by": "mlxinfer",
                    "input_modalities": ["text", "image"] if vision else ["text"],
                }
            )
        return {"object": "list", "data": data}

    async def chat_completions(self, request: Request):
        ask = openai_request.parse(await self.routes.body(request), chat=True)
        return await self.routes.generation(request, ask.n, self.complete, ask, openai_busy)

    async def completions(self, request: Request):
        ask = openai_request.parse(await self.routes.body(request), chat=False)
        return await self.routes.generation(request, ask.n, self.complete, ask, openai_busy)

    def complete(self, ask: CompletionRequest, streams: Streams):
        """Either endpoint's response (in a worker thread): its ``n`` choices started, then
        the whole JSON or its stream of events."""
        entry = self.routes.served(ask.model, openai_not_found)
        choices: list[Choice] = []
        try:
            for i in range(ask.n):
                sampling = openai_request.choice_sampling(ask.sampling, i)
                first, results = self.routes.start(
                    entry, ask.prompt, ask, ask.chat, bad, failed, streams, sampling
                )
                choices.append(Choice(i, first, results))
        except BaseException:
            for c in choices:
                c.close()
            raise
        if ask.stream:
            return openai_events(ask, entry.tokenizer, choices)
        return openai_whole(ask, entry.tokenizer, choices)


def bad(e: Exception) -> OpenAIError:
    """The 400 for a request the engine refused (a prompt too long names its code)."""
    code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else None
    return OpenAIError(400, str(e), code=code)


def failed(e: Exception) -> OpenAIError:
    return OpenAIError(500, str(e), type="server_error")
