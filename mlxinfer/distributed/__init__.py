"""Running one model across processes (ranks) with MLX's distributed engine (``mx.distributed``:
ring over TCP, JACCL over Thunderbolt RDMA, MPI). docs/distributed.md says how to run it.

- ``group``: joining the ranks (hostfile checks) and every wait on them, bounded;
- ``watchdog``: the bound: a step that overruns ``rank_timeout`` ends the process;
- ``placement``: which rank holds which layers, heads and weights;
- ``pipeline`` and ``tensor``: the two splits, applied to a loaded model from the outside
  (the model modules never learn about ranks);
- ``part``: :func:`load`, this rank's part of a model (``mlxinfer.load(path, distributed=...)``);
- ``reading``: reading only this rank's tensors of a checkpoint;
- ``batching``: the batching engine's turns, decided by rank 0 and taken by every rank;
- ``launch``: ``mlxinfer launch``, local ranks started and taken down together.

Library use, one process per rank::

    model, tokenizer = mlxinfer.distributed.load(path, "pipeline")   # or "tensor"
    seed = mlxinfer.distributed.shared_seed()    # for sampling at temperature > 0
    text = mlxinfer.generate(model, tokenizer, prompt, seed=seed)     # on every rank
"""

from __future__ import annotations

from importlib import import_module

# Loaded on first use (the CLI imports this package to add its options: no MLX at start-up).
_EXPORTS = {
    "DEFAULT_RANK_TIMEOUT": "watchdog",
    "Watchdog": "watchdog",
    "Ranks": "group",
    "connect": "group",
    "current": "group",
    "read_hostfile": "group",
    "load": "part",
}

__all__ = sorted([*_EXPORTS, "shared_seed"])


def shared_seed(seed: int | None = None) -> int:
    """``seed``, or one drawn by rank 0: the same on every rank (each rank's sampler must draw
    the same numbers, or the ranks part ways; the token check then stops them all)."""
    from .group import current

    return current().shared_seed(seed)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'mlxinfer.distributed' has no attribute '{name}'")
