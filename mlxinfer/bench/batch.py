"""``mlxinfer bench --batch 1,4,8,16``: aggregate throughput of the batching engine.

For each batch size B, B seeded random prompts of P tokens, each generating
exactly ``max_tokens`` (EOS ignored), all submitted at once to one
:class:`~mlxinfer.batch.Engine`. Rates are the batch's aggregate, counted as
mlx-lm's ``batch_generate`` counts its own (``--compare mlx-lm`` runs
``mlx_lm.benchmark --batch-size B`` on the same weights): prefill tokens over
the time spent in prefill forwards, generated tokens over the time spent in
decode forwards; ``total_s`` is the wall time of the whole run, which needs no
definition. Two more rows need no peer run:

- KV bytes held for a mix of prompt lengths, the pool's blocks against a dense
  left-padded cache as mlx-lm's ``BatchGenerator`` keeps it (B × the longest
  sequence, grown in 256-token steps) — computed from the same bytes per token;
- a newcomer's time to first token while B others decode, against alone.

Each batch's aggregate is also given against one ``generate`` stream (``generate_step`` over
its own cache, the same prompt length and tokens, as ``mlxinfer bench`` times it): what a user
compares when deciding whether to batch. The repetitions go in rounds, each every batch size
and then one stream, so that other work on a shared machine weighs on every column alike.

``--kv-bits`` quantizes every engine's pool (``Engine(kv_bits=)``), and the KV-bytes row counts
its packed bytes; mlx-lm's batch benchmark has no KV quantization (a note says so).
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx

from ..batch import Engine
from .common import Log, Run
from .runs import prompt_ids, summarize, time_run

MIX = (40, 300, 1200, 90, 650, 20, 2000, 150)  # prompt lengths of the KV-bytes row
DENSE_STEP = 256
NEWCOMER_OTHERS_TOKENS = 512  # the others are still decoding when the newcomer arrives
STEP_TIMEOUT_S = 600.0  # most seconds any one token may take before the bench gives up  # mlx-lm's BatchKVCache grows in steps of this many tokens


def _summary(runs: list[Run]) -> dict:
    out = summarize(runs)
    totals = sorted(r.total_s for r in runs)
    out["median"]["total_s"] = totals[len(totals) // 2]
    return out


def _options(kv_bits: int | None) -> dict:
    return {} if kv_bits is None else {"kv_bits": kv_bits}


def time_batch(model, prompts: list[list[int]], max_tokens: int, kv_bits: int | None = None) -> Run:
    """One run of every prompt through a fresh engine; the batch's aggregate rates."""
    mx.synchronize()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    with Engine(model, max_batch=max(len(prompts), 1), **_options(kv_bits)) as engine:
        handles = [engine.submit(p, max_tokens=max_tokens) for p in prompts]
        firsts = []
        for h in handles:
            steps = h.steps(STEP_TIMEOUT_S)
            next(steps)
            firsts.append(time.perf_counter())
            for _ in steps:
                pass
        total = time.perf_counter() - t0
        prefill = engine.prefill_tokens / max(engine.prefill_s, 1e-9)
        decode = engine.decode_tokens / max(engine.decode_s, 1e-9)
    return Run(
        ttft_s=max(firsts) - t0,
        prefill_tps=prefill,
        decode_tps=decode,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        total_s=total,
    )


def kv_bytes_row(
    model, max_tokens: int, lengths: tuple[int, ...] = MIX, kv_bits: int | None = None
) -> dict:
    """The pool's bytes for ``lengths`` (+ ``max_tokens`` each) against a dense left-padded
    cache of the same bytes per token."""
    with Engine(model, max_batch=len(lengths), **_options(kv_bits)) as engine:
        pool = engine.pool
        blocks = sum(pool.blocks_for(n + max_tokens) for n in lengths)
        per_token = pool.bytes_per_block // pool.block_size
    longest = max(lengths) + max_tokens
    dense_tokens = -(-longest // DENSE_STEP) * DENSE_STEP
    paged = blocks * pool.bytes_per_block
    dense = len(lengths) * dense_tokens * per_token
    return {
        "lengths": list(lengths),
        "max_tokens": max_tokens,
        "paged_bytes": paged,
        "dense_left_padded_bytes": dense,
        "ratio": paged / dense,
    }


def newcomer_ttft(
    model, others: int, prompt_tokens: int, vocab: int, kv_bits: int | None = None
) -> dict:
    """Time to first token of a request joining ``others`` running ones, against alone."""
    prompt = prompt_ids(prompt_tokens, vocab, seed=999)
    with Engine(model, **_options(kv_bits)) as engine:
        t0 = time.perf_counter()
        next(engine.submit(prompt, max_tokens=1).steps(STEP_TIMEOUT_S))
        alone = time.perf_counter() - t0
    with Engine(model, max_batch=others + 1, **_options(kv_bits)) as engine:
        running = [
            engine.submit(
                prompt_ids(prompt_tokens, vocab, seed=i), max_tokens=NEWCOMER_OTHERS_TOKENS
            )
            for i in range(others)
        ]
        for h in running:
            next(h.steps(STEP_TIMEOUT_S))  # every one is decoding
        t0 = time.perf_counter()
        next(engine.submit(prompt, max_tokens=1).steps(STEP_TIMEOUT_S))
        joined = time.perf_counter() - t0
        for h in running:
            h.cancel()
    return {"others": others, "prompt_tokens": prompt_tokens, "alone_s": alone, "joined_s": joined}


def prefix_ttft(
    model,
    vocab: int,
    prefix_tokens: int = 1000,
    suffix_tokens: int = 16,
    kv_bits: int | None = None,
) -> dict:
    """Time to first token of two requests sharing a ``prefix_tokens`` system prompt: the first
    computes it, the second finds its blocks in the pool."""
    system = prompt_ids(prefix_tokens, vocab, seed=2024)
    times, cached = [], []
    with Engine(model, **_options(kv_bits)) as engine:
        for seed in (1, 2):
            t0 = time.perf_counter()
            handle = engine.submit(system + prompt_ids(suffix_tokens, vocab, seed), max_tokens=1)
            next(handle.steps(STEP_TIMEOUT_S))
            times.append(time.perf_counter() - t0)
            cached.append(handle.cached_tokens)
    return {
        "prefix_tokens": prefix_tokens,
        "suffix_tokens": suffix_tokens,
        "first_s": times[0],
        "second_s": times[1],
        "second_cached_tokens": cached[1],
    }


def run_batch_benchmark(
    model,
    model_dir: Path,
    sizes: list[int],
    prompt_tokens: int,
    max_tokens: int,
    reps: int,
    compare: str | None,
    log: Log,
    kv_bits: int | None = None,
) -> dict:
    from .bandwidth import environment, measure_bandwidth
    from .peer import run_mlx_lm

    log("measuring memory bandwidth …")
    bandwidth = measure_bandwidth()  # named with the figures: machines differ
    vocab = model.args.vocab_size
    prompts = {B: [prompt_ids(prompt_tokens, vocab, seed=i) for i in range(B)] for B in sizes}
    prompt = prompt_ids(prompt_tokens, vocab, seed=0)
    for B in sizes:
        log(f"batch {B}: mlxinfer warm-up")
        time_batch(model, prompts[B], max_tokens, kv_bits)
    log("one generate stream: warm-up")
    time_run(model, prompt, max_tokens, kv_bits)
    # Rounds in turn (each: every batch size, then one generate stream), so that other work on
    # the machine falls on every column alike: the columns are compared with each other.
    runs: dict[int, list[Run]] = {B: [] for B in sizes}
    streams = []
    for r in range(reps):
        for B in sizes:
            runs[B].append(time_batch(model, prompts[B], max_tokens, kv_bits))
            log(
                f"batch {B}: mlxinfer {r + 1}/{reps}  decode {runs[B][-1].decode_tps:.1f} tok/s "
                f"(aggregate)  total {runs[B][-1].total_s:.1f} s"
            )
        streams.append(time_run(model, prompt, max_tokens, kv_bits)[0])
        log(f"one generate stream {r + 1}/{reps}  decode {streams[-1].decode_tps:.1f} tok/s")
    results = []
    for B in sizes:
        row = {"batch": B, "mlxinfer": _summary(runs[B])}
        if compare == "mlx-lm":
            log(f"batch {B}: mlx-lm (mlx_lm.benchmark --batch-size {B}) …")
            row["mlx-lm"] = _summary(
                run_mlx_lm(model_dir, prompt_tokens, max_tokens, reps, batch_size=B)
            )
        results.append(row)
    return {
        "environment": environment(compare),
        "bandwidth": {"gb_per_s": bandwidth[0], "probe": bandwidth[1]},
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "kv_bits": kv_bits,
        "batches": results,
        "generate": summarize(streams),
        "kv_bytes": kv_bytes_row(model, max_tokens, kv_bits=kv_bits),
        "newcomer": newcomer_ttft(model, 8, prompt_tokens, vocab, kv_bits),
        "prefix": prefix_ttft(model, vocab, kv_bits=kv_bits),
    }


def batch_tables(result: dict) -> str:
    rows = result["batches"]
    one = next((r for r in rows if r["batch"] == 1), None)
    env, bw = result["environment"], result["bandwidth"]
    kv_bits = result.get("kv_bits")
    keys = f", mlxinfer's keys and values {kv_bits}-bit" if kv_bits else ""
    lines = [
        f"{result['prompt_tokens']}-token prompts, {result['max_tokens']} tokens each{keys}, "
        "greedy — "
        f"MLX {env['mlx']} on {env['device']}, {env['blas']}; {env.get('cpu', 'CPU')} × "
        f"{env['cpus']}, memory bandwidth {bw['gb_per_s']:.1f} GB/s ({bw['probe']}), "
        f"1-min load average {env['load_average_1min'] or 0:.1f}",
        "",
        "| batch | engine | decode tok/s (aggregate) ↑ | × batch 1 | × one `generate` | total s ↓ "
        "| peak MB ↓ |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    stream = result["generate"]["median"]["decode_tps"] if "generate" in result else None
    for r in rows:
        for engine in ("mlxinfer", "mlx-lm"):
            if engine not in r:
                continue
            m = r[engine]["median"]
            base = one[engine]["median"]["decode_tps"] if one and engine in one else None
            scale = f"{m['decode_tps'] / base:.2f}×" if base else "—"
            ours = engine == "mlxinfer" and stream
            streams = f"{m['decode_tps'] / stream:.2f}×" if ours else "—"
            lines.append(
                f"| {r['batch']} | {engine} | {m['decode_tps']:.1f} | {scale} | {streams} | "
                f"{m['total_s']:.1f} | {m['peak_memory_gb'] * 1000:.0f} |"
            )
    if stream:
        lines.append(
            f"\none `generate` stream (the same prompt length and tokens, its own cache): "
            f"{stream:.1f} tok/s decode"
        )
    ratios = [
        f"batch {r['batch']}: {r['mlxinfer']['median']['decode_tps'] / r['mlx-lm']['median']['decode_tps']:.2f}×"
        for r in rows
        if "mlx-lm" in r
    ]
    if ratios:
        lines.append("\nmlxinfer / mlx-lm aggregate decode: " + ", ".join(ratios))
        if kv_bits:
            lines.append("(mlx-lm's batch benchmark has no KV quantization: its cache is float)")
    kv = result["kv_bytes"]
    lines.append(
        f"\nKV held for prompts of {kv['lengths']} (+{kv['max_tokens']} tokens each): paged "
        f"{kv['paged_bytes'] / 1e6:.1f} MB, dense left-padded {kv['dense_left_padded_bytes'] / 1e6:.1f}"
        f" MB ({kv['ratio']:.2f}×)"
    )
    n = result["newcomer"]
    lines.append(
        f"newcomer's time to first token ({n['prompt_tokens']}-token prompt): alone "
        f"{n['alone_s'] * 1000:.0f} ms, while {n['others']} others decode {n['joined_s'] * 1000:.0f} ms"
    )
    if "prefix" in result:
        p = result["prefix"]
        lines.append(
            f"shared {p['prefix_tokens']}-token prefix: time to first token {p['first_s'] * 1000:.0f} ms "
            f"for the first request, {p['second_s'] * 1000:.0f} ms for the second "
            f"({p['second_cached_tokens']} tokens from the pool, {p['first_s'] / p['second_s']:.1f}× lower)"
        )
    return "\n".join(lines)
