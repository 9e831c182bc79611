"""Tokenizer specification: encode / decode / special tokens match transformers' AutoTokenizer
for the same directory; chat templates render exactly as transformers renders them, inside a
sandbox; bad files fail with one-line TokenizerErrors."""

from __future__ import annotations

import json
import random
import shutil
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_fixtures import (
    CHATML_TEMPLATE,
    build_byte_fallback_json,
    build_byte_level_bpe,
    build_sentencepiece,
)

from mlxinfer.errors import TokenizerError
from mlxinfer.tokenization import Tokenizer

transformers = pytest.importorskip("transformers")

KINDS = ["bpe_bos", "bpe_plain", "spm", "spm_json"]

SAMPLES = [
    "",
    "Hello world",
    "Hello world, this is a test.",
    " leading space",
    "two  spaces and trailing ",
    "  ",
    "line\nbreaks\n\n\tand tabs",
    "Café naïve résumé straße",
    "e\u0301 combining mark",
    "日本語のテキスト 中文 한국어",
    "rare CJK 龘 饕餮",
    "emoji 😀🎉 family 👨‍👩‍👧 flag 🇯🇵",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s>[INST] Hello [/INST] Hi</s>",
    "control \x00\x01\x7f chars",
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    spm = build_sentencepiece(root / "spm")
    return {
        "bpe_bos": build_byte_level_bpe(root / "bpe_bos", add_bos=True),
        "bpe_plain": build_byte_level_bpe(root / "bpe_plain", add_bos=False),
        "spm": spm,
        "spm_json": build_byte_fallback_json(spm, root / "spm_json"),
    }


@pytest.fixture(scope="module")
def ours(dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {kind: Tokenizer.from_dir(path) for kind, path in dirs.items()}


@pytest.fixture(scope="module")
def theirs(dirs: dict[str, Path]) -> dict[str, object]:
    return {
        kind: transformers.AutoTokenizer.from_pretrained(str(path)) for kind, path in dirs.items()
    }


# --- encode / decode parity ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours, theirs, kind, add_special_tokens):
    for text in SAMPLES:
        expected = theirs[kind].encode(text, add_special_tokens=add_special_tokens)
        assert ours[kind].encode(text, add_special_tokens=add_special_tokens) == expected, repr(
            text
        )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_matches_transformers(ours, theirs, kind, skip_special_tokens):
    for text in SAMPLES:
        ids = theirs[kind].encode(text)
        expected = theirs[kind].decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours[kind].decode(ids, skip_special_tokens=skip_special_tokens) == expected, repr(
            text
        )


@pytest.mark.parametrize("kind", KINDS)
def test_decode_of_arbitrary_ids_matches_transformers(ours, theirs, kind):
    # Including lone and invalid byte tokens, whose decoding is the least obvious part.
    tokenizer = ours[kind]
    rng = random.Random(1234)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 10))]
        for skip in (False, True):
            assert tokenizer.decode(ids, skip) == theirs[kind].decode(
                ids, skip_special_tokens=skip
            ), ids


@pytest.mark.parametrize("kind", ["bpe_bos", "spm", "spm_json"])
@settings(max_examples=100, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=40))
def test_encode_matches_transformers_on_random_text(ours, theirs, kind, text):
    assert ours[kind].encode(text) == theirs[kind].encode(text)


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_match_transformers(ours, theirs, kind):
    tokenizer, reference = ours[kind], theirs[kind]
    assert tokenizer.bos_token_id == reference.bos_token_id
    assert reference.eos_token_id in tokenizer.eos_token_ids
    assert tokenizer.vocab_size == len(reference)
    assert tokenizer.bos_token == reference.bos_token
    assert tokenizer.eos_token == reference.eos_token


def test_bos_follows_the_tokenizer_json_post_processor_not_add_bos_token(ours):
    # Both configs say the opposite of their post-processor; transformers 5 follows the post-processor.
    bos = ours["bpe_bos"].bos_token_id
    assert ours["bpe_bos"].encode("hi")[0] == bos
    assert ours["bpe_bos"].encode("hi", add_special_tokens=False)[0] != bos
    assert bos not in ours["bpe_plain"].encode("hi")


def test_sentencepiece_bos_follows_add_bos_token(dirs, tmp_path):
    tokenizer = Tokenizer.from_dir(dirs["spm"])
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id == 1
    directory = shutil.copytree(dirs["spm"], tmp_path / "spm")
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_eos_token": True}))
    tokenizer = Tokenizer.from_dir(directory)
    ids = tokenizer.encode("hi")
    assert ids[0] != 1 and ids[-1] == 2  # SentencePiece's own <s> / </s> serve as BOS / EOS
    assert tokenizer.eos_token_ids == {2}


def test_eos_ids_gather_tokenizer_generation_and_model_configs(ours):
    tokenizer = ours["bpe_bos"]
    expected = {tokenizer.token_to_id(t) for t in ("<|end_of_text|>", "<|im_end|>", "<|eot_id|>")}
    assert tokenizer.eos_token_ids == expected
    assert isinstance(tokenizer.eos_token_ids, frozenset)


def test_special_tokens_are_one_id_and_skipped_when_asked(ours):
    tokenizer = ours["bpe_plain"]
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert ids[-1] == tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_decode_ignores_ids_outside_the_vocabulary(ours):
    for tokenizer in ours.values():
        ids = tokenizer.encode("hello", add_special_tokens=False)
        assert tokenizer.decode(ids + [tokenizer.vocab_size + 5, -1]) == tokenizer.decode(ids)


def test_lone_surrogate_is_a_tokenizer_error(ours):
    for tokenizer in ours.values():
        with pytest.raises(TokenizerError, match=r"lone surrogate '\\ud800' at index 1"):
            tokenizer.encode("a\ud800b")


def test_byte_level_round_trip_is_lossless(ours):
    text = "Any text: 日本語 😀 e\u0301 \x00\t\r\n  done "
    assert ours["bpe_plain"].decode(ours["bpe_plain"].encode(text)) == text


# --- chat templates ------------------------------------------------------------------------------

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have these tools:\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# The less common features Hub templates rely on.
FEATURES_TEMPLATE = """{% set ns = namespace(turns=0, last_user='') %}
{% for message in messages %}
    {% if message.role == 'tool' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message.role == 'user' %}{% set ns.last_user = message.content %}{% endif %}
<{{ message.role }}>
    {%- if message.content is defined %}{{ message.content }}{% endif %}
    {%- if message.tool_calls is defined %}{% for call in message.tool_calls %}{{ call | tojson }}{% endfor %}{% endif %}
    {%- if message.role == 'assistant' %}{% generation %}[gen]{% endgeneration %}{% endif %}
</{{ message.role }}>
    {% if ns.turns >= 4 %}{% break %}{% endif %}
{% endfor %}
turns={{ ns.turns }} last={{ ns.last_user }} dict={{ dict(a=1, b='é') | tojson }} keys={{ dict.fromkeys(['x']) | tojson }}
{% if enable_thinking is defined %}thinking={{ enable_thinking }}{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2? <b>&</b> 日本"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  And 3+3?  "},
    ],
]


def _with_template(directory: Path, destination: Path, template: str) -> Path:
    shutil.copytree(directory, destination)
    (destination / "chat_template.jinja").write_text(template, encoding="utf-8")
    return destination


@pytest.mark.parametrize(
    "template",
    [CHATML_TEMPLATE, LLAMA3_TEMPLATE, MISTRAL_TEMPLATE],
    ids=["chatml", "llama3", "mistral"],
)
@pytest.mark.parametrize("base", ["bpe_bos", "spm"])
def test_chat_template_matches_transformers(dirs, tmp_path, template, base):
    directory = _with_template(dirs[base], tmp_path / "model", template)
    tokenizer = Tokenizer.from_dir(directory)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert tokenizer.has_chat_template
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            rendered = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt
            )
            assert rendered == expected


@pytest.mark.parametrize("name", ["gemma", "chatml"])
def test_named_chat_template_renders_like_transformers(dirs, tmp_path, name):
    """``set_chat_template(name)`` (``--chat-template``) on a tokenizer with none, and the same
    template read from a Jinja file, render as transformers renders that template."""
    from mlxinfer.tokenization.chat_template import NAMED_TEMPLATES

    reference = transformers.AutoTokenizer.from_pretrained(
        str(_with_template(dirs["spm"], tmp_path / "model", NAMED_TEMPLATES[name]))
    )
    for source in (name, str(tmp_path / "model" / "chat_template.jinja")):
        tokenizer = Tokenizer.from_dir(dirs["spm"])
        tokenizer.set_chat_template(source)
        for messages in CONVERSATIONS:
            expected = reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            assert tokenizer.apply_chat_template(messages) == expected


def test_chat_template_kwargs_and_tools_match_transformers(dirs, tmp_path):
    directory = _with_template(dirs["bpe_bos"], tmp_path / "model", LLAMA3_TEMPLATE)
    tokenizer = Tokenizer.from_dir(directory)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Météo <now> & later",
                "parameters": {"city": {"type": "string"}},
            },
        }
    ]
    kwargs = {"tools": tools, "date_string": "01 Jan 2025"}
    expected = reference.apply_chat_template(
        CONVERSATIONS[1], tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert tokenizer.apply_chat_template(CONVERSATIONS[1], **kwargs) == expected
    assert (
        '"description": "Météo <now> & later"' in expected
    )  # HF's tojson: no HTML escaping, no \\u escapes


def test_chat_template_features_match_transformers(dirs, tmp_path):
    directory = _with_template(dirs["bpe_plain"], tmp_path / "model", FEATURES_TEMPLATE)
    tokenizer = Tokenizer.from_dir(directory)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = [
        {"role": "user", "content": "first"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"name": "f", "arguments": {"x": "ü"}}],
        },
        {"role": "tool", "content": "42"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "never reached"},
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert tokenizer.apply_chat_template(messages, **kwargs) == expected
    assert "None" not in expected  # a None content counts as absent, as in transformers


def test_chat_template_leaves_messages_untouched(ours):
    messages = [{"role": "user", "content": "hi", "extra": None}]
    snapshot = json.dumps(messages)
    ours["bpe_bos"].apply_chat_template(messages)
    assert json.dumps(messages) == snapshot


def test_strftime_now(dirs, tmp_path):
    directory = _with_template(
        dirs["bpe_plain"], tmp_path / "model", "{{ strftime_now('%Y-%m-%d') }}"
    )
    before = datetime.now()
    rendered = Tokenizer.from_dir(directory).apply_chat_template([{"role": "user", "content": "x"}])
    assert rendered in {
        before.strftime("%Y-%m-%d"),
        (before + timedelta(seconds=5)).strftime("%Y-%m-%d"),
    }


def test_chat_template_sources_and_priority(dirs, tmp_path):
    messages = [{"role": "user", "content": "x"}]
    directory = shutil.copytree(dirs["bpe_plain"], tmp_path / "model")
    # tokenizer_config.json's template (ChatML here) is used when nothing else exists ...
    assert (
        Tokenizer.from_dir(directory)
        .apply_chat_template(messages)
        .endswith("<|im_start|>assistant\n")
    )
    # ... chat_template.json beats it ...
    (directory / "chat_template.json").write_text(
        json.dumps({"chat_template": "json:{{ messages[0].content }}"})
    )
    assert Tokenizer.from_dir(directory).apply_chat_template(messages) == "json:x"
    # ... and chat_template.jinja beats both.
    (directory / "chat_template.jinja").write_text("jinja:{{ messages[0].content }}")
    assert Tokenizer.from_dir(directory).apply_chat_template(messages) == "jinja:x"
    extra = directory / "additional_chat_templates"
    extra.mkdir()
    (extra / "tool_use.jinja").write_text("tools:{{ tools | length }}")
    tokenizer = Tokenizer.from_dir(directory)
    assert tokenizer.apply_chat_template(messages) == "jinja:x"
    assert tokenizer.apply_chat_template(messages, tools=[{"name": "f"}]) == "tools:1"


def test_named_templates_in_tokenizer_config(dirs, tmp_path):
    directory = shutil.copytree(dirs["spm"], tmp_path / "model")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain {{ bos_token }}"},
        {"name": "tool_use", "template": "tools {{ tools[0].name }}"},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(directory)
    messages = [{"role": "user", "content": "x"}]
    assert tokenizer.apply_chat_template(messages) == "plain <s>"
    assert tokenizer.apply_chat_template(messages, tools=[{"name": "f"}]) == "tools f"


def test_no_chat_template(dirs):
    tokenizer = Tokenizer.from_dir(dirs["spm"])
    assert not tokenizer.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


# --- template failures ---------------------------------------------------------------------------

SANDBOX_ESCAPES = [
    "{{ ''.__class__ }}",  # transformers renders this as ""; here any unsafe attribute fails at once
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ namespace(_private=1) }}",
]


@pytest.mark.parametrize("template", SANDBOX_ESCAPES)
def test_template_cannot_escape_the_sandbox(dirs, tmp_path, template):
    directory = _with_template(dirs["bpe_plain"], tmp_path / "model", template)
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_dir(directory).apply_chat_template([{"role": "user", "content": "x"}])
    assert "chat_template.jinja" in str(info.value)
    assert "\n" not in str(info.value)


def test_raise_exception_becomes_tokenizer_error(dirs, tmp_path):
    directory = _with_template(dirs["bpe_bos"], tmp_path / "model", MISTRAL_TEMPLATE)
    tokenizer = Tokenizer.from_dir(directory)
    with pytest.raises(
        TokenizerError, match="raised: After the optional system message, conversation roles"
    ):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_syntax_error(dirs, tmp_path):
    directory = _with_template(dirs["bpe_bos"], tmp_path / "model", "line one\n{% for x in %}\n")
    with pytest.raises(
        TokenizerError, match=r"chat_template\.jinja: syntax error at line 2"
    ) as info:
        Tokenizer.from_dir(directory).apply_chat_template([{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)


def test_template_runtime_error(dirs, tmp_path):
    directory = _with_template(dirs["bpe_bos"], tmp_path / "model", "{{ 1 / 0 }}")
    with pytest.raises(TokenizerError, match="ZeroDivisionError"):
        Tokenizer.from_dir(directory).apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_messages(ours):
    tokenizer = ours["bpe_bos"]
    with pytest.raises(TokenizerError, match="messages is empty"):
        tokenizer.apply_chat_template([])
    with pytest.raises(TokenizerError, match=r"messages\[1\] should be a dict, found str"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}, "oops"])


# --- file failures -------------------------------------------------------------------------------


def test_missing_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_dir(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message and "tokenizer.json" in message and "tokenizer.model" in message


def test_not_a_directory(tmp_path):
    with pytest.raises(
        TokenizerError, match="expected a checkpoint directory with tokenizer files, found nothing"
    ):
        Tokenizer.from_dir(tmp_path / "nope")


@pytest.mark.parametrize(
    ("file", "content", "expected"),
    [
        ("tokenizer_config.json", "{not json", r"tokenizer_config\.json: cannot read as JSON"),
        (
            "tokenizer_config.json",
            "[1, 2]",
            r"tokenizer_config\.json: expected a JSON object, found list",
        ),
        (
            "tokenizer_config.json",
            '{"eos_token": 5}',
            r"'eos_token' should be a string or an object",
        ),
        (
            "generation_config.json",
            '{"eos_token_id": "2"}',
            r"generation_config\.json: 'eos_token_id' should be",
        ),
        (
            "config.json",
            '{"eos_token_id": [1, "x"]}',
            r"config\.json: 'eos_token_id' should be an int or a list",
        ),
        (
            "chat_template.json",
            '{"template": "x"}',
            r"chat_template\.json: expected an object with key",
        ),
        ("tokenizer.json", "{}", r"tokenizer\.json: cannot load"),
    ],
)
def test_bad_side_files(dirs, tmp_path, file, content, expected):
    directory = shutil.copytree(dirs["bpe_bos"], tmp_path / "model")
    (directory / file).write_text(content)
    with pytest.raises(TokenizerError, match=expected) as info:
        Tokenizer.from_dir(directory)
    assert "\n" not in str(info.value)


def test_corrupt_sentencepiece_model(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match=r"tokenizer\.model: cannot load"):
        Tokenizer.from_dir(tmp_path)


# --- a real checkpoint ---------------------------------------------------------------------------


@pytest.mark.real
def test_real_smollm2_tokenizer_matches_transformers(smollm2_hf_dir):
    tokenizer = Tokenizer.from_dir(smollm2_hf_dir)
    reference = transformers.AutoTokenizer.from_pretrained(str(smollm2_hf_dir))
    assert (tokenizer.bos_token_id, tokenizer.vocab_size) == (
        reference.bos_token_id,
        len(reference),
    )
    assert reference.eos_token_id in tokenizer.eos_token_ids
    for text in SAMPLES:
        ids = reference.encode(text)
        assert tokenizer.encode(text) == ids, repr(text)
        assert tokenizer.decode(ids) == reference.decode(ids), repr(text)
        assert tokenizer.decode(ids, True) == reference.decode(ids, skip_special_tokens=True), repr(
            text
        )
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert tokenizer.apply_chat_template(messages) == expected
    ids = random.Random(0).choices(range(tokenizer.vocab_size), k=2000)
    detokenizer = tokenizer.detokenizer()
    assert "".join(map(detokenizer.add_token, ids)) + detokenizer.finalize() == reference.decode(
        ids
    )
