"""The batching engine's counters, as ``Engine.metrics`` gives them (the server's ``/metrics``)."""

from __future__ import annotations


def engine_metrics(engine) -> dict[str, float]:
    """A snapshot of ``engine``'s counters, read without a lock: each value is current, but
    they may be a step apart."""
    pool = engine.pool.stats()
    return {
        "requests_running": len(engine._running),
        "requests_waiting": len(engine._waiting),
        "requests_done": engine.requests_done,
        "prompt_tokens": engine.prefill_tokens,
        "generated_tokens": engine.decode_tokens,
        "prefill_tokens_per_second": engine.prefill_tokens / engine.prefill_s
        if engine.prefill_s
        else 0.0,
        "decode_tokens_per_second": engine.decode_tokens / engine.decode_s
        if engine.decode_s
        else 0.0,
        "decode_steps": engine.steps_run,
        "decode_flights": engine.micro.ticks if engine.micro is not None else 0,
        "prefill_steps": engine.prefill_steps,
        "kv_blocks_in_use": pool.blocks_in_use,
        "kv_blocks_cached": pool.blocks_cached,
        "kv_blocks_free": pool.blocks_free,
        "kv_window_blocks_in_use": engine.window_pool.stats().blocks_in_use
        if engine.window_pool is not None
        else 0,
        "kv_bytes": pool.nbytes + (engine.window_pool.nbytes if engine.window_pool else 0),
        "prefix_hit_ratio": pool.prefix_hits / pool.prefix_queries if pool.prefix_queries else 0.0,
        "draft_tokens": engine.draft_tokens,
        "draft_accepted_tokens": engine.accepted_tokens,
        "draft_steps": engine.draft_steps,
        "draft_seconds": engine.draft_s,
        "draft_kv_bytes": engine.draft_kv_bytes,
        "draft_model_bytes": sum(engine._draft_weights.values()),
        "state_snapshots": len(engine.snapshots) if engine.snapshots is not None else 0,
        "state_snapshot_bytes": engine.snapshots.nbytes if engine.snapshots is not None else 0,
        **disk_metrics(engine.pool.disk),
    }


def disk_metrics(disk) -> dict[str, int]:
    """The prefix cache's disk tier's counters (zeros without one)."""
    names = ("loaded", "written", "dropped", "rejected", "evicted")
    return {f"prefix_disk_blocks_{n}": getattr(disk, n, 0) for n in names}
