"""The Responses API's route, ``POST /v1/responses``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..hangup import Streams
from ..image_parts import for_model
from ..openai.routes import bad, failed
from ..routes import Routes, openai_busy, openai_not_found
from . import request as responses_request
from .reply import Reply
from .request import ResponsesRequest


class ResponsesRoutes:
    """The Responses API's endpoint on the shared :class:`Routes`."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])

    async def responses(self, request: Request):
        ask = responses_request.parse(await self.routes.body(request))
        return await self.routes.generation(request, 1, self.respond, ask, openai_busy)

    def respond(self, ask: ResponsesRequest, streams: Streams):
        """The response (in a worker thread): the object whole, or its events."""
        entry = self.routes.served(ask.model, openai_not_found)
        messages = for_model(entry, ask.messages)  # a text-only model: tool images as notes
        first, results = self.routes.start(entry, messages, ask, True, bad, failed, streams)
        reply = Reply(ask, entry.tokenizer, first, results)
        return reply.events() if ask.stream else JSONResponse(reply.whole())
