"""What a constraint costs: decode tok/s with and without a JSON Schema, at batch 1 and 8, and
the host time spent building masks per token.

    python tools/bench_constraints.py MODEL_DIR [--tokens 96] [--rounds 3] [--json OUT]

Every request generates exactly ``--tokens`` tokens: the schema is an array of 60 strings, so
the constrained output never ends early, and EOS is never sampled unconstrained (a length
stop). Batch 1 runs ``stream_generate``; batch 8 runs eight requests in one ``Engine``. The
two forms alternate, ``--rounds`` times; the table gives the medians. Decode tok/s is
``GenerationStats.decode_tps`` (after the first token) summed over the batch's requests.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import json
import statistics
import threading
from pathlib import Path

import mlxinfer
from mlxinfer import Engine, SamplingParams, load, stream_generate
from mlxinfer.bench.bandwidth import environment, measure_bandwidth
from mlxinfer.output.constraints import Constraint

SCHEMA = {
    "type": "array",
    "items": {"type": "string", "maxLength": 30},
    "minItems": 60,
    "maxItems": 60,
}
PROMPT = "List sixty animals, as a JSON array of strings. Request {i}."


def one(model, tokenizer, constraint, tokens: int) -> float:
    """Decode tok/s of one request alone."""
    extra = {"constraint": constraint} if constraint else {}
    rs = list(
        stream_generate(
            model,
            tokenizer,
            [{"role": "user", "content": PROMPT.format(i=0)}],
            chat_template=True,
            max_tokens=tokens,
            **extra,
        )
    )
    return rs[-1].stats.decode_tps


def batch(model, tokenizer, constraint, tokens: int, rows: int) -> float:
    """Aggregate decode tok/s of ``rows`` requests in one engine."""
    rates = [0.0] * rows
    with Engine(model, max_batch=rows) as engine:

        def run(i):
            extra = {"constraint": constraint} if constraint else {}
            results = engine.stream(
                tokenizer,
                [{"role": "user", "content": PROMPT.format(i=i)}],
                chat_template=True,
                max_tokens=tokens,
                sampling=SamplingParams(),
                **extra,
            )
            rates[i] = list(results)[-1].stats.decode_tps

        threads = [threading.Thread(target=run, args=(i,)) for i in range(rows)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return sum(rates)


def mask_cost(tokenizer, constraint, tokens: list[int]) -> float:
    """Host seconds per token a processor spends building masks, replaying ``tokens``."""
    import mlx.core as mx

    process = constraint.processor(tokenizer)
    history = [0]
    logits = mx.zeros((1, 64))
    for t in tokens:
        process(mx.array(history), logits)
        history.append(t)
    return process.mask_s / len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model, tokenizer = load(str(args.model))
    constraint = Constraint.json_schema(SCHEMA)
    gbs, probe = measure_bandwidth()
    runs: dict[str, list[float]] = {k: [] for k in ("plain 1", "schema 1", "plain 8", "schema 8")}
    one(model, tokenizer, constraint, 8)  # warm-up: the vocabulary, the plans
    for _ in range(args.rounds):
        runs["plain 1"].append(one(model, tokenizer, None, args.tokens))
        runs["schema 1"].append(one(model, tokenizer, constraint, args.tokens))
        runs["plain 8"].append(batch(model, tokenizer, None, args.tokens, 8))
        runs["schema 8"].append(batch(model, tokenizer, constraint, args.tokens, 8))
    sample = list(
        stream_generate(
            model,
            tokenizer,
            [{"role": "user", "content": PROMPT.format(i=0)}],
            chat_template=True,
            max_tokens=args.tokens,
            constraint=constraint,
        )
    )
    per_token = mask_cost(tokenizer, constraint, [r.token for r in sample])
    med = {k: statistics.median(v) for k, v in runs.items()}
    env = environment(None)
    print(f"{env['cpu']}, {env['cpus']} CPUs, {env['blas']}; bandwidth {gbs:.1f} GB/s ({probe})")
    print(f"mlxinfer {mlxinfer.__version__}, {args.model}, {args.tokens} tokens a request")
    print("\n| batch | plain tok/s | with the schema | ratio |")
    print("|---:|---:|---:|---:|")
    for b in (1, 8):
        p, s = med[f"plain {b}"], med[f"schema {b}"]
        print(f"| {b} | {p:.1f} | {s:.1f} | {s / p:.2f}× |")
    print(f"\nhost time building a mask: {per_token * 1e3:.3f} ms per token (one request)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "environment": {**env, "bandwidth_gb_s": gbs, "probe": probe},
                    "tokens": args.tokens,
                    "runs": runs,
                    "median": med,
                    "mask_ms_per_token": per_token * 1e3,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
