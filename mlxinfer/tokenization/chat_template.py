"""Chat templates with Hugging Face semantics, rendered in a Jinja sandbox.

A checkpoint's chat template is Jinja source from the Hub: untrusted code. It is
rendered the way transformers' ``apply_chat_template(..., tokenize=False)``
renders it -- same environment options, same helper functions, same variables --
inside ``ImmutableSandboxedEnvironment`` so that a template cannot reach Python
internals or mutate the caller's messages. Every failure, from a syntax error to
the template's own ``raise_exception``, becomes a one-line ``TokenizerError``.

Where templates come from (the first that exists wins, as in transformers 5):
``chat_template.jinja`` (+ named ``additional_chat_templates/*.jinja``), then
``chat_template.json``, then ``tokenizer_config.json["chat_template"]`` (a string,
or a list of ``{"name", "template"}``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.utils
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols

from ..errors import TokenizerError
from . import template_guard
from .template_guard import GuardedSandbox, TemplateLimitError

# Names a message's reasoning travels under; transformers copies it to all of them
# because templates disagree on which one they read.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate:
    """One Jinja chat template, compiled on first use.

    Args:
        source: the Jinja text.
        origin: where it came from (file and key), used in error messages.
        time_limit: seconds a render may take (compiling, once, has
            ``template_guard.COMPILE_TIME_LIMIT``).
        max_output: characters a render may produce, beyond
            ``template_guard.INPUT_ALLOWANCE`` times the messages' and variables' own size.
    """

    def __init__(
        self,
        source: str,
        origin: str,
        *,
        time_limit: float = template_guard.DEFAULT_TIME_LIMIT,
        max_output: int = template_guard.DEFAULT_MAX_OUTPUT,
    ) -> None:
        self.source = source
        self.origin = origin
        self.time_limit = time_limit
        self.compile_time_limit = max(template_guard.COMPILE_TIME_LIMIT, time_limit)
        self.max_output = max_output
        self._compiled: jinja2.Template | None = None

    def render(
        self,
        messages: list[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
    ) -> str:
        """Render ``messages``; ``variables`` (special tokens, tools, user kwargs) are template globals."""
        if not messages:
            raise TokenizerError(
                f"chat template {self.origin}: messages is empty, expected at least one message"
            )
        chat = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise TokenizerError(
                    f"chat template {self.origin}: messages[{index}] should be a dict, found {type(message).__name__}"
                )
            # Like transformers: a key set to None is treated as absent (OpenAI clients send content=None).
            chat.append(_alias_reasoning({k: v for k, v in message.items() if v is not None}))
        context = {"tools": None, "documents": None, **variables}
        try:
            # Everything the template sees is rebuilt from plain JSON-like values (see _plain).
            context, chat = _plain(context), _plain(chat)
            room = template_guard.text_size([context, chat], 2**62)
            max_chars = self.max_output + template_guard.INPUT_ALLOWANCE * room
            if self._compiled is None:
                with template_guard.limits(self.compile_time_limit, max_chars, "compiling"):
                    self._template()
            with template_guard.limits(self.time_limit, max_chars):
                return self._template().render(
                    context, messages=chat, add_generation_prompt=bool(add_generation_prompt)
                )
        except TokenizerError:
            raise
        except Exception as exc:  # anything a template does wrong is the template's error
            raise TokenizerError(f"chat template {self.origin}: {_describe(exc)}") from exc

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            if len(self.source) > template_guard.MAX_SOURCE:
                raise TokenizerError(
                    f"chat template {self.origin}: {len(self.source)} characters of source pass "
                    f"the limit of {template_guard.MAX_SOURCE}"
                )
            try:
                self._compiled = _make_environment().from_string(self.source)
            except jinja2.TemplateSyntaxError as exc:
                raise TokenizerError(
                    f"chat template {self.origin}: syntax error at line {exc.lineno}: {_one_line(exc.message or str(exc))}"
                ) from exc
        return self._compiled


def load_chat_templates(path: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, ChatTemplate]:
    """Every chat template a checkpoint directory declares, by name (``"default"`` for the unnamed one)."""
    templates: dict[str, ChatTemplate] = {}
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = ChatTemplate(_read_text(jinja_file), str(jinja_file))
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = ChatTemplate(_read_text(file), str(file))
    if templates:
        return templates

    json_file = path / "chat_template.json"
    if json_file.is_file():
        try:
            data = json.loads(_read_text(json_file))
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"{json_file}: not valid JSON ({exc})") from exc
        if not isinstance(data, dict) or "chat_template" not in data:
            raise TokenizerError(
                f"{json_file}: expected an object with key 'chat_template', found {_kind(data)}"
            )
        return _templates_from_value(data["chat_template"], json_file)

    if tokenizer_config.get("chat_template") is not None:
        return _templates_from_value(
            tokenizer_config["chat_template"], path / "tokenizer_config.json"
        )
    return {}


# Chat formats a user may ask for by name (``--chat-template gemma``) when a checkpoint carries
# none: a base model, or a GGUF whose file has no ``tokenizer.chat_template``. Never applied
# unasked: a model not trained on a format continues it as text.
NAMED_TEMPLATES = {
    # Gemma's turn format: a system message is folded into the first user turn; the
    # assistant's role is "model".
    "gemma": (
        "{{ bos_token }}"
        "{% if messages[0]['role'] == 'system' %}"
        "{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
        "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
        "{% for m in turns %}"
        "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
        "{{ ((prefix if loop.first else '') + m['content']) | trim }}{{ '<end_of_turn>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
    # ChatML (Qwen, SmolLM, Hermes …), with no default system message.
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
}


def named_chat_template(name_or_path: str) -> ChatTemplate:
    """A chat template by name (:data:`NAMED_TEMPLATES`) or from a Jinja file."""
    if name_or_path in NAMED_TEMPLATES:
        return ChatTemplate(NAMED_TEMPLATES[name_or_path], f"the named template {name_or_path!r}")
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return ChatTemplate(_read_text(path), str(path))
    raise TokenizerError(
        f"chat template {name_or_path!r}: expected one of {', '.join(sorted(NAMED_TEMPLATES))} "
        "or a Jinja file, found neither"
    )


def select_chat_template(templates: Mapping[str, ChatTemplate], *, use_tools: bool) -> ChatTemplate:
    """transformers' choice among named templates: ``tool_use`` when tools are given, else ``default``."""
    if use_tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if len(templates) == 1:
        return next(iter(templates.values()))
    raise TokenizerError(
        f"chat templates: expected one named 'default', found only {sorted(templates)}"
    )


def _templates_from_value(value: Any, file: Path) -> dict[str, ChatTemplate]:
    key = f"{file}['chat_template']"
    if isinstance(value, str):
        return {"default": ChatTemplate(value, key)}
    if isinstance(value, list):
        templates = {}
        for index, entry in enumerate(value):
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise TokenizerError(
                    f"{key}[{index}]: expected an object with string 'name' and 'template', found {_kind(entry)}"
                )
            templates[entry["name"]] = ChatTemplate(entry["template"], f"{key}[{entry['name']!r}]")
        return templates
    raise TokenizerError(
        f"{key}: expected a string or a list of named templates, found {_kind(value)}"
    )


# --- the sandboxed environment --------------------------------------------------------------------


class _Sandbox(GuardedSandbox):
    """The immutable sandbox under time and size limits (template_guard.py), failing loudly
    on unsafe attributes.

    Jinja's sandbox answers ``''.__class__`` with an Undefined that prints as ""
    and only raises when used further; transformers renders that "". No honest
    template reads dunders or mutating methods, so here the first touch raises.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _make_environment() -> GuardedSandbox:
    # trim_blocks / lstrip_blocks and these globals are what Hub templates are written against.
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _DictFactory()
    env.guard_filters()
    return env


class _TemplateRaised(jinja2.TemplateError):
    """Raised by a template's own ``raise_exception(message)``."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, ') and returns Markup; templates
    # written for transformers expect plain json.dumps with non-ASCII kept.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here it just renders."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names, so no template can plant or read dunders on it."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 -- Jinja's Namespace uses this signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")


class _DictFactory:
    """The template's ``dict``: builds dicts, but is not the ``dict`` type itself (no type attributes to climb)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


# --- inputs ---------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A copy of ``value`` made only of JSON-like types.

    Callers may put rich objects in messages or kwargs; their methods are unknown
    to the sandbox, so they are replaced by an inert ``"<TypeName>"`` string.
    Copying also means the template can never alter the caller's data.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


# --- error text -----------------------------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _TemplateRaised):
        return f"raised: {_one_line(str(exc))}"
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return f"blocked by the sandbox: {_one_line(str(exc))}"
    if isinstance(exc, TemplateLimitError):
        return _one_line(str(exc))
    if isinstance(exc, RecursionError):
        return "RecursionError: nested too deeply (a macro or structure that recurses without end?)"
    return f"{type(exc).__name__}: {_one_line(str(exc))}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{file}: cannot read ({_one_line(str(exc))})") from exc


def _kind(value: Any) -> str:
    return type(value).__name__
