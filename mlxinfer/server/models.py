"""The models a server serves: the one it was started with, any converted model under
``--models-dir`` and every model in the store (``mlxinfer pull``), loaded on first use and
unloaded after ``--keep-alive`` idle seconds (as Ollama and LM Studio do).

A request names a model; the name is looked up among the directories found under the
models directory (each one holding a ``config.json``) and the store's models (by their store
names, ``org/name:variant``; ``org/name`` is ``org/name:latest``), never joined to a path. Each loaded
model has its own batching engine; an engine whose thread failed is replaced at the next
request for it (its requests got a 500), and the failure is kept for ``/health``.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from ..batch import Engine
from ..distributed.serving import across_ranks
from ..embeddings import Embedder, is_embedding_dir, read_pooling
from ..loading.loader import store_path
from ..store.layout import stored_models, stored_name


@dataclass
class Entry:
    name: str
    path: Path | None  # None: given loaded, kept for the server's life
    model: Any = None
    tokenizer: Any = None
    engine: Engine | None = None
    last_used: float = field(default_factory=time.monotonic)
    failures: list[str] = field(default_factory=list)
    loads: int = 0
    embedding: bool = False  # an embedding checkpoint: its "engine" is an embeddings.Embedder
    # Idle seconds before it is unloaded, as its last request asked (Ollama's keep_alive; inf:
    # never); None: the registry's.
    keep_alive: float | None = None

    @property
    def loaded(self) -> bool:
        return self.engine is not None


class Models:
    def __init__(
        self,
        *,
        engine_options: dict,
        models_dir: Path | None = None,
        keep_alive: float | None = None,
        load: Callable[[str], tuple[Any, Any]] | None = None,
        force: bool = False,
        store: Path | None = None,
    ) -> None:
        self.engine_options = engine_options
        self.models_dir = Path(models_dir) if models_dir is not None else None
        self.store = Path(store) if store is not None else None  # the store's root folder
        self.keep_alive = keep_alive
        self._load = load
        self.force = force  # load past what the machine can give (serve --force)
        self.entries: dict[str, Entry] = {}
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self.scan()
        if (self.models_dir is not None or self.store is not None) and keep_alive is not None:
            period = max(0.05, min(5.0, keep_alive / 4))
            threading.Thread(target=self._reap_loop, args=(period,), daemon=True).start()

    def add_loaded(self, name: str, model, tokenizer, engine: Engine | None = None) -> None:
        """A model given loaded: served until the server stops."""
        engine = engine or Engine(model, **self.engine_options)
        self.entries[name] = Entry(name, None, model, tokenizer, engine, loads=1)

    def scan(self) -> None:
        """Find the model directories under the models directory and the store (new ones too)."""
        found: list[tuple[str, Path]] = []
        if self.models_dir is not None and self.models_dir.is_dir():
            for path in sorted(self.models_dir.iterdir()):
                if path.is_dir() and (path / "config.json").is_file():
                    found.append((path.name, path))
        if self.store is not None:
            found += [(stored_name(path, self.store), path) for path in stored_models(self.store)]
        with self._lock:
            for name, path in found:
                self.entries.setdefault(name, Entry(name, path, embedding=is_embedding_dir(path)))

    def _stored(self, name: str) -> Entry | None:
        """The entry of the store model ``name`` means however it is spelt (``org/name`` for
        ``org/name:latest``, any case: the store's folders are lower case), if it is one."""
        if self.store is None:
            return None
        path = store_path(name, self.store.parent)
        return next((e for e in self.entries.values() if path and e.path == path), None)

    def names(self) -> list[str]:
        self.scan()
        return list(self.entries)

    def get(self, name: str) -> Entry | None:
        """The entry for ``name`` with a working engine (loaded now if it was not), or None if
        no model has that name."""
        with self._lock:
            entry = self.entries.get(name)
            if entry is None:
                self.scan()
                entry = self.entries.get(name) or self._stored(name)
            if entry is None:
                return None
            if entry.engine is not None and not entry.engine.alive:
                # Across ranks a failed engine stays (the ranks it ran with are gone): /health
                # and the requests say why.
                if entry.engine.failure is not None and not across_ranks(entry.model):
                    failure = entry.engine.failure
                    entry.failures.append(f"{type(failure).__name__}: {failure}")
                    entry.engine = Engine(entry.model, **self.engine_options)
            if entry.engine is None:
                self._make_room(entry)
                entry.model, entry.tokenizer = self._load(str(entry.path))
                entry.engine = self._engine(entry)
                entry.loads += 1
            entry.last_used = time.monotonic()
            return entry

    def _engine(self, entry: Entry):
        """A loaded model's engine: the batching one, or an embedding model's Embedder."""
        if entry.embedding:
            return Embedder(entry.model, entry.tokenizer, read_pooling(entry.path))
        return Engine(entry.model, **self.engine_options)

    def _make_room(self, entry: Entry) -> None:
        """Before ``entry`` loads: its weights, its engine's KV budget and headroom, with the
        KV budgets the loaded models may still grow into, must fit what the machine can give
        (memory.py); idle models are unloaded, least recently used first, until they do, or
        an InsufficientMemoryError names the numbers. ``force`` skips the check."""
        if self.force:
            return
        from ..batch.pool import DEFAULT_KV_BUDGET
        from ..loading import memory
        from ..loading.loader import default_dtype, weight_files
        from ..loading.memory import recommended_working_set

        budget = self.engine_options.get("kv_budget", DEFAULT_KV_BUDGET)
        weights = memory.weights_bytes(weight_files(entry.path), default_dtype())
        while True:
            held = [e for e in self.entries.values() if e.engine is not None and e is not entry]
            promised = sum(max(budget - e.engine.metrics()["kv_bytes"], 0) for e in held)
            parts = {
                "weights": weights,
                "KV budget": budget,
                "headroom": memory.HEADROOM,
                "KV budgets of the models loaded": promised,
            }
            room = memory.capacity(recommended_working_set())
            if room is None or sum(parts.values()) <= room.bytes:
                return
            idle = [e for e in held if e.path is not None and _idle(e.engine)]
            if not idle:
                hint = f", or wait until one of {', '.join(e.name for e in held)} is idle"
                memory.check_fits(f"model '{entry.name}'", parts, room, hint=hint)
            victim = min(idle, key=lambda e: e.last_used)
            victim.engine.close()
            victim.engine = victim.model = victim.tokenizer = None
            gc.collect()
            mx.clear_cache()  # MLX's buffer cache back to the system, so the room shows

    def touch(self, entry: Entry) -> None:
        entry.last_used = time.monotonic()

    def reap(self, now: float | None = None) -> list[str]:
        """Unload the models from the models directory idle for ``keep_alive`` seconds (no
        request running or waiting; a model's own ``keep_alive`` first); returns their names."""
        now = time.monotonic() if now is None else now
        gone = []
        with self._lock:
            for entry in self.entries.values():
                keep = entry.keep_alive if entry.keep_alive is not None else self.keep_alive
                if entry.path is None or entry.engine is None or keep is None:
                    continue
                busy = entry.engine.metrics()
                if busy["requests_running"] or busy["requests_waiting"]:
                    entry.last_used = now
                    continue
                if now - entry.last_used >= keep:
                    entry.engine.close()
                    entry.engine = entry.model = entry.tokenizer = None
                    gone.append(entry.name)
        return gone

    def unload(self, name: str) -> bool:
        """Unload ``name`` now if it came from the models directory and runs nothing (Ollama's
        ``keep_alive: 0``); a busy one is unloaded by the reaper once idle. Whether it is
        unloaded now."""
        with self._lock:
            entry = self.entries.get(name)
            if entry is None or entry.path is None or entry.engine is None:
                return False
            if not _idle(entry.engine):
                entry.keep_alive = 0.0  # the reaper unloads it once idle
                return False
            entry.engine.close()
            entry.engine = entry.model = entry.tokenizer = None
            return True

    def _reap_loop(self, period: float) -> None:
        while not self._closed.wait(period):
            self.reap()

    def close(self, timeout: float = 10.0) -> None:
        """Close every engine: their requests end with EngineError; each thread is waited for
        at most ``timeout`` seconds (one step, unless a forward runs long)."""
        self._closed.set()
        for entry in list(self.entries.values()):  # not under the lock: a load may hold it
            if entry.engine is not None:
                entry.engine.close(timeout)


def _idle(engine: Engine) -> bool:
    busy = engine.metrics()
    return not (busy["requests_running"] or busy["requests_waiting"])
