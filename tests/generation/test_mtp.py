"""Speculative decoding with the model's own MTP head (``draft=MTP()``), on tiny MiMo checkpoints.

Greedy output is plain greedy's and transformers' (``generate`` with and without
``use_mtp``, the same accepted-draft count); sampled output keeps the target's distribution (a
chi-square test of the first two tokens, as tests/generation/test_speculative.py does); a head
wired to predict the trunk's next-next token has most drafts accepted, and the same test fails
when the head reads the pair in the wrong order. The checkpoints are tiny random ones built with
transformers (tests/support/mtp_models.py): no real MTP weights can be had here.
"""

import dataclasses
import itertools

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from hf_models import add_tokenizer, make_tiny, torch_greedy
from mtp_models import make_mimo, transformers_layout

from mlxinfer import load, stream_generate
from mlxinfer.cache.prompt import PromptCache
from mlxinfer.cli.main import cli
from mlxinfer.errors import DraftError
from mlxinfer.generation import generate_step, speculative
from mlxinfer.generation.mtp_drafts import MTP
from mlxinfer.generation.sampling import filtered_logprobs, make_sampler
from mlxinfer.generation.speculative import speculative_generate_step
from mlxinfer.loading.loader import load_model
from mlxinfer.models.base import lm_head
from mlxinfer.models.layers import mtp as mtp_layer

PROMPT = [5, 17, 33, 2, 99, 120, 7, 64, 3, 11, 42, 8]


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    """A two-layer trunk with a random head: drafts are nearly always wrong."""
    path, trunk, mtp = make_mimo(tmp_path_factory.mktemp("mtp") / "random", vocab_size=320)
    add_tokenizer(path)
    return path, trunk, mtp, load(path)[0]


@pytest.fixture(scope="module")
def noisy_head(tmp_path_factory):
    """A wired head with noise: some drafts right, some wrong."""
    path, trunk, mtp = make_mimo(
        tmp_path_factory.mktemp("mtp") / "noisy", num_hidden_layers=1, wired=0.6, seed=1
    )
    return path, trunk, mtp, load_model(path)[0]


@pytest.fixture(scope="module")
def wired_head(tmp_path_factory):
    path, trunk, mtp = make_mimo(
        tmp_path_factory.mktemp("mtp") / "wired", num_hidden_layers=1, wired=0.0, seed=2
    )
    return path, trunk, mtp, load_model(path)[0]


def run(model, draft=None, n=24, prompt=PROMPT, **kw):
    if draft is None:
        return [t for t, _ in generate_step(prompt, model, max_tokens=n, **kw)], 0, 0
    steps = list(speculative_generate_step(prompt, model, draft, max_tokens=n, **kw))
    return [s[0] for s in steps], sum(s[4] for s in steps), sum(s[5] for s in steps)


# --- Greedy: plain greedy's tokens, transformers' tokens ----------------------------------------


@pytest.mark.parametrize("num_draft", [None, 1, 3])
@pytest.mark.parametrize("fixture", ["random_head", "noisy_head"])
def test_greedy_equals_plain_and_transformers_greedy(request, fixture, num_draft):
    _, trunk, _, model = request.getfixturevalue(fixture)
    plain, _, _ = run(model)
    tokens, drafted, _ = run(model, MTP(), num_draft=num_draft)
    assert tokens == plain == torch_greedy(trunk, PROMPT, 24)
    assert drafted > 0  # the head drafted from the first step on (primed by the prefill)


def test_transformers_use_mtp_and_its_head_give_the_same_tokens_and_acceptance(
    noisy_head, tmp_path, monkeypatch
):
    """transformers' ``generate(use_mtp=True)`` gives the same tokens; and with one draft per
    step exactly as many drafts pass as transformers' head would pass: the k = 1 loop
    simulated with its drafts (its MtpModel over the whole greedy sequence; we also draft on
    the first step, from the prefill, where generate drafts nothing)."""
    _, trunk, mtp, model = noisy_head
    out = transformers_layout(trunk, mtp, tmp_path / "tf")
    L = trunk.config.num_hidden_layers
    monkeypatch.setattr(
        type(trunk), "_keys_to_ignore_on_load_unexpected", [rf"model\.layers\.{L}\."]
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    n = 24
    with torch.no_grad():
        theirs = reference.generate(
            torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, use_mtp=True, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
    tokens, drafted, accepted = run(model, MTP(), n=n, num_draft=1)
    assert tokens == theirs
    seq = PROMPT + tokens
    drafts = reference_drafts(trunk, mtp, seq)  # drafts[j]: the head's guess for seq[j + 2]
    n_pos, passed, proposed = len(PROMPT), 0, 0
    while n_pos < len(seq) - 1:  # a step drafts seq[n_pos] (then a bonus token when right)
        proposed += 1
        right = drafts[n_pos - 2] == seq[n_pos]
        passed += right
        n_pos += 1 + right
    assert (accepted, drafted) == (passed, proposed)
    assert 0 < accepted < drafted  # some right, some wrong: the count says something


def reference_drafts(trunk, mtp, seq: list[int]) -> list[int]:
    from transformers.cache_utils import MtpCache

    T = len(seq)
    with torch.no_grad():
        h = trunk(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1]
        cache = MtpCache(config=trunk.config.get_mtp_config())
        g = mtp.forward_layer(
            0, h[:, :-1], torch.arange(1, T)[None], cache, input_ids=torch.tensor([seq[1:]])
        )
        return mtp._project_to_logits(g)[0].argmax(-1).tolist()


# --- Sampling: the target's distribution, exactly -----------------------------------------------

N_SAMPLES = 300
TOP_K = 5
CHI2_CRIT_24_DOF = 51.18  # chi-square 99.9 % quantile, 24 degrees of freedom


def target_dist(model, ids, temperature):
    logits = model(mx.array([ids]))[0, -1:]  # no cache: an independent forward pass
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.exp(np.array(filtered_logprobs(logprobs, temperature=temperature, top_k=TOP_K)[0]))


def first_two_fit(model, prompt, temperature=0.8):
    """Chi-square of the first two sampled tokens against the target's joint distribution."""
    p1 = target_dist(model, prompt, temperature)
    joint = {
        (a, b): p1[a] * pb
        for a in np.flatnonzero(p1)
        for b, pb in enumerate(target_dist(model, prompt + [int(a)], temperature))
        if pb > 0
    }
    assert len(joint) == TOP_K**2
    counts = dict.fromkeys(joint, 0)
    outside = drafted = accepted = 0
    pc = PromptCache(model.make_cache())
    for seed in range(N_SAMPLES):
        steps = speculative_generate_step(
            prompt,
            model,
            MTP(),
            prompt_cache=pc,
            max_tokens=3,
            num_draft=2,
            sampler=make_sampler(temperature, top_k=TOP_K, seed=seed),
        )
        first = list(itertools.islice(steps, 2))
        steps.close()
        drafted, accepted = drafted + first[0][4], accepted + first[0][5]
        pair = tuple(s[0] for s in first)
        if pair in counts:
            counts[pair] += 1
        else:
            outside += 1
        pc = PromptCache(model.make_cache())  # a fresh cache: the head is primed every time
    chi2 = sum((counts[c] - N_SAMPLES * p) ** 2 / (N_SAMPLES * p) for c, p in joint.items())
    return chi2, outside, accepted / drafted


def test_sampled_tokens_follow_the_target_distribution(noisy_head):
    model = noisy_head[3]
    chi2, outside, rate = first_two_fit(model, PROMPT[:6])
    assert outside == 0 and chi2 < CHI2_CRIT_24_DOF
    assert 0.1 < rate < 0.95  # both sides of the acceptance rule ran


def test_a_wrong_acceptance_rule_fails_the_same_test(noisy_head, monkeypatch):
    monkeypatch.setattr(speculative, "_residual", lambda p, q: p)  # draws from p on rejection
    chi2, outside, _ = first_two_fit(noisy_head[3], PROMPT[:6])
    assert not (outside == 0 and chi2 < CHI2_CRIT_24_DOF)


# --- Acceptance: a head that predicts right is accepted ----------------------------------------


def test_a_wired_head_has_most_drafts_accepted(wired_head):
    model = wired_head[3]
    plain, _, _ = run(model, n=40)
    tokens, drafted, accepted = run(model, MTP(), n=40, num_draft=3)
    assert tokens == plain
    assert drafted >= 30 and accepted / drafted > 0.9


def test_the_same_head_read_in_deepseeks_order_is_rejected(wired_head, monkeypatch):
    """[e, h] instead of MiMo's [h, e]: the projection picks the trunk's state, not the next
    token's embedding, and the drafts stop matching (the acceptance test can fail)."""
    model = wired_head[3]
    wrong = dataclasses.replace(mtp_layer.MIMO, hidden_first=False)
    heads = [
        mtp_layer.MTPHead(block, wrong, model.model.embed_tokens, lambda h: lm_head(h, model.head))
        for block in model.model.mtp_layers
    ]
    monkeypatch.setattr(type(model), "mtp_heads", property(lambda _: heads))
    _, drafted, accepted = run(model, MTP(), n=40, num_draft=3)
    assert drafted > 0 and accepted / drafted < 0.5


# --- Chat turns: the head resumes over the reused prefix -----------------------------------------


def test_a_kept_head_cache_resumes_where_the_prompt_cache_is_reused(random_head):
    """Turn 2 reuses turn 1's cache: with keep_cache the head takes its own pairs over that
    prefix (and the target feeds its last token again), ending with the same cache as a head
    primed over the whole conversation at once; the tokens are plain greedy's either way."""
    model = random_head[3]
    draft, pc = MTP(keep_cache=True), PromptCache(model.make_cache())
    turn1, _, _ = run(model, draft, n=8, prompt_cache=pc)
    prompt2 = PROMPT + turn1 + [7, 9, 11]
    turn2, _, _ = run(model, draft, n=8, prompt=prompt2, prompt_cache=pc)
    resumed = draft._kept
    whole = MTP(keep_cache=True)
    assert run(model, whole, n=8, prompt=prompt2)[0] == turn2 == run(model, n=8, prompt=prompt2)[0]
    fresh = whole._kept
    assert resumed is not None and fresh is not None
    assert resumed.first == fresh.first == 0 and resumed.tokens == fresh.tokens
    assert resumed.cache.offset == fresh.cache.offset == len(fresh.tokens) - 1
    for a, b in zip(resumed.cache.state, fresh.cache.state):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)
    # Without keep_cache the head starts where turn 2's prefill starts.
    plain_draft = MTP()
    run(model, plain_draft, n=8, prompt_cache=(pc2 := PromptCache(model.make_cache())))
    drafter = plain_draft.start(model, pc2.cache, prompt2)
    assert drafter.resume(pc2, prompt2, pc2.reuse(prompt2)) and drafter.first > 0


# --- The CLI and the library's one-line errors --------------------------------------------------


def test_cli_mtp(random_head, tmp_path):
    path = random_head[0]
    base = ["generate", "-m", str(path), "-p", "Hello world", "-n", "12"]
    expected = CliRunner().invoke(cli, base).stdout
    result = CliRunner().invoke(cli, base + ["--mtp", "--num-draft", "2", "-v"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == expected
    assert "draft accepted" in result.stderr
    # MTP drafts in the statistics rows the other sources use, per position and in ms too.
    assert "by position" in result.stderr and "draft / verify" in result.stderr
    result = CliRunner().invoke(cli, base + ["--mtp", "--prompt-lookup"])
    assert result.exit_code == 2 and "choose one draft source" in result.stderr
    plain, _ = make_tiny(tmp_path / "qwen2", "qwen2", vocab_size=320)
    add_tokenizer(plain)
    result = CliRunner().invoke(cli, ["generate", "-m", str(plain), "-p", "Hi", "--mtp"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no MTP heads" in lines[0] and str(plain) in lines[0]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\nHello world\n")
    batch = ["generate", "-m", str(path), "--batch", str(prompts), "-n", "8"]
    result = CliRunner().invoke(cli, batch + ["--mtp", "--num-draft", "2"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == CliRunner().invoke(cli, batch).stdout  # each row as without drafts


def test_cli_mtp_over_a_prompt_cache_file(random_head, tmp_path):
    """Turn 2 starts from the cache file turn 1 wrote (the head's cache with it:
    test_mtp_cache_file.py): the same text as without --mtp."""
    path, cache = random_head[0], tmp_path / "session.safetensors"
    texts = []
    for flags in ([], ["--mtp"]):
        cache.unlink(missing_ok=True)
        out = []
        for prompt in ("Hello world", "Hello world, again"):
            args = ["generate", "-m", str(path), "-p", prompt, "-n", "8", "--no-chat-template"]
            result = CliRunner().invoke(cli, args + ["--prompt-cache-file", str(cache)] + flags)
            assert result.exit_code == 0, result.stderr
            out.append(result.stdout)
        texts.append(out)
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    "rules", [{}, {"regex": "[a-z]{2,6}[0-9]{3}"}, {"choices": ["one", "two"]}]
)
def test_stream_generate_with_mtp_equals_plain(random_head, rules):
    """Through stream_generate, also with structured output (drafts a constraint forbids are
    dropped before verification; the head's cache keeps only what was kept)."""
    _, _, _, model = random_head
    tokenizer = load(random_head[0])[1]
    plain = "".join(r.text for r in stream_generate(model, tokenizer, "Hi", max_tokens=10, **rules))
    drafted = stream_generate(model, tokenizer, "Hi", max_tokens=10, draft=MTP(), **rules)
    assert "".join(r.text for r in drafted) == plain


def test_a_one_token_prompt_drafts_from_the_second_step(noisy_head):
    """Nothing is prefilled, so the head has no pair before the first verification; it drafts
    from the next step on."""
    model = noisy_head[3]
    steps = list(speculative_generate_step([42], model, MTP(), max_tokens=12, num_draft=2))
    assert [s[0] for s in steps] == run(model, n=12, prompt=[42])[0]
    assert steps[0][4] == 0 and sum(s[4] for s in steps) > 0


def test_mtp_across_ranks_is_refused_in_one_line():
    class Rank:  # what distributed/pipeline.RankModel shows the draft
        backend, source_dir = "distributed", "/models/mimo"

    with pytest.raises(DraftError, match="across ranks"):
        MTP().check(Rank(), None)


def test_chat_session_stats_report_mtp_by_position(random_head):
    """A ChatSession turn drafted by the MTP head: its stats say per position how many drafts
    were proposed and kept, and the draft and verify milliseconds."""
    from mlxinfer import ChatSession

    path = random_head[0]
    model, tokenizer = load(path)
    session = ChatSession(model, tokenizer, draft=MTP(), num_draft=2, max_tokens=10)
    stats = list(session.send("Hello world"))[-1].stats
    assert len(stats.drafted_by_position) == 2 and stats.drafted_by_position[0] > 0
    assert sum(stats.drafted_by_position) == stats.draft_tokens
    assert sum(stats.accepted_by_position) == stats.accepted_tokens
    assert stats.draft_ms > 0 and stats.verify_ms > 0
    assert len(stats.acceptance_by_position) == 2
