"""Tool calls: the tools a request offers, the way a model family writes a call, and the calls
parsed out of what it wrote.

Tools are given as OpenAI (and the Hugging Face chat-template convention) writes them,
``{"type": "function", "function": {"name", "description", "parameters"}}``, and reach the
chat template as its ``tools`` variable. Which form a model's calls take is read from its
chat template:

- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block a call;
- Llama 3.x: the call as bare JSON, ``{"name": ..., "parameters": {...}}`` (after
  ``<|python_tag|>`` or not; several separated by ``;``);
- Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``;
- harmony (gpt-oss): a message to a recipient, ``<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...args}<|call|>`` (or ``to=`` in the role before the channel).

With ``tool_choice`` ``"required"`` or naming a function, the call is generated under a
constraint: the family's wrapper around JSON that the function's parameter schema admits.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConstraintError


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        out = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }
        return out if index is None else {"index": index, **out}


def check_tools(tools: Any, where: str = "tools") -> list[dict]:
    """The tools in OpenAI's shape, checked: a ValueError naming the first bad field."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{where}: expected a non-empty list of tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{at}: expected {{'type': 'function', 'function': {{...}}}}")
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{at}.function.name: expected a non-empty string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"{at}.function.parameters: expected a JSON Schema object")
        function = {"name": fn["name"], "parameters": params}
        if fn.get("description") is not None:
            function["description"] = str(fn["description"])
        out.append({"type": "function", "function": function})
    return out


class ToolFormat:
    """How one family writes tool calls."""

    name = ""
    opener = ""  # text that starts a call
    key = "arguments"  # the arguments' key in the call's JSON

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text that is not a call, the calls) of a whole output."""
        raise NotImplementedError

    def lark(self, call: str, tokenizer) -> str:
        """A Lark grammar for one call whose JSON is ``call`` (a ``%json`` schema)."""
        raise NotImplementedError

    def grammar(self, chosen: list[dict], tokenizer) -> str:
        """A Lark grammar for one call of one of the ``chosen`` tools: by default the call's
        JSON (``name`` and the arguments under :attr:`key`) inside the family's wrapper."""
        from .constraints.spec import JSON_OPTIONS

        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    self.key: t["function"]["parameters"],
                },
                "required": ["name", self.key],
                "additionalProperties": False,
            }
            for t in chosen
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return self.lark(json.dumps({**schema, "x-guidance": JSON_OPTIONS}), tokenizer)


class Hermes(ToolFormat):
    name, opener = "hermes", "<tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text):
        calls = [c for m in self.BLOCK.finditer(text) if (c := _call(m.group(1))) is not None]
        if not calls:
            return text, []
        return self.BLOCK.sub("", text).strip(), calls

    def lark(self, call, tokenizer):
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {call}'


class Llama3(ToolFormat):
    name, opener, key = "llama3", "{", "parameters"

    def parse(self, text):
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = [_call(part) for part in body.split(";") if part.strip()]
        if not calls or any(c is None for c in calls):
            return text, []
        return "", calls

    def lark(self, call, tokenizer):
        return f"start: call\ncall: %json {call}"


class Mistral(ToolFormat):
    name, opener = "mistral", "[TOOL_CALLS]"

    def parse(self, text):
        head, found, rest = text.partition("[TOOL_CALLS]")
        if not found:
            return text, []
        try:
            items = json.loads(rest.strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(item) for item in items]
        if any(c is None for c in calls):
            return text, []
        return head.strip(), calls

    def lark(self, call, tokenizer):
        token = tokenizer.token_to_id("[TOOL_CALLS]")
        opener = f"<[{token}]>" if token is not None else '"[TOOL_CALLS]"'
        return f'start: {opener} " [" call "]"\ncall: %json {call}'


class Harmony(ToolFormat):
    """gpt-oss's calls: the recipient names the function, the message body is its arguments."""

    name, opener = "harmony", "to=functions."
    CALL = re.compile(
        r"(?:<\|start\|>assistant(?P<role>[^<]*))?<\|channel\|>(?P<header>[^<]*)"
        r"(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<body>.*?)(?:<\|call\|>|<\|end\|>|$)",
        re.DOTALL,
    )
    RECIPIENT = re.compile(r"to=functions\.([\w.\-]+)")

    def parse(self, text):
        calls, kept, at = [], [], 0
        for m in self.CALL.finditer(text):
            found = self.RECIPIENT.search((m["role"] or "") + " " + m["header"])
            call = _call({"name": found[1], "arguments": m["body"].strip()}) if found else None
            if call is None:
                continue
            calls.append(call)
            kept.append(text[at : m.start()])
            at = m.end()
        if not calls:
            return text, []
        return "".join(kept) + text[at:], calls

    MARKERS = ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>")

    def grammar(self, chosen, tokenizer):
        """A message to one of the chosen functions: its name in the header, its arguments (its
        parameters' schema) as the body, the markers as the tokenizer's special tokens."""
        from .constraints.spec import JSON_OPTIONS

        ids = {m: tokenizer.token_to_id(m) for m in self.MARKERS}
        if missing := [m for m, i in ids.items() if i is None]:
            raise ConstraintError(
                f"tool_choice: the harmony format needs the tokens {', '.join(missing)}, "
                "which this tokenizer lacks"
            )
        ch, con, msg, call = (f"<[{ids[m]}]>" for m in self.MARKERS)
        rules, alternatives = [], []
        for i, tool in enumerate(chosen):
            fn = tool["function"]
            header = json.dumps(f"commentary to=functions.{fn['name']} ")
            args = json.dumps({**fn["parameters"], "x-guidance": JSON_OPTIONS})
            rules.append(f'call{i}: {ch} {header} {con} "json" {msg} args{i} {call}')
            rules.append(f"args{i}: %json {args}")
            alternatives.append(f"call{i}")
        return "\n".join([f"start: {' | '.join(alternatives)}", *rules])


FORMATS = (Hermes(), Mistral(), Llama3(), Harmony())


def tool_format(tokenizer) -> ToolFormat:
    """The form of the model's calls, read from its chat template (Hermes when it says
    nothing that names another)."""
    source = tokenizer.chat_template_source(tools=True) or ""
    if "<|channel|>" in source:
        return FORMATS[3]
    if "[TOOL_CALLS]" in source:
        return FORMATS[1]
    if "<tool_call>" in source:
        return FORMATS[0]
    if '"parameters"' in source and "<|start_header_id|>" in source:
        return FORMATS[2]
    return FORMATS[0]


def call_constraint(fmt: ToolFormat, tools: list[dict], choice: Any, tokenizer):
    """The constraint for ``tool_choice`` ``"required"`` (any of ``tools``) or a named function
    (``{"type": "function", "function": {"name": ...}}``); None for ``"auto"``/``"none"``."""
    from .constraints import Constraint

    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            names = ", ".join(t["function"]["name"] for t in tools)
            raise ValueError(
                f"tool_choice.function.name: '{name}' is not among the tools ({names})"
            )
    else:
        raise ValueError(
            "tool_choice: expected 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark(fmt.grammar(chosen, tokenizer))
    try:
        return Constraint._checked("tool_call", grammar, chosen)
    except ConstraintError as e:
        raise ConstraintError(f"tools: {e}") from None


def _call(raw: Any) -> ToolCall | None:
    """A call from its JSON (text or parsed): ``name`` and ``arguments`` (or ``parameters``)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return None
    args = raw.get("arguments", raw.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(raw["name"], args if isinstance(args, dict) else {"value": args})


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages with tool calls as the Hugging Face chat templates take them: an
    assistant's ``tool_calls`` with their arguments as objects (not JSON text)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    return out


def _template_call(call: dict) -> dict:
    fn = dict(call.get("function", call))
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {"type": "function", "id": call.get("id"), "function": fn}
