"""What a request's output must match: a JSON Schema, any JSON object, a regular expression,
one of a list of strings, or a grammar. Each is compiled to an llguidance grammar and
checked when it is made, so a constraint the library cannot enforce is a ConstraintError
naming what is wrong before any token is generated.

JSON is generated compact: ``", "`` between items, ``": "`` after keys, and no other
whitespace outside strings (a small model given free whitespace can loop on it forever).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from ...errors import ConstraintError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """A compiled constraint; :meth:`processor` gives each request its own matcher.

    ``kind``: ``json_schema``, ``json_object``, ``regex``, ``choice`` or ``grammar``;
    ``source``: what it was made from (the schema, pattern, options or grammar text)."""

    kind: str
    grammar: str  # llguidance's serialized grammar
    source: Any = None

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        """Output that validates against ``schema`` (the subset llguidance supports:
        docs/structured.md)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ConstraintError(f"json_schema: not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ConstraintError(
                f"json_schema: expected a JSON object, found {type(schema).__name__}"
            )
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise ConstraintError(f"json_schema: {e}") from None
        return cls._checked("json_schema", grammar, schema)

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        made = cls.json_schema({"type": "object"})
        return cls("json_object", made.grammar, None)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Output that matches ``pattern`` whole (Rust regex syntax, no look-around)."""
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError(f"regex: expected a non-empty string, found {pattern!r}")
        import llguidance

        return cls._checked("regex", llguidance.LLMatcher.grammar_from_regex(pattern), pattern)

    @classmethod
    def choices(cls, options: Sequence[str]) -> Constraint:
        """Output that is exactly one of ``options``."""
        options = list(options) if not isinstance(options, str) else [options]
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ConstraintError(f"choices: expected non-empty strings, found {options!r}")
        import llguidance

        lark = "start: " + " | ".join(json.dumps(o) for o in options)
        return cls._checked("choice", llguidance.LLMatcher.grammar_from_lark(lark), options)

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        """Output in the language of ``text``: a Lark grammar (llguidance's format) or a
        llama.cpp GBNF grammar."""
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError("grammar: expected the grammar's text, found nothing")
        import llguidance

        try:
            grammar = llguidance.grammar_from("grammar", text)
        except ValueError as e:
            raise ConstraintError(f"grammar: {e}") from None
        return cls._checked("grammar", grammar, text)

    @classmethod
    def from_response_format(cls, response_format: Any) -> Constraint | None:
        """OpenAI's ``response_format``: ``{"type": "text"}`` (None), ``{"type":
        "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name", "schema",
        "strict"}}``."""
        if not isinstance(response_format, dict):
            raise ConstraintError(
                f"response_format: expected an object, found {type(response_format).__name__}"
            )
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ConstraintError(
                    "response_format.json_schema: expected an object with a 'schema' object"
                )
            return cls.json_schema(spec.get("schema", {}))
        raise ConstraintError(
            f"response_format.type: expected 'text', 'json_object' or 'json_schema', found {kind!r}"
        )

    @classmethod
    def _checked(cls, kind: str, grammar: str, source: Any) -> Constraint:
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            message = " ".join(messages[0].split()) if messages else "invalid"
            raise ConstraintError(f"{kind}: {message}")
        return cls(kind, grammar, source)

    def processor(self, tokenizer):
        """A fresh logits processor enforcing this constraint for one request."""
        from .matcher import ConstraintProcessor, vocabulary

        return ConstraintProcessor(self, vocabulary(tokenizer))


def from_options(
    *,
    constraint: Constraint | None = None,
    response_format: Any = None,
    json_schema: Any = None,
    regex: str | None = None,
    choices: Sequence[str] | None = None,
    grammar: str | None = None,
) -> Constraint | None:
    """The one constraint these keyword options ask for (None for none); a ConstraintError
    if more than one is given."""
    given = {
        "constraint": constraint,
        "response_format": response_format,
        "json_schema": json_schema,
        "regex": regex,
        "choices": choices,
        "grammar": grammar,
    }
    named = [k for k, v in given.items() if v is not None]
    if len(named) > 1:
        raise ConstraintError(f"give one constraint, found {', '.join(named)}")
    if constraint is not None:
        return constraint
    if response_format is not None:
        return Constraint.from_response_format(response_format)
    if json_schema is not None:
        return Constraint.json_schema(json_schema)
    if regex is not None:
        return Constraint.regex(regex)
    if choices is not None:
        return Constraint.choices(choices)
    if grammar is not None:
        return Constraint.grammar(grammar)
    return None
