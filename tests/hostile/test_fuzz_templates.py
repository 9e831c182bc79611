"""Fuzz target: random chat templates and messages render to text or end in a TokenizerError,
within the time limit and without building anything huge.

The templates are assembled from pieces that reach every hook of template_guard.py: loops
(nested, recursive), products and powers, ``~`` and ``+``, widening filters and string
methods with widths and counts up to 10**9, format strings, macros that recurse, captures,
and attempts at the sandbox's internals. ``MLXINFER_FUZZ_EXAMPLES`` sets the budget
(``tools/fuzz.py`` runs it long); ``MLXINFER_FUZZ_RANDOM=1`` draws fresh examples.
"""

from __future__ import annotations

import os
import resource
import time

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mlxinfer.errors import TokenizerError
from mlxinfer.tokenization.chat_template import ChatTemplate

EXAMPLES = int(os.environ.get("MLXINFER_FUZZ_EXAMPLES", "100"))
DERANDOMIZE = os.environ.get("MLXINFER_FUZZ_RANDOM", "") != "1"
TIME_LIMIT = 0.1
MAX_OUTPUT = 64 * 1024
# One step between two reads of the deadline (an operation on a value under the cap) is
# short; the slack covers that and a loaded CI machine.
SLACK = 2.0

NUMBERS = st.sampled_from(["0", "1", "2", "3", "-1", "7", "64", "1000", "100000", "10**6", "10**9"])
STRINGS = st.sampled_from(
    ["'x'", "'ab\\n'", "'\\t'", "''", "'{:>{}}'", "'%s-%d'", "'%*d'", "'{0}{1}'", "'a b c'"]
)
NAMES = st.sampled_from(
    ["messages", "messages[0]", "messages[0].content", "m", "i", "v", "ns.s", "loop.index", "tools"]
)
ESCAPES = st.sampled_from(
    [
        "''.__class__.__mro__",
        "cycler.__init__.__globals__",
        "namespace.__init__",
        "messages.__class__",
        "(''|attr('__class__'))",
        "'{0.__class__}'.format(1)",
        "raise_exception('boom')",
        "self.__dict__",
        "dict.__base__",
        "x.__subclasses__()",
    ]
)
FILTERS = st.sampled_from(
    [
        "upper",
        "length",
        "list",
        "string",
        "join",
        "join('-')",
        "tojson",
        "tojson(indent=4)",
        "center({n})",
        "indent({n})",
        "wordwrap({n})",
        "replace('a', 'bbb')",
        "replace('', 'xy')",
        "batch({n}, 0)",
        "slice({n})",
        "sum",
        "format({n})",
        "trim",
        "first",
        "last",
        "map('string')",
        "select('odd')",
        "sort",
        "unique",
        "reverse",
        "default({n})",
        "int",
        "round({n})",
        "truncate({n})",
        "pprint",
        "items",
        "nosuchfilter",
    ]
)
METHODS = st.sampled_from(
    [
        "ljust({n})",
        "center({n})",
        "zfill({n})",
        "replace('x', 'yyyy')",
        "expandtabs({n})",
        "join(range({n})|map('string'))",
        "split()",
        "format({n}, {n})",
        "encode()",
        "count('a')",
    ]
)


def _expressions() -> st.SearchStrategy[str]:
    # one atom in seven an attempt at the internals, so that most templates get further
    atoms = st.one_of(NUMBERS, STRINGS, NAMES, NUMBERS, STRINGS, NAMES, ESCAPES)

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        binary = st.tuples(inner, st.sampled_from(["*", "**", "+", "~", "%", "//"]), inner)
        filtered = st.tuples(inner, FILTERS, NUMBERS)
        method = st.tuples(inner, METHODS, NUMBERS)
        return st.one_of(
            binary.map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            filtered.map(lambda t: f"({t[0]} | {t[1].format(n=t[2])})"),
            method.map(lambda t: f"{t[0]}.{t[1].format(n=t[2])}"),
            st.tuples(inner, inner).map(lambda t: f"[{t[0]}, {t[1]}]"),
            NUMBERS.map(lambda n: f"range({n})"),
            NUMBERS.map(lambda n: f"([v] * {n})"),
        )

    return st.recursive(atoms, extend, max_leaves=6)


EXPRESSIONS = _expressions()


def _statements() -> st.SearchStrategy[str]:
    leaf = st.one_of(
        EXPRESSIONS.map(lambda e: "{{ " + e + " }}"),
        EXPRESSIONS.map(lambda e: "{% set v = " + e + " %}"),
        EXPRESSIONS.map(lambda e: "{% set ns.s = ns.s ~ " + e + " %}"),
        st.sampled_from(["text ", "{{ m() }}", "{{ loop(m) }}", "{{ v }}", "{{ ns.s }}"]),
    )

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        body = st.lists(inner, min_size=1, max_size=3).map("".join)
        return st.one_of(
            st.tuples(EXPRESSIONS, body).map(
                lambda t: "{% for i in " + t[0] + " %}" + t[1] + "{% endfor %}"
            ),
            st.tuples(EXPRESSIONS, body, NUMBERS).map(
                lambda t: (
                    "{% for i in "
                    + t[0]
                    + " %}"
                    + t[1]
                    + "{% if loop.index > "
                    + t[2]
                    + " %}{% break %}{% endif %}{% endfor %}"
                )
            ),
            st.tuples(EXPRESSIONS, body).map(
                lambda t: "{% for m in " + t[0] + " recursive %}" + t[1] + "{% endfor %}"
            ),
            st.tuples(EXPRESSIONS, body).map(
                lambda t: "{% if " + t[0] + " %}" + t[1] + "{% endif %}"
            ),
            body.map(lambda b: "{% set v %}" + b + "{% endset %}"),
            body.map(lambda b: "{% macro m(n=0) %}" + b + "{{ m(n + 1) }}{% endmacro %}{{ m() }}"),
            body.map(lambda b: "{% filter upper %}" + b + "{% endfilter %}"),
        )

    return st.recursive(leaf, extend, max_leaves=8)


TEMPLATES = st.lists(_statements(), min_size=1, max_size=4).map(
    lambda parts: "{% set ns = namespace(s='') %}" + "".join(parts)
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "tool"]),
            "content": st.one_of(st.text(max_size=40), st.just("a" * 10_000), st.none()),
        }
    ),
    min_size=1,
    max_size=4,
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=DERANDOMIZE,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(source=TEMPLATES, messages=MESSAGES)
# the hostile cases of test_chat_template_limits.py, so that every run starts from them
@example(
    source="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    messages=[{"role": "user", "content": "x"}],
)
@example(source="{{ 'x' * 10**9 }}", messages=[{"role": "user", "content": "x"}])
@example(source="{{ ''.__class__.__mro__ }}", messages=[{"role": "user", "content": "x"}])
@example(
    source="{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    messages=[{"role": "user", "content": "x"}],
)
@example(
    source="{% for i in range(100000) %}{{ 'a' * 1000000 }}{% endfor %}",
    messages=[{"role": "user", "content": "x"}],
)
def test_any_template_renders_or_fails_with_our_error_within_the_time_limit(
    source: str, messages: list[dict]
) -> None:
    template = ChatTemplate(source, "fuzz.jinja", time_limit=TIME_LIMIT, max_output=MAX_OUTPUT)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.monotonic()
    try:
        text = template.render(
            messages, add_generation_prompt=True, variables={"bos_token": "<s>", "tools": None}
        )
    except TokenizerError as error:
        message = str(error)
        assert "\n" not in message and message.startswith("chat template fuzz.jinja: ")
        # an allocation that failed means a size went unchecked
        assert "MemoryError" not in message, message
    else:
        assert isinstance(text, str)
        assert len(text) <= MAX_OUTPUT + 4 * 50_000
    elapsed = time.monotonic() - start
    assert elapsed < TIME_LIMIT + SLACK, f"{elapsed:.2f} s for {source!r}"
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown < 512 * 1024, f"peak memory grew by {grown // 1024} MiB for {source!r}"
