"""How big a template's values and results are, estimated before they are built.

The rules template_guard.py applies at each sandbox hook: a value past the output cap
(characters for text, entries for containers, :data:`MAX_INT_BITS` for integers) is
refused with :class:`TemplateLimitError`, and so is an operation whose result would be
(a product, a power, a format width, a join, a replace, an indented JSON), before
Python allocates it.
"""

from __future__ import annotations

import re
import string
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jinja2
import jinja2.utils

MAX_INT_BITS = 4096


class TemplateLimitError(jinja2.TemplateError):
    """A render ran past one of its :class:`Limits`."""


class Limits:
    """The budget of one render: a deadline, an output cap and the running counts."""

    __slots__ = ("stage", "time_limit", "deadline", "max_chars", "max_items", "emitted", "depth")

    def __init__(self, time_limit: float, max_chars: int, stage: str = "rendering") -> None:
        self.stage = stage
        self.time_limit = time_limit
        self.deadline = time.monotonic() + time_limit
        self.max_chars = max_chars
        self.max_items = max(max_chars // 4, 100_000)  # list/dict entries (jinja's MAX_RANGE)
        self.emitted = 0
        self.depth = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"{self.stage} ran past the time limit of {self.time_limit:g} s"
            )

    def fits(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise TemplateLimitError(
                f"{what} of ~{size} characters passes the limit of {self.max_chars} characters"
            )


# --- sizes ------------------------------------------------------------------------------------------


_EXIT = object()  # marks the end of a namespace's entries on text_size's stack


def text_size(value: Any, cap: int, *, per_item: int = 2, per_depth: int = 0) -> int:
    """About how many characters ``str(value)`` (or its JSON) has; stops counting past ``cap``.

    Strings count their length, containers their brackets and separators
    (``per_item`` per entry, plus ``per_depth`` per nesting level for indented
    JSON) and their entries, shared ones each time (as their text repeats them).
    The walk is iterative and stops once over ``cap``, so it costs at most ~cap/2
    steps. Only a namespace can contain itself (lists and dicts are immutable in
    the sandbox); its repr prints such a cycle as ``...``, and so it is counted.
    """
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    open_namespaces: set[int] = set()
    while stack:
        item, depth = stack.pop()
        kind = type(item)  # not isinstance: a Namespace answers __class__ slowly, in Python
        if item is _EXIT:
            open_namespaces.discard(depth)
            continue
        if issubclass(kind, (str, bytes)):
            total += len(item) + (2 if depth else 0)  # quotes inside a container's repr
        elif kind is bool or item is None:
            total += 5
        elif issubclass(kind, int):
            total += item.bit_length() // 3 + 2
        elif issubclass(kind, float):
            total += 24
        elif issubclass(kind, (list, tuple, dict, set, frozenset, jinja2.utils.Namespace)):
            if issubclass(kind, jinja2.utils.Namespace):
                if id(item) in open_namespaces:
                    total += 5
                    continue
                open_namespaces.add(id(item))
                stack.append((_EXIT, id(item)))
                item = object.__getattribute__(item, "_Namespace__attrs")
            total += 2 + len(item) * (per_item + per_depth * (depth + 1))
            if total > cap:
                return total
            entries = item.items() if issubclass(type(item), dict) else ((e,) for e in item)
            for pair in entries:
                for entry in pair:
                    if type(entry) is str:  # most entries: counted here, not pushed
                        total += len(entry) + 2
                    elif type(entry) is int:
                        total += entry.bit_length() // 3 + 2
                    else:
                        stack.append((entry, depth + 1))
                if total > cap:
                    return total
        else:  # Undefined, a macro, a loop, a cycler: a short repr
            total += 64
        if total > cap:
            return total
    return total


def check_value(budget: Limits, value: Any, what: str) -> Any:
    """Refuse a value whose own size passes the limits (strings, containers, integers)."""
    if isinstance(value, (str, bytes)):
        budget.fits(len(value), what)
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        if len(value) > budget.max_items:
            raise TemplateLimitError(
                f"{what} of {len(value)} entries passes the limit of {budget.max_items} entries"
            )
    elif isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(
                f"{what}: an integer of {value.bit_length()} bits passes the limit of {MAX_INT_BITS} bits"
            )
    return value


def _length(value: Any) -> int:
    try:
        return len(value)
    except TypeError:
        return 0


def check_ints(budget: Limits, args: tuple, kwargs: Mapping[str, Any], what: str) -> None:
    """A width or count argument larger than the output cap can only build something too big."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > budget.max_chars:
            raise TemplateLimitError(
                f"{what}: the argument {arg} passes the limit of {budget.max_chars}"
            )


# --- growing operations -----------------------------------------------------------------------------


def binop_size(budget: Limits, operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(times, int) and not isinstance(seq, (int, float)):
            n = _length(seq) * max(times, 0)
            if isinstance(seq, (str, bytes)):
                budget.fits(n, "the product")
            elif n > budget.max_items:
                raise TemplateLimitError(
                    f"the product of {n} entries passes the limit of {budget.max_items} entries"
                )
        elif isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(
                    f"the product of integers passes the limit of {MAX_INT_BITS} bits"
                )
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if left.bit_length() * right > MAX_INT_BITS:
                raise TemplateLimitError(
                    f"the power {left}**{right} passes the limit of {MAX_INT_BITS} bits"
                )
    elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
        n = _length(left) + _length(right)
        if isinstance(left, (str, bytes)):
            budget.fits(n, "the sum")
        elif n > budget.max_items:
            raise TemplateLimitError(
                f"the sum of {n} entries passes the limit of {budget.max_items} entries"
            )
    elif operator == "%" and isinstance(left, str):
        _check_percent_format(budget, left, right)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent_format(budget: Limits, fmt: str, args: Any) -> None:
    """``'%1000000000d' % 1`` allocates a gigabyte: widths, precisions and the arguments
    they would take (``*``) must stay under the cap, and so must the arguments' text."""
    star = False
    for match in _PERCENT_SPEC.finditer(fmt):
        for number in match.groups():
            if number == "*":
                star = True
            elif number and int(number) > budget.max_chars:
                raise TemplateLimitError(
                    f"the format width {number} passes the limit of {budget.max_chars}"
                )
    if star:
        check_ints(budget, args if isinstance(args, tuple) else (args,), {}, "the format")
    budget.fits(len(fmt) + text_size(args, budget.max_chars), "the formatted text")


def check_brace_format(budget: Limits, fmt: str, args: tuple, kwargs: Mapping) -> None:
    """``'{:1000000000}'.format(1)``: the same rule for ``str.format``'s specs."""
    nested = False
    pending = [fmt]
    while pending:
        for _, _, spec, _ in string.Formatter().parse(pending.pop()):
            if not spec:
                continue
            nested = nested or "{" in spec
            for number in re.findall(r"\d+", spec):
                if int(number) > budget.max_chars:
                    raise TemplateLimitError(
                        f"the format width {number} passes the limit of {budget.max_chars}"
                    )
            pending.append(spec)
    if nested:
        check_ints(budget, args, kwargs, "the format")
    budget.fits(len(fmt) + text_size((args, dict(kwargs)), budget.max_chars), "the formatted text")


def method_size(budget: Limits, method: Any, args: tuple, kwargs: Mapping) -> None:
    """The string methods whose result can be far longer than their inputs."""
    owner = getattr(method, "__self__", None)
    if not isinstance(owner, (str, bytes)):
        return
    name = method.__name__
    if name == "replace" and len(args) >= 2:
        _check_replace(budget, owner, args[0], args[1], args[2] if len(args) > 2 else -1)
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            budget.fits(
                len(owner) + owner.count(b"\t" if isinstance(owner, bytes) else "\t") * tab,
                "the expanded text",
            )
    elif name == "join" and args:
        _check_join(budget, owner, args[0])
    elif name == "translate" and args and isinstance(args[0], Mapping):
        widest = max((_length(v) for v in args[0].values() if v is not None), default=1)
        budget.fits(len(owner) * max(widest, 1), "the translated text")


def collect(budget: Limits, items: Iterator[Any], what: str) -> list[Any]:
    """A lazy sequence as a list, refused as soon as its entries or their text pass the limits."""
    gathered: list[Any] = []
    size = 0
    for item in items:
        budget.tick()
        size += text_size(item, budget.max_chars - size + 1) + 2
        budget.fits(size, what)
        gathered.append(item)
        if len(gathered) > budget.max_items:
            raise TemplateLimitError(f"{what} passes the limit of {budget.max_items} entries")
    return gathered


def _check_replace(budget: Limits, s: Any, old: Any, new: Any, count: Any) -> None:
    base = str if isinstance(s, str) else bytes
    if isinstance(s, base) and isinstance(old, base) and isinstance(new, base):
        n = s.count(old)
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        budget.fits(len(s) + n * (len(new) - len(old)), "the replaced text")


def _check_join(budget: Limits, separator: Any, items: Any) -> None:
    if isinstance(items, (list, tuple)):
        size = text_size(list(items), budget.max_chars, per_item=_length(separator))
        budget.fits(size, "the joined text")


# --- filters ------------------------------------------------------------------------------


def filter_sizes(budget: Limits, name: str, value: Any, args: tuple, kwargs: dict) -> None:
    """Estimates for the built-in filters that widen their input."""
    cap = budget.max_chars
    if name in ("join",):
        _check_join(budget, args[0] if args else kwargs.get("d", ""), value)
        return
    if name == "tojson":
        indent = kwargs.get("indent", args[1] if len(args) > 1 else None) or 0
        separators = kwargs.get("separators", args[2] if len(args) > 2 else None) or ("", "")
        extra = sum(_length(s) for s in separators) if isinstance(separators, tuple) else 0
        if isinstance(indent, str):
            indent = len(indent)
        size = text_size(value, cap, per_item=2 + extra + (1 if indent else 0), per_depth=indent)
        budget.fits(size, "the JSON")
        return
    if name == "pprint":
        budget.fits(text_size(value, cap, per_item=3, per_depth=1), "the printed value")
        return
    if name == "sum" and isinstance(value, (list, tuple)):
        budget.fits(text_size(value, cap), "the sum")
        return
    if not isinstance(value, (str, bytes)):
        # every other filter below starts from str(value)
        budget.fits(text_size(value, cap), f"the text of the '{name}' filter's input")
    text = value if isinstance(value, str) else None
    if text is None:
        return
    if name == "replace" and len(args) >= 2:
        _check_replace(budget, text, args[0], args[1], args[2] if len(args) > 2 else -1)
    elif name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        prefix = _length(width) if isinstance(width, str) else width
        if isinstance(prefix, int):
            budget.fits(len(text) + (text.count("\n") + 1) * prefix, "the indented text")
    elif name == "wordwrap":
        width = args[0] if args else kwargs.get("width", 79)
        wrap = kwargs.get("wrapstring", args[2] if len(args) > 2 else None) or "\n"
        if isinstance(width, int) and width > 0:
            breaks = len(text) // width + text.count("\n") + 1
            budget.fits(len(text) + breaks * _length(wrap), "the wrapped text")
    elif name == "format":
        _check_percent_format(budget, text, kwargs or args)
    elif name == "center":
        width = args[0] if args else kwargs.get("width", 80)
        if isinstance(width, int):
            budget.fits(max(width, len(text)), "the centred text")
