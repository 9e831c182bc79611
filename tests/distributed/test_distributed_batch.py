"""The batching engine across ranks (mlxinfer/distributed/batching.py): ``batch_generate`` with
a model loaded with ``distributed="pipeline"|"tensor"``, two ranks on 127.0.0.1 (ring backend),
started as tests/distributed/test_distributed.py starts them.

The reference is one process on the same checkpoint: its ``batch_generate`` and, prompt by
prompt, its ``generate`` (the rest of the suite holds both to transformers). Run as a script,
this file is one rank: ``python test_distributed_batch.py MODEL_DIR MODE N PROMPTS OUT``
loads MODEL_DIR with ``distributed=MODE``, runs ``batch_generate`` over PROMPTS (a JSON list of
token-id lists) for N greedy tokens each, and writes {"texts": [...]} to OUT.rank<r>.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve()
N_TOKENS = 8
CANCELLED = 5  # the request rank 0 alone cancels (a 70-token prompt), of LONG tokens
LONG = 48


def _prompts() -> list[list[int]]:
    """8 prompts of mixed lengths (1 to 90 tokens: prefill chunks longer than the 64 positions
    whose logits a pipeline step shares, several chunks in one forward); the last begins with
    the 33 tokens of another (two full 16-token blocks of the pool to share)."""
    lengths = [6, 1, 90, 13, 33, 70, 2, 45]
    prompts = [[(7 * i + 11 * n + 3) % 290 + 3 for i in range(n)] for n in lengths]
    prompts[7] = prompts[4] + [5, 6, 7, 8, 9]
    return prompts


def _run_ranks(tmp_path, model_dir, mode, job, wait=None):
    from test_distributed import WAIT_S, Ranks

    wait = wait or WAIT_S + 30

    out = tmp_path / "out.json"
    (tmp_path / "job.json").write_text(json.dumps(job))
    command = [sys.executable, str(SCRIPT), str(model_dir), mode, str(tmp_path / "job.json")]
    with Ranks(tmp_path, command + [str(out)]) as ranks:
        codes = [ranks.wait(0, wait), ranks.wait(1, 30)]
        assert codes == [0, 0], ranks.text(0) + ranks.text(1)
        results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
        return results, ranks.text(0) + ranks.text(1)


def _stop_string(texts: list[str]) -> str:
    """Two letters from the middle of one of the texts: a stop string that cuts it short."""
    for text in texts:
        for i in range(2, len(text) - 3):
            if text[i : i + 2].isascii() and text[i : i + 2].isalpha():
                return text[i : i + 2]
    raise AssertionError(f"no two letters in {texts}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A tiny random llama (4 heads, 2 KV heads, 3 layers: both splits apply) and what one
    process gives for the prompts: ``generate``'s tokens and texts one prompt at a time, which
    ``batch_generate``'s texts must equal; the same with a stop string."""
    from test_distributed import _checkpoint

    import mlxinfer
    from mlxinfer.generation import generate_step

    path, _ = _checkpoint(tmp_path_factory.mktemp("llama"))
    model, tokenizer = mlxinfer.load(path)
    prompts = _prompts()
    texts = [mlxinfer.generate(model, tokenizer, p, max_tokens=N_TOKENS) for p in prompts]
    tokens = [
        [t for t, _ in generate_step(p, model, max_tokens=LONG if i == CANCELLED else N_TOKENS)]
        for i, p in enumerate(prompts)
    ]
    assert mlxinfer.batch_generate(model, tokenizer, prompts, max_tokens=N_TOKENS) == texts
    assert len(set(map(tuple, tokens))) == len(tokens)  # distinct: a row given another's shows
    stop = _stop_string(texts)
    cut = [
        mlxinfer.generate(model, tokenizer, p, max_tokens=N_TOKENS, stop=[stop]) for p in prompts
    ]
    assert (
        mlxinfer.batch_generate(model, tokenizer, prompts, max_tokens=N_TOKENS, stop=[stop]) == cut
    )
    assert cut != texts
    sampled = mlxinfer.batch_generate(
        model, tokenizer, prompts, max_tokens=N_TOKENS, temperature=0.9, seed=7
    )
    assert sampled != texts
    job = {"prompts": prompts, "n": N_TOKENS, "stop": stop, "cancel": CANCELLED}
    short = [t[:N_TOKENS] for t in tokens]
    lookup, accepted = _lookup(model, prompts, N_TOKENS)
    assert lookup == short and accepted > 0  # prompt lookup: greedy, the same tokens
    drafted = _drafted(model, model, prompts, N_TOKENS)  # the checkpoint drafting for itself
    assert drafted["greedy"] == short and drafted["greedy_accepted"] > 0
    assert drafted["seeded"] != short
    expected = {"texts": texts, "tokens": tokens, "cut": cut, "sampled": sampled, "short": short}
    expected["rank0"] = _seeded_tokens(model, prompts[:4], N_TOKENS)
    return path, job, {**expected, "accepted": accepted, "drafted": drafted}


SLOW = pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="more two-rank launches than the suite's share: set MLXINFER_SLOW=1 to run",
)


@pytest.mark.parametrize("mode", ["pipeline", pytest.param("tensor", marks=SLOW)])
def test_batch_generate_across_two_ranks_matches_one_process(reference, tmp_path, mode):
    """Both ranks' ``batch_generate`` texts (and an engine's tokens) equal one process's, with
    and without a stop string (whose cancellations rank 0 decides for every rank)."""
    path, job, expected = reference
    job = {**job, "disk": str(tmp_path / "prefix-cache")}
    results, log = _run_ranks(tmp_path, path, mode, job)
    split = "runs layers 0-1 of 3" if mode == "pipeline" else "runs heads 0-1 of 4"
    assert split in log and "falls back" not in log, log
    for result in results:  # every rank's engines took the same turns
        assert result["texts"] == expected["texts"]
        assert result["cut"] == expected["cut"]
        assert result["sampled"] == expected["sampled"]
        assert result["lookup"] == expected["short"] and result["accepted"] > 0
        assert result["drafted"] == expected["drafted"]  # rank 0's draft model, one process's
        assert result["drafted_texts"] == expected["texts"]
        assert result["again"] == [expected["tokens"][-1], 32]  # two 16-token blocks shared
        tokens = result["tokens"]
        assert tokens[:CANCELLED] + tokens[CANCELLED + 1 :] == (
            expected["tokens"][:CANCELLED] + expected["tokens"][CANCELLED + 1 :]
        )
    # The request rank 0 alone cancelled (after reading 2 tokens) ended at the same token on
    # both ranks, before its last.
    cancelled = results[0]["tokens"][CANCELLED]
    assert results[1]["tokens"][CANCELLED] == cancelled
    assert (
        2 <= len(cancelled) < LONG and cancelled == expected["tokens"][CANCELLED][: len(cancelled)]
    )
    # The same steps on both ranks: the engine's forwards (and one at its start, for the
    # pool's shapes); batched: one prompt at a time would take at least 8 x 8 forwards.
    steps, forwards = results[0]["engine_steps"]
    assert results[1]["engine_steps"] == [steps, forwards] and steps == forwards + 1
    assert forwards < len(job["prompts"]) * N_TOKENS
    assert results[0]["steps"] == results[1]["steps"]
    # A pipeline's engine decoded in flights of rows, one at each rank (distributed/micro.py),
    # also with requests submitted and sampled on rank 0 alone (serve's way).
    assert (results[0]["flights"] > 0) == (mode == "pipeline"), results[0]["flights"]
    assert results[0]["rank0"] == expected["rank0"] and "rank0" not in results[1]
    assert results[0]["rank0_flights"] == results[1]["rank0_flights"]
    assert (results[0]["rank0_flights"] > 0) == (mode == "pipeline")
    assert results[0]["unseeded"] == results[1]["unseeded"] != expected["sampled"]
    # The prefix cache on disk: each rank wrote its own part's full blocks (the 90-token
    # prompt's 5 and the one its first decoded tokens filled: 12 files in the shared directory)
    # and, restarted, read its own prompt's back.
    from mlxinfer.batch.pool import DEFAULT_BLOCK_SIZE

    blocks = (len(job["prompts"][2]) - 1) // DEFAULT_BLOCK_SIZE
    for result in results:
        disk = result["disk"]
        assert disk["tokens"] == [expected["tokens"][2]] * 2
        assert disk["loaded"] == blocks and disk["cached"] == blocks * DEFAULT_BLOCK_SIZE
        written = (len(job["prompts"][2]) + job["n"] - 1) // DEFAULT_BLOCK_SIZE  # keys held
        assert len(disk["files"]) == 2 * written


@SLOW
@pytest.mark.slow
def test_a_killed_rank_during_batch_generate_is_a_clear_error(reference, tmp_path):
    from test_distributed import Ranks

    path, job, _ = reference
    (tmp_path / "job.json").write_text(json.dumps({**job, "n": 30000}))
    command = [sys.executable, str(SCRIPT), str(path), "pipeline", str(tmp_path / "job.json")]
    with Ranks(tmp_path, command + [str(tmp_path / "out.json")]) as ranks:
        ranks.wait_for(0, "batch_generate: started")
        time.sleep(1.0)
        assert ranks.procs[0].poll() is None  # still generating
        ranks.procs[1].kill()
        start = time.monotonic()
        assert ranks.wait(0, timeout=60) != 0
        assert time.monotonic() - start < 60
        err = ranks.text(0)
        assert "rank 0: lost rank 1 during" in err, err


@SLOW
@pytest.mark.slow
def test_generate_batch_across_two_ranks_from_the_cli(reference, tmp_path):
    """``mlxinfer launch -n 2 -- mlxinfer generate --distributed pipeline --batch FILE``: rank 0
    prints one JSON line per prompt, the texts of one process."""
    from test_distributed import WAIT_S, _launch

    path, job, expected = reference
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hi", "The cat sat")))
    command = [sys.executable, "-m", "mlxinfer", "generate", "-m", str(path), "--batch"]
    command += [str(prompts), "--no-chat-template", "-n", str(N_TOKENS)]
    one = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S)
    assert one.returncode == 0, one.stderr
    lookup, model = ["--prompt-lookup"], ["--draft-model", str(path)]  # rank 0's drafts
    for extra in ([], lookup, model):  # greedy: drafts change no token
        done = _launch(tmp_path, "-n", "2", "--", *command, "--distributed", "pipeline", *extra)
        assert done.returncode == 0, done.stderr
        assert done.stdout == one.stdout and len(done.stdout.splitlines()) == 2


def test_a_quantized_pool_across_two_ranks_matches_one_process(tmp_path):
    """``kv_bits=8`` over the pipeline: each rank's pool holds its layers' keys as 8-bit codes
    (64-wide heads, one group), read where they lie (``gather_qmm`` over the pages: the plain
    path the suite runs); both ranks' ``batch_generate`` texts and an engine's tokens are one
    process's, whose single-request loop over a ``QuantizedKVCache`` gives the same tokens."""
    from test_distributed import _checkpoint

    import mlxinfer
    from mlxinfer.cache.prompt import PromptCache
    from mlxinfer.generation import generate_step

    path, _ = _checkpoint(tmp_path / "llama", head_dim=64)
    model, tokenizer = mlxinfer.load(path)
    prompts = _prompts()
    texts = mlxinfer.batch_generate(model, tokenizer, prompts, max_tokens=N_TOKENS, kv_bits=8)
    tokens = []
    for p in prompts:
        cache = PromptCache(model.make_cache(kv_bits=8))
        tokens.append(
            [t for t, _ in generate_step(p, model, prompt_cache=cache, max_tokens=N_TOKENS)]
        )
    assert texts == [tokenizer.decode(t) for t in tokens]
    job = {"prompts": prompts, "n": N_TOKENS, "stop": "", "more": False, "kv_bits": 8}
    results, log = _run_ranks(tmp_path, path, "pipeline", job)
    assert "runs layers 0-1 of 3" in log and "falls back" not in log, log
    for result in results:
        assert result["texts"] == texts and result["tokens"] == tokens


@SLOW
@pytest.mark.slow
@pytest.mark.parametrize(
    "family, mode",
    [
        ("qwen2", "tensor"),
        ("mixtral", "pipeline"),
        ("mixtral", "tensor"),
        ("deepseek_v3", "pipeline"),
        ("deepseek_v3", "tensor"),
    ],
)
def test_families_batch_generate_across_two_ranks(tmp_path, family, mode):
    """Sliding and full layers split by heads (qwen2), MoE (mixtral: over the pipeline, and
    split by heads and experts) and MLA's latent caches in the pool (deepseek_v3: over the
    pipeline, and split by heads, the latent whole on each rank): one process's texts."""
    from hf_models import make_tiny
    from test_distributed import FAMILIES
    from tiny_checkpoint import tokenizer_json

    import mlxinfer
    from mlxinfer.generation import generate_step

    config = dict(vocab_size=300, num_hidden_layers=3, **FAMILIES[family])
    path, _ = make_tiny(tmp_path / family, family, **config)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json(300)))
    model, tokenizer = mlxinfer.load(path)
    prompts = _prompts()
    texts = [mlxinfer.generate(model, tokenizer, p, max_tokens=N_TOKENS) for p in prompts]
    tokens = [[t for t, _ in generate_step(p, model, max_tokens=N_TOKENS)] for p in prompts]
    job = {"prompts": prompts, "n": N_TOKENS, "stop": _stop_string(texts), "more": False}
    results, log = _run_ranks(tmp_path, path, mode, job)
    assert "falls back" not in log and "runs " in log, log
    for result in results:
        assert result["texts"] == texts and result["tokens"] == tokens


@SLOW
@pytest.mark.slow
@pytest.mark.real
def test_smollm2_batch_generate_across_two_ranks(smollm2_hf_dir, tmp_path):
    """The real SmolLM2-135M (30 layers; 9 heads: tensor falls back to the pipeline)."""
    import mlxinfer
    from mlxinfer.generation import generate_step

    model, tokenizer = mlxinfer.load(smollm2_hf_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]
    prompts = [tokenizer.encode(t) for t in texts]
    expected = [mlxinfer.generate(model, tokenizer, p, max_tokens=12) for p in prompts]
    tokens = [[t for t, _ in generate_step(p, model, max_tokens=12)] for p in prompts]
    del model
    job = {"prompts": prompts, "n": 12, "stop": "\n\n", "more": False}
    results, log = _run_ranks(tmp_path, smollm2_hf_dir, "tensor", job, wait=240)
    assert "falls back to the pipeline: 9 attention heads do not divide over 2 ranks" in log
    for result in results:
        assert result["tokens"] == tokens
        assert result["texts"] == expected


def test_another_ranks_request_takes_rank_0s_drafts_from_a_draft_model():
    """A draft model drafts on rank 0 alone: on another rank a request drafting with one holds
    a Rank0Drafts (no ranks needed: decided at submission, before any collective); prompt
    lookup, no draft, or rank 0 itself start their own drafting."""
    from types import SimpleNamespace

    from mlxinfer.batch.requests import _Request
    from mlxinfer.distributed.batching import Turns
    from mlxinfer.distributed.copies import Rank0Drafts
    from mlxinfer.generation.drafts import DraftModel, PromptLookup
    from mlxinfer.generation.sampling import SamplingParams

    turns = Turns.__new__(Turns)
    for first in (True, False):
        turns.ranks = SimpleNamespace(first=first)
        for draft in (None, PromptLookup(), DraftModel(object())):
            request = _Request([1, 2], 4, SamplingParams().sampler(), [], frozenset())
            follows = turns.follow_drafts(request, draft, None, 8)
            assert follows == (not first and isinstance(draft, DraftModel))
            assert isinstance(request.drafter, Rank0Drafts) == follows
    with pytest.raises(ValueError, match="num_draft must be in 1..8"):  # as rank 0's check
        turns.follow_drafts(request, DraftModel(object()), 9, 8)


def _seeded_tokens(model, prompts, n) -> list[list[int]]:
    """Each prompt's tokens through an engine, sampled at temperature 0.9 with seed 7."""
    from mlxinfer.batch import Engine

    with Engine(model) as engine:
        return _seeded_tokens_in(engine, prompts, n)


def _rank0_requests(model, prompts, n, result) -> None:
    """Requests submitted on rank 0 alone (``serve``'s way: ``rank0_requests``), sampled there:
    the other rank's engine follows until rank 0 closes it."""
    from mlxinfer.batch import Engine

    engine = Engine(model, rank0_requests=True)
    if model.ranks.first:
        result["rank0"] = _seeded_tokens_in(engine, prompts, n)
        engine.close()
    while engine._thread.is_alive():
        engine._thread.join(0.5)
    result["rank0_flights"] = engine.flights.micro.ticks if engine.flights.micro is not None else 0


def _seeded_tokens_in(engine, prompts, n) -> list[list[int]]:
    from mlxinfer.generation.sampling import SamplingParams

    sampling = SamplingParams(temperature=0.9, seed=7)
    handles = [engine.submit(p, max_tokens=n, sampling=sampling) for p in prompts]
    return [[s.token for s in h.steps()] for h in handles]


def _lookup(model, prompts, n):
    """Each prompt's tokens through an engine drafting by prompt lookup, and the drafts kept.
    Two drafts a step: left to choose, one process's k follows its timings, which could find
    drafting not worth it (0 kept: seen when other tests' modules were loaded first)."""
    from mlxinfer.batch import Engine
    from mlxinfer.generation.drafts import PromptLookup

    with Engine(model) as engine:
        handles = [
            engine.submit(p, max_tokens=n, draft=PromptLookup(), num_draft=2) for p in prompts
        ]
        steps = [list(h.steps()) for h in handles]
    return [[s.token for s in row] for row in steps], sum(s.from_draft for r in steps for s in r)


def _drafted(model, draft_model, prompts, n) -> dict:
    """Each prompt's tokens through an engine drafting with ``draft_model`` (a whole copy,
    loaded plain), greedy and seeded (temperature 0.9, seed 7), two drafts a step, and the
    drafts kept."""
    from mlxinfer.batch import Engine
    from mlxinfer.generation.drafts import DraftModel
    from mlxinfer.generation.sampling import SamplingParams

    out = {}
    for name, sampling in [("greedy", None), ("seeded", SamplingParams(temperature=0.9, seed=7))]:
        with Engine(model) as engine:
            draft = DraftModel(draft_model)
            # k fixed: one process chooses it from its timings, ranks from nominal costs (the
            # same k on every rank), so only a fixed k gives counts both can be held to
            handles = [
                engine.submit(p, max_tokens=n, draft=draft, sampling=sampling, num_draft=2)
                for p in prompts
            ]
            steps = [list(h.steps()) for h in handles]
        out[name] = [[s.token for s in row] for row in steps]
        out[name + "_accepted"] = sum(s.from_draft for r in steps for s in r)
    return out


def _disk_runs(model, prompt, n, directory) -> dict:
    """The prefix cache on disk across ranks: an engine writes ``prompt``'s blocks (each rank
    its own part's), a second one (a restart: an empty pool) reads them back."""
    from mlxinfer.batch import Engine

    tokens = []
    for _ in range(2):
        with Engine(model, prefix_cache_dir=directory) as engine:
            handle = engine.submit(prompt, max_tokens=n)
            tokens.append([s.token for s in handle.steps()])
            loaded = engine.metrics()["prefix_disk_blocks_loaded"]
    files = sorted(str(f) for f in Path(directory).rglob("*.safetensors"))
    return {"tokens": tokens, "loaded": loaded, "cached": handle.cached_tokens, "files": files}


def _more_runs(model, tokenizer, draft_model, prompts, n, stop, result) -> None:
    """A stop string, drafts by prompt lookup and by a draft model (rank 0's), and sampling: with a seed (every request alike,
    as in one process), and without one (each request gets rank 0's seed plus its number)."""
    import mlxinfer

    run = functools.partial(mlxinfer.batch_generate, model, tokenizer, prompts, max_tokens=n)
    result["cut"] = run(stop=[stop])
    result["lookup"], result["accepted"] = _lookup(model, prompts, n)
    result["drafted"] = _drafted(model, draft_model, prompts, n)
    from mlxinfer.generation.drafts import DraftModel

    result["drafted_texts"] = run(draft=DraftModel(draft_model))  # greedy: the same texts
    result["sampled"] = run(temperature=0.9, seed=7)
    result["unseeded"] = run(temperature=0.9)


def _rank_main() -> None:
    import mlxinfer
    from mlxinfer.batch import Engine

    model_dir, mode, job, out = sys.argv[1:5]
    job = json.loads(Path(job).read_text())
    prompts, n = job["prompts"], job["n"]
    model, tokenizer = mlxinfer.load(
        model_dir, distributed=mode, log=lambda m: print(m, file=sys.stderr)
    )
    print("batch_generate: started", file=sys.stderr, flush=True)
    kv = {"kv_bits": job["kv_bits"]} if job.get("kv_bits") else {}  # a quantized pool
    result = {"texts": mlxinfer.batch_generate(model, tokenizer, prompts, max_tokens=n, **kv)}
    # An engine whose requests reach the ranks at other times (rank 1's later, one by one),
    # one of which rank 0 alone cancels after its second token: rank 0 decides for all.
    rank = model.ranks.rank
    before = model.ranks.steps
    with Engine(model, **kv) as engine:
        handles = []
        cancel = job.get("cancel")
        for i, p in enumerate(prompts):
            handles.append(engine.submit(p, max_tokens=LONG if i == cancel else n))
            time.sleep(0.15 * rank)
        tokens = {}
        if rank == 0 and cancel is not None:
            steps = handles[cancel].steps()
            tokens[cancel] = [next(steps).token, next(steps).token]
            handles[cancel].cancel()
            tokens[cancel] += [s.token for s in steps]  # those made before the cancel
        for i, h in enumerate(handles):
            if i not in tokens:
                tokens[i] = [s.token for s in h.steps()]
        result["tokens"] = [tokens[i] for i in range(len(handles))]
        again = engine.submit(prompts[-1], max_tokens=n)  # its prefix's blocks are cached now
        result["again"] = [[s.token for s in again.steps()], again.cached_tokens]
        forwards = engine.steps_run + engine.prefill_steps
        result["flights"] = engine.flights.micro.ticks if engine.flights.micro is not None else 0
    result["engine_steps"] = [model.ranks.steps - before, forwards]
    _rank0_requests(model, prompts[:4], n, result)
    if job.get("disk"):
        result["disk"] = _disk_runs(model, prompts[2], n, job["disk"])
    if job.get("more", True):
        draft_model, _ = mlxinfer.load(model_dir)  # whole, on every rank; rank 0's drafts
        _more_runs(model, tokenizer, draft_model, prompts, n, job["stop"], result)
    result["steps"] = model.ranks.steps
    print(model.ranks.summary(), file=sys.stderr)
    from distributed_rank import finish

    finish(out, result)


if __name__ == "__main__":
    _rank_main()
