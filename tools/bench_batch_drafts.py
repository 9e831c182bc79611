"""Drafts inside the batch. A draft model: the rows' draft steps batched over the draft model's
pool, against each row drafting in a cache of its own (B × k one-token forwards a step). Prompt
lookup (``--lookup``): the rows drafting from their own prompts, against plain decoding.

    python tools/bench_batch_drafts.py TARGET_DIR [DRAFT_DIR] [--requests 8] [--max-tokens 48]
    python tools/bench_batch_drafts.py TARGET_DIR --lookup [--requests 8] [--max-tokens 64]

DRAFT_DIR defaults to TARGET_DIR (the model drafting for itself: every greedy draft is kept,
so the step count is the same both ways and only the draft's cost differs). One engine per
run; the requests are submitted at once, greedy, ``num_draft`` 3; the two ways and plain decoding
(no drafts, for scale) alternate, twice. Prints each run's aggregate tok/s, the draft model's
time and forwards, and checks that every run gives the same tokens. With ``--lookup`` the
prompts ask for a text repeated, the requests draft by prompt lookup (``num_draft`` 4), and
the ways are "lookup" and "plain".
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlxinfer
from mlxinfer.batch import Engine
from mlxinfer.bench.bandwidth import report_runs
from mlxinfer.generation.drafts import DraftModel, PromptLookup

PROMPT = "Rewrite this sentence in the passive voice, then explain the change: the cat {i} chased the mouse."
LOOKUP_PROMPT = (
    "Repeat this text exactly, twice: The river {i} runs past the old mill. Children play on its "
    "banks in summer. In winter the water freezes at the edges. The mill has stood for a century."
)


def run(model, tokenizer, draft, prompts, max_tokens: int, way: str) -> dict:
    """``way``: "draft pool", "per row" (each row drafts in a cache of its own), "lookup"
    (prompt lookup) or "plain"."""
    with Engine(model, max_batch=len(prompts)) as engine:
        if way == "per row":
            engine._draft_pool = lambda d: None
        if way == "plain":
            options = {}
        elif way == "lookup":
            options = {"draft": PromptLookup(), "num_draft": 4}
        else:
            options = {"draft": DraftModel(draft), "num_draft": 3}
        t0 = time.perf_counter()
        handles = [engine.submit(p, max_tokens=max_tokens, **options) for p in prompts]
        tokens = [[s.token for s in h.steps()] for h in handles]
        wall = time.perf_counter() - t0
        m = engine.metrics()
    return {
        "way": way,
        "aggregate_tps": sum(map(len, tokens)) / wall,
        "wall_s": wall,
        "decode_tps": m["decode_tokens_per_second"],  # tokens over the decode steps' time
        "draft_seconds": m["draft_seconds"],
        "draft_forwards": m["draft_steps"],
        "verify_steps": m["decode_steps"],
        "accepted": m["draft_accepted_tokens"],
        "drafted": m["draft_tokens"],
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("draft", type=Path, nargs="?")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=None, help="48; 64 with --lookup")
    ap.add_argument("--lookup", action="store_true", help="prompt lookup against plain decoding")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model, tokenizer = mlxinfer.load(args.target)
    draft = model if args.draft is None else mlxinfer.load(args.draft)[0]
    text = LOOKUP_PROMPT if args.lookup else PROMPT
    max_tokens = args.max_tokens or (64 if args.lookup else 48)
    ways = ("lookup", "plain") if args.lookup else ("draft pool", "per row", "plain")
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": text.format(i=i)}]),
            add_special_tokens=False,
        )
        for i in range(args.requests)
    ]
    run(model, tokenizer, draft, prompts[:2], 4, ways[0])  # warm-up
    rows = []
    for way in ways * 2:
        r = run(model, tokenizer, draft, prompts, max_tokens, way)
        rows.append(r)
        print(
            f"{way:>14}: {r['aggregate_tps']:5.1f} tok/s (decode {r['decode_tps']:5.1f}), "
            f"draft {r['draft_seconds']:5.2f} s in {r['draft_forwards']} forwards, "
            f"{r['verify_steps']} verification steps, {r['accepted']}/{r['drafted']} kept",
            flush=True,
        )
    report_runs(rows, args.json, "every run")


if __name__ == "__main__":
    main()
