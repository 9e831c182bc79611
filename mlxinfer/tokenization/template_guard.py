"""Time and size limits for chat-template rendering.

Jinja's sandbox keeps a template away from Python internals, but not from the
machine's time and memory: ``{% for i in range(100000) %}{% for j in range(100000)
%}{% endfor %}{% endfor %}`` runs for hours and ``{{ 'x' * 10**12 }}`` asks for a
terabyte (vLLM's CVE-2025-61620 is that denial of service). Here every render runs
under a :class:`Limits` budget, checked where a template can spend:

- **time**: a deadline read at every loop iteration, every output, call, attribute
  and item lookup, filter and test, so no loop runs long unseen;
- **output**: the characters the template produces (``{{ }}`` values and text,
  counted before they are joined, including what is captured by ``{% set %}``
  blocks and macros) stay under a cap;
- **values**: before an operation that can grow a value (``*``, ``+``, ``**``,
  ``%`` and ``~``, ``str.format``, the widening filters and string methods) its
  result's size is estimated and refused past the cap, so nothing huge is ever
  allocated; integers stay under :data:`MAX_INT_BITS` bits; calls nest at most
  :data:`MAX_CALL_DEPTH` deep (a recursive macro stops before Python's stack does).

The loop and output hooks are added to the template's syntax tree before it is
compiled (:class:`GuardedCodeGenerator`, Jinja's documented ``code_generator_class``
hook); the rest are the sandbox's own hooks (``call``, ``getattr``, ``getitem``,
``call_binop``, ``wrap_str_format``). A limit that trips raises
:class:`TemplateLimitError`, which chat_template.py reports as a one-line TokenizerError.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import jinja2
import jinja2.utils
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension
from jinja2.lexer import Token, TokenStream
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from .template_sizes import (
    Limits,
    TemplateLimitError,
    binop_size,
    check_brace_format,
    check_ints,
    check_value,
    collect,
    filter_sizes,
    method_size,
    text_size,
)

DEFAULT_TIME_LIMIT = 2.0  # seconds; real templates render in milliseconds
# Compiling runs once per template and takes ~1 s per 30 KiB of dense tags on a slow CPU
# (Jinja's parser and code generator are Python); Hub templates are a few KiB to ~40 KiB.
COMPILE_TIME_LIMIT = 10.0
DEFAULT_MAX_OUTPUT = 4 * 2**20  # characters produced, beyond INPUT_ALLOWANCE × the input's size
# A template may render each message more than once (into a {% set %} block, then out),
# so a long conversation earns room in proportion to its own size.
INPUT_ALLOWANCE = 4
MAX_SOURCE = 2**20  # characters of template source (compiling it stays under the time limit)
MAX_CALL_DEPTH = 64  # macro recursion that deep is a runaway; Python's own limit comes later


_current: ContextVar[Limits | None] = ContextVar("mlxinfer_template_limits", default=None)


@contextmanager
def limits(time_limit: float, max_chars: int, stage: str = "rendering") -> Iterator[Limits]:
    """Run the block (compiling or rendering a template) under a fresh budget."""
    budget = Limits(time_limit, max_chars, stage)
    token = _current.set(budget)
    try:
        yield budget
    finally:
        _current.reset(token)


def _budget() -> Limits | None:
    budget = _current.get()
    if budget is not None:
        budget.tick()
    return budget


# --- filters and tests ---------------------------------------------------------------------------


def _guard_filter(name: str, func: Any) -> Any:
    # Filters marked pass_context / pass_eval_context / pass_environment take that first.
    skip = 1 if hasattr(func, "jinja_pass_arg") else 0

    @functools.wraps(func)  # keeps jinja_pass_arg
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None or len(args) <= skip:
            return func(*args, **kwargs)
        value, rest = args[skip], args[skip + 1 :]
        if isinstance(value, Iterator):  # map/select output: gathered under the limits first
            value = collect(budget, value, f"the '{name}' filter's input")
            args = (*args[:skip], value, *rest)
        check_ints(budget, rest, kwargs, f"the '{name}' filter")
        filter_sizes(budget, name, value, rest, kwargs)
        return check_value(budget, func(*args, **kwargs), f"the '{name}' filter's result")

    return guarded


def _guard_test(func: Any) -> Any:
    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _budget()
        return func(*args, **kwargs)

    return guarded


# --- hooks the compiled template calls ---------------------------------------------------------------


@jinja2.pass_context  # so that Jinja never folds it at compile time
def guard_iter(context: Any, iterable: Any) -> Iterator[Any]:
    """Every ``{% for %}`` iterates through this: the deadline is read at each item."""
    budget = _current.get()
    for item in iterable:
        if budget is not None:
            budget.tick()
        yield item


@jinja2.pass_context
def emit(context: Any, value: Any) -> Any:
    """Every ``{{ value }}`` and piece of template text passes here before it is output."""
    budget = _budget()
    if budget is not None:
        left = budget.max_chars - budget.emitted
        size = len(value) if isinstance(value, str) else text_size(value, left + 1)
        budget.emitted += size
        if budget.emitted > budget.max_chars:
            raise TemplateLimitError(
                f"the rendered text passes the limit of {budget.max_chars} characters"
            )
    return value


@jinja2.pass_context
def concat(context: Any, *items: Any) -> str:
    """``a ~ b``: the sizes are added before the strings are joined."""
    budget = _budget()
    if budget is not None:
        size = 0
        for item in items:
            size += text_size(item, budget.max_chars - size + 1)
            budget.fits(size, "the concatenation")
    if context.eval_ctx.autoescape:
        return jinja2.runtime.markup_join(items)
    return jinja2.runtime.str_join(items)


# The hooks are filters under names no template uses: a filter compiles to a direct call,
# where a function would go through the sandbox's slower ``call``.
HOOKS = {"__mlxinfer_iter": guard_iter, "__mlxinfer_emit": emit, "__mlxinfer_concat": concat}


def _imported(name: str, args: list[nodes.Expr], lineno: int) -> nodes.Filter:
    return nodes.Filter(args[0], f"__mlxinfer_{name}", args[1:], [], None, None, lineno=lineno)


class _InsertHooks(NodeTransformer):
    """Route loops, output and ``~`` through :func:`guard_iter`, :func:`emit` and :func:`concat`."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _imported("iter", [node.iter], node.lineno)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        wrapped: list[nodes.Expr] = []
        for child in node.nodes:
            if isinstance(child, nodes.TemplateData):
                # literal text is never escaped; marked safe it stays so under autoescape
                const = nodes.Const(child.data, lineno=child.lineno)
                wrapped.append(
                    nodes.MarkSafeIfAutoescape(
                        _imported("emit", [const], child.lineno), lineno=child.lineno
                    )
                )
            else:
                wrapped.append(_imported("emit", [child], child.lineno))
        node.nodes = wrapped
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        if not node.nodes:
            return nodes.Const("", lineno=node.lineno)
        return _imported("concat", list(node.nodes), node.lineno)


class GuardedCodeGenerator(CodeGenerator):
    """Jinja's code generator, run over a tree with the budget's hooks inserted, reading
    the deadline at every node (a large template takes seconds to compile)."""

    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        node = _InsertHooks().visit(node)
        node.set_environment(self.environment)
        super().visit_Template(node, frame)

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        _budget()
        return super().visit(node, *args, **kwargs)


class _ParseDeadline(Extension):
    """Reads the deadline at every token the parser takes (``filter_stream`` is Jinja's hook)."""

    def filter_stream(self, stream: TokenStream) -> Iterator[Token]:
        for token in stream:
            _budget()
            yield token


class GuardedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every hook reading the current :class:`Limits`."""

    code_generator_class = GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_extension(_ParseDeadline)
        # lipsum(n=10**6) is a paragraph generator no chat template needs.
        self.globals.pop("lipsum", None)
        self.filters.pop("urlize", None)  # per-URL attributes multiply its output; unused
        self.filters.update(HOOKS)

    def guard_filters(self) -> None:
        """Wrap every filter and test (call once the environment's filters are final)."""
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.tests = {name: _guard_test(f) for name, f in self.tests.items()}
        self.filters.update(HOOKS)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if budget is None:
            return super().call_binop(context, operator, left, right)
        binop_size(budget, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        return check_value(budget, result, f"the result of {operator!r}")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        @functools.wraps(wrapper)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            budget = _budget()
            if budget is not None:
                if is_map and len(args) == 1 and isinstance(args[0], Mapping):
                    check_brace_format(budget, fmt, (), args[0])
                else:
                    check_brace_format(budget, fmt, args, kwargs)
            return wrapper(*args, **kwargs)

        return guarded

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        if inspect.isbuiltin(__obj):  # a str / int / list method: widths and counts are ints
            if getattr(__obj, "__name__", "") == "join" and args and isinstance(args[0], Iterator):
                args = (collect(budget, args[0], "the joined items"), *args[1:])
            check_ints(budget, args, kwargs, f"{getattr(__obj, '__name__', 'the call')}()")
            method_size(budget, __obj, args, kwargs)
        if budget.depth >= MAX_CALL_DEPTH:
            raise TemplateLimitError(
                f"calls nested deeper than the limit of {MAX_CALL_DEPTH} (a macro that recurses without end?)"
            )
        budget.depth += 1
        try:
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        return check_value(budget, result, "the call's result")
