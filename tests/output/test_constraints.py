"""Structured output (mlxinfer/output/constraints/): JSON Schemas, regexes, choices and grammars
enforced token by token.

Each sampled token is checked against a matcher of the library's own, built here from the
grammar and fed the same tokens (not the processor under test); the finished outputs are
checked with Python's ``re`` and the ``jsonschema`` package."""

from __future__ import annotations

import json
import os
import re
import threading

import pytest
from hf_models import add_tokenizer, make_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

llguidance = pytest.importorskip("llguidance", reason="llguidance (structured output) is missing")
jsonschema = pytest.importorskip(
    "jsonschema", reason="jsonschema (the test's validator) is missing"
)

from mlxinfer import Engine, PromptLookup, generate, load, stream_generate  # noqa: E402
from mlxinfer.errors import ConstraintError  # noqa: E402
from mlxinfer.output.constraints import Constraint, from_options  # noqa: E402
from mlxinfer.output.constraints.matcher import vocabulary  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("constraints"), vocab_size=320, hidden_size=64)
    add_tokenizer(path)
    return load(str(path))


def allowed_each_step(tokenizer, constraint: Constraint, tokens: list[int]) -> list[bool]:
    """For each token, whether the library's own matcher allowed it at its step."""
    matcher = llguidance.LLMatcher(vocabulary(tokenizer).llg, constraint.grammar, log_level=0)
    out = []
    for t in tokens:
        mask = matcher.compute_bitmask()
        out.append(bool(mask[t // 8] >> (t % 8) & 1))
        if not out[-1] or not matcher.consume_token(t):
            break
    return out


def tokens_of(results) -> tuple[list[int], str, str]:
    results = list(results)
    return [r.token for r in results], "".join(r.text for r in results), results[-1].finish_reason


# --- a constraint is checked when it is made ---------------------------------------------------


@pytest.mark.parametrize(
    "make, named",
    [
        (
            lambda: Constraint.json_schema({"not": {"type": "string"}}),
            'Unimplemented keys: ["not"]',
        ),
        (lambda: Constraint.json_schema({"type": "strin"}), "Invalid type: strin"),
        (
            lambda: Constraint.json_schema({"type": "integer", "minimum": 3, "maximum": 1}),
            "minimum",
        ),
        (lambda: Constraint.json_schema("{not json"), "json_schema: not valid JSON"),
        (lambda: Constraint.json_schema([1]), "expected a JSON object, found list"),
        (lambda: Constraint.regex("[a-"), "unclosed character class"),
        (lambda: Constraint.choices([]), "choices: expected non-empty strings"),
        (lambda: Constraint.grammar("start: foo"), 'unknown name: "foo"'),
        (lambda: Constraint.from_response_format({"type": "xml"}), "response_format.type"),
        (
            lambda: Constraint.from_response_format({"type": "json_schema", "json_schema": 3}),
            "response_format.json_schema",
        ),
        (
            lambda: from_options(regex="a", choices=["a"]),
            "give one constraint, found regex, choices",
        ),
    ],
)
def test_a_bad_constraint_is_an_error_naming_what_is_wrong(make, named):
    with pytest.raises(ConstraintError) as e:
        make()
    assert named in str(e.value)


def test_a_bad_constraint_fails_before_any_token(tiny):
    model, tokenizer = tiny
    results = stream_generate(model, tokenizer, "Hi", json_schema={"not": {}})
    with pytest.raises(ConstraintError, match="not"):
        next(results)


# --- every token allowed ------------------------------------------------------------------------

LEAF = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 200),
    ),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.just({"type": "boolean"}),
    st.lists(st.text("abxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
)


def _object(properties: dict):
    names = sorted(properties)
    return st.lists(st.sampled_from(names), unique=True).map(
        lambda required: {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }
    )


SCHEMAS = st.recursive(
    LEAF,
    lambda inner: st.one_of(
        st.builds(
            lambda items, lo, extra: {
                "type": "array",
                "items": items,
                "minItems": lo,
                "maxItems": lo + extra,
            },
            inner,
            st.integers(0, 2),
            st.integers(0, 2),
        ),
        st.dictionaries(st.sampled_from("abcd"), inner, min_size=1, max_size=3).flatmap(_object),
    ),
    max_leaves=5,
)
ATOMS = st.sampled_from(["[a-z]", "[0-9]", "x", "(ab|cd)", "-", "[A-F]"])
REGEXES = st.lists(
    ATOMS.flatmap(lambda a: st.sampled_from([a, a + "{1,3}", a + "?", a + "{2}"])),
    min_size=1,
    max_size=5,
).map("".join)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=SCHEMAS, seed=st.integers(0, 2**16), lookup=st.booleans())
def test_sampled_json_follows_a_random_schema_token_by_token(tiny, schema, seed, lookup):
    """Sampled at temperature 1, half the time drafting by prompt lookup."""
    model, tokenizer = tiny
    c = Constraint.json_schema(schema)
    extra = {"draft": PromptLookup()} if lookup else {}
    results = stream_generate(
        model,
        tokenizer,
        'Data: {"a": [1, 2], "b": true}',
        max_tokens=300,
        temperature=1.0,
        seed=seed,
        constraint=c,
        **extra,
    )
    tokens, text, finish = tokens_of(results)
    assert all(allowed_each_step(tokenizer, c, tokens))
    assert finish == "stop" and tokens[-1] in tokenizer.eos_token_ids, (schema, text)
    jsonschema.validate(json.loads(text), schema)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pattern=REGEXES, seed=st.integers(0, 2**16), lookup=st.booleans())
def test_sampled_text_matches_a_random_regex_token_by_token(tiny, pattern, seed, lookup):
    model, tokenizer = tiny
    c = Constraint.regex(pattern)
    extra = {"draft": PromptLookup()} if lookup else {}
    results = stream_generate(
        model,
        tokenizer,
        "Code: ab-12 cd-34 xx:",
        max_tokens=100,
        temperature=1.0,
        seed=seed,
        regex=pattern,
        **extra,
    )
    tokens, text, finish = tokens_of(results)
    assert all(allowed_each_step(tokenizer, c, tokens))
    assert finish == "stop" and re.fullmatch(pattern, text), (pattern, text)


def test_a_choice_is_one_of_the_options_and_ends_at_eos(tiny):
    model, tokenizer = tiny
    options = ["yes", "no", "maybe later"]
    for seed in range(6):
        tokens, text, finish = tokens_of(
            stream_generate(model, tokenizer, "Well?", temperature=1.0, seed=seed, choices=options)
        )
        assert text in options and finish == "stop" and tokens[-1] in tokenizer.eos_token_ids


def test_a_lark_grammar(tiny):
    model, tokenizer = tiny
    grammar = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'
    for seed in range(4):
        text = generate(
            model, tokenizer, "Tuple:", temperature=1.0, seed=seed, max_tokens=80, grammar=grammar
        )
        assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", text), text


def test_a_constraint_composes_with_the_samplers_filters(tiny):
    """top-k, top-p, min-p and a repetition penalty act on the allowed tokens only: the
    output still matches, and greedy equals top-k 1."""
    model, tokenizer = tiny
    c = Constraint.json_schema(PERSON)
    greedy = generate(model, tokenizer, "P:", constraint=c, max_tokens=60)
    assert (
        generate(model, tokenizer, "P:", constraint=c, temperature=1.0, top_k=1, max_tokens=60)
        == greedy
    )
    for options in (
        dict(top_p=0.5),
        dict(min_p=0.2),
        dict(repetition_penalty=1.3),
        dict(top_k=3, top_p=0.9),
    ):
        text = generate(
            model, tokenizer, "P:", constraint=c, temperature=1.0, seed=1, max_tokens=60, **options
        )
        jsonschema.validate(json.loads(text), PERSON)


# --- inside the batch and with speculative decoding ---------------------------------------------


def test_mixed_rows_in_a_batch_with_prompt_lookup_each_match_and_equal_alone(tiny):
    """8 rows at once: schemas, regexes, a choice and unconstrained rows, half of them
    drafting by prompt lookup, greedy and seeded: each row's tokens are all allowed and
    the same as the request alone with the same draft source (no state passes between
    rows). Greedy rows drafting equal them without drafts too (checked below)."""
    model, tokenizer = tiny
    rows = [
        (dict(json_schema=PERSON), {}),
        (dict(regex="[0-9]{3}-[a-z]{2,4}"), dict(draft=PromptLookup())),
        (dict(choices=["alpha", "beta", "gamma"]), {}),
        ({}, dict(draft=PromptLookup())),
        (dict(json_schema={"type": "array", "items": {"type": "boolean"}, "maxItems": 4}), {}),
        (dict(regex="(ab|cd){2,5}x"), dict(draft=PromptLookup(), num_draft=3)),
        ({}, {}),
        (dict(json_schema=PERSON), dict(draft=PromptLookup())),
    ]
    prompts = [f"Row {i} says abab cdcd 123-ab:" for i in range(8)]
    sampling = [dict(temperature=1.0, seed=i) if i % 2 else {} for i in range(8)]
    got = [None] * 8
    with Engine(model, max_batch=8) as engine:

        def run(i):
            constraint, extra = rows[i]
            got[i] = tokens_of(
                engine.stream(
                    tokenizer,
                    prompts[i],
                    max_tokens=60,
                    sampling=_sampling(**sampling[i]),
                    **constraint,
                    **extra,
                )
            )

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for i, ((constraint, extra), (tokens, text, _finish)) in enumerate(zip(rows, got)):
        alone = tokens_of(
            stream_generate(
                model, tokenizer, prompts[i], max_tokens=60, **sampling[i], **constraint, **extra
            )
        )
        assert (tokens, text) == alone[:2], i
        c = from_options(**constraint)
        if c is not None:
            assert all(allowed_each_step(tokenizer, c, tokens)), i


ROW = st.one_of(
    SCHEMAS.map(lambda schema: ("json_schema", schema)),
    REGEXES.map(lambda pattern: ("regex", pattern)),
    st.just((None, None)),
)


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(st.tuples(ROW, st.booleans()), min_size=8, max_size=8), seed=st.integers(0, 99)
)
def test_random_constraints_in_a_batch_of_eight_with_prompt_lookup(tiny, rows, seed):
    """Eight rows at once, each a random schema, a random regex or nothing, each drafting by
    prompt lookup or not, sampled: every constrained row's tokens are allowed at each step and
    its output validates or matches."""
    model, tokenizer = tiny
    got = [None] * 8
    with Engine(model, max_batch=8) as engine:

        def run(i):
            (kind, source), lookup = rows[i]
            extra = {kind: source} if kind else {}
            if lookup:
                extra["draft"] = PromptLookup()
            got[i] = tokens_of(
                engine.stream(
                    tokenizer,
                    f'Row {i}: {{"a": [1, 2]}} ab-12 cd-34',
                    max_tokens=300,
                    sampling=_sampling(temperature=1.0, seed=seed + i),
                    **extra,
                )
            )

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    for ((kind, source), _), (tokens, text, finish) in zip(rows, got):
        if kind is None:
            continue
        c = from_options(**{kind: source})
        assert all(allowed_each_step(tokenizer, c, tokens)), (kind, source, text)
        assert finish == "stop", (kind, source, text)
        if kind == "regex":
            assert re.fullmatch(source, text), (source, text)
        else:
            jsonschema.validate(json.loads(text), source)


def _sampling(**options):
    from mlxinfer import SamplingParams

    return SamplingParams(**options)


def test_speculative_decoding_alone_keeps_the_constraint_and_the_output(tiny):
    """Prompt lookup proposes drafts the grammar may forbid: they are rejected, rolled back,
    and the output is exactly the one without speculation."""
    model, tokenizer = tiny
    prompt = 'The list [true, false, true, false, true] and {"name": "ab", "age": 12}:'
    for constraint in (dict(json_schema=PERSON), dict(regex="(true|false)(, (true|false)){2,5}")):
        plain = generate(model, tokenizer, prompt, max_tokens=60, **constraint)
        drafted = generate(
            model, tokenizer, prompt, max_tokens=60, draft=PromptLookup(), num_draft=4, **constraint
        )
        assert drafted == plain


def test_no_state_leaks_to_the_next_request(tiny):
    model, tokenizer = tiny
    fresh = generate(model, tokenizer, "Hello", max_tokens=30)
    with Engine(model) as engine:
        constrained = "".join(
            r.text for r in engine.stream(tokenizer, "Hello", max_tokens=30, json_schema=PERSON)
        )
        after = "".join(r.text for r in engine.stream(tokenizer, "Hello", max_tokens=30))
    jsonschema.validate(json.loads(constrained), PERSON)
    assert after == fresh


# --- other tokenizers ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken"])
def test_sentencepiece_and_tiktoken_vocabularies(kind, tmp_path):
    """The processor alone, on random logits, through a SentencePiece or tiktoken tokenizer:
    the decoded text of what it lets through matches."""
    import mlx.core as mx

    from mlxinfer import Tokenizer

    if kind == "sentencepiece":
        from tokenizer_fixtures import build_sentencepiece

        tokenizer = Tokenizer.from_dir(build_sentencepiece(tmp_path))
    else:
        from test_tiktoken import build_tiktoken

        tokenizer = Tokenizer.from_dir(build_tiktoken(tmp_path))
    pattern = "[a-z]{2,6} [0-9]{1,3}"
    process = Constraint.regex(pattern).processor(tokenizer)
    history = [tokenizer.bos_token_id or 0]
    mx.random.seed(0)
    for _ in range(40):
        logits = mx.random.normal((1, tokenizer.vocab_size))
        token = int(mx.argmax(process(mx.array(history), logits), axis=-1).item())
        history.append(token)
        if token in tokenizer.eos_token_ids:
            break
    assert history[-1] in tokenizer.eos_token_ids
    assert re.fullmatch(pattern, tokenizer.decode(history[1:-1]))


# --- reachable from the command line ------------------------------------------------------------


def test_cli_json_schema_regex_and_choice(tiny, tmp_path):
    from click.testing import CliRunner

    from mlxinfer.cli.main import cli

    model_dir = str(tiny[1].path)
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    run = CliRunner().invoke
    r = run(
        cli, ["generate", "-m", model_dir, "-p", "Hi", "-n", "80", "--json-schema", str(schema)]
    )
    assert r.exit_code == 0, r.output
    jsonschema.validate(json.loads(r.stdout), PERSON)
    r = run(cli, ["generate", "-m", model_dir, "-p", "Hi", "--regex", "[0-9]{2}x"])
    assert r.exit_code == 0 and re.fullmatch("[0-9]{2}x", r.stdout.strip()), r.output
    r = run(cli, ["generate", "-m", model_dir, "-p", "Hi", "--choice", "up", "--choice", "down"])
    assert r.exit_code == 0 and r.stdout.strip() in ("up", "down"), r.output
    # Any JSON object: the random tiny model writes keys of any length, so only its start.
    r = run(cli, ["generate", "-m", model_dir, "-p", "Hi", "--json", "-n", "8"])
    assert r.exit_code == 0 and r.stdout.startswith('{"'), r.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "properties": {"a": {"not": {}}}}')
    r = run(cli, ["generate", "-m", model_dir, "-p", "Hi", "--json-schema", str(bad)])
    assert r.exit_code == 1 and str(bad) in r.output and '["not"]' in r.output
    r = run(cli, ["generate", "-m", model_dir, "-p", "Hi", "--json", "--regex", "a"])
    assert r.exit_code == 2 and "choose one constraint" in r.output


# --- the real model -----------------------------------------------------------------------------


@pytest.mark.real
def test_twenty_schemas_on_smollm2_greedy_and_sampled(smollm2_mlx_dir, record_property):
    """SmolLM2-135M-Instruct (the GGUF's 4-bit import, on the compiled kernels where they
    load), 20 schemas of different shapes, each asked for in the prompt: every constrained
    output parses and validates, greedy and at temperature 1.0 (the 40 requests in one batch);
    without the constraint the same prompts mostly fail (the count is reported). The suite runs
    every other schema (10: ~14 s of its 10 minutes); all 20 with MLXINFER_SLOW=1."""
    from schemas import CASES, prompt

    if os.environ.get("MLXINFER_SLOW") != "1":
        CASES = CASES[::2]

    from mlxinfer import SamplingParams
    from mlxinfer.backends.cpu import plans as cpu_plans

    model, tokenizer = load(smollm2_mlx_dir)
    if getattr(model, "backend", None) == "cpu":
        cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    prompts = [[{"role": "user", "content": prompt(what, schema)}] for what, schema in CASES]

    def run(engine, jobs, max_tokens):
        """Each (case index, sampling, constrained) job as one request, all in one batch."""
        outs = [None] * len(jobs)

        def one(j):
            i, sampling, constrained = jobs[j]
            extra = dict(json_schema=CASES[i][1]) if constrained else {}
            results = engine.stream(
                tokenizer,
                prompts[i],
                max_tokens=max_tokens,
                sampling=sampling,
                chat_template=True,
                **extra,
            )
            outs[j] = "".join(r.text for r in results)

        threads = [threading.Thread(target=one, args=(j,)) for j in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        return outs

    def valid(text, schema) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    n = len(CASES)
    samplings = [SamplingParams(), SamplingParams(temperature=1.0, seed=0)]
    jobs = [(i, s, True) for s in samplings for i in range(n)]
    # One engine for both runs: the unconstrained requests find their prompts' blocks cached.
    with Engine(model, max_batch=len(jobs)) as engine:
        outs = run(engine, jobs, 160)
        bad = [(CASES[i][0], s.temperature, out) for (i, s, _), out in zip(jobs, outs)]
        bad = [b for b, (i, _, _), out in zip(bad, jobs, outs) if not valid(out, CASES[i][1])]
        assert bad == []
        outs = run(engine, [(i, samplings[0], False) for i in range(n)], 64)
    unconstrained = sum(valid(out, schema) for (_, schema), out in zip(CASES, outs))
    record_property("unconstrained_valid", f"{unconstrained}/{n}")
    print(f"unconstrained, greedy: {unconstrained} of {n} valid")
    assert unconstrained <= n // 2
