"""Hybrid models: recurrent layers among attention layers, and the state cache they keep.

LFM2 (short convolutions) against transformers on a tiny random checkpoint (whole pass,
chunked prefill and decode against its own cached forward, greedy tokens), a 4-bit
conversion and the state cache's size. Then, for LFM2 and Qwen3-Next (Gated DeltaNet; its
parity is in test_qwen3_next.py): speculative decoding's rewind and prompt-cache reuse
through snapshots, the cache file, and the batch engine's refusal.
"""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from hf_models import add_tokenizer, make_tiny, torch_greedy, torch_logits, torch_logits_chunked
from mlx.utils import tree_map

from mlxinfer.batch import Engine
from mlxinfer.cache.kv import KVCache, StateCache
from mlxinfer.cache.prompt import PromptCache
from mlxinfer.cli.main import cli
from mlxinfer.errors import ConfigError
from mlxinfer.generation import generate_step
from mlxinfer.generation.drafts import DraftModel, PromptLookup, SelfDraft
from mlxinfer.generation.speculative import speculative_generate_step
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model
from mlxinfer.models import build_model

# Conv first, two convs in a row, attention in between: every kind of neighbour.
LAYER_TYPES = ["conv", "full_attention", "conv", "conv"]
WIDTH = 3  # conv_L_cache: the state is the last WIDTH - 1 inputs
HIDDEN = 64
IDS = [(7 * i + 3) % 256 for i in range(20)]  # longer than the conv's width
# Repeats, so prompt lookup finds matches.
PROMPT = [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 20, 21, 11, 12]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, torch_model = make_tiny(
        tmp_path_factory.mktemp("lfm2") / "tiny",
        "lfm2",
        perturb_vectors=True,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        conv_L_cache=WIDTH,
        block_multiple_of=64,  # feed-forward width: ⅔ × 128 rounded up to 64 -> 128
        vocab_size=320,  # add_tokenizer's: every id it encodes is a row of the embedding
    )
    add_tokenizer(path)
    model, _ = load_model(path)
    return path, model, torch_model


@pytest.fixture(scope="module", params=["lfm2", "qwen3_next"])
def hybrid(request, tiny, tmp_path_factory):
    """(path, model) of each hybrid family: LFM2's convolutions, Qwen3-Next's Gated DeltaNet."""
    if request.param == "lfm2":
        return tiny[:2]
    from test_qwen3_next import TINY

    path, _ = make_tiny(
        tmp_path_factory.mktemp("qwen3_next"), perturb_vectors=True, **{**TINY, "vocab_size": 320}
    )
    add_tokenizer(path)
    return path, load_model(path)[0]


@pytest.fixture(scope="module")
def noisy(hybrid):
    """The checkpoint with noise on every weight: a draft model that is often wrong."""
    path, _ = hybrid
    model, _ = load_model(path)
    rng = np.random.default_rng(0)
    model.update(
        tree_map(lambda w: w + mx.array(rng.normal(0, 0.01, w.shape), w.dtype), model.parameters())
    )
    return model


def filled(model, tokens):
    """A cache holding ``tokens``, filled in one plain forward pass."""
    pc = PromptCache(model.make_cache(), tokens)
    model(mx.array([tokens]), pc.cache)
    return pc


def assert_same_cache(a: PromptCache, b: PromptCache):
    assert a.tokens == b.tokens
    for ca, cb in zip(a.cache, b.cache, strict=True):
        assert ca.offset == cb.offset == len(a.tokens)
        for x, y in zip(ca.state, cb.state, strict=True):
            assert x.shape == y.shape and np.allclose(np.array(x), np.array(y), atol=1e-5)


def greedy(model, prompt, n, **kw):
    return [t for t, _ in generate_step(prompt, model, max_tokens=n, **kw)]


# --- Parity with transformers ---------------------------------------------------------------


def test_layers_and_caches_follow_layer_types(tiny):
    _, model, _ = tiny
    assert [layer.is_attention for layer in model.layers] == [t != "conv" for t in LAYER_TYPES]
    kinds = [type(c) for c in model.make_cache()]
    assert kinds == [StateCache, KVCache, StateCache, StateCache]
    assert model.layers[0].conv.conv.weight.shape == (HIDDEN, WIDTH, 1)  # MLX's conv layout


def test_logits_match_transformers(tiny):
    _, model, torch_model = tiny
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - torch_logits(torch_model, IDS)).max() < 1e-3


def test_chunked_prefill_and_decode_match_transformers_cache(tiny):
    _, model, torch_model = tiny
    # Chunks longer and shorter than the width, then one token at a time.
    chunks = [IDS[:7], IDS[7:8], IDS[8:12]] + [[t] for t in IDS[12:]]
    cache = model.make_cache()
    out = np.concatenate([np.array(model(mx.array([c]), cache)[0]) for c in chunks])
    assert np.abs(out - torch_logits_chunked(torch_model, chunks)).max() < 1e-3
    assert all(c.offset == len(IDS) for c in cache)


def test_greedy_matches_transformers(tiny):
    _, model, torch_model = tiny
    assert greedy(model, IDS, 32) == torch_greedy(torch_model, IDS, 32)


def test_older_config_keys_build_the_same_model(tiny, tmp_path):
    path, model, _ = tiny
    old = tmp_path / "old"
    shutil.copytree(path, old)
    config = json.loads((old / "config.json").read_text())
    config.pop("layer_types")
    config["full_attn_idxs"] = [i for i, t in enumerate(LAYER_TYPES) if t != "conv"]
    config["block_ff_dim"] = config.pop("intermediate_size")
    config["tie_embedding"] = config.pop("tie_word_embeddings")
    (old / "config.json").write_text(json.dumps(config))
    again, _ = load_model(old)
    assert again.args.layer_types == LAYER_TYPES and again.args.ff_dim == model.args.ff_dim
    assert np.array_equal(np.array(again(mx.array([IDS]))), np.array(model(mx.array([IDS]))))


def test_bad_layer_types_name_the_key(tiny):
    path, _, _ = tiny
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(ConfigError, match="'layer_types' must list 4 entries"):
        build_model({**config, "layer_types": ["conv", "mamba", "conv", "conv"]})


def test_4bit_conversion_loads_and_runs(tiny, tmp_path):
    path, model, _ = tiny
    convert(path, tmp_path / "q4", quantize=True, bits=4, group_size=32)
    q, _ = load_model(tmp_path / "q4")
    assert isinstance(q.layers[0].conv.in_proj, nn.QuantizedLinear)
    assert isinstance(q.layers[1].self_attn.o_proj, nn.QuantizedLinear)
    assert isinstance(q.layers[0].conv.conv, nn.Conv1d)  # the depthwise conv stays float
    cache = q.make_cache()
    logits = np.array(q(mx.array([IDS]), cache)[0])
    assert np.isfinite(logits).all()
    assert np.isfinite(np.array(q(mx.array([[IDS[0]]]), cache))).all()
    # 4 bits stay close to the float model: most positions agree on the argmax.
    ref = np.array(model(mx.array([IDS]))[0])
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() > 0.5


# --- The state cache ------------------------------------------------------------------------


def test_state_cache_nbytes_is_its_size_and_does_not_grow(tiny):
    _, model, _ = tiny
    cache = model.make_cache()
    state_bytes = 1 * (WIDTH - 1) * HIDDEN * 4  # batch × (K - 1) × hidden × float32
    kv_bytes = 2 * 2 * 16 * 4  # keys and values × kv_heads × head_dim × float32, per token
    for fed, chunk in ((2, IDS[:2]), (20, IDS[2:]), (21, IDS[:1])):
        model(mx.array([chunk]), cache)
        states = [c for c in cache if isinstance(c, StateCache)]
        assert [c.nbytes for c in states] == [state_bytes] * 3
        assert all(c.offset == fed for c in cache)
        assert cache[1].nbytes == kv_bytes * fed
    assert not states[0].is_trimmable() and states[0].trim(3) == 0


# --- Speculative decoding: verify, take the states at the last token kept ----------------


@pytest.mark.parametrize("source", ["lookup", "self-2", "model"])
@pytest.mark.parametrize("num_draft", [None, 3])
def test_speculative_greedy_equals_plain_greedy(hybrid, noisy, source, num_draft):
    _, model = hybrid
    draft = {
        "lookup": PromptLookup(),
        "self-2": SelfDraft(2),
        "model": DraftModel(noisy, prompt_cache=PromptCache(noisy.make_cache())),
    }[source]
    prompt = PROMPT
    ref = PromptCache(model.make_cache())
    tokens = greedy(model, prompt, 40, prompt_cache=ref)
    pc = PromptCache(model.make_cache())
    out = list(
        speculative_generate_step(
            prompt, model, draft, prompt_cache=pc, max_tokens=40, num_draft=num_draft
        )
    )
    assert [s.token for s in out] == tokens
    # With a fixed k (an adaptive one may turn drafting off where it does not pay here):
    if num_draft is not None:
        # Drafts were accepted: a random model's output rarely repeats the prompt, so prompt
        # lookup's drafts may all be rejected (Qwen3-Next's are), which rewinds all the same.
        assert any(s.from_draft for s in out) or source == "lookup"
        assert sum(s.drafted for s in out) > 0
        # Some drafts were rejected (so the recurrent states went back) ...
        assert sum(s.drafted for s in out) > sum(s.accepted for s in out)
    # ... and the caches end as plain decoding leaves them.
    assert pc.tokens == ref.tokens
    assert_same_cache(pc, filled(model, ref.tokens))
    if source == "model":  # the draft's cache holds a prefix of them, exactly
        dpc = draft.prompt_cache
        assert dpc.tokens == pc.tokens[: len(dpc.tokens)]
        assert num_draft is None or len(dpc.tokens) >= len(pc.tokens) - 1
        assert_same_cache(dpc, filled(noisy, dpc.tokens))


def test_speculative_early_stop_keeps_the_tokens_received(hybrid):
    _, model = hybrid
    pc = PromptCache(model.make_cache())
    draft = DraftModel(model, prompt_cache=PromptCache(model.make_cache()))  # always right
    steps = speculative_generate_step(
        PROMPT, model, draft, prompt_cache=pc, max_tokens=40, num_draft=4
    )
    got = [next(steps).token for _ in range(2)]  # inside a run of accepted drafts
    steps.close()
    assert pc.tokens == PROMPT + got
    assert_same_cache(pc, filled(model, pc.tokens))
    # The cache carries on exactly: the next tokens are those of a fresh run.
    assert greedy(model, pc.tokens + [got[-1]], 8, prompt_cache=pc) == greedy(
        model, PROMPT + got + [got[-1]], 8
    )


# --- Prompt caches --------------------------------------------------------------------------


def test_a_prompt_cache_carries_over_chat_turns(hybrid):
    _, model = hybrid
    pc = PromptCache(model.make_cache())
    first = greedy(model, PROMPT, 10, prompt_cache=pc)
    # The next turn extends everything fed so far: nothing to drop.
    turn = PROMPT + first + [3, 4, 5, 6]
    assert len(pc.reuse(list(turn))) == len(turn) - len(pc.tokens)
    pc2 = PromptCache(model.make_cache())
    greedy(model, PROMPT, 10, prompt_cache=pc2)
    assert greedy(model, turn, 12, prompt_cache=pc2) == greedy(model, turn, 12)


@pytest.mark.parametrize("suffix", [[], [99, 98, 97]], ids=["regenerate", "edit-reply"])
def test_a_prefix_is_reused_from_the_checkpoint_where_the_prompt_ended(hybrid, suffix):
    """The cache cannot drop the generated tokens; it goes back to the snapshot taken after
    the prompt's prefill and feeds only what follows."""
    _, model = hybrid
    pc = PromptCache(model.make_cache())
    greedy(model, PROMPT, 10, prompt_cache=pc)
    prompt = PROMPT + suffix
    todo = pc.reuse(list(prompt))
    assert todo == prompt[len(PROMPT) - 1 :]  # served from the checkpoint, not from scratch
    pc = PromptCache(model.make_cache())
    greedy(model, PROMPT, 10, prompt_cache=pc)
    assert greedy(model, prompt, 12, prompt_cache=pc) == greedy(model, prompt, 12)


def test_a_prompt_cache_file_with_state_caches_round_trips(hybrid, tmp_path):
    _, model = hybrid
    pc = PromptCache(model.make_cache())
    greedy(model, PROMPT, 6, prompt_cache=pc)
    pc.save(tmp_path / "cache.safetensors")
    loaded = PromptCache.load(tmp_path / "cache.safetensors")
    assert loaded.tokens == pc.tokens
    assert [type(c) for c in loaded.cache] == [type(c) for c in pc.cache]
    assert [c.offset for c in loaded.cache] == [c.offset for c in pc.cache]
    assert loaded.nbytes == pc.nbytes
    nxt = mx.array([[PROMPT[3]]])
    assert np.array_equal(np.array(model(nxt, loaded.cache)), np.array(model(nxt, pc.cache)))


# --- The batch engine -----------------------------------------------------------------------


def test_in_the_batch_each_row_keeps_its_own_state(hybrid, tmp_path):
    """Rows of a recurrent model in one batch: each gets the tokens it gets alone, though two
    share a long prefix (submitted together: neither finds the other's blocks yet) and one
    drafts by prompt lookup. (Rows joining at different times, against transformers:
    tests/batch/test_batch.py; prefixes resumed from state snapshots and drafting rows:
    tests/batch/test_hybrid_prefix.py.)"""
    path, model = hybrid
    prefix = [(5 * i + 1) % 256 for i in range(40)]
    prompts = [prefix + [1, 2, 3], prefix + [9, 8], PROMPT, [7]]
    alone = [greedy(model, p, 8) for p in prompts]
    with Engine(model, block_size=16, max_batch=4) as engine:
        handles = [engine.submit(p, max_tokens=8) for p in prompts[:3]]
        handles.append(engine.submit(prompts[3], max_tokens=8, draft=PromptLookup()))
        got = [[s.token for s in h.steps()] for h in handles]
        stats = engine.stats()
    assert got == alone
    assert stats.prefix_hits == 0 and all(h.cached_tokens == 0 for h in handles)
    assert engine.steps_run < 4 * 8  # the rows decoded together
    # `generate --batch` runs it too.
    file = tmp_path / "prompts.txt"
    file.write_text("hello\nhi there\n")
    result = CliRunner().invoke(
        cli, ["generate", "--model", str(path), "--batch", str(file), "-n", "4"]
    )
    assert result.exit_code == 0, result.output
