"""Prompt cleaning, context fitting and stop strings."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxinfer.errors import PromptTooLongError
from mlxinfer.generation.prompt import clean_prompt, fit_context
from mlxinfer.generation.stop import StopMatcher


def test_clean_prompt_normalises_newlines_and_drops_controls():
    assert clean_prompt("a\r\nb\rc\x00d\x1b[0m\te\u200bf") == "a\nb\ncd[0m\te\u200bf"


def test_fit_context_refuses_with_numbers():
    with pytest.raises(PromptTooLongError, match="prompt: 10 tokens, but the model's context is 8"):
        fit_context(list(range(10)), 8, 4, truncate=False)


def test_fit_context_left_truncates():
    assert fit_context(list(range(10)), 8, 3, truncate=True) == list(range(5, 10))
    assert fit_context([1, 2], 8, 3, truncate=False) == [1, 2]


def run(stops, pieces):
    """The text a matcher releases for ``pieces``, and the stop string it hit (None: none)."""
    m = StopMatcher(stops)
    out, hit = [], None
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return out, hit


def test_stop_string_split_across_segments_never_leaks():
    out, hit = run(["</s>"], ["Hello <", "/", "s> more"])
    assert hit == "</s>" and "".join(out) == "Hello " and out[0] == "Hello "


def test_the_matcher_names_the_stop_string_hit():
    """The one the text reached first; of two found in one segment, the one that starts first."""
    assert run(["END", "</s>", "x"], ["ab </", "s> END x"]) == (["ab ", ""], "</s>")
    assert run(["later", "sooner"], ["a sooner or later"]) == (["a "], "sooner")
    assert run(["abc", "ab"], ["xabc"]) == (["x"], "ab")  # same start: the lesser string


def test_false_alarm_prefix_is_released():
    out, hit = run(["STOP"], ["a ST", "ART b"])
    assert hit is None and "".join(out) == "a START b"


@given(st.text(alphabet="abS T", max_size=30), st.lists(st.integers(1, 5), max_size=10))
def test_stream_output_is_text_before_first_stop(text, cuts):
    pieces, i = [], 0
    for c in cuts:
        pieces.append(text[i : i + c])
        i += c
    pieces.append(text[i:])
    out, hit = run(["ST", "bb"], pieces)
    idx = [(j, s) for s in ("ST", "bb") if (j := text.find(s)) >= 0]
    expected = text[: min(idx)[0]] if idx else text
    assert "".join(out) == expected and hit == (min(idx)[1] if idx else None)
