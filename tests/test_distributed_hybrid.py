"""A hybrid family (recurrent layers beside attention) over two ranks on 127.0.0.1, started as
tests/test_distributed.py starts them: as a pipeline, and split by heads (tensor: every rank
runs every layer on its share of the attention heads, conv channels or Gated DeltaNet key
heads, its recurrent layers' state caches holding that share's state).

LFM2 with layers [attention, conv, conv, attention]: rank 0 runs an attention and a conv
layer, rank 1 a conv and an attention layer, so each rank's attention mask comes from its own
first attention layer (in the whole model, the first is layer 0: on rank 1 that is a conv
layer's state cache). One launch runs ``generate_step`` (the reference: transformers' greedy
tokens and float32 log-probabilities) and ``batch_generate`` with 8 prompts of mixed lengths,
whose recurrent rows keep their states per request (the reference: one process's texts, which
tests/test_hybrid.py holds to transformers). Run as a script, this file is one rank:
``python test_distributed_hybrid.py MODEL_DIR MODE JOB OUT``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve()
PROMPT = [1, 5, 9, 30, 7, 44]
N_TOKENS = 8
# Attention first and last: each rank holds one of each kind.
LAYER_TYPES = ["full_attention", "conv", "conv", "full_attention"]


def _lfm2(path: Path, **overrides):
    from hf_models import add_tokenizer, make_tiny

    config = dict(
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        block_multiple_of=64,
        vocab_size=320,
        perturb_vectors=True,
    )
    path, model = make_tiny(path, "lfm2", **{**config, **overrides})
    add_tokenizer(path)
    return path, model


def _reference(model, n=N_TOKENS):
    """transformers' greedy tokens and the f32 log-probabilities of each step's choice."""
    import torch
    from hf_models import torch_greedy

    tokens = torch_greedy(model, PROMPT, n)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens[:-1]])).logits[0]
    return tokens, torch.log_softmax(logits, -1).numpy()[len(PROMPT) - 1 :]


def _one_process(path: Path, prompts: list[list[int]]) -> list[str]:
    import mlxinfer

    model, tokenizer = mlxinfer.load(path)
    texts = [mlxinfer.generate(model, tokenizer, p, max_tokens=N_TOKENS) for p in prompts]
    assert len(set(texts)) == len(texts)  # distinct: a row given another's state shows
    return texts


def _run(tmp_path: Path, path: Path, mode: str, prompts: list[list[int]]):
    from test_distributed import WAIT_S, Ranks

    out, job = tmp_path / "out.json", tmp_path / "job.json"
    job.write_text(json.dumps({"prompt": PROMPT, "n": N_TOKENS, "prompts": prompts}))
    command = [sys.executable, str(SCRIPT), str(path), mode, str(job), str(out)]
    with Ranks(tmp_path, command) as ranks:
        codes = [ranks.wait(0, WAIT_S + 30), ranks.wait(1, 30)]
        assert codes == [0, 0], ranks.text(0) + ranks.text(1)
        results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
        return results, ranks.text(0) + ranks.text(1)


def _check(results, model, texts):
    tokens, logprobs = _reference(model)
    for result in results:  # every rank yields the same
        assert result["tokens"] == tokens
        assert result["texts"] == texts
    delta = np.abs(np.array(results[0]["logprobs"]) - logprobs).max()
    print(f"max |Δ| of the f32 log-probabilities against transformers: {delta:.2e}")
    assert delta < 1e-3


def test_lfm2_pipeline_matches_transformers_and_batches(tmp_path):
    from test_distributed_batch import _prompts

    path, model = _lfm2(tmp_path / "lfm2")
    prompts = _prompts()
    texts = _one_process(path, prompts)
    results, log = _run(tmp_path, path, "pipeline", prompts)
    assert "rank 0/2 runs layers 0-1 of 4" in log and "rank 1/2 runs layers 2-3 of 4" in log
    _check(results, model, texts)


SLOW = pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="more two-rank launches than the suite's share: set MLXINFER_SLOW=1 to run",
)


@SLOW
@pytest.mark.slow
def test_lfm2_tensor_matches_transformers_and_batches(tmp_path):
    """Split by heads and conv channels: each rank runs half of every layer (its attention
    heads, its conv channels, its MLP hidden units), its conv layers' state caches holding its
    channels only."""
    from test_distributed_batch import _prompts

    path, model = _lfm2(tmp_path / "lfm2")
    prompts = _prompts()[:3]
    texts = _one_process(path, prompts)
    results, log = _run(tmp_path, path, "tensor", prompts)
    assert "falls back" not in log, log
    for r, (heads, channels) in enumerate([("0-1", "0-31"), ("2-3", "32-63")]):
        line = (
            f"rank {r}/2 runs heads {heads} of 4 in every attention layer and channels "
            f"{channels} of 64 of each conv layer"
        )
        assert line in log, log
    _check(results, model, texts)


@SLOW
@pytest.mark.slow
@pytest.mark.parametrize(
    "layer_types",
    [
        # rank 0: recurrent layers only (no mask); rank 1: its first layer is attention
        ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        ["full_attention", "linear_attention", "linear_attention", "full_attention"],
    ],
    ids=["no-attention-on-rank-0", "both-kinds-on-each"],
)
def test_qwen3_next_pipeline_matches_transformers(tmp_path, layer_types):
    """Qwen3-Next's Gated DeltaNet (two state arrays per layer) and MoE blocks."""
    from hf_models import add_tokenizer, make_tiny
    from test_distributed_batch import _prompts
    from test_qwen3_next import TINY

    config = {**TINY, "vocab_size": 320, "layer_types": layer_types}
    path, model = make_tiny(tmp_path / "qwen3_next", perturb_vectors=True, **config)
    add_tokenizer(path)
    prompts = _prompts()[:4]
    texts = _one_process(path, prompts)
    if "full_attention" not in layer_types[:2]:  # rank 0's pool would hold no layer
        texts = (
            "batching across ranks: a rank holds recurrent layers only (no attention layer for "
            "its pool): not built yet (generate runs such a split)"
        )
    results, _ = _run(tmp_path, path, "pipeline", prompts)
    _check(results, model, texts)


@SLOW
@pytest.mark.slow  # a two-rank launch: the shares are checked in the default suite
# (test_distributed_recurrent.py)
def test_qwen3_next_tensor_matches_transformers_and_batches(tmp_path):
    """Split by heads: the output-gated attention by query heads (each head's [queries | gate]
    rows together), Gated DeltaNet by key heads (their value heads with them: each rank's state
    cache holds its heads' conv inputs and states), the experts by hidden units."""
    from hf_models import add_tokenizer, make_tiny
    from test_distributed_batch import _prompts
    from test_qwen3_next import TINY

    config = {**TINY, "vocab_size": 320}  # recurrent layers first: every rank holds attention
    path, model = make_tiny(tmp_path / "qwen3_next", perturb_vectors=True, **config)
    add_tokenizer(path)
    prompts = _prompts()[:4]
    texts = _one_process(path, prompts)
    results, log = _run(tmp_path, path, "tensor", prompts)
    assert "falls back" not in log, log
    for r in range(2):
        line = (
            f"rank {r}/2 runs heads {2 * r}-{2 * r + 1} of 4 in every attention layer and "
            f"hidden units {16 * r}-{16 * r + 15} of 32 of each layer's 8 experts and key head "
            f"{r} of 2 of each linear-attention layer"
        )
        assert line in log, log
    _check(results, model, texts)


def _rank_main() -> None:
    import mlxinfer
    from mlxinfer.errors import DistributedError
    from mlxinfer.generation import generate_step

    model_dir, mode, job, out = sys.argv[1:5]
    job = json.loads(Path(job).read_text())
    model, tokenizer = mlxinfer.load(
        model_dir, distributed=mode, log=lambda m: print(m, file=sys.stderr)
    )
    tokens, logprobs = [], []
    for token, lp in generate_step(job["prompt"], model, max_tokens=job["n"]):
        tokens.append(token)
        logprobs.append(lp.tolist())
    try:
        texts = mlxinfer.batch_generate(model, tokenizer, job["prompts"], max_tokens=job["n"])
    except DistributedError as e:  # refused on every rank alike
        texts = str(e)
    result = {"tokens": tokens, "logprobs": logprobs, "texts": texts}
    from distributed_rank import finish

    finish(out, result)


if __name__ == "__main__":
    _rank_main()
