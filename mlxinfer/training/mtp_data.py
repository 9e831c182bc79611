"""What ``train-mtp`` learns from (``mtp.py``): the model's own answers to the shipped prompts,
the trunk's likeliest next tokens at every position (the teacher), and batches of the pairs
``(h_j, x_{j+1})`` with the trunk's distribution for ``x_{j+2}``."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources

import mlx.core as mx
import mlx.nn as nn


def shipped_prompts() -> list[str]:
    """The prompts ``train-mtp`` has the model answer (``mlxinfer/training/prompts.txt``)."""
    text = resources.files(__package__).joinpath("prompts.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def generate_sequences(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_tokens: int,
    seed: int,
) -> list[list[int]]:
    """Each prompt's ids (through the chat template, when the model has one) followed by the
    model's own answer, twice: greedy, then sampled at 0.8 (sequences 2i and 2i + 1 are prompt
    i's). One request at a time (on the CPU the batching engine's prefill is slower for these
    short prompts: docs/speculative.md)."""
    from ..generation import stream_generate
    from ..generation.request import prepare_prompt

    out = []
    for i, p in enumerate(prompts):
        ids = prepare_prompt(tokenizer, p)
        for temperature in (0.0, 0.8):
            tokens = [
                r.token
                for r in stream_generate(
                    model,
                    tokenizer,
                    ids,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    seed=seed + i,
                )
            ]
            out.append(ids + tokens)
    return out


def teacher(states: mx.array, lm_w: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The trunk's next-token log-probs at each position of one sequence, as its ``k``
    likeliest: (log-probs (L, k), ids (L, k)), the likeliest first."""
    logp = nn.log_softmax(states @ lm_w.T, axis=-1)
    k = min(k, logp.shape[-1])
    ids = mx.argpartition(-logp, k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(logp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    ids, vals = mx.take_along_axis(ids, order, -1), mx.take_along_axis(vals, order, -1)
    mx.eval(ids, vals)
    return vals, ids


def pairs(seqs, states, teachers, rows: list[int], length: int):
    """A batch of the sequences ``rows``, each its first ``length`` + 1 positions at most, as
    (tokens x_{j+1} (B, T), states h_j (B, T, H), the trunk's top log-probs and ids for
    x_{j+2} (B, T, K) twice, mask (B, T)), T the longest pair count; short rows padded, masked."""
    n = [min(len(seqs[r]), length + 1) - 1 for r in rows]
    T = max(n)
    H, K = states[rows[0]].shape[-1], teachers[rows[0]][0].shape[-1]
    toks, hs, tvs, tis, mask = [], [], [], [], []
    for r, k in zip(rows, n):
        pad = T - k
        toks.append(mx.array(seqs[r][1 : k + 1] + [0] * pad, dtype=mx.int32))
        h, (tv, ti) = states[r][:k], (a[1 : k + 1] for a in teachers[r])
        if pad:
            h = mx.concatenate([h, mx.zeros((pad, H), dtype=h.dtype)])
            tv = mx.concatenate([tv, mx.zeros((pad, K), dtype=tv.dtype)])
            ti = mx.concatenate([ti, mx.zeros((pad, K), dtype=ti.dtype)])
        hs.append(h)
        tvs.append(tv)
        tis.append(ti)
        mask.append(mx.array([1.0] * k + [0.0] * pad))
    return mx.stack(toks), mx.stack(hs), mx.stack(tvs), mx.stack(tis), mx.stack(mask)
