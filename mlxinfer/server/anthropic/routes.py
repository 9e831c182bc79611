"""Anthropic's routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ...batch import EngineError
from ...errors import MediaError, PromptTooLongError, TokenizerError
from ...generation import loop
from ..api_errors import AnthropicError
from ..hangup import Streams
from ..image_parts import for_model
from ..images import ImageLimit, decode_images, image_sources, takes_images
from ..limits import RETRY_AFTER_S, check_prompt_length, in_worker
from ..routes import Routes
from ..templating import fit_messages, prefix_block
from . import objects
from . import request as anthropic_request
from .reply import AnthropicReply
from .request import MessagesRequest

PING = objects.event("ping", {})  # Anthropic's stream keeps alive with its own event


class AnthropicRoutes:
    """Anthropic's endpoints, one method each, on the shared :class:`Routes`."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/messages", self.messages, methods=["POST"])
        app.add_api_route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])

    async def messages(self, request: Request):
        ask = anthropic_request.parse(await self.routes.body(request, AnthropicError))
        return await self.routes.generation(request, 1, self.reply, ask, busy, PING)

    async def count_tokens(self, request: Request):
        body = await self.routes.body(request, AnthropicError)
        ask = anthropic_request.parse(body, count_only=True)
        return await in_worker(request, lambda: self.count(ask))  # never on the event loop

    def reply(self, ask: MessagesRequest, streams: Streams):
        """``/v1/messages``' response (in a worker thread): the message whole, or its events."""
        entry = self.routes.served(ask.model, not_found)
        ask.cache_block = prefix_block(entry.engine)
        first, results = self.routes.start(
            entry,
            for_model(entry, ask.messages),  # a text-only model: tool results' images as notes
            ask,
            True,
            lambda e: AnthropicError(400, str(e)),
            lambda e: AnthropicError(500, str(e)),
            streams,
        )
        reply = AnthropicReply(ask, entry.tokenizer, first, results)
        if ask.stream:
            return reply.events()
        try:
            return JSONResponse(reply.whole())
        except (EngineError, TimeoutError) as e:
            raise AnthropicError(500, str(e)) from None

    def count(self, ask: MessagesRequest) -> dict:
        """The prompt's tokens, templated as generation would template it."""
        entry = self.routes.served(ask.model, not_found)
        messages, images = for_model(entry, ask.messages), None
        try:
            if sources := image_sources(messages):  # as routes.start refuses or decodes them
                images = _images(entry, sources, self.routes.app.state.limits)
            else:
                check_prompt_length(entry.model, messages, ask.tools)
                messages = fit_messages(entry.tokenizer, messages, ask.tools, ask.tool_choice)
            ids = loop.prepare_prompt(
                entry.tokenizer,
                messages,
                chat_template=True,
                tools=ask.tools if ask.tool_choice != "none" else None,  # as generation
                chat_template_kwargs=ask.template_kwargs,
                images=images,
            )
        except ImageLimit as e:
            raise e.shaped(AnthropicError(400, str(e))) from None
        except (PromptTooLongError, TokenizerError, ValueError, MediaError) as e:
            raise AnthropicError(400, str(e)) from None
        return {"input_tokens": len(ids)}


def _images(entry, sources: list, limits):
    """The images of a request to count (within ``limits``, as ``routes.start`` takes them):
    each image's placeholder tokens are counted."""
    from ...generation.images import load_images

    if not takes_images(entry.model):
        raise ValueError(
            f"model '{entry.name}' takes text only (no vision tower): image blocks are refused"
        )
    return load_images(entry.model, entry.tokenizer, decode_images(sources, limits))


def not_found(message: str) -> AnthropicError:
    return AnthropicError(404, f"model: {message}")


def busy(message: str) -> AnthropicError:
    """Anthropic's 503 when the queue is full."""
    return AnthropicError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})
