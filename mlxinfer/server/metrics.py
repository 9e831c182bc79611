"""The server's status routes, answered on the event loop (while every worker thread is busy):
``/health`` (is each loaded model's engine alive; a failed one is replaced) and ``/metrics``
(each loaded model's engine counters, the server's own and MLX's memory, in Prometheus' text
format)."""

from __future__ import annotations

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from ..batch.metrics import position_metrics
from .limits import Work
from .models import Models

PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
# engine metric -> (Prometheus type, help)
METRICS = {
    "requests_running": ("gauge", "Requests admitted: prefilling or decoding."),
    "requests_waiting": ("gauge", "Requests waiting for room in the batch or the KV pool."),
    "requests_done": ("counter", "Requests finished or cancelled."),
    "prompt_tokens": ("counter", "Prompt tokens prefilled (not counting prefix-cache hits)."),
    "generated_tokens": ("counter", "Tokens generated."),
    "prefill_tokens_per_second": ("gauge", "Prefill throughput since start."),
    "decode_tokens_per_second": ("gauge", "Aggregate decode throughput since start."),
    "decode_steps": ("counter", "Batched decode forwards."),
    "decode_flights": (
        "counter",
        "Ticks of micro-batched decode across pipeline ranks (a flight of rows at each rank).",
    ),
    "prefill_steps": ("counter", "Prefill forwards (short prompt chunks share one)."),
    "kv_blocks_in_use": ("gauge", "KV blocks referenced by running requests."),
    "kv_blocks_cached": ("gauge", "Unreferenced KV blocks kept for prefix hits."),
    "kv_blocks_free": ("gauge", "KV blocks free within the budget."),
    "kv_window_blocks_in_use": (
        "gauge",
        "Window-pool KV blocks (sliding-window layers) referenced by running requests.",
    ),
    "kv_bytes": ("gauge", "Bytes the KV pools' arrays hold (the window pool's too)."),
    "prefix_hit_ratio": (
        "gauge",
        "Prompt blocks served from the prefix cache, of those looked up.",
    ),
    "draft_tokens": (
        "counter",
        "Tokens proposed by drafts (prompt lookup, a draft model, an MTP head).",
    ),
    "draft_accepted_tokens": ("counter", "Proposed tokens accepted."),
    "draft_steps": ("counter", "Draft-model forwards, each over the requests drafting with it."),
    "draft_seconds": (
        "counter",
        "Seconds spent drafting (a draft model's prefill and proposals, MTP heads, prompt lookup).",
    ),
    "draft_row_steps": ("counter", "Verification steps of drafting requests (one per request)."),
    "draft_tokens_per_step": (
        "gauge",
        "Tokens a drafting request's verification step emits on average (1.0: plain decoding).",
    ),
    "verify_seconds": (
        "counter",
        "Seconds spent in the drafting requests' verification steps (forward, acceptance, rewind).",
    ),
    "draft_kv_bytes": ("gauge", "Bytes of the draft-model keys held for running requests."),
    "draft_model_bytes": ("gauge", "Bytes of the draft models' weights."),
    "state_snapshots": (
        "gauge",
        "Recurrent-state snapshots kept for prefix reuse (models with recurrent layers).",
    ),
    "state_snapshot_bytes": ("gauge", "Bytes of those snapshots (inside the KV budget)."),
    "image_encoder_calls": ("counter", "Vision tower calls (a request's images not cached)."),
    "image_encoder_cache_hits": ("counter", "Images whose features came from the encoder cache."),
    "image_encoder_cache_bytes": ("gauge", "Bytes of image features in the encoder cache."),
    "prefix_disk_blocks_loaded": ("counter", "Prefix blocks read back from the disk tier."),
    "prefix_disk_blocks_written": ("counter", "Prefix blocks written to the disk tier."),
    "prefix_disk_blocks_dropped": ("counter", "Blocks not written: the disk queue was full."),
    "prefix_disk_blocks_rejected": (
        "counter",
        "Block files removed unused: truncated, corrupted or another model's.",
    ),
    "prefix_disk_blocks_evicted": ("counter", "Block files removed to hold the disk budget."),
}


def prometheus(registry: Models, work: Work | None = None) -> str:
    """Each loaded model's engine counters in Prometheus' text format, ``mlxinfer_<name>``
    labelled with the model; the server's own (``work``: requests in flight, refused) unlabelled."""
    kinds = {"up": ("gauge", "1 while the model's engine thread is alive."), **METRICS}
    samples: dict[str, list[str]] = {key: [] for key in kinds}
    loaded = 0
    for entry in list(registry.entries.values()):
        engine = entry.engine
        if engine is None:
            continue
        loaded += 1
        label = '{model="' + entry.name.replace("\\", "\\\\").replace('"', '\\"') + '"}'
        for key, value in {"up": float(engine.alive), **engine.metrics()}.items():
            samples[key].append(f"{_metric(key, kinds)}{label} {value:g}")
    lines = [
        "# HELP mlxinfer_models_loaded Models loaded now.",
        "# TYPE mlxinfer_models_loaded gauge",
        f"mlxinfer_models_loaded {loaded}",
    ]
    if work is not None:
        lines += [
            "# HELP mlxinfer_server_requests_in_flight Engine requests the server has taken and "
            "not yet answered (an OpenAI request with n choices counts n).",
            "# TYPE mlxinfer_server_requests_in_flight gauge",
            f"mlxinfer_server_requests_in_flight {work.in_flight}",
            "# HELP mlxinfer_server_requests_refused_total Requests refused with a 503 because "
            "max_queue requests were waiting.",
            "# TYPE mlxinfer_server_requests_refused_total counter",
            f"mlxinfer_server_requests_refused_total {work.refused}",
        ]
    for key, (kind, text) in kinds.items():
        name = _metric(key, kinds)
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples[key]]
    lines += _position_lines(registry)
    lines += _rank_lines(registry)
    for key, value, text in _mlx_memory():
        lines += [f"# HELP mlxinfer_{key} {text}", f"# TYPE mlxinfer_{key} gauge"]
        lines.append(f"mlxinfer_{key} {value}")
    return "\n".join(lines) + "\n"


POSITION_METRICS = {  # by draft position (1: a step's first draft)
    "draft_position_tokens": ("counter", "Drafts proposed at this position of a step."),
    "draft_position_accepted_tokens": ("counter", "Drafts accepted at this position of a step."),
}


def _position_lines(registry: Models) -> list[str]:
    """``mlxinfer_draft_position_*_total{model=..., position=...}``: per-position acceptance."""
    samples: dict[str, list[str]] = {key: [] for key in POSITION_METRICS}
    for entry in list(registry.entries.values()):
        if not hasattr(getattr(entry.engine, "counters", None), "draft_by_position"):
            continue  # no engine, or one that never drafts (embeddings)
        model = entry.name.replace("\\", "\\\\").replace('"', '\\"')
        for key, values in position_metrics(entry.engine).items():
            for j, value in enumerate(values):
                samples[key].append(f'{{model="{model}",position="{j + 1}"}} {value}')
    lines: list[str] = []
    for key, (kind, text) in POSITION_METRICS.items():
        name = f"mlxinfer_{key}_total"
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [name + sample for sample in samples[key]]
    return lines


RANK_METRICS = {  # across ranks: each rank's, as of the engine's last turn
    "kv_bytes": ("gauge", "Bytes of the rank's KV pool (its own layers or heads)."),
    "weight_bytes": ("gauge", "Bytes of the weights the rank holds."),
    "computing_seconds": ("counter", "Seconds the rank spent computing its part of the steps."),
    "waiting_seconds": ("counter", "Seconds the rank spent waiting on the other ranks."),
}


def _rank_lines(registry: Models) -> list[str]:
    """``mlxinfer_rank_<name>{model=..., rank=...}`` for the engines that run across ranks (one
    process's turns have no ranks; an embedding model's engine has no turns)."""
    samples: dict[str, list[str]] = {key: [] for key in RANK_METRICS}
    for entry in list(registry.entries.values()):
        turns = getattr(entry.engine, "turns", None)
        if turns is None:
            continue
        model = entry.name.replace("\\", "\\\\").replace('"', '\\"')
        for rank, values in turns.rank_metrics().items():
            for key, value in values.items():
                samples[key].append(f'{{model="{model}",rank="{rank}"}} {value:.15g}')
    lines: list[str] = []
    for key, (kind, text) in RANK_METRICS.items():
        if samples[key]:
            name = f"mlxinfer_rank_{key}" + ("_total" if kind == "counter" else "")
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines += [name + sample for sample in samples[key]]
    return lines


def _mlx_memory() -> list[tuple[str, int, str]]:
    """MLX's allocator figures (process-wide): what arrays hold, what its buffer cache keeps."""
    import mlx.core as mx

    return [
        ("mlx_active_bytes", mx.get_active_memory(), "Bytes MLX's live arrays hold."),
        ("mlx_cache_bytes", mx.get_cache_memory(), "Bytes MLX's buffer cache keeps for reuse."),
        ("mlx_peak_bytes", mx.get_peak_memory(), "Most bytes MLX's arrays held at once."),
    ]


def _metric(key: str, kinds: dict) -> str:
    return f"mlxinfer_{key}" + ("_total" if kinds[key][0] == "counter" else "")


def add_status(app: FastAPI, registry: Models, work: Work) -> None:
    """``GET /health`` and ``GET /metrics`` on ``app``."""

    @app.get("/health")
    async def health():  # on the event loop: answered while every worker thread is busy
        report, ok, errors = {}, True, []
        for entry in list(registry.entries.values()):
            if entry.loaded and not entry.engine.alive and entry.engine.failure is not None:
                await anyio.to_thread.run_sync(registry.get, entry.name)  # replaced now
            item = {"loaded": entry.loaded, "restarts": len(entry.failures)}
            if entry.failures:
                item["last_failure"] = entry.failures[-1]
            if entry.loaded and not entry.engine.alive:
                ok = False
                errors.append(f"{entry.name}: {entry.engine.failure or 'engine closed'}")
            report[entry.name] = item
        if ok:
            return {"status": "ok", "models": report}
        return JSONResponse(
            {"status": "error", "error": "; ".join(errors), "models": report}, status_code=503
        )

    @app.get("/metrics")
    async def metrics():  # reads counters only: on the event loop, never waiting for a thread
        return PlainTextResponse(prometheus(registry, work), media_type=PROMETHEUS)
