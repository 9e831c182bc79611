"""What a request may be before the server spends anything on it, and how much work it may wait for.

:class:`Guard` is an ASGI middleware in front of every route. In this order it refuses, each in
the API's own JSON error shape (``shapes``):

- more than ``max_headers`` headers, or more than ``max_header_bytes`` of them: 431 (uvicorn's
  own parser is given a larger hard cap, ``h11_limit``, past which it drops the connection);
- a ``Host`` that is not this machine's, when the request came in on a loopback address (or
  one not in ``allowed_hosts``, when that is given): 403. A web page the user visits can point a
  name it controls at 127.0.0.1 (DNS rebinding, CVE-2024-28224); its requests then carry that
  name as their ``Host``, which this refuses;
- a body over ``max_body`` bytes: 413, from ``Content-Length`` before a byte is read, or
  counted as a chunked body arrives;
- a body not all sent within ``body_timeout`` seconds: 408.

The body is read here, whole, and handed on to the route. The routes then check what the body
says: JSON only with a JSON ``Content-Type`` (415), JSON without NaN, Infinity or deep nesting
(:func:`parse_json`), a prompt not far longer than the context could hold, counted in characters
before any tokenizer runs (:func:`check_prompt_length`).

:class:`Work` is the generation work in flight: a thread limiter of its own (so that streams
waiting for tokens never hold the threads other routes need; ``/health`` and ``/metrics`` need
none) and the waiting-queue cap (``max_queue``: a request arriving while that many are already
waiting for a place in the batch is a 503 with ``Retry-After``).
"""

from __future__ import annotations

import ipaddress
import json
import math
from dataclasses import dataclass
from typing import Any, Callable

import anyio

from ..errors import PromptTooLongError
from ..vision.media import MediaLimits
from .quoting import shown
from .shapes import error_response

MAX_DEPTH = 64  # JSON nesting: tool schemas go a few levels deep, nothing needs 64
CHARS_PER_TOKEN = 16  # a generous bound: tokenizers average 3-5 characters a token on text
PROMPT_SLACK_CHARS = 1 << 16  # on top, for short contexts and template-heavy prompts
RETRY_AFTER_S = 2  # a full queue drains by several requests a second on any machine
LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True)
class Limits:
    """The server's limits (``make_app``'s and ``mlxinfer serve``'s options of these names).

    ``allowed_hosts``: the ``Host`` names (a port is ignored) the server answers besides
    ``localhost`` and loopback addresses; ``"*"`` any, ``"*.example.com"`` its subdomains. None
    (the default): any host, except on a connection to a loopback address, where only this
    machine's names (``serve`` passes ``["*"]`` when bound to a non-loopback address)."""

    max_body: int = 32 << 20  # agent clients send 40-80 KB today
    max_header_bytes: int = 64 << 10  # room for a long ``anthropic-beta`` list
    max_headers: int = 100
    body_timeout: float = 30.0
    max_queue: int = 256  # an 80-client soak queues rather than being refused
    allowed_hosts: tuple[str, ...] | None = None
    shutdown_timeout: float = 5.0  # seconds a SIGTERM waits for responses to end
    # Images (server/images.py): per request, and each image's encoded bytes and pixels; the
    # last two are the library's own caps (vision.MediaLimits) unless set.
    max_images: int = 8
    max_image_bytes: int = MediaLimits.max_bytes
    max_image_pixels: int = MediaLimits.max_pixels
    allow_remote_images: bool = False  # http(s) image URLs fetched (under the caps, 10 s)

    def __post_init__(self) -> None:
        for name in (
            "max_body",
            "max_header_bytes",
            "max_headers",
            "max_queue",
            "max_images",
            "max_image_bytes",
            "max_image_pixels",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an integer >= 0, found {value!r}")
        for name in ("body_timeout", "shutdown_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(f"{name}: expected a number of seconds > 0, found {value!r}")
        if self.allowed_hosts is not None:
            hosts = tuple(h.strip().lower() for h in self.allowed_hosts if h.strip())
            object.__setattr__(self, "allowed_hosts", hosts)

    @property
    def media(self) -> MediaLimits:
        """The caps each image of a request must fit, naming ``serve``'s flags in errors."""
        return MediaLimits(
            max_bytes=self.max_image_bytes,
            max_pixels=self.max_image_pixels,
            cap_name="serve --max-image-{}",
        )

    @property
    def h11_limit(self) -> int:
        """uvicorn's cap on a request's head (request line and headers), past which it closes
        the connection with a plain 400: above ours, so that ours answers 431 first."""
        return 2 * self.max_header_bytes + (16 << 10)


class Guard:
    """The ASGI middleware that enforces :class:`Limits` (see the module's docstring)."""

    def __init__(self, app, limits: Limits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limits = self.limits
        headers = scope.get("headers", [])
        size = sum(len(k) + len(v) + 4 for k, v in headers)  # "name: value\r\n"
        if len(headers) > limits.max_headers or size > limits.max_header_bytes:
            message = (
                f"request headers: {len(headers)} headers, {size} bytes "
                f"(at most {limits.max_headers} headers, {limits.max_header_bytes} bytes)"
            )
            return await _refuse(scope, receive, send, 431, message, "headers_too_large")
        host = _header(headers, b"host")
        if not host_allowed(host, scope.get("server"), limits.allowed_hosts):
            message = (
                f"Host {shown(host)} is not served here (mlxinfer serve --allowed-hosts names more)"
            )
            return await _refuse(scope, receive, send, 403, message, "host_not_allowed")
        length = _header(headers, b"content-length")
        chunked = _header(headers, b"transfer-encoding") is not None
        if length is None and not chunked:
            return await self.app(scope, receive, send)
        if length is not None and not chunked:
            if not (length.isascii() and length.isdigit()):
                message = f"Content-Length: expected a number of bytes, found {shown(length)}"
                return await _refuse(scope, receive, send, 400, message, "invalid_request")
            if int(length) > limits.max_body:
                message = f"request body: {int(length)} bytes (at most {limits.max_body})"
                return await _refuse(scope, receive, send, 413, message, "request_too_large")
        body = await _read_body(receive, limits)
        if isinstance(body, tuple):
            status, message, code = body
            return await _refuse(scope, receive, send, status, message, code)
        if body is None:  # the client went away
            return
        given = False

        async def replay():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, when it comes

        await self.app(scope, replay, send)


async def _read_body(receive, limits: Limits) -> bytes | tuple | None:
    """The whole body; (status, message, code) when it is too long or too slow; None when the
    client hung up."""
    chunks, size = [], 0
    with anyio.move_on_after(limits.body_timeout):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limits.max_body:
                return 413, f"request body: over {limits.max_body} bytes", "request_too_large"
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    return (  # the deadline passed
        408,
        f"request body: {size} bytes came in {limits.body_timeout:g} s, not all of it",
        "request_timeout",
    )


async def _refuse(scope, receive, send, status: int, message: str, code: str) -> None:
    # The connection is closed after the answer: the rest of the request is never read.
    headers = {"Connection": "close"}
    await error_response(scope.get("path", ""), status, message, code, headers)(
        scope, receive, send
    )


def _header(headers, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def host_name(host: str) -> str:
    """``Host``'s name: lowercased, its port and an IPv6 address's brackets removed."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    if host.count(":") > 1:  # a bare IPv6 address
        return host
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host


def is_loopback(name: str) -> bool:
    """Whether a name or address (no port) is this machine's loopback: ``localhost`` (and its
    subdomains, which browsers resolve to loopback themselves), 127.0.0.0/8, ``::1``."""
    name = name.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def host_allowed(host: str | None, server, allowed: tuple[str, ...] | None) -> bool:
    """Whether a request with this ``Host``, received on ``server`` (the ASGI scope's
    ``(address, port)`` it came in on), may be answered."""
    if allowed is None:
        local = server[0] if server else None
        if not (isinstance(local, str) and is_loopback(local)):
            return True  # a LAN address, a Unix socket, a test client: any host
        allowed = ()
    if "*" in allowed or host is None:  # no Host: HTTP/1.0, never a browser
        return True
    name = host_name(host)
    if is_loopback(name):
        return True
    return any(
        name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:]))
        for pattern in allowed
    )


# --- the body --------------------------------------------------------------------------------


def is_json_type(content_type: str | None) -> bool:
    """``application/json`` (with parameters, any case) or a ``+json`` type."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class BadJSON(ValueError):
    pass


def _constant(name: str):
    raise BadJSON(f"the request body: {name} is not a JSON number (expected a finite number)")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise BadJSON(
            f"the request body: the number {text[:40]} is out of range (expected a finite number)"
        )
    return value


def parse_json(raw: bytes) -> Any:
    """The body's JSON; BadJSON (one line) for invalid JSON or UTF-8, NaN, Infinity, numbers out
    of float range, or nesting deeper than ``MAX_DEPTH``."""
    try:
        text = raw.decode("utf-8")  # RFC 8259: JSON between systems is UTF-8, nothing else
    except UnicodeDecodeError as e:
        raise BadJSON(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_constant, parse_float=_finite)
    except BadJSON:
        raise
    except RecursionError:
        raise BadJSON(
            f"the request body: JSON nested too deeply (at most {MAX_DEPTH} levels)"
        ) from None
    except ValueError as e:
        detail = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise BadJSON(f"the request body is not valid JSON ({detail})") from None
    if _depth(value) > MAX_DEPTH:
        raise BadJSON(f"the request body: JSON nested too deeply (at most {MAX_DEPTH} levels)")
    return value


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return deepest


def prompt_chars(*parts: Any) -> int:
    """Characters in every string (keys too) of the prompt's parts: messages, tools."""
    total, stack = 0, list(parts)
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def check_prompt_length(model, *parts: Any) -> None:
    """PromptTooLongError when the prompt (messages or text, tools) has far more characters than
    the model's context could hold as tokens: refused before the tokenizer spends minutes on it."""
    context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    if not isinstance(context, int) or context <= 0:
        return
    bound = context * CHARS_PER_TOKEN + PROMPT_SLACK_CHARS
    chars = prompt_chars(*parts)
    if chars > bound:
        raise PromptTooLongError(
            f"prompt: {chars} characters, more than the model's context of {context} tokens "
            f"could hold (at most {bound} characters at {CHARS_PER_TOKEN} a token)"
        )


# --- the work in flight --------------------------------------------------------------------------


class Overloaded(Exception):
    """The waiting queue is full."""


class Work:
    """The generation requests in flight (counted in engine requests: an OpenAI request with
    ``n`` choices is ``n``) and the threads they run on. All counting happens on the event
    loop's thread."""

    THREADS_PAST_QUEUE = 512  # room for the requests running in every engine, and their reads

    def __init__(self, max_queue: int, running: Callable[[], int]) -> None:
        self.max_queue, self._running = max_queue, running
        self.in_flight = 0
        self.refused = 0  # 503s: the queue was full
        self._limiter: anyio.CapacityLimiter | None = None

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        if self._limiter is None:  # made on the event loop, at first use
            self._limiter = anyio.CapacityLimiter(self.max_queue + self.THREADS_PAST_QUEUE)
        return self._limiter

    @property
    def waiting(self) -> int:
        return max(0, self.in_flight - self._running())

    def enter(self, n: int = 1) -> Callable[[], None]:
        """Count ``n`` requests in; Overloaded when ``max_queue`` already wait. Returns the
        release (idempotent)."""
        waiting = self.waiting
        if waiting >= self.max_queue:
            self.refused += 1
            raise Overloaded(
                f"the server is busy: {waiting} requests are waiting for a place in the batch "
                f"(at most {self.max_queue}: mlxinfer serve --max-queue); retry after "
                f"{RETRY_AFTER_S} s"
            )
        self.in_flight += n
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= n

        return release


async def in_worker(request, fn: Callable, *args) -> Any:
    """``fn(*args)`` in a worker thread of the app's generation work (the default pool when the
    app has none)."""
    work = getattr(request.app.state, "work", None)
    limiter = work.limiter if work is not None else None
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)
