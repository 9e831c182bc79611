"""A request's output rules as one object: what ends the output, what it must match, the tools it
may call and whether its reasoning is split from its answer.

``stream_generate``, ``generate``, ``batch_generate`` and ``Engine.start``/``stream`` take them as
``output=OutputRules(...)`` or as loose keywords of the same names (as ``sampling=`` and
``SamplingParams``); :meth:`OutputRules.merge` makes one object of the two, and names a setting
given both ways.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from ..output.constraints import Constraint


@dataclass(frozen=True)
class OutputRules:
    """What shapes a request's output; each field as ``stream_generate``'s keyword of that name.

    ``stop``: strings that end it. ``constraint``, ``response_format``, ``json_schema``,
    ``regex``, ``choices``, ``grammar``: structured output (at most one). ``tools``,
    ``tool_choice``: functions it may call, and whether it must. ``split_reasoning``: the
    reasoning apart from the answer.
    """

    stop: Sequence[str] = ()
    constraint: Constraint | None = None
    response_format: dict | None = None
    json_schema: dict | str | None = None
    regex: str | None = None
    choices: Sequence[str] | None = None
    grammar: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    split_reasoning: bool = False

    @classmethod
    def merge(cls, output: OutputRules | None, loose: dict[str, Any]) -> OutputRules:
        """``output``, or the ``loose`` keywords as one object when it is None. A keyword set
        (not at its default) beside ``output`` is a ValueError naming it (as ``sampling=`` beside
        a sampling keyword is); a name that is no field, a TypeError."""
        if unknown := sorted(set(loose) - set(OUTPUT_FIELDS)):
            raise TypeError(f"unexpected output option(s) {', '.join(unknown)}")
        if output is None:
            return cls(**loose)
        if clash := [k for k, v in loose.items() if not _unset(k, v)]:
            raise ValueError(
                f"{', '.join(clash)}: given in output= (an OutputRules) and as a keyword too"
            )
        return output

    def constraint_options(self) -> dict[str, Any]:
        """The structured-output fields, as ``output.tooling.output_rules`` takes them."""
        return {k: getattr(self, k) for k in _CONSTRAINT_FIELDS}


OUTPUT_FIELDS = tuple(f.name for f in fields(OutputRules))
_DEFAULTS = {f.name: f.default for f in fields(OutputRules)}
_CONSTRAINT_FIELDS = ("constraint", "response_format", "json_schema", "regex", "choices", "grammar")


def _unset(name: str, value: Any) -> bool:
    """Whether a loose keyword was left at its default (any empty ``stop``, ``[]`` as ``()``)."""
    return not value if name == "stop" else value is _DEFAULTS[name]  # None, or False
