"""Store names: ``org/name[:variant]``, ``name`` = ``name:latest``; anything else is one line."""

import pytest

from mlxinfer.loading.loader import store_path
from mlxinfer.store import StoreError, parse_name

GOOD = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("HuggingFaceTB", "SmolLM2-135M-Instruct", None),
    "org/Model-GGUF:Q4_K_M": ("org", "Model-GGUF", "Q4_K_M"),
    "mine": (None, "mine", None),
    "mine:v2": (None, "mine", "v2"),
    "a.b_c-d/e.f": ("a.b_c-d", "e.f", None),
}
HOSTILE = {
    "": "an empty name",
    "../etc": "'..' in the org",
    "org/..": "'..' in the name",
    "org/a..b": "'..' in the name",
    "org/name:..": "'..' in the variant",
    "a/b/c": "2 '/'",
    "/etc/passwd": "2 '/'",
    "org/na me": "the character ' ' in the name",
    "org/name:a:b": "a second ':'",
    "org/": "an empty name",
    "org/name:": "an empty variant",
    ".hidden/x": "the org '.hidden' starting with '.'",
    "org/-x": "the name '-x' starting with '-'",
    "org/naïve": "the character 'ï' in the name",
    "org\\x/y": "the character '\\\\' in the org",
    "o/" + "n" * 97: "a name of 97 characters (at most 96)",
}


@pytest.mark.parametrize("text", list(GOOD))
def test_a_good_name_parses_and_has_a_store_directory(text, tmp_path):
    name = parse_name(text)
    assert (name.org, name.name, name.variant) == GOOD[text]
    assert name.path(tmp_path) == store_path(text, tmp_path)  # one layout rule
    assert name.path(tmp_path).is_relative_to(tmp_path / "store")


def test_name_and_name_latest_are_one_model(tmp_path):
    assert parse_name("org/x").path(tmp_path) == parse_name("org/x:latest").path(tmp_path)
    assert str(parse_name("org/x")) == "org/x:latest"
    assert parse_name("Org/X:Q4").path(tmp_path) == parse_name("org/x:q4").path(tmp_path)
    assert parse_name("x").path(tmp_path) == tmp_path / "store" / "library" / "x" / "latest"
    assert parse_name("org/x:a").path(tmp_path) != parse_name("org/x").path(tmp_path)


@pytest.mark.parametrize("text", list(HOSTILE))
def test_a_hostile_name_is_one_line_naming_what_was_found(text, tmp_path):
    with pytest.raises(StoreError) as e:
        parse_name(text)
    message = str(e.value)
    assert "\n" not in message
    assert repr(text) in message and "expected 'org/name'" in message
    assert f"found {HOSTILE[text]}" in message
    assert store_path(text, tmp_path) is None  # resolution never takes it for a stored name
