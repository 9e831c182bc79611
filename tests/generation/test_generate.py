"""The streaming generator and the CLI on a tiny model with a real tokenizer."""

import pytest
from click.testing import CliRunner
from fixtures import load_script
from hf_models import add_tokenizer, make_tiny, torch_greedy

from mlxinfer import generate, load, stream_generate
from mlxinfer.cli.main import cli
from mlxinfer.errors import PromptTooLongError
from mlxinfer.generation.chat import ChatSession


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, torch_model = make_tiny(
        tmp_path_factory.mktemp("gen") / "tiny", vocab_size=320, max_position_embeddings=64
    )
    add_tokenizer(path)
    model, tokenizer = load(path)
    return path, model, tokenizer, torch_model


def test_stream_matches_transformers_greedy_and_decode(tiny):
    _, model, tok, torch_model = tiny
    ids = tok.encode("Hello world, the quick")
    results = list(stream_generate(model, tok, "Hello world, the quick", max_tokens=20))
    tokens = [r.token for r in results]
    assert tokens == torch_greedy(torch_model, ids, 20)[: len(tokens)]
    assert "".join(r.text for r in results) == tok.decode(
        [t for t in tokens if t not in tok.eos_token_ids]
    )
    assert results[-1].finish_reason in ("stop", "length")
    assert all(r.finish_reason is None for r in results[:-1])


def test_generate_equals_joined_stream(tiny):
    _, model, tok, _ = tiny
    assert generate(model, tok, "Paris is", max_tokens=12) == "".join(
        r.text for r in stream_generate(model, tok, "Paris is", max_tokens=12)
    )


def test_max_tokens_is_exact_and_stats_filled(tiny):
    _, model, tok, _ = tiny
    # Ban EOS via a huge negative bias is not available, so pick max_tokens small enough.
    results = list(stream_generate(model, tok, [5, 6, 7], max_tokens=5))
    assert len(results) <= 5
    last = results[-1]
    assert last.stats.prompt_tokens == 3 and last.stats.generation_tokens == len(results)
    assert last.stats.prefill_tps > 0 and last.stats.time_to_first_token_s > 0
    assert last.stats.peak_memory_gb > 0
    if last.finish_reason == "length":
        assert len(results) == 5


def test_eos_stops_generation(tiny):
    _, model, tok, torch_model = tiny
    ids = [5, 6, 7]
    ref = torch_greedy(torch_model, ids, 30)
    eos = ref[3]  # pretend the 4th greedy token is EOS
    tok_eos = tok.eos_token_ids
    try:
        tok.eos_token_ids = frozenset({eos})
        results = list(stream_generate(model, tok, ids, max_tokens=30))
    finally:
        tok.eos_token_ids = tok_eos
    assert [r.token for r in results] == ref[: ref.index(eos) + 1]
    assert results[-1].finish_reason == "stop"
    # The EOS token adds no text; what was held back (a partial character) is flushed.
    assert "".join(r.text for r in results) == tok.decode([r.token for r in results[:-1]])


def test_stop_string_ends_stream_without_leaking(tiny):
    _, model, tok, torch_model = tiny
    full = "".join(r.text for r in stream_generate(model, tok, [5, 6, 7], max_tokens=30))
    if len(full) < 6:
        pytest.skip(f"tiny model's greedy text too short to cut: {full!r}")
    stop = full[3:6]
    cut = full[: full.find(stop)]
    results = list(stream_generate(model, tok, [5, 6, 7], max_tokens=30, stop=[stop]))
    assert "".join(r.text for r in results) == cut
    assert results[-1].finish_reason == "stop"


def test_prompt_longer_than_context(tiny):
    _, model, tok, _ = tiny
    with pytest.raises(
        PromptTooLongError, match="prompt: 80 tokens, but the model's context is 64"
    ):
        list(stream_generate(model, tok, list(range(80)), max_tokens=4))
    results = list(stream_generate(model, tok, list(range(80)), max_tokens=4, truncate_prompt=True))
    assert results[-1].stats.prompt_tokens == 60


def test_context_bounds_max_tokens(tiny):
    _, model, tok, _ = tiny
    results = list(stream_generate(model, tok, list(range(1, 62)), max_tokens=50))
    assert len(results) <= 3


def test_chat_session_reuses_cache(tiny):
    _, model, tok, _ = tiny
    chat = ChatSession(model, tok, max_tokens=8)
    first = "".join(r.text for r in chat.send("Hello"))
    first_prompt = tok.encode(tok.apply_chat_template(chat.messages[:1]), add_special_tokens=False)
    second = list(chat.send("Paris"))
    assert chat.messages[1] == {"role": "assistant", "content": first}
    # At least the whole first-turn prompt came from the cache.
    assert second[-1].stats.cached_tokens >= len(first_prompt)
    # And the reply equals a fresh, uncached run of the same conversation.
    fresh = [r.token for r in stream_generate(model, tok, chat.messages[:3], max_tokens=8)]
    assert [r.token for r in second] == fresh


def test_cli_generate_streams_only_text(tiny):
    path, model, tok, _ = tiny
    expected = generate(model, tok, [{"role": "user", "content": "Hello"}], max_tokens=10)
    result = CliRunner().invoke(cli, ["generate", "-m", str(path), "-p", "Hello", "-n", "10"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == expected + "\n"


def test_cli_generate_raw_and_stdin_and_verbose(tiny):
    path, model, tok, _ = tiny
    expected = generate(model, tok, "Paris is", max_tokens=6)
    result = CliRunner().invoke(
        cli, ["generate", "-m", str(path), "--no-chat-template", "-n", "6", "-v"], input="Paris is"
    )
    assert result.exit_code == 0
    assert result.stdout == expected + "\n"
    assert "decode" in result.stderr and "time to first token" in result.stderr
    from mlxinfer.backends import kernels

    assert kernels.describe() in result.stderr.splitlines()  # the compiled kernels, or why not


def test_cli_prefill_step_size_chunks_the_prompt_with_the_same_output(tiny, monkeypatch):
    import mlxinfer.generation.loop as generation

    path, model, tok, _ = tiny
    expected = generate(model, tok, "Paris is the capital of", max_tokens=6)
    calls = []
    original = generation.prefill
    monkeypatch.setattr(
        generation,
        "prefill",
        lambda m, pc, ids, step=512, **kw: (
            calls.append((len(ids), step)) or original(m, pc, ids, step, **kw)
        ),
    )
    result = CliRunner().invoke(
        cli,
        [
            "generate",
            "-m",
            str(path),
            "--no-chat-template",
            "-n",
            "6",
            "--prefill-step-size",
            "2",
            "-p",
            "Paris is the capital of",
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == expected + "\n"
    assert calls and calls[0][1] == 2 and calls[0][0] > 2  # several chunks
    bad = CliRunner().invoke(
        cli, ["generate", "-m", str(path), "--prefill-step-size", "0", "-p", "x"]
    )
    assert bad.exit_code == 2 and "--prefill-step-size" in bad.stderr
    for size in ("0", "4", "-3"):  # a cache that keeps 4 first tokens needs room past them
        bad = CliRunner().invoke(
            cli, ["generate", "-m", str(path), "--max-kv-size", size, "-p", "x"]
        )
        assert bad.exit_code == 2 and "--max-kv-size" in bad.stderr, bad.stderr


def test_a_max_kv_size_that_cannot_hold_a_token_past_the_sinks_is_a_value_error(tiny):
    """The library's ``max_kv_size`` as the CLI's: below 5 (4 sinks and one more) or not an
    integer, a ValueError naming it (was the cache's own 'max_size (0) must exceed keep (4)')."""
    _, model, tokenizer, _ = tiny
    for size in (0, 4, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"^max_kv_size: expected"):
            generate(model, tokenizer, "x", max_tokens=2, max_kv_size=size)
    assert generate(model, tokenizer, "x", max_tokens=2, max_kv_size=5) is not None


def test_cli_model_without_chat_template_gets_the_raw_prompt_or_a_named_format(tiny, tmp_path):
    """A checkpoint with no chat template (a base model) gets the prompt as raw text; a format is
    applied only when named (--chat-template), and --system without one is refused."""
    import json
    import shutil

    path, model, tok, _ = tiny
    base = tmp_path / "base"
    shutil.copytree(path, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]  # the tiny tokenizer's is ChatML
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    run = CliRunner().invoke(cli, ["generate", "-m", str(base), "-p", "Hello", "-n", "6", "-v"])
    assert run.exit_code == 0, run.stderr
    assert run.stdout == generate(model, tok, "Hello", max_tokens=6) + "\n"
    assert "no chat template, so the prompt goes to the model as raw text" in run.stderr
    named = CliRunner().invoke(
        cli, ["generate", "-m", str(base), "-p", "Hello", "-n", "6", "--chat-template", "chatml"]
    )
    assert named.exit_code == 0, named.stderr
    assert (
        named.stdout
        == generate(model, tok, [{"role": "user", "content": "Hello"}], max_tokens=6) + "\n"
    )
    system = CliRunner().invoke(
        cli, ["generate", "-m", str(base), "-p", "Hello", "--system", "Be brief."]
    )
    assert system.exit_code == 2 and "--system needs a chat template" in system.stderr
    both = CliRunner().invoke(
        cli,
        ["generate", "-m", str(base), "-p", "x", "--chat-template", "chatml", "--no-chat-template"],
    )
    assert both.exit_code == 2 and "not both" in both.stderr
    unknown = CliRunner().invoke(
        cli, ["generate", "-m", str(base), "-p", "x", "--chat-template", "nope"]
    )
    assert (
        unknown.exit_code == 1 and "expected one of chatml, gemma or a Jinja file" in unknown.stderr
    )
    chat = CliRunner().invoke(cli, ["chat", "-m", str(base)], input="Hi\n")
    assert chat.exit_code == 1 and "--chat-template" in chat.stderr


def test_cli_prompt_too_long_exits_nonzero(tiny):
    path, *_ = tiny
    result = CliRunner().invoke(
        cli, ["generate", "-m", str(path), "--no-chat-template", "-p", "hello " * 100]
    )
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: prompt: ") and result.stdout == ""


@pytest.mark.parametrize("flag", [[], ["--prompt-lookup"], ["--self-draft-layers", "1"]])
def test_cli_chat_keeps_history(tiny, flag):
    """Each turn equals the API's chat; speculative flags change how tokens are found, not which."""
    path, model, tok, _ = tiny
    result = CliRunner().invoke(
        cli, ["chat", "-m", str(path), "-n", "6", *flag], input="Hello\nParis\n/exit\n"
    )
    assert result.exit_code == 0, result.stderr
    chat = ChatSession(model, tok, max_tokens=6)
    a = "".join(r.text for r in chat.send("Hello"))
    b = "".join(r.text for r in chat.send("Paris"))
    assert result.stdout == f">> {a}\n>> {b}\n>> "


def test_app_example_runs_and_stops_early(tmp_path, capsys):
    path, _ = make_tiny(tmp_path / "tiny", vocab_size=320, max_position_embeddings=512)
    add_tokenizer(path)
    example = load_script("examples/embed_in_app.py")
    example.main(str(path))
    out = capsys.readouterr().out
    assert out.count("[") >= 2 and ("[stopped]" in out or "[length]" in out or "[stop]" in out)


def test_metal_wires_memory_for_the_run_and_restores_it(tiny, monkeypatch):
    """On Metal the run raises the wired limit to the recommended working set, then restores it."""
    import mlx.core as mx

    _, model, tok, _ = tiny
    calls, during = [], []
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 12345})

    def set_wired_limit(limit):
        calls.append(limit)
        return 7  # the limit that was in force before

    monkeypatch.setattr(mx, "set_wired_limit", set_wired_limit)
    for _ in stream_generate(model, tok, "Paris is", max_tokens=3):
        during.append(list(calls))
    assert during[0] == [12345]
    assert calls == [12345, 7]


def test_cpu_backend_leaves_the_wired_limit_alone(tiny, monkeypatch):
    import mlx.core as mx

    _, model, tok, _ = tiny
    calls = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(limit) or 0)
    list(stream_generate(model, tok, "Paris is", max_tokens=3))
    assert calls == []


def test_sampling_settings_as_one_object(tiny):
    """``sampling=SamplingParams(...)`` is the same request as the separate keywords; giving both
    is an error naming the keywords, and a bad setting is an error naming it."""
    from mlxinfer import SamplingParams

    _, model, tok, _ = tiny
    keywords = dict(temperature=0.8, top_p=0.9, top_k=20, seed=3, repetition_penalty=1.3)
    expected = [r.token for r in stream_generate(model, tok, "Paris is", max_tokens=12, **keywords)]
    one = [
        r.token
        for r in stream_generate(
            model, tok, "Paris is", max_tokens=12, sampling=SamplingParams(**keywords)
        )
    ]
    assert one == expected
    with pytest.raises(ValueError, match="also as temperature, seed"):
        list(stream_generate(model, tok, "x", sampling=SamplingParams(), temperature=0.5, seed=1))
    with pytest.raises(ValueError, match="top_p must be in"):
        list(stream_generate(model, tok, "x", sampling=SamplingParams(temperature=1.0, top_p=0.0)))
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        list(stream_generate(model, tok, "x", repetition_penalty=-1.0))


def test_prepare_request_fits_the_prompt_in_the_context_and_the_kv_room(tiny):
    """``prepare_request``, which ``stream_generate`` and ``Engine.start`` share: the chat
    template's ids; a prompt past the context refused in one line, or left-truncated to its last
    ``context - min(max_tokens, context // 2)`` tokens; a KV room with a budget refuses or
    truncates likewise and says it cut the length, one without (the engine's pool) only caps."""
    from mlxinfer.generation.request import KVRoom, prepare_request
    from mlxinfer.loading.memory import KVLimit

    _, model, tok, _ = tiny
    messages = [{"role": "user", "content": "Hello there"}]
    request = prepare_request(model, tok, messages, max_tokens=8)
    expected = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert request.ids == expected and request.stats.prompt_tokens == len(expected)
    assert request.max_tokens == 8 and request.logits_processors == [] and request.tooling is None

    with pytest.raises(PromptTooLongError) as e:
        prepare_request(model, tok, list(range(80)), max_tokens=4)
    assert "\n" not in str(e.value) and "80 tokens" in str(e.value) and "64 tokens" in str(e.value)
    request = prepare_request(model, tok, list(range(80)), max_tokens=4, truncate_prompt=True)
    assert request.ids == list(range(20, 80)) and request.max_tokens == 4  # 64 - 4 kept

    budget = KVRoom(30, KVLimit(30, 3000, "kv_budget"))
    with pytest.raises(PromptTooLongError, match="prompt: 40 tokens, but the KV budget holds 30"):
        prepare_request(model, tok, list(range(40)), max_tokens=100, kv_room=budget)
    request = prepare_request(
        model, tok, list(range(40)), max_tokens=100, kv_room=budget, truncate_prompt=True
    )
    # 30 - min(100, 30 // 2) = 15 kept; the 15 left in the room cap max_tokens, and say so
    assert request.ids == list(range(25, 40)) and request.max_tokens == 15
    assert request.stats.limited_by == "kv_budget"

    pool = KVRoom(20)  # the engine's: caps max_tokens; a prompt past it is submit's to refuse
    request = prepare_request(model, tok, list(range(10)), max_tokens=100, kv_room=pool)
    assert request.max_tokens == 10 and request.stats.limited_by == ""
    request = prepare_request(model, tok, list(range(40)), max_tokens=4, kv_room=pool)
    assert request.ids == list(range(40)) and request.max_tokens == 4
