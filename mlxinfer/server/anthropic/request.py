"""Anthropic's Messages API: what a /v1/messages body asks for, checked (the JSON sent back is
:mod:`.objects`).

Fields follow the server's rule (``fields``, docs/server.md "Fields"): those acted on are
checked (a malformed value is a 400 naming it); those with no local meaning (``IGNORED``) and
unknown ones are accepted, ignored and logged once. ``anthropic-beta`` header values are
accepted and ignored. ``system`` and ``messages`` become the chat template's turns in
:mod:`.messages`.
Errors take Anthropic's shape (:class:`~mlxinfer.server.api_errors.AnthropicError`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from ...generation.sampling import SamplingParams
from ..api_errors import AnthropicError
from ..fields import Fields, log_once
from ..numbers import as_float, outside
from ..quoting import shown
from .messages import system_messages, turns

USED = {
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",  # effort: the template's reasoning_effort; format: a JSON Schema
    "output_format",  # the structured-outputs beta's earlier place for the format
}
COUNT_USED = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"}
# Known, with no local meaning: accepted and ignored (docs/server.md lists them).
IGNORED = {
    "metadata",  # user_id for abuse monitoring
    "context_management",  # server-side clearing of old tool results and thinking
    "cache_control",  # automatic prompt caching: the prefix cache is always on
    "service_tier",
    "container",  # code-execution containers
    "mcp_servers",  # remote MCP servers the API would call
    "inference_geo",
}
FIELDS = Fields.of("/v1/messages", USED, IGNORED)
COUNT_FIELDS = Fields.of("/v1/messages/count_tokens", COUNT_USED, IGNORED | USED - COUNT_USED)
# output_config.effort -> the templates' reasoning_effort (gpt-oss's: low, medium, high)
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
MAX_INT = 2**31 - 1  # max_tokens, top_k: past any context or vocabulary


@dataclass
class MessagesRequest:
    model: str
    messages: list[dict]  # system first, if any: ready for the chat template
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex[:24]}")
    tools: list[dict] | None = None  # in OpenAI's shape, for the chat template
    tool_choice: Any = None  # in OpenAI's terms
    # ``thinking`` as ``enable_thinking``, ``output_config.effort`` as ``reasoning_effort``
    template_kwargs: dict = field(default_factory=dict)
    constraint: Any = None  # a Constraint from ``output_config.format``, or None
    cache_block: int = 0  # the engine's prefix-cache block (0: it caches no prefix): usage


def parse(body: Any, *, count_only: bool = False) -> MessagesRequest:
    """Check a /v1/messages (or /v1/messages/count_tokens) body; AnthropicError (400) naming the
    first bad field."""
    if not isinstance(body, dict):
        raise AnthropicError(400, "the request body must be a JSON object")
    (COUNT_FIELDS if count_only else FIELDS).screen(body)
    model = body.get("model")
    if not isinstance(model, str):
        raise AnthropicError(400, "model: a string is required")
    messages = system_messages(body.get("system")) + turns(body.get("messages"))
    tools, choice = _tools(body)
    kwargs = {**_thinking(body.get("thinking")), **_effort(body.get("output_config"))}
    if count_only:
        return MessagesRequest(
            model,
            messages,
            0,
            SamplingParams(),
            tools=tools,
            tool_choice=choice,
            template_kwargs=kwargs,
        )
    max_tokens = body.get("max_tokens")
    if (
        not isinstance(max_tokens, int)
        or isinstance(max_tokens, bool)
        or not 1 <= max_tokens <= MAX_INT
    ):
        raise AnthropicError(
            400, f"max_tokens: an integer in 1..{MAX_INT} is required, got {shown(max_tokens)}"
        )
    stop = body.get("stop_sequences") or []
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise AnthropicError(400, "stop_sequences: a list of strings is required")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise AnthropicError(400, f"stream: true or false is required, got {shown(stream)}")
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, above=True),
        top_k=_integer(body, "top_k", 0, MAX_INT),
    )
    try:
        sampling.check()
    except ValueError as e:
        raise AnthropicError(400, str(e)) from None
    return MessagesRequest(
        model,
        messages,
        max_tokens,
        sampling,
        [s for s in stop if s],
        stream=stream,
        tools=tools,
        tool_choice=choice,
        template_kwargs=kwargs,
        constraint=_format(body),
    )


def _thinking(thinking: Any) -> dict:
    """``thinking``: ``{"type": "enabled", "budget_tokens": n}``, ``{"type": "adaptive"}`` or
    ``{"type": "disabled"}``, as the chat template's ``enable_thinking`` (Qwen3's; other
    templates ignore it). The budget is not enforced: ``max_tokens`` bounds the whole reply."""
    if thinking is None:
        return {}
    kinds = ("enabled", "adaptive", "disabled")
    if not isinstance(thinking, dict) or thinking.get("type") not in kinds:
        raise AnthropicError(
            400, "thinking: {'type': 'enabled' | 'adaptive' | 'disabled'} is required"
        )
    return {"enable_thinking": thinking["type"] != "disabled"}


def _effort(config: Any) -> dict:
    """``output_config.effort`` as the template's ``reasoning_effort`` (a template without one
    ignores it); its other keys but ``format`` are ignored."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise AnthropicError(400, f"output_config: an object is required, got {shown(config)}")
    for key in config:
        if key not in ("effort", "format"):
            log_once("/v1/messages", f"output_config.{key}", known=False)
    effort = config.get("effort")
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise AnthropicError(
            400,
            f"output_config.effort: one of {', '.join(EFFORTS)} is required, got {shown(effort)}",
        )
    return {"reasoning_effort": EFFORTS[effort]}


def _format(body: dict):
    """``output_config.format`` (or the beta's ``output_format``): ``{"type": "json_schema",
    "schema": {...}}``, as a Constraint (the output validates against the schema)."""
    config = body.get("output_config")
    where, spec = "output_config.format", config.get("format") if isinstance(config, dict) else None
    if spec is None:
        where, spec = "output_format", body.get("output_format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        raise AnthropicError(
            400, f"{where}: {{'type': 'json_schema', 'schema': {{...}}}} is required"
        )
    from ...errors import ConstraintError
    from ...output.constraints import Constraint

    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise AnthropicError(400, f"{where}.schema: a JSON Schema object is required")
    try:
        return Constraint.json_schema(schema)
    except ConstraintError as e:
        raise AnthropicError(400, f"{where}: {e}") from None


def _tools(body: dict) -> tuple[list[dict] | None, Any]:
    """Anthropic's ``tools`` (name, description, input_schema) in OpenAI's shape, and its
    ``tool_choice`` in OpenAI's terms (any: required; tool: that function)."""
    from ...output.toolcalls import check_tools

    tools = body.get("tools")
    if tools is None:
        return None, None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise AnthropicError(400, "tools: a list of tools is required")
    hosted = [t for t in tools if t.get("type") not in (None, "custom")]
    for t in hosted:  # web_search, code_execution, bash_...: run by Anthropic's servers
        log_once("/v1/messages", f"tools[type={str(t.get('type'))[:40]}]", known=True)
    tools = [t for t in tools if t not in hosted]
    if hosted and not tools:
        return None, None
    shaped = [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description"),
                "parameters": t.get("input_schema", {"type": "object", "properties": {}}),
            },
        }
        for t in tools
    ]
    try:
        checked = check_tools(shaped)
    except ValueError as e:
        raise AnthropicError(400, str(e).replace(".function.parameters", ".input_schema")) from None
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    names = [t["function"]["name"] for t in checked]
    if kind in ("auto", "none"):
        return checked, kind
    if kind == "any":
        return checked, "required"
    if kind == "tool" and choice.get("name") in names:
        return checked, {"type": "function", "function": {"name": choice["name"]}}
    raise AnthropicError(
        400,
        f"tool_choice: expected type auto, any, none, or tool with a name among the tools "
        f"({', '.join(names)}), got {shown(choice)}",
    )


def _number(
    body: dict, name: str, default: float, lo: float, hi: float, *, above: bool = False
) -> float:
    """A finite number in [lo, hi] (``above``: > lo), or ``default``."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AnthropicError(400, f"{name}: a number is required, got {type(value).__name__}")
    if isinstance(value, int):  # an int past float range is out of any range here
        value = as_float(value)
    span = outside(value, lo, hi, above=above)
    if span is not None:
        raise AnthropicError(400, f"{name}: a number in {span} is required, got {value:g}")
    return value


def _integer(body: dict, name: str, default: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise AnthropicError(400, f"{name}: an integer in 0..{hi} is required, got {shown(value)}")
    return value
