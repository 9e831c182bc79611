"""Ollama's API: what a ``/api/chat``, ``/api/generate``, ``/api/embed`` or ``/api/show`` body
asks for, checked (the JSON sent back is :mod:`.objects`).

Fields follow the server's rule (``fields``, docs/server.md "Fields"), in the body and in its
``options`` (checked in :mod:`.options`): those acted on are checked (a malformed value is a 400
naming it); those with no local meaning and unknown ones are accepted, ignored and logged once;
those that would change the output and cannot be honoured (``REFUSED``) are a 400 unless their
value asks for nothing.
The official client sends ``"tools": []`` on every plain chat (no tools, here); its messages
become the chat template's turns in :mod:`.messages`.
Errors take Ollama's shape (:class:`~mlxinfer.server.api_errors.OllamaError`).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from ...generation.sampling import SamplingParams
from ..api_errors import OllamaError
from ..fields import Fields
from ..quoting import named, shown
from .messages import kind, turns, with_images
from .options import parse_options

USED_CHAT = {"model", "messages", "tools", "stream", "format", "options", "keep_alive", "think"}
USED_CHAT |= {"logprobs", "top_logprobs"}
USED_GENERATE = {"model", "prompt", "system", "raw", "images", "stream", "format", "options"}
USED_GENERATE |= {"keep_alive", "think", "logprobs", "top_logprobs"}
REFUSED = {
    "suffix": "not supported (no insertion)",
    "template": "not supported: the model's own chat template is used (serve --chat-template)",
    "context": "not supported (deprecated by Ollama): send the conversation to /api/chat",
    "width": "not supported (no image generation)",
    "height": "not supported (no image generation)",
    "steps": "not supported (no image generation)",
}
CHAT = Fields.of("/api/chat", USED_CHAT, (), REFUSED)
GENERATE = Fields.of("/api/generate", USED_GENERATE, (), REFUSED)
EMBED = Fields.of(
    "/api/embed",
    {"model", "input", "truncate", "dimensions", "prompt"},
    {"options", "keep_alive"},
)
MAX_TOP_LOGPROBS = 20  # as Ollama's and OpenAI's
THINK_LEVELS = ("low", "medium", "high")  # gpt-oss's reasoning_effort
FOREVER = math.inf
MAX_KEEP_ALIVE = 100 * 365 * 86400.0  # seconds; longer is for ever (and stays a datetime)
# Go's time.ParseDuration units, as Ollama reads keep_alive strings ("5m", "1h30m", "-1s")
DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


@dataclass
class OllamaRequest:
    """A checked ``/api/chat`` or ``/api/generate`` body: what ``Routes.start`` reads (the
    prompt, ``max_tokens``, ``sampling``, ``stop``, ``stream``, ``constraint``, ``tools``,
    ``tool_choice``, ``template_kwargs``) and Ollama's own (``num_ctx``, ``think``,
    ``keep_alive``)."""

    model: str
    chat: bool  # /api/chat (a ``message`` per chunk) or /api/generate (a ``response``)
    prompt: Any  # messages for the chat template, or the raw text (generate's ``raw``)
    templated: bool  # whether the prompt goes through the chat template
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = True  # Ollama streams unless told not to
    num_ctx: int | None = None  # the prompt and the reply within this many tokens
    constraint: Any = None  # ``format``: a Constraint, or None
    tools: list[dict] | None = None  # OpenAI's shape, for the chat template
    tool_choice: Any = None
    template_kwargs: dict = field(default_factory=dict)
    think: bool | str | None = None
    logprobs: bool = False  # each token's log-prob, and its ``top_logprobs`` alternatives
    top_logprobs: int = 0
    keep_alive: float | None = None  # seconds; FOREVER for a negative one; None: the server's
    started: float = field(default_factory=time.perf_counter)  # for total_duration
    created: float = field(default_factory=time.time)  # created_at

    @property
    def empty(self) -> bool:
        """No prompt at all: a request to load the model (or with ``keep_alive`` 0 to unload
        it), as Ollama's clients preload and stop models."""
        return not self.prompt


def parse_chat(body: Any) -> OllamaRequest:
    """Check an ``/api/chat`` body; OllamaError (400) naming the first bad field."""
    body = _object(body)
    _screen(CHAT, body)
    messages = body.get("messages")
    if messages is None:
        messages = []
    ask = _common(body, chat=True, prompt=_messages(messages), templated=True)
    tools = body.get("tools")
    if tools:  # the official client sends [] on every plain chat
        from ...output.toolcalls import check_tools

        try:
            ask.tools, ask.tool_choice = check_tools(tools), "auto"
        except ValueError as e:
            raise OllamaError(400, str(e)) from None
    elif tools is not None and tools != []:
        raise OllamaError(400, f"tools: expected a list of tools, found {shown(tools)}")
    return ask


def parse_generate(body: Any) -> OllamaRequest:
    """Check an ``/api/generate`` body: without ``raw`` its ``prompt`` is one user turn (after
    its ``system``, if any) through the chat template; with ``raw`` the text as it is."""
    body = _object(body)
    _screen(GENERATE, body)
    prompt = _typed(body, "prompt", str, "")
    system = _typed(body, "system", str, "")
    raw = _typed(body, "raw", bool, False)
    content = _with_images(prompt, body.get("images"), "images")
    if raw:
        if system:
            raise OllamaError(400, "system: not used with raw (the prompt is sent as it is)")
        if content is not prompt:
            raise OllamaError(400, "images: not used with raw (images need the chat template)")
        return _common(body, chat=False, prompt=prompt, templated=False)
    turns = [{"role": "system", "content": system}] if system else []
    turns = turns + [{"role": "user", "content": content}] if content else []
    return _common(body, chat=False, prompt=turns, templated=True)


def parse_model(body: Any, *names: str) -> str:
    """The model a body names (``/api/show``, ``/api/delete``: ``model``, or the older
    ``name``)."""
    body = _object(body)
    for name in names or ("model", "name"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise OllamaError(400, f"{name}: expected a model name, found {shown(value)}")
            return value
    raise OllamaError(400, f"{names[0] if names else 'model'}: required")


@dataclass
class EmbedRequest:
    model: str
    inputs: list[str]
    truncate: bool = True  # Ollama's default: an input past the context is cut to it
    dimensions: int | None = None
    started: float = field(default_factory=time.perf_counter)


def parse_embed(body: Any, *, legacy: bool = False) -> EmbedRequest:
    """An ``/api/embed`` body (``input``: a string or a list of strings), or with ``legacy``
    an ``/api/embeddings`` one (``prompt``: one string)."""
    body = _object(body)
    EMBED.screen(body)
    model = parse_model(body, "model")
    if legacy:
        prompt = _typed(body, "prompt", str, None)
        if prompt is None:
            raise OllamaError(400, "prompt: required (a string to embed)")
        return EmbedRequest(model, [prompt])
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not (isinstance(inputs, list) and inputs and all(isinstance(s, str) for s in inputs)):
        raise OllamaError(
            400, f"input: expected a string or a non-empty list of strings, found {shown(inputs)}"
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions <= 0
    ):
        raise OllamaError(
            400, f"dimensions: expected a positive integer, found {shown(dimensions)}"
        )
    return EmbedRequest(model, inputs, _typed(body, "truncate", bool, True), dimensions)


def parse_keep_alive(value: Any) -> float | None:
    """``keep_alive`` in seconds: a number of seconds, or a Go duration ("5m", "1h30m", "0",
    "-1"); a negative one keeps the model loaded (FOREVER); None when not given."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = (
            float(value) if not abs(value) >= 1e300 else (math.inf if value > 0 else -math.inf)
        )
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        try:
            seconds = float(text)  # a bare number: seconds
        except ValueError:
            parts = DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise OllamaError(
                    400,
                    f"keep_alive: expected seconds or a duration such as '5m' or '1h30m', "
                    f"found {shown(value)}",
                ) from None
            seconds = sum(float(n) * DURATION_UNITS[u] for n, u in parts)
        seconds *= sign
    else:
        raise OllamaError(400, f"keep_alive: expected seconds or a duration, found {shown(value)}")
    if math.isnan(seconds):
        raise OllamaError(400, f"keep_alive: expected seconds or a duration, found {shown(value)}")
    return FOREVER if seconds < 0 or seconds > MAX_KEEP_ALIVE else seconds


# --- the parts ---------------------------------------------------------------------------------


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise OllamaError(400, f"the request body must be a JSON object, found {kind(body)}")
    return body


def _screen(fields: Fields, body: dict) -> None:
    refusal = fields.screen(body)
    if refusal is not None:
        raise OllamaError(400, refusal.message)


def _common(body: dict, *, chat: bool, prompt: Any, templated: bool) -> OllamaRequest:
    """What chat and generate share: the model, stream, options, format, think, keep_alive."""
    model = parse_model(body, "model")
    options = parse_options(body.get("options"))
    ask = OllamaRequest(
        model,
        chat,
        prompt,
        templated,
        options.max_tokens,
        options.sampling,
        options.stop,
        stream=_typed(body, "stream", bool, True),
        num_ctx=options.num_ctx,
        constraint=_format(body.get("format")),
        keep_alive=parse_keep_alive(body.get("keep_alive")),
    )
    ask.logprobs = _typed(body, "logprobs", bool, False)
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise OllamaError(
                400,
                f"top_logprobs: expected an integer in 0..{MAX_TOP_LOGPROBS}, found {shown(top)}",
            )
        ask.top_logprobs = top
        ask.logprobs = ask.logprobs or top > 0  # alternatives are asked for with their tokens'
    think = body.get("think")
    if think is not None:
        if not isinstance(think, bool) and think not in THINK_LEVELS:
            raise OllamaError(
                400, f"think: expected true, false, 'low', 'medium' or 'high', found {shown(think)}"
            )
        ask.think = think
        ask.template_kwargs = {"enable_thinking": think is not False}  # Qwen3's, SmolLM3's ...
        if isinstance(think, str):
            ask.template_kwargs["reasoning_effort"] = think  # gpt-oss's
    return ask


def _format(spec: Any):
    """``format``: "json" (any JSON value: Ollama's JSON mode; an object here, as OpenAI's
    json_object) or a JSON Schema, as a Constraint; "" or null: none."""
    if spec is None or spec == "":
        return None
    from ...errors import ConstraintError
    from ...output.constraints import Constraint

    try:
        if spec == "json":
            return Constraint.json_object()
        if isinstance(spec, dict):
            return Constraint.json_schema(spec)
    except ConstraintError as e:
        raise OllamaError(400, f"format: {e}") from None
    raise OllamaError(400, f"format: expected 'json' or a JSON Schema object, found {shown(spec)}")


def _with_images(prompt: str, images: Any, where: str) -> str | list[dict]:
    try:
        return with_images(prompt, images, where)
    except ValueError as e:
        raise OllamaError(400, str(e)) from None


def _messages(messages: Any) -> list[dict]:
    try:
        return turns(messages)
    except ValueError as e:
        raise OllamaError(400, str(e)) from None


def _typed(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise OllamaError(400, f"{named(name)}: expected {_KINDS[kind]}, found {kind(value)}")
    return value


_KINDS = {str: "a string", bool: "true or false", int: "an integer", list: "a list"}
