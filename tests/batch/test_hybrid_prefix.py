"""Prefix reuse for models with recurrent layers in the batching engine (issue #30, part 1).

Spec: on tiny random LFM2 (convolutions), Qwen3-Next and Qwen3.5 (Gated DeltaNet) checkpoints,
a request sharing a long prefix with an earlier one resumes from a snapshot of the recurrent
states at a block boundary: it prefills at most its suffix plus one block (the engine's prefill
counter, its ``cached_tokens``), in a batch of rows at mixed depths, and its greedy tokens are
transformers' for it alone and a cold engine's (no snapshots); divergence mid-block and a prefix
ending on a block boundary. On Qwen3.5 (the scheduler's rules, whatever the layers): the branch
point a diverging request leaves for the next, the next turn resuming after the reply, eviction
(of snapshots under a small ``state_budget``, of the blocks under a small ``kv_budget``: the
request is still right, only less is cached; snapshots and pool stay inside ``kv_budget``), and
rows drafting in the batch (their states restored after rejected drafts). The snapshot store and
the chunking arithmetic, by hand.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hf_models import make_tiny, torch_cache
from test_qwen3_next import DENSE, TINY

from mlxinfer.batch import Engine
from mlxinfer.loading.loader import load_model

BS = 16  # block size
NEW = 5  # tokens generated per request
FAMILIES = {
    "lfm2": dict(
        model_type="lfm2",
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "conv"],
        conv_L_cache=3,
        block_multiple_of=64,
    ),
    "qwen3_next": dict(TINY, num_experts=4, shared_expert_intermediate_size=32),
    "qwen3_5_text": dict(DENSE, model_type="qwen3_5_text"),
}


def _ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


PREFIX = _ids(520, 0)  # 32 full blocks and 8 tokens: its prefill's last full block ends at 512
SHARED = 288  # every prompt with a transformers reference starts with PREFIX[:SHARED]


class Reference:
    """transformers' greedy tokens (its own cached forward, EOS ignored) for prompts that
    start with ``PREFIX[:SHARED]``, whose cache is computed once and copied for each."""

    def __init__(self, torch_model) -> None:
        self.model, self.cache = torch_model, torch_cache(torch_model)
        with torch.no_grad():
            torch_model(torch.tensor([PREFIX[:SHARED]]), cache=self.cache, use_cache=True)

    def greedy(self, ids: list[int]) -> list[int]:
        assert ids[:SHARED] == PREFIX[:SHARED]
        cache, step, out = copy.deepcopy(self.cache), ids[SHARED:], []
        with torch.no_grad():
            for _ in range(NEW):
                logits = self.model(torch.tensor([step]), cache=cache, use_cache=True).logits
                step = [int(logits[0, -1].argmax())]
                out.append(step[0])
        return out


_BUILT: dict[str, tuple] = {}


def _build(name: str, tmp_path_factory) -> tuple:
    """(name, model, Reference) of a tiny random checkpoint of that family, made once."""
    if name not in _BUILT:
        spec = {k: v for k, v in FAMILIES[name].items() if v is not None}
        path, torch_model = make_tiny(
            tmp_path_factory.mktemp(name),
            perturb_vectors=True,
            max_position_embeddings=2048,
            **spec,
        )
        _BUILT[name] = name, load_model(path)[0], Reference(torch_model)
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """One family (Gated DeltaNet: a convolution's inputs and a recurrent state per layer) for
    the scheduler's rules, which are the same whatever the layers."""
    return _build("qwen3_5_text", tmp_path_factory)


def run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int], int]:
    """Submit ``prompts`` together: (their greedy tokens, their cached tokens, the prompt tokens
    the engine prefilled for them)."""
    before = engine.prefill_tokens
    handles = [engine.submit(p, max_tokens=NEW) for p in prompts]
    tokens = [[s.token for s in h.steps()] for h in handles]
    return tokens, [h.cached_tokens for h in handles], engine.prefill_tokens - before


def test_a_shared_prefix_is_resumed_from_a_state_snapshot_in_a_mixed_batch(family):
    """After a 520-token prompt, three rows at once: one extending it (it diverges mid-block:
    the snapshot at 512, its last full block), one diverging exactly at a block boundary (512),
    one unrelated. The first two prefill only their suffixes (plus the 8 tokens of the partial
    block), with transformers' and a cold engine's tokens."""
    name, model, reference = family
    extend = PREFIX + _ids(30, 1)
    boundary = PREFIX[:512] + _ids(25, 2)
    other = _ids(70, 3)
    expected = [reference.greedy(p) for p in (extend, boundary)]
    with Engine(model, block_size=BS, state_budget=0) as cold:
        cold_tokens, cold_cached, _ = run(cold, [extend, boundary, other])
    assert cold_cached == [0, 0, 0]  # no snapshots: nothing shared
    with Engine(model, block_size=BS) as engine:
        run(engine, [PREFIX])
        assert engine.metrics()["state_snapshots"] >= 2  # at 256 (a chunk's end) and 512
        tokens, cached, fed = run(engine, [extend, boundary, other])
    assert cached == [512, 512, 0], name
    # Each prompt's last token is fed by its first decode step, not by prefill.
    assert fed == (len(extend) - 1 - 512) + (len(boundary) - 1 - 512) + (len(other) - 1)
    assert len(extend) - 1 - 512 <= len(extend) - len(PREFIX) + BS
    assert tokens[:2] == expected == cold_tokens[:2], name
    assert tokens[2] == cold_tokens[2], name


def test_divergence_mid_block_and_the_branch_point(qwen35):
    """A prompt diverging from a cached one mid-block (at 300: 18 full blocks and 12 tokens).
    With a snapshot every block (``state_every=1``) it resumes at 288. With the default ones
    (every prefill chunk: 256) it resumes at 256 and leaves a snapshot where the blocks it
    shared end (288), from which the next prompt diverging there resumes."""
    name, model, reference = qwen35
    first, second, third = (PREFIX[:300] + _ids(20, seed) for seed in (4, 5, 6))
    expected = [reference.greedy(p) for p in (first, second, third)]
    with Engine(model, block_size=BS, state_every=1) as engine:
        run(engine, [PREFIX])
        tokens, cached, fed = run(engine, [first])
    assert cached == [288] and fed == len(first) - 1 - 288
    assert tokens == expected[:1], name
    with Engine(model, block_size=BS) as engine:
        run(engine, [PREFIX])
        got = []
        for prompt, resumed in zip((second, third), (256, 288)):
            tokens, cached, fed = run(engine, [prompt])
            assert cached == [resumed] and fed == len(prompt) - 1 - resumed
            got += tokens
    assert got == expected[1:], name


def test_the_next_turn_resumes_after_the_reply(qwen35):
    """A request's decoding fills a block (500 prompt tokens, 20 generated: the block ending at
    512): that state is kept when it retires, so the next turn (the prompt, the reply, a new
    message) resumes at 512, not at its prompt's last full block (496)."""
    name, model, reference = qwen35
    turn = PREFIX[:500]
    with Engine(model, block_size=BS) as engine:
        handle = engine.submit(turn, max_tokens=20)
        reply = [s.token for s in handle.steps()]
        following = turn + reply + _ids(10, 11)
        tokens, cached, fed = run(engine, [following])
    assert cached == [512] and fed == len(following) - 1 - 512
    assert tokens == [reference.greedy(following)], name


def test_snapshots_evicted_under_a_small_state_budget(qwen35):
    """Room for one snapshot: the prompt's last (512) pushes out the earlier one (256); a prompt
    diverging at 300 then finds none at or before its shared blocks and prefills everything,
    with the same tokens. The snapshots never hold more than their budget."""
    name, model, reference = qwen35
    with Engine(model, block_size=BS) as sized:
        run(sized, [_ids(40, 7)])  # one snapshot: at 32, its last full block
        one = sized.metrics()["state_snapshot_bytes"]
    assert one > 0
    diverging = PREFIX[:300] + _ids(20, 8)
    expected = reference.greedy(diverging)
    with Engine(model, block_size=BS, state_budget=one) as engine:
        run(engine, [PREFIX])
        assert engine.snapshots.evictions >= 1
        assert engine.metrics()["state_snapshot_bytes"] <= one
        assert run(engine, [PREFIX + [9, 9, 9]])[1] == [512]  # the one kept still serves
        tokens, cached, fed = run(engine, [diverging])
        assert engine.metrics()["state_snapshot_bytes"] <= one
    assert cached == [0] and fed == len(diverging) - 1
    assert tokens == [expected], name


def test_blocks_evicted_under_a_small_kv_budget(qwen35):
    """A pool of 48 blocks: an unrelated prompt of 300 tokens takes cached blocks of the
    first (its first block among them); its snapshots (whose blocks are gone) cannot serve, and the prompt extending it is
    prefilled whole, with the same tokens. The pool and the snapshots stay inside kv_budget."""
    name, model, reference = qwen35
    with Engine(model, block_size=BS) as probe:
        per_block = probe.pool.bytes_per_block
        run(probe, [_ids(40, 7)])  # one snapshot; PREFIX leaves two (256, 512)
        snapshot_bytes = 2 * probe.metrics()["state_snapshot_bytes"]
    kv_budget = 48 * per_block + snapshot_bytes
    extend = PREFIX + _ids(30, 9)
    expected = reference.greedy(extend)
    with Engine(model, block_size=BS, kv_budget=kv_budget, state_budget=snapshot_bytes) as engine:
        assert engine.pool.max_blocks * per_block + engine.snapshots.max_bytes <= kv_budget
        run(engine, [PREFIX])
        run(engine, [_ids(300, 10)])  # 19 blocks: 16 free, then the oldest cached go
        tokens, cached, fed = run(engine, [extend])
        assert engine.metrics()["state_snapshot_bytes"] <= snapshot_bytes
    assert cached == [0] and fed == len(extend) - 1
    assert tokens == [expected], name


def test_the_default_split_of_kv_budget(qwen35):
    """A recurrent model's snapshots get a quarter of kv_budget unless told; 0 turns prefix
    reuse off; more than the budget is refused, and so is a snapshot every 0 blocks."""
    from mlxinfer.batch.snapshots import split_budget

    with pytest.raises(ValueError, match="state_every"):
        Engine(qwen35[1], state_every=0)
    with pytest.raises(ValueError, match="state_budget"):
        Engine(qwen35[1], kv_budget=1 << 20, state_budget=2 << 20)

    assert split_budget(1000, None) == (750, 250)
    assert split_budget(1000, 0) == (1000, 0)
    with pytest.raises(ValueError, match="state_budget"):
        split_budget(1000, 1001)


def test_the_snapshot_store_is_an_lru_of_copies_inside_its_bytes():
    """get() hands out copies (a row writing into its restored state leaves the snapshot as
    it was); the least recently used goes first, a snapshot whose blocks are gone before it;
    one larger than the store is not kept."""
    import mlx.core as mx

    from mlxinfer.batch.snapshots import Snapshots

    def state(value: float) -> list[mx.array]:
        return [mx.full((1, 4), value), mx.full((1, 2, 2), value)]  # 32 bytes

    gone = {b"c"}
    store = Snapshots(96, alive=lambda h: h not in gone)
    for h, v in ((b"a", 1.0), (b"b", 2.0), (b"c", 3.0)):
        assert store.put(h, state(v))
    restored = store.get(b"a")  # now the most recent
    restored[0][0, 0] = 42.0
    assert store.get(b"a")[0].tolist() == [[1.0] * 4]
    assert store.put(b"d", state(4.0))  # "c" (blocks gone) goes, not "b" (the oldest)
    assert b"c" not in store and b"b" in store and store.nbytes == 96
    assert store.put(b"e", state(5.0))  # then the least recently used: "b"
    assert b"b" not in store and b"a" in store and len(store) == 3
    assert not store.put(b"f", state(6.0) * 4)  # 128 bytes: never fits
    assert store.nbytes <= store.max_bytes


def test_where_a_prefill_chunk_stops():
    """Chunks stop at every `every`-th block boundary, the prompt's last full block (of the
    n - 1 tokens prefill feeds) and the branch point, whichever comes first."""
    from mlxinfer.batch.snapshots import chunk_end, wanted

    # blocks of 16, every 4 blocks (64), a prompt of 150 (last full block at 144), no branch
    assert chunk_end(0, 149, 16, 4, 0, 150) == 64
    assert chunk_end(64, 149, 16, 4, 0, 150) == 128
    assert chunk_end(128, 149, 16, 4, 0, 150) == 144
    assert chunk_end(144, 149, 16, 4, 0, 150) == 149
    assert chunk_end(70, 100, 16, 4, 96, 150) == 96  # a branch point first
    assert chunk_end(10, 40, 16, 4, 0, 150) == 40  # a short budget: no point in reach
    assert [p for p in range(150) if wanted(p, 16, 4, 96, 150)] == [64, 96, 128, 144]


def test_hybrid_rows_draft_in_the_batch(qwen35):
    """Rows of a recurrent model draft beside a plain row: one with the model itself as its draft
    model (its drafts accepted, but near the end, where it drafts fewer than the others), one by
    prompt lookup (rejected ones). A row that kept fewer tokens than the step fed (rejected
    drafts, padding) gets its states back from before the step and the kept tokens fed again:
    each row gets transformers' greedy tokens."""
    from hf_models import torch_greedy

    from mlxinfer.generation.drafts import DraftModel, PromptLookup

    name, model, reference = qwen35
    prompts = [_ids(30, 20), _ids(20, 21) * 3, _ids(25, 22)]
    expected = [torch_greedy(reference.model, p, 12) for p in prompts]
    drafts = [DraftModel(model), PromptLookup(), None]
    with Engine(model, block_size=BS, max_draft=4) as engine:
        # a fixed k: the rows draft every step whatever the step costs measured here say
        handles = [
            engine.submit(p, max_tokens=12, draft=d, num_draft=3 if d else None)
            for p, d in zip(prompts, drafts)
        ]
        tokens = [[s.token for s in h.steps()] for h in handles]
        drafted, accepted = engine.draft_tokens, engine.accepted_tokens
    assert tokens == expected, name
    assert 0 < accepted < drafted, name


def test_a_tool_call_prompt_that_hits_the_cache_makes_the_same_call(tmp_path):
    """Qwen3.5 with a Hermes tools template and ``tool_choice="required"``: the same agent
    prompt (a long system prompt, the tools, a question) asked again resumes from a snapshot
    and gives the same call, token for token, as an engine that keeps no snapshots."""
    import json

    from hf_models import add_tokenizer
    from test_toolcalls import TOOLS
    from tool_templates import HERMES

    from mlxinfer import load

    spec = dict(DENSE, model_type="qwen3_5_text", vocab_size=320, max_position_embeddings=2048)
    path, _ = make_tiny(tmp_path, **spec)
    add_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES}))
    model, tok = load(str(path))
    system = "You are a careful agent. Use the tools. " * 4
    ask = [{"role": "system", "content": system}, {"role": "user", "content": "Paris weather?"}]

    def call(engine: Engine) -> tuple[tuple, int]:
        results = list(
            engine.stream(
                tok, ask, max_tokens=120, tools=TOOLS, tool_choice="required", chat_template=True
            )
        )
        calls = [(c.name, c.arguments) for c in results[-1].tool_calls]
        return (tuple(r.token for r in results), calls), results[-1].stats.cached_tokens

    with Engine(model, state_budget=0) as engine:
        cold, cached = call(engine)
    assert cached == 0 and len(cold[1]) == 1  # one call, parsed (its text is held back)
    with Engine(model) as engine:
        assert call(engine) == (cold, 0)
        again, cached = call(engine)
    assert cached >= BS and again == cold
