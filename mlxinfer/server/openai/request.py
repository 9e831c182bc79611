"""The OpenAI API's requests: what a body asks for, checked (the JSON sent back is
:mod:`.objects`).

Only what is parsed here reaches the engine. Fields follow the server's rule (``fields``,
docs/server.md "Fields"): those acted on are checked (a malformed value is a 400 naming it);
those with no local meaning (``IGNORED``) and unknown ones are accepted, ignored and logged
once; those that would change the output and that the server cannot honour (``REFUSED``) are
a 400 naming them unless their value asks for nothing.
Errors take OpenAI's shape (:class:`~mlxinfer.server.api_errors.OpenAIError`); the chat
``messages`` are checked in :mod:`.messages`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from ...generation.sampling import SamplingParams
from ..api_errors import OpenAIError
from ..fields import Fields
from ..numbers import as_float, outside
from ..quoting import shown
from .messages import chat_messages

# Fields accepted and acted on, per endpoint; ``IGNORED`` are accepted and change nothing.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed")
CHAT_FIELDS = {
    "reasoning_effort",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
    "response_format",
    "logprobs",
    "top_logprobs",
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stream",
    "stream_options",
    "n",
    *SAMPLING,
}
COMPLETION_FIELDS = {
    "response_format",
    "logprobs",  # the legacy shape: an int, how many alternatives per token (0..5)
    "model",
    "prompt",
    "max_tokens",
    "stop",
    "stream",
    "stream_options",
    "n",
    *SAMPLING,
}
# Known, with no local meaning: accepted and ignored (docs/server.md lists them).
IGNORED = {
    "user",  # an end-user id for abuse monitoring
    "safety_identifier",
    "store",  # keep the completion for OpenAI's dashboards
    "metadata",
    "service_tier",
    "prompt_cache_key",  # the prefix cache needs no key
    "prompt_cache_retention",
    "parallel_tool_calls",  # several calls are parsed either way
    "prediction",  # a predicted output: only a speed hint
    "verbosity",  # a hint only gpt-5's own models are trained on
}
# Known, would change the output, not implemented: a 400 unless the value asks for nothing.
REFUSED = {
    "logit_bias": "not supported (token biases are not implemented)",
    "frequency_penalty": "not supported (only 0)",
    "presence_penalty": "not supported (only 0)",
    "audio": "not supported (text output only)",
    "modalities": "only ['text'] is supported",
    "functions": "not supported: use 'tools'",
    "function_call": "not supported: use 'tool_choice'",
    "web_search_options": "not supported (no web search here)",
    "suffix": "not supported (no insertion)",
    "echo": "not supported",
    "best_of": "not supported (only 1)",
}
ALLOWED = {"modalities": (["text"],), "best_of": (1,)}  # values that ask for nothing more
CHAT = Fields.of("/v1/chat/completions", CHAT_FIELDS, IGNORED, REFUSED, ALLOWED)
COMPLETION = Fields.of("/v1/completions", COMPLETION_FIELDS, IGNORED, REFUSED, ALLOWED)
DEFAULT_MAX_TOKENS = 512
MAX_N = 16  # choices per request: each is a request in the engine
MAX_INT = 2**31 - 1  # max_tokens, top_k: past any context or vocabulary
MAX_SEED = 2**63 - 1  # MLX takes seeds below 2**64; choice i samples with seed + i


@dataclass
class CompletionRequest:
    """One request, checked: the prompt (chat messages or text), how much to generate, how."""

    model: str
    prompt: Any  # list of chat messages, or a str
    chat: bool
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # each token's log-prob, and its ``top_logprobs`` alternatives
    top_logprobs: int = 0
    n: int = 1  # choices
    constraint: Any = None  # a Constraint from ``response_format``, or None
    tools: list[dict] | None = None  # checked, OpenAI's shape
    tool_choice: Any = None
    # more chat-template variables: ``chat_template_kwargs`` (vLLM's and llama.cpp's field),
    # OpenAI's ``reasoning_effort`` (gpt-oss's template reads it), Anthropic's ``thinking``
    template_kwargs: dict = field(default_factory=dict)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


def parse(body: Any, *, chat: bool) -> CompletionRequest:
    """Check a /v1/chat/completions (``chat``) or /v1/completions body; OpenAIError (400) naming
    the first bad field."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    refusal = (CHAT if chat else COMPLETION).screen(body)
    if refusal is not None:
        raise OpenAIError(400, refusal.message, param=refusal.field, code="unsupported_parameter")
    model = _typed(body, "model", str, required=True)
    if chat:
        prompt = chat_messages(body.get("messages"))
    else:
        prompt = _typed(body, "prompt", str, required=True)
    n = _typed(body, "n", int, default=1)
    if not 1 <= n <= MAX_N:
        raise OpenAIError(400, f"'n' must be in 1..{MAX_N}, got {shown(n)}", param="n")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _typed(body, name, int, default=DEFAULT_MAX_TOKENS)
    if not 1 <= max_tokens <= MAX_INT:
        raise OpenAIError(
            400, f"'{name}' must be in 1..{MAX_INT}, got {shown(max_tokens)}", param=name
        )
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4):
        raise OpenAIError(
            400, "'stop' must be a string or a list of at most 4 strings", param="stop"
        )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):  # its other keys (include_obfuscation ...) are ignored
        raise OpenAIError(400, "'stream_options' must be an object", param="stream_options")
    if not isinstance(options.get("include_usage", False), bool):
        raise OpenAIError(
            400, "'stream_options.include_usage' must be bool", param="stream_options"
        )
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, above=True),
        top_k=_integer(body, "top_k", 0, 0, MAX_INT),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0, below=True),
        seed=_integer(body, "seed", None, 0, MAX_SEED),
    )
    try:
        sampling.check()
    except ValueError as e:
        raise OpenAIError(400, str(e)) from None
    ask = CompletionRequest(
        model,
        prompt,
        chat,
        max_tokens,
        sampling,
        [s for s in stop if s],
        stream=bool(_typed(body, "stream", bool, default=False)),
        include_usage=bool(options.get("include_usage", False)),
        n=n,
    )
    if chat:
        ask.logprobs = bool(_typed(body, "logprobs", bool, default=False))
        ask.top_logprobs = _typed(body, "top_logprobs", int, default=0)
        if not 0 <= ask.top_logprobs <= MAX_TOP_LOGPROBS:
            raise OpenAIError(
                400,
                f"'top_logprobs' must be in 0..{MAX_TOP_LOGPROBS}, got {shown(ask.top_logprobs)}",
                param="top_logprobs",
            )
        if ask.top_logprobs and not ask.logprobs:
            raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if chat and body.get("tools") is not None:
        ask.tools, ask.tool_choice = _tools(body)
    if chat:
        ask.template_kwargs = _template_kwargs(body)
    if body.get("response_format") is not None:
        from ...errors import ConstraintError
        from ...output.constraints import Constraint

        try:
            ask.constraint = Constraint.from_response_format(body["response_format"])
        except ConstraintError as e:
            raise OpenAIError(400, str(e), param="response_format") from None
    if not chat:
        ask.id = ask.id.replace("chatcmpl-", "cmpl-")
        top = _typed(body, "logprobs", int, default=None)
        if top is not None:
            if not 0 <= top <= MAX_LEGACY_LOGPROBS:
                raise OpenAIError(
                    400,
                    f"'logprobs' must be in 0..{MAX_LEGACY_LOGPROBS}, got {shown(top)}",
                    param="logprobs",
                )
            ask.logprobs, ask.top_logprobs = True, top
    return ask


def _template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise OpenAIError(
            400,
            "'chat_template_kwargs' must be an object of template variables",
            param="chat_template_kwargs",
        )
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("minimal", "low", "medium", "high"):
            raise OpenAIError(
                400,
                "'reasoning_effort' must be one of minimal, low, medium, high, got "
                f"{shown(effort)}",
                param="reasoning_effort",
            )
        kwargs = {"reasoning_effort": effort, **kwargs}
    return dict(kwargs)


MAX_TOP_LOGPROBS = 20
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' limit, as OpenAI's


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: with a seed, its own (seed + index), so that the choices
    differ yet the response is reproducible."""
    if sampling.seed is None or index == 0:
        return sampling
    return replace(sampling, seed=sampling.seed + index)


def _typed(body: dict, name: str, kind: type, *, default: Any = None, required: bool = False):
    if name not in body or body[name] is None:
        if required:
            raise OpenAIError(400, f"'{name}' is required", param=name)
        return default
    value = body[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise OpenAIError(
            400, f"'{name}' must be {kind.__name__}, got {type(value).__name__}", param=name
        )
    return value


def _number(
    body: dict,
    name: str,
    default: float,
    lo: float,
    hi: float,
    *,
    above: bool = False,
    below: bool = False,
) -> float:
    """A finite number in [lo, hi] (``above``: > lo; ``below``: < hi), or ``default``."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OpenAIError(400, f"'{name}' must be a number, got {type(value).__name__}", param=name)
    if isinstance(value, int):  # an int past float range is out of any range here
        value = as_float(value)
    span = outside(value, lo, hi, above=above, below=below)
    if span is not None:
        raise OpenAIError(400, f"'{name}' must be in {span}, got {value:g}", param=name)
    return value


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = _typed(body, name, int, default=default)
    if value is not None and not lo <= value <= hi:
        raise OpenAIError(400, f"'{name}' must be in {lo}..{hi}, got {shown(value)}", param=name)
    return value


def _tools(body: dict) -> tuple[list[dict], Any]:
    from ...output.toolcalls import check_tools

    try:
        tools = check_tools(body["tools"])
    except ValueError as e:
        raise OpenAIError(400, str(e), param="tools") from None
    choice = body.get("tool_choice", "auto")
    names = [t["function"]["name"] for t in tools]
    named = isinstance(choice, dict) and isinstance(choice.get("function"), dict)
    if named and choice["function"].get("name") not in names:
        raise OpenAIError(
            400,
            f"'tool_choice': function {shown(choice['function'].get('name'))} is not among the "
            "tools "
            f"({', '.join(names)})",
            param="tool_choice",
        )
    if not named and choice not in ("none", "auto", "required"):
        raise OpenAIError(
            400,
            "'tool_choice' must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    return tools, choice
