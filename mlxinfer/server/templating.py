"""What a chat request needs of the served model's chat template, checked before the engine
renders it (docs/server.md, "Chat templates"):

- a template at all: a model without one is a 400 naming ``--chat-template``;
- tools offered to a template that cannot show them are a 400 saying so, never dropped
  silently (the model would never see them);
- a ``system`` message in the middle of the conversation stays where it is when the template
  renders it there, and is otherwise folded into the nearest user turn (the next one, else the
  one before it): never into the leading system prompt, whose change would make the prefix
  cache miss from the first token.

What a template can do is learned once per template source, by rendering a probe
conversation, and kept (``MAX_KNOWN`` sources).
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import TokenizerError

MAX_KNOWN = 64  # template sources whose abilities are remembered
PROBE_TOOL = "mlxinfer_probe_tool_b1f4"
PROBE_SYSTEM = "mlxinfer probe: a system message mid-conversation"
NO_TEMPLATE = (
    "this model has no chat template: start the server with --chat-template NAME|FILE "
    "(gemma, chatml, or a Jinja file) to serve chat requests"
)

_known: dict[tuple[str, str], bool] = {}
_lock = threading.Lock()


def fit_messages(tokenizer, messages: list[dict], tools: Any = None, tool_choice: Any = None):
    """``messages`` ready for the model's chat template: TokenizerError (a 400) when the model
    has no template, or when ``tools`` are offered (and ``tool_choice`` is not "none") to a
    template that cannot show them; mid-conversation system messages folded where needed."""
    if not getattr(tokenizer, "has_chat_template", True):
        raise TokenizerError(NO_TEMPLATE)
    if tools and tool_choice != "none" and not shows_tools(tokenizer):
        raise TokenizerError(
            "tools: this model's chat template does not show tools to the model (it would never "
            "see them); serve it with --chat-template FILE, a template that renders 'tools'"
        )
    lead = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    if lead <= 1 and all(m.get("role") != "system" for m in messages[lead:]):
        return messages
    if takes_system_anywhere(tokenizer):
        return messages
    return fold_system(messages)


def fold_system(messages: list[dict]) -> list[dict]:
    """The leading system messages as one (Codex sends two), and those after the first other
    turn each joined (a blank line between) to the next user turn, or to the user turn just
    before when an assistant or tool turn (or the end) comes first, or else made a user turn of
    their own."""
    lead = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    out, pending, rest = list(messages[:lead]), [], messages[lead:]
    if lead > 1:
        joined = "\n\n".join(m.get("content") or "" for m in messages[:lead])
        out, lead = [{**messages[0], "content": joined}], 1
    for m in rest:
        if m.get("role") == "system":
            pending.append(m.get("content") or "")
            continue
        if pending:
            if m.get("role") == "user":
                m = {**m, "content": "\n\n".join([*pending, m.get("content") or ""])}
            else:
                _attach(out, pending, lead)
            pending = []
        out.append(m)
    if pending:
        _attach(out, pending, lead)
    return out


def _attach(out: list[dict], pending: list[str], lead: int) -> None:
    if len(out) > lead and out[-1].get("role") == "user":
        out[-1] = {**out[-1], "content": "\n\n".join([out[-1].get("content") or "", *pending])}
    else:
        out.append({"role": "user", "content": "\n\n".join(pending)})


def shows_tools(tokenizer) -> bool:
    """Whether the template (the one used with tools) writes the tools it is given into the
    prompt: a probe tool's name appears in a render. A template that fails the probe is asked
    whether it reads the ``tools`` variable at all."""
    source = tokenizer.chat_template_source(tools=True) or ""
    probe = {
        "type": "function",
        "function": {
            "name": PROBE_TOOL,
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }

    def ask() -> bool:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe])
        except TokenizerError:
            return _reads(source, "tools")
        return PROBE_TOOL in text

    return _remembered("tools", source, ask)


def takes_system_anywhere(tokenizer) -> bool:
    """Whether the template renders a system message that comes after other turns, in its
    place (neither refusing it nor dropping it)."""
    source = tokenizer.chat_template_source() or ""
    probe = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "system", "content": PROBE_SYSTEM},
        {"role": "user", "content": "second question"},
    ]

    def ask() -> bool:
        try:
            text = tokenizer.apply_chat_template(probe)
        except TokenizerError:
            return False
        at = text.find(PROBE_SYSTEM)
        return text.find("first answer") < at < text.find("second question")

    return _remembered("system", source, ask)


def _remembered(kind: str, source: str, ask) -> bool:
    key = (kind, source)
    with _lock:
        if key in _known:
            return _known[key]
    answer = ask()
    with _lock:
        if len(_known) >= MAX_KNOWN:
            _known.pop(next(iter(_known)))
        _known[key] = answer
    return answer


def _reads(source: str, name: str) -> bool:
    """Whether the Jinja ``source`` reads the variable ``name`` (False if it does not parse)."""
    import jinja2
    from jinja2 import meta

    try:
        return name in meta.find_undeclared_variables(
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
        )
    except jinja2.TemplateError:
        return False


def templated(load, chat_template: str):
    """``load`` (path -> model, tokenizer), giving a model without a chat template
    ``chat_template`` (``serve --chat-template`` for ``--models-dir`` models)."""

    def loaded(path: str):
        model, tokenizer = load(path)
        if not getattr(tokenizer, "has_chat_template", True):
            tokenizer.set_chat_template(chat_template)
        return model, tokenizer

    return loaded


def prefix_block(engine) -> int:
    """The tokens per block of ``engine``'s prefix cache, or 0 when it shares no prefix (a
    model with recurrent layers does only with its states' snapshots: a prompt's last full
    block is always snapshotted, so a longer prompt resumes after it)."""
    pool = getattr(engine, "pool", None)
    if pool is None:
        return 0
    if getattr(engine, "recurrent", False) and getattr(engine, "snapshots", None) is None:
        return 0
    return int(pool.block_size)
