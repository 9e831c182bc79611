"""``output=OutputRules(...)``: the output rules as one object, the same request as the loose
keywords, through ``stream_generate`` and ``Engine.stream``; a setting given both ways is a
ValueError naming it, as sampling= beside a sampling keyword is."""

import re

import pytest
from hf_models import add_tokenizer, make_tiny

from mlxinfer import Engine, OutputRules, batch_generate, load, stream_generate

REGEX = "(yes|no), [0-9]{2,3} [a-z]{3,8}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny(
        tmp_path_factory.mktemp("rules") / "tiny", vocab_size=320, max_position_embeddings=128
    )
    add_tokenizer(path)
    return load(path)


def _stop_in(text: str) -> str:
    """A stop string the greedy output holds, past its first characters."""
    words = text.strip()
    assert len(words) > 6, text
    return words[3:6]


def test_output_rules_are_the_loose_keywords(tiny):
    model, tok = tiny
    plain = "".join(r.text for r in stream_generate(model, tok, "Paris is", max_tokens=16))
    stop = _stop_in(plain)
    with Engine(model) as engine:
        runs = {
            "stream_generate": lambda **o: stream_generate(model, tok, "Paris is", **o),
            "Engine.stream": lambda **o: engine.stream(tok, "Paris is", **o),
        }
        for name, run in runs.items():
            for loose in (dict(stop=[stop]), dict(regex=REGEX)):
                expected = list(run(max_tokens=16, **loose))
                one = list(run(max_tokens=16, output=OutputRules(**loose)))
                assert [r.token for r in one] == [r.token for r in expected], (name, loose)
                assert one[-1].stop_string == expected[-1].stop_string
            stopped = list(run(max_tokens=16, output=OutputRules(stop=[stop])))
            assert stopped[-1].stop_string == stop, name
            assert plain.startswith("".join(r.text for r in stopped)), name
            matched = "".join(r.text for r in run(max_tokens=16, output=OutputRules(regex=REGEX)))
            assert re.fullmatch(REGEX, matched), (name, matched)
    assert batch_generate(model, tok, ["Paris is"], max_tokens=16, stop=[stop]) == batch_generate(
        model, tok, ["Paris is"], max_tokens=16, output=OutputRules(stop=[stop])
    )


def test_a_setting_given_both_ways_is_a_type_error_naming_it(tiny):
    model, tok = tiny
    rules = OutputRules(stop=["."])
    with pytest.raises(ValueError, match="regex: given in output="):
        list(stream_generate(model, tok, "x", output=rules, regex=REGEX))
    with pytest.raises(ValueError, match="stop, split_reasoning: given in output="):
        list(stream_generate(model, tok, "x", output=rules, stop=["!"], split_reasoning=True))
    with Engine(model) as engine, pytest.raises(ValueError, match="choices: given in output="):
        list(engine.stream(tok, "x", output=rules, choices=["a", "b"]))
    with pytest.raises(ValueError, match="stop: given in output="):
        batch_generate(model, tok, ["x"], output=rules, stop=["!"])
    # Loose keywords left at their defaults are no clash (an empty stop list among them).
    assert list(stream_generate(model, tok, "x", max_tokens=2, output=rules, stop=[]))
