"""OpenAI's Responses API (``POST /v1/responses``), stateless: a body checked into what the
engine is asked (the reply and its events are :mod:`.reply`).

``instructions`` and ``input`` (a string, or items: ``message``, ``function_call``,
``function_call_output``, ``custom_tool_call`` / ``_output``, ``reasoning``) become chat
messages for the model's template. Tools: ``function`` tools as they are; a ``custom``
(freeform) tool as a function of one string, ``input``; a ``namespace`` tool's functions under
the flat name ``NAMESPACE__NAME`` (Codex's own spelling), answered as calls of ``NAME`` with
their ``namespace``; hosted tools (``web_search``, ``tool_search``, ``file_search`` ...) have
nothing to run here and are left out, logged once. Nothing is stored: ``previous_response_id``
and ``conversation`` are 400s naming them. Fields with no local meaning are ignored
(:mod:`.fields`). Errors are OpenAI's shape, naming the field (``input[3].content[0].text``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...generation.sampling import SamplingParams
from ..api_errors import OpenAIError
from ..fields import Fields, log_once
from ..openai import request as openai_request
from ..quoting import shown
from .inputs import bad, flat_name, input_messages, resolve

MAX_TOOLS = 1_000  # tools, a namespace's counted one by one
MAX_NAME = 256  # a tool's name (a namespace's flat name included)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

FIELDS = Fields.of(
    "/v1/responses",
    used=(
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "text",
        "reasoning",
        "stream",
        "temperature",
        "top_p",
    ),
    ignored=(
        "store",  # nothing is stored either way
        "include",  # reasoning.encrypted_content: reasoning comes back as text
        "parallel_tool_calls",  # several calls are parsed either way
        "prompt_cache_key",  # the prefix cache matches by content
        "prompt_cache_retention",
        "client_metadata",
        "metadata",
        "user",
        "safety_identifier",
        "truncation",
        "service_tier",
        "stream_options",
        "max_tool_calls",
    ),
    refused={
        "previous_response_id": "this server keeps no responses (stateless): send the whole "
        "conversation in 'input' (with 'store': false, as Codex does)",
        "conversation": "this server keeps no conversations (stateless): send the whole "
        "conversation in 'input'",
        "background": "background responses need stored responses, which this server keeps none of",
        "prompt": "stored prompt templates are not kept here: send 'instructions' and 'input'",
        "top_logprobs": "log-probs are not returned by /v1/responses here",
    },
)


@dataclass
class Tool:
    """A tool the model sees (by its flat name) and how its call goes back to the client."""

    kind: str  # "function" or "custom"
    name: str
    namespace: str | None = None


@dataclass
class ResponsesRequest:
    """A /v1/responses request, checked: what ``Routes.start`` reads, and what the
    reply echoes back."""

    model: str
    messages: list[dict]
    max_tokens: int
    sampling: SamplingParams
    stream: bool = False
    stop: list[str] = field(default_factory=list)
    constraint: Any = None
    tools: list[dict] | None = None  # OpenAI chat shape, as the template takes them
    tool_choice: Any = None
    names: dict[str, Tool] = field(default_factory=dict)  # flat name -> the client's tool
    template_kwargs: dict = field(default_factory=dict)
    echo: dict = field(default_factory=dict)  # request fields the response object repeats
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def parse(body: Any) -> ResponsesRequest:
    """Check a /v1/responses body; OpenAIError (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    refusal = FIELDS.screen(body)
    if refusal is not None:
        raise OpenAIError(400, refusal.message, param=refusal.field, code="unsupported_field")
    model = openai_request._typed(body, "model", str, required=True)
    instructions = openai_request._typed(body, "instructions", str)
    tools, names = _tools(body.get("tools"))
    messages = input_messages(body.get("input"), instructions, names)
    if not messages:
        raise bad("input", "expected a non-empty string or list of items")
    limit = openai_request._typed(body, "max_output_tokens", int, default=openai_request.MAX_INT)
    if not 1 <= limit <= openai_request.MAX_INT:
        raise bad(
            "max_output_tokens", f"expected 1..{openai_request.MAX_INT}, found {shown(limit)}"
        )
    sampling = SamplingParams(
        temperature=openai_request._number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=openai_request._number(body, "top_p", 1.0, 0.0, 1.0, above=True),
    )
    ask = ResponsesRequest(
        model,
        messages,
        limit,
        sampling,
        stream=bool(openai_request._typed(body, "stream", bool, default=False)),
        names=names,
    )
    if tools:
        ask.tools = tools
        ask.tool_choice = _tool_choice(body.get("tool_choice"), ask)
    ask.constraint, text = _text(body.get("text"))
    ask.template_kwargs, reasoning = _reasoning(body.get("reasoning"))
    ask.echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "reasoning": reasoning,
        "store": body.get("store") is True,
        "temperature": sampling.temperature,
        "text": text,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": [t for t in body.get("tools") or [] if isinstance(t, dict)],
        "top_p": sampling.top_p,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
    }
    return ask


# --- tools -------------------------------------------------------------------------------------


def _tools(tools: Any) -> tuple[list[dict], dict[str, Tool]]:
    """The tools the model is shown (chat shape) and the map from their names back."""
    if tools is None:
        return [], {}
    if not isinstance(tools, list):
        raise bad("tools", f"expected a list of tools, found {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise bad("tools", f"{len(tools)} tools (at most {MAX_TOOLS})")
    shown_tools: list[dict] = []
    names: dict[str, Tool] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise bad(where, "expected an object with a 'type'")
        kind = tool["type"]
        if kind == "namespace":
            space = _name(tool, where)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise bad(f"{where}.tools", "expected a list of the namespace's tools")
            for j, fn in enumerate(inner):
                at = f"{where}.tools[{j}]"
                if not isinstance(fn, dict):
                    raise bad(at, "expected a tool object")
                flat = flat_name(space, _name(fn, at))
                _add(shown_tools, names, fn, at, flat, space)
        elif kind in ("function", "custom"):
            _add(shown_tools, names, tool, where, _name(tool, where), None)
        else:  # web_search, tool_search, file_search, code_interpreter, mcp ...
            log_once("/v1/responses", f"tools[].type={kind[:64]}", known=True)
    return shown_tools, names


def _name(tool: dict, where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise bad(f"{where}.name", f"expected a string of 1..{MAX_NAME} characters")
    return name


def _add(out: list, names: dict, tool: dict, where: str, flat: str, space: str | None) -> None:
    kind = tool.get("type", "function")
    if kind not in ("function", "custom"):
        log_once("/v1/responses", f"tools[].tools[].type={str(kind)[:64]}", known=True)
        return
    if len(out) >= MAX_TOOLS:
        raise bad("tools", f"more than {MAX_TOOLS} tools (a namespace's counted one by one)")
    if flat in names:
        raise bad(f"{where}.name", f"{shown(flat)} names two tools")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(f"{where}.description", "expected a string")
    if kind == "custom":  # freeform text: one string argument, ``input``
        parameters = {
            "type": "object",
            "properties": {"input": {"type": "string", "description": _freeform(tool)}},
            "required": ["input"],
        }
    else:
        parameters = tool.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise bad(f"{where}.parameters", "expected a JSON Schema object")
    function = {"name": flat, "parameters": parameters}
    if description:
        function["description"] = description
    out.append({"type": "function", "function": function})
    names[flat] = Tool(kind, tool["name"], space)


def _freeform(tool: dict) -> str:
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if isinstance(definition, str):
            return f"Freeform text (not JSON) in this {syntax} grammar:\n{definition}"
    return "Freeform text (not JSON)"


def _tool_choice(choice: Any, ask: ResponsesRequest) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto"
    where = "tool_choice"
    if not isinstance(choice, dict):
        raise bad(where, "expected 'auto', 'none', 'required' or an object")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        flat = resolve(choice.get("name"), choice.get("namespace"), ask.names)
        if flat is None:
            known = ", ".join(ask.names)
            raise bad(where, f"{shown(choice.get('name'))} is not among the tools ({known})")
        return {"type": "function", "function": {"name": flat}}
    if kind == "allowed_tools":
        allowed = choice.get("tools")
        mode = choice.get("mode", "auto")
        if not isinstance(allowed, list) or mode not in ("auto", "required"):
            raise bad(where, "allowed_tools: expected 'mode' auto|required and a list 'tools'")
        keep = {
            resolve(t.get("name"), t.get("namespace"), ask.names)
            for t in allowed
            if isinstance(t, dict)
        }
        ask.tools = [t for t in ask.tools or [] if t["function"]["name"] in keep] or None
        return mode if ask.tools else "none"
    raise bad(where, f"type {shown(kind)}: only function and custom tools run here")


# --- text.format, reasoning ----------------------------------------------------------------


def _text(text: Any) -> tuple[Any, dict]:
    """The constraint ``text.format`` asks for, and the ``text`` the response repeats."""
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise bad("text", f"expected an object, found {type(text).__name__}")
    fmt = text.get("format")
    if fmt is None:
        return None, {**text, "format": {"type": "text"}}
    if not isinstance(fmt, dict):
        raise bad("text.format", f"expected an object, found {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad("text.format.schema", "expected a JSON Schema object")
        name = fmt.get("name", "response")
        response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    elif kind in ("text", "json_object"):
        response_format = {"type": kind}
    else:
        raise bad(
            "text.format.type", f"expected text, json_object or json_schema, found {shown(kind)}"
        )
    from ...errors import ConstraintError
    from ...output.constraints import Constraint

    try:
        return Constraint.from_response_format(response_format), text
    except ConstraintError as e:
        raise bad("text.format", str(e)) from None


def _reasoning(reasoning: Any) -> tuple[dict, dict]:
    """``reasoning.effort`` as the template's switches: gpt-oss's ``reasoning_effort`` (low,
    medium, high) and, for ``none``, Qwen3's ``enable_thinking`` false; and the ``reasoning``
    the response repeats. ``summary`` is ignored: the reasoning itself comes back."""
    if reasoning is None:
        return {}, {"effort": None, "summary": None}
    if not isinstance(reasoning, dict):
        raise bad("reasoning", f"expected an object, found {type(reasoning).__name__}")
    effort = reasoning.get("effort")
    echo = {"effort": effort, "summary": reasoning.get("summary")}
    if effort is None:
        return {}, echo
    if effort not in EFFORTS:
        raise bad(
            "reasoning.effort", f"expected one of {', '.join(EFFORTS)}, found {shown(effort)}"
        )
    level = {"none": "low", "minimal": "low", "xhigh": "high"}.get(effort, effort)
    kwargs: dict = {"reasoning_effort": level}
    if effort == "none":
        kwargs["enable_thinking"] = False
    return kwargs, echo
