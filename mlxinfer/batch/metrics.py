"""The batching engine's counters, as ``Engine.metrics`` gives them (the server's ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    """What an engine has done so far: the scheduler, the verification step and the flights
    count into one of these (read as ``Engine.steps_run`` etc. too)."""

    steps_run: int = 0  # decode forwards so far
    prefill_steps: int = 0  # prefill forwards so far (short chunks share one)
    # Time spent in each kind of forward, and the tokens it fed (the bench's rates).
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    requests_done: int = 0  # requests retired (finished or cancelled)
    draft_tokens: int = 0  # drafts proposed
    accepted_tokens: int = 0  # of those, kept
    # Draft models: their forwards (a token each for each row in it, prefill chunks aside),
    # the time spent in them, and the bytes of the draft keys held for the running requests.
    draft_steps: int = 0
    draft_s: float = 0.0  # drafting of every kind (draft models, MTP heads, prompt lookup)
    draft_kv_bytes: int = 0
    # Drafting rows' verification: their row-steps, the steps' seconds (forward, acceptance,
    # rewinds), and by draft position j the drafts proposed there and accepted.
    draft_row_steps: int = 0
    verify_s: float = 0.0
    draft_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    def count_drafts(self, m: int, a: int, drafting: bool) -> None:
        """A row's verification step: ``m`` drafts proposed, ``a`` accepted."""
        self.draft_tokens += m
        self.accepted_tokens += a
        self.draft_row_steps += drafting
        grow = m - len(self.draft_by_position)
        if grow > 0:  # lists replaced, not extended: a reader on another thread sees either
            self.draft_by_position = self.draft_by_position + [0] * grow
            self.accepted_by_position = self.accepted_by_position + [0] * grow
        for j in range(m):
            self.draft_by_position[j] += 1
            self.accepted_by_position[j] += j < a


COUNTERS = frozenset(Counters.__dataclass_fields__)


def engine_metrics(engine) -> dict[str, float]:
    """A snapshot of ``engine``'s counters, read without a lock: each value is current, but
    they may be a step apart."""
    pool, n = engine.pool.stats(), engine.counters
    micro, heads = engine.flights.micro, engine.pools.head_pool
    return {
        "requests_running": len(engine._running),
        "requests_waiting": len(engine._waiting),
        "requests_done": n.requests_done,
        "prompt_tokens": n.prefill_tokens,
        "generated_tokens": n.decode_tokens,
        "prefill_tokens_per_second": n.prefill_tokens / n.prefill_s if n.prefill_s else 0.0,
        "decode_tokens_per_second": n.decode_tokens / n.decode_s if n.decode_s else 0.0,
        "decode_steps": n.steps_run,
        "decode_flights": micro.ticks if micro is not None else 0,
        "prefill_steps": n.prefill_steps,
        "kv_blocks_in_use": pool.blocks_in_use,
        "kv_blocks_cached": pool.blocks_cached,
        "kv_blocks_free": pool.blocks_free,
        "kv_window_blocks_in_use": engine.window_pool.stats().blocks_in_use
        if engine.window_pool is not None
        else 0,
        "kv_bytes": pool.nbytes
        + (engine.window_pool.nbytes if engine.window_pool else 0)
        + (heads.nbytes if heads is not None else 0),  # the MTP heads' pool is in kv_budget
        "prefix_hit_ratio": pool.prefix_hits / pool.prefix_queries if pool.prefix_queries else 0.0,
        "draft_tokens": n.draft_tokens,
        "draft_accepted_tokens": n.accepted_tokens,
        "draft_steps": n.draft_steps,
        "draft_seconds": n.draft_s,
        "draft_row_steps": n.draft_row_steps,
        "draft_tokens_per_step": (n.accepted_tokens + n.draft_row_steps) / n.draft_row_steps
        if n.draft_row_steps
        else 0.0,
        "verify_seconds": n.verify_s,
        "draft_kv_bytes": n.draft_kv_bytes,
        "draft_model_bytes": sum(engine._draft_weights.values()),
        "state_snapshots": len(engine.snapshots) if engine.snapshots is not None else 0,
        "state_snapshot_bytes": engine.snapshots.nbytes if engine.snapshots is not None else 0,
        "image_encoder_calls": engine.encoder_cache.calls,
        "image_encoder_cache_hits": engine.encoder_cache.hits,
        "image_encoder_cache_bytes": engine.encoder_cache.nbytes,
        **disk_metrics(engine.pool.disk),
    }


def position_metrics(engine) -> dict[str, list[int]]:
    """By draft position (the first draft of a step first): drafts proposed and accepted."""
    n = engine.counters
    return {
        "draft_position_tokens": list(n.draft_by_position),
        "draft_position_accepted_tokens": list(n.accepted_by_position),
    }


def disk_metrics(disk) -> dict[str, int]:
    """The prefix cache's disk tier's counters (zeros without one)."""
    names = ("loaded", "written", "dropped", "rejected", "evicted")
    return {f"prefix_disk_blocks_{n}": getattr(disk, n, 0) for n in names}
