"""Chat templates are untrusted code: a hostile one ends in a one-line TokenizerError naming
the template and the limit it passed, quickly and without building anything huge
(template_guard.py, template_sizes.py) -- never a hang, a gigabyte string or a crash."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from mlxinfer.errors import TokenizerError
from mlxinfer.tokenization.chat_template import ChatTemplate

MESSAGES = [{"role": "user", "content": "hi"}]
MiB = 2**20


def render(source: str, messages=MESSAGES, **limits) -> str:
    template = ChatTemplate(source, "hostile.jinja", **limits)
    return template.render(messages, add_generation_prompt=True, variables={})


def refused(source: str, match: str, *, within: float = 1.5, **limits) -> str:
    """Render ``source``, expecting our error matching ``match`` within ``within`` seconds."""
    start = time.monotonic()
    with pytest.raises(TokenizerError, match=match) as caught:
        render(source, **limits)
    elapsed = time.monotonic() - start
    message = str(caught.value)
    assert message.startswith("chat template hostile.jinja: ") and "\n" not in message
    assert elapsed < within, f"{elapsed:.1f} s: {message}"
    return message


@pytest.mark.parametrize(
    "source",
    [
        # 10**10 iterations, no output, no call inside: only the loops themselves can stop it
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% set r = [0] * 100000 %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% if j is odd %}"
        "{% endif %}{% endfor %}{% endfor %}",
    ],
)
def test_a_loop_that_would_run_for_hours_stops_at_the_time_limit(source: str) -> None:
    refused(source, r"rendering ran past the time limit of 0\.3 s", time_limit=0.3)


def test_compiling_a_huge_template_stops_at_its_own_time_limit() -> None:
    # ~64 KiB of dense tags: seconds of Jinja's parser and code generator
    template = ChatTemplate("{% if x %}{{ a.b | upper }}{% endif %}" * 1800, "hostile.jinja")
    template.compile_time_limit = 0.2
    start = time.monotonic()
    with pytest.raises(TokenizerError, match=r"compiling ran past the time limit of 0\.2 s"):
        template.render(MESSAGES, add_generation_prompt=True, variables={})
    assert time.monotonic() - start < 1.5


def test_template_source_past_one_mebibyte_is_refused_before_compiling() -> None:
    refused("x" * (MiB + 1), rf"{MiB + 1} characters of source pass the limit of {MiB}")


@pytest.mark.parametrize(
    "source, match",
    [
        # each asks for 10**8 characters, 24x the 4 MiB cap: refused before Python builds it
        ("{{ 'x' * 10**8 }}", "the product of ~100000000 characters"),
        ("{{ 'x' | center(10**8) }}", "the 'center' filter: the argument 100000000"),
        ("{{ 'x'.ljust(10**8) }}", r"ljust\(\): the argument 100000000"),
        ("{{ (1).to_bytes(10**8, 'big') | length }}", r"to_bytes\(\): the argument 100000000"),
        ("{{ '%100000000d' % 1 }}", "the format width 100000000"),
        ("{{ '%100000000d' | format(1) }}", "the format width 100000000"),
        ("{{ '{:100000000}'.format(1) }}", "the format width 100000000"),
        ("{{ '{:{}}'.format(1, 10**8) }}", "the format: the argument 100000000"),
        ("{{ ('a' * 4000000).replace('a', 'b' * 25) | length }}", "the replaced text"),
        ("{{ ('a' * 4000000) | replace('a', 'b' * 25) | length }}", "the replaced text"),
        ("{{ ('\t' * 4000000).expandtabs(25) | length }}", "the expanded text"),
        ("{{ ('\n' * 4000000) | indent(25) | length }}", "the indented text"),
        ("{% set big = 'a' * 1000000 %}{{ ([big] * 100) | join | length }}", "the joined text"),
        ("{% set big = 'a' * 1000000 %}{{ ''.join([big] * 100) | length }}", "the joined text"),
        ("{% set big = 'a' * 1000000 %}{{ ([big] * 100) | tojson | length }}", "the JSON"),
        ("{% set big = 'a' * 1000000 %}{{ ([big] * 100) | string | length }}", "'string' filter"),
        ("{{ [0] | batch(10**8, 0) | list | length }}", "the 'batch' filter: the argument"),
        # doubling by ~ and +: 2**27 characters after 27 steps
        (
            "{% set ns = namespace(s='x') %}{% for i in range(27) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
            "the concatenation of ~8388608 characters",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(27) %}"
            "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
            "the sum of ~8388608 characters",
        ),
    ],
)
def test_a_value_past_the_size_limit_is_refused_before_it_is_built(source: str, match: str) -> None:
    message = refused(source, match)
    assert "passes the limit of" in message


def test_integers_stay_under_4096_bits() -> None:
    refused(
        "{{ (2 ** 100000).bit_length() }}", r"the power 2\*\*100000 passes the limit of 4096 bits"
    )
    refused(
        "{% set ns = namespace(n=3) %}{% for i in range(20) %}{% set ns.n = ns.n * ns.n %}"
        "{% endfor %}{{ ns.n.bit_length() }}",
        "the product of integers passes the limit of 4096 bits",
    )


def test_the_rendered_text_has_a_cap_that_grows_with_the_conversation() -> None:
    # 10 MB of output from 1 MB pieces, written out or captured by {% set %} / a macro
    for source in (
        "{% set big = 'a' * 1000000 %}{% for i in range(10) %}{{ big }}{% endfor %}",
        "{% set big = 'a' * 1000000 %}{% set x %}{% for i in range(10) %}{{ big }}{% endfor %}"
        "{% endset %}{{ x | length }}",
        "{% macro m() %}{{ 'a' * 1000000 }}{% endmacro %}{{ (m() ~ m() ~ m() ~ m() ~ m()) | length }}",
    ):
        refused(source, r"passes the limit of 4194\d\d\d characters")
    # A 5 MiB conversation still renders: its own size earns room (INPUT_ALLOWANCE x it).
    long = [{"role": "user", "content": "w" * (5 * MiB)}]
    rendered = render("{% for m in messages %}{{ m.content }}{% endfor %}", long)
    assert len(rendered) == 5 * MiB


def test_a_smaller_output_cap_can_be_set() -> None:
    message = refused(
        "{% for i in range(200) %}{{ 'abcdefghij' }}{% endfor %}",
        r"the rendered text passes the limit of \d+ characters",
        max_output=1000,
    )
    # 1000 plus room for the few characters of MESSAGES (INPUT_ALLOWANCE times them)
    assert 1000 < int(message.split("limit of ")[1].split()[0]) < 1000 + 4 * 100


def test_endless_macro_recursion_is_our_error_even_with_a_deep_python_stack() -> None:
    # With the interpreter's recursion limit raised (as some applications do), a template's
    # endless recursion used to overflow the C stack: a segmentation fault.
    code = textwrap.dedent(
        """
        import sys
        sys.setrecursionlimit(1_000_000)
        from mlxinfer.errors import TokenizerError
        from mlxinfer.tokenization.chat_template import ChatTemplate
        for source in (
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}",
        ):
            try:
                ChatTemplate(source, "t").render(
                    [{"role": "user", "content": "x"}], add_generation_prompt=True, variables={}
                )
            except TokenizerError as e:
                print(e)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    assert all("calls nested deeper than the limit of 64" in line for line in lines)
