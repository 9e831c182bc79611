"""Embedding mlxinfer in an app: a model handle that loads on demand and unloads when idle,
streams that any thread may cancel, an ``async for`` that never blocks the event loop, and
memory figures a UI can show. A thin layer over the batching engine (batch/).

Thread safety: a :class:`ModelHandle` may be used from any number of threads and tasks at
once. Every request goes through the handle's one engine, whose thread alone runs the model:
requests that overlap are decoded together, and no two threads ever run the model at the
same time. ``load``/``unload`` take the handle's lock; a request started while the model
loads waits for the load; ``unload`` cancels the requests still running.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator, Sequence

import mlx.core as mx

from .batch import Engine, Stream
from .batch.pool import DEFAULT_KV_BUDGET
from .generation.results import GenerationResult
from .generation.sampling import SAMPLING_FIELDS, SamplingParams
from .platform.progress import Progress

# stream_generate's options the engine takes as they are (sampling ones become a SamplingParams)
ENGINE_OPTIONS = {
    "max_tokens",
    "stop",
    "chat_template",
    "truncate_prompt",
    "timeout",
    "draft",
    "num_draft",
    "constraint",
    "response_format",
    "json_schema",
    "regex",
    "choices",
    "grammar",
    "tools",
    "tool_choice",
    "split_reasoning",
    "output",
    "chat_template_kwargs",
    "images",
}


class ModelHandle:
    """A model an app holds: loaded on first use (or :meth:`load`), unloaded by
    :meth:`unload` or after ``keep_alive`` idle seconds (no request running).

    ``path``: a model directory, a Hub repo id, or None for the default model.
    ``progress``: a ``(stage, done, total)`` callback for loads (:mod:`mlxinfer.platform.progress`).
    ``force``: load even if the weights and the engine's ``kv_budget`` exceed the memory the
    machine can give (an InsufficientMemoryError naming the numbers otherwise).
    ``engine_options``: for the :class:`~mlxinfer.batch.Engine` (``max_batch``, ``kv_budget``...).
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        keep_alive: float | None = None,
        progress: Progress | None = None,
        force: bool = False,
        dtype: Any = "auto",
        **engine_options,
    ) -> None:
        self.path, self.keep_alive, self.progress = path, keep_alive, progress
        self.force, self.dtype, self.engine_options = force, dtype, engine_options
        self.model = self.tokenizer = self.engine = None
        self.weights_bytes = 0
        self._lock = threading.RLock()
        self._streams: set[Stream] = set()
        self._last_used = time.monotonic()
        self._closed = threading.Event()
        if keep_alive is not None:
            period = max(0.05, min(5.0, keep_alive / 4))
            threading.Thread(target=self._reap, args=(period,), daemon=True).start()

    # --- residency ---------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        """Whether the model is in memory. Asked while a load or an unload runs on another thread
        (the keep-alive's), it waits for it to end: False means the memory was given back.
        The engine's parts refer to one another, so only the collector frees them, and a
        collection already running on another thread makes this thread's a no-op."""
        with self._lock:
            return self.engine is not None

    def load(self) -> ModelHandle:
        """Load now (a no-op when loaded); returns the handle."""
        from mlx.utils import tree_flatten

        from .loading.loader import load

        with self._lock:
            if self.engine is None:
                self.model, self.tokenizer = load(
                    self.path,
                    dtype=self.dtype,
                    progress=self.progress,
                    force=self.force,
                    kv_budget=self.engine_options.get("kv_budget", DEFAULT_KV_BUDGET),
                )
                self.weights_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
                self.engine = Engine(self.model, **self.engine_options)
            self._last_used = time.monotonic()
            return self

    def unload(self) -> None:
        """Cancel what is running, stop the engine and free the weights and caches."""
        with self._lock:
            for stream in list(self._streams):
                stream.cancel()
            if self.engine is not None:
                self.engine.close()
            self.model = self.tokenizer = self.engine = None
            self.weights_bytes = 0
            gc.collect()
            mx.clear_cache()

    def close(self) -> None:
        """Unload, and stop the keep-alive timer."""
        self._closed.set()
        self.unload()

    def __enter__(self) -> ModelHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _reap(self, period: float) -> None:
        while not self._closed.wait(period):
            with self._lock:
                idle = time.monotonic() - self._last_used
                if self.engine is not None and not self._streams and idle >= self.keep_alive:
                    self.unload()

    def memory(self) -> dict[str, int]:
        """Bytes: the weights, the KV blocks in use and the pool's arrays, and MLX's active,
        peak and cached memory (the process's, all models included)."""
        pool = self.engine.stats() if self.engine is not None else None
        return {
            "weights": self.weights_bytes,
            "kv_in_use": pool.bytes_in_use if pool is not None else 0,
            "kv_pool": pool.nbytes if pool is not None else 0,
            "active": mx.get_active_memory(),
            "peak": mx.get_peak_memory(),
            "cache": mx.get_cache_memory(),
        }

    # --- requests ----------------------------------------------------------------------------

    def start(self, prompt, **options) -> Stream:
        """Start one request (loading the model first if needed); its :class:`Stream`, which
        any thread may cancel. Takes ``stream_generate``'s options, ``images`` included (paths,
        bytes, data URLs, Pillow images: decoded on the caller's thread, so a bad one raises
        MediaError here; the model needs a vision tower)."""
        with self._lock:
            self.load()
            options = engine_options(options)
            if options.get("images") and self.engine.image_refusal() is not None:
                stream: Stream = _Solo(self.model, self.tokenizer, prompt, options)
            else:
                stream = self.engine.start(self.tokenizer, prompt, **options)
            self._streams.add(stream)
        return _Tracked(stream, self)

    def stream(self, prompt, **options):
        """``stream_generate``'s results, through the engine (a stop, a break or an exception
        in the caller cancels the request)."""
        stream = self.start(prompt, **options)
        try:
            yield from stream
        finally:
            stream.cancel()

    def generate(self, prompt, **options) -> str:
        return "".join(r.text for r in self.stream(prompt, **options))

    def astream(self, prompt, **options) -> AsyncIterator[GenerationResult]:
        """:meth:`stream` as an async iterator: see :func:`astream_generate`."""
        return _astream(lambda: self.start(prompt, **options))


class _Solo(Stream):
    """A request with images for a model whose image requests the engine cannot run yet
    (``Engine.image_refusal``: Qwen-VL's M-RoPE positions), run as the server runs it:
    ``stream_generate(images=...)`` on a thread of its own (one such request at a time, each
    on a fresh cache). The engine path replaces it once the engine takes that model's images."""

    cached_tokens = 0  # a fresh cache: nothing reused

    def __init__(self, model, tokenizer, prompt, options: dict) -> None:
        from .generation import stream_generate
        from .vision import load_image

        timeout = options.pop("timeout", None)
        sources = options["images"]
        options["images"] = [load_image(s, label=f"image {i + 1}") for i, s in enumerate(sources)]
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._timeout, self.handle, self._results = timeout, self, self
        self._request = SimpleNamespace(cancelled=self._stop)  # what Stream.cancelled reads

        def run() -> None:
            try:
                with _SOLO:
                    results = stream_generate(model, tokenizer, prompt, **options)
                    for r in results:
                        self._queue.put(r)
                        if self._stop.is_set():
                            break
                    results.close()
            except BaseException as e:  # handed to the reader
                self._queue.put(e)
            self._queue.put(_END)

        threading.Thread(target=run, daemon=True, name="mlxinfer-images").start()

    def __next__(self):
        try:
            item = self._queue.get(timeout=self._timeout)
        except queue.Empty:
            self.cancel()
            raise TimeoutError(f"no token within {self._timeout} s") from None
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self._stop.set()

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()


_SOLO = threading.Lock()  # _Solo requests run one after another, as the server's do


class _Tracked(Stream):
    """A stream that leaves its handle's running set when it ends or is cancelled."""

    def __init__(self, inner: Stream, owner: ModelHandle) -> None:
        super().__init__(inner.handle, inner._results)
        self._owner = owner

    def __next__(self):
        try:
            return super().__next__()
        except BaseException:
            self._done()
            raise

    def cancel(self) -> None:
        super().cancel()
        self._done()

    def _done(self) -> None:
        owner = self._owner
        with owner._lock:
            owner._streams = {s for s in owner._streams if s.handle is not self.handle}
            owner._last_used = time.monotonic()


def engine_options(options: dict) -> dict:
    """``stream_generate``'s keyword options as :meth:`Engine.start` takes them."""
    sampling = {k: options.pop(k) for k in list(options) if k in SAMPLING_FIELDS}
    unknown = set(options) - ENGINE_OPTIONS - {"sampling"}
    if unknown:
        raise TypeError(
            f"option(s) {', '.join(sorted(unknown))}: not available through the engine "
            f"(it takes {', '.join(sorted(ENGINE_OPTIONS | set(SAMPLING_FIELDS)))})"
        )
    if sampling:
        if "sampling" in options:
            raise ValueError("sampling: given as one SamplingParams, and also as separate options")
        options["sampling"] = SamplingParams(**sampling)
    return options


def astream_generate(
    model, tokenizer=None, prompt: str | Sequence | None = None, **options
) -> AsyncIterator[GenerationResult]:
    """``async for r in astream_generate(handle, prompt=..., **options)``: the results of one
    request, as ``stream_generate`` gives them, without blocking the event loop. ``model``: a
    :class:`ModelHandle` (``tokenizer`` then unused), or a model with its tokenizer (served by
    an engine kept for that model). Many may run at once: they share one batch. Leaving the
    ``async for`` early, or cancelling its task, cancels the request within one decode step."""
    if isinstance(model, ModelHandle):
        return model.astream(prompt if prompt is not None else tokenizer, **options)
    engine = _engine_for(model)
    return _astream(lambda: engine.start(tokenizer, prompt, **engine_options(options)))


_ENGINES: dict[int, tuple[Any, Engine]] = {}
_ENGINES_LOCK = threading.Lock()


def _engine_for(model) -> Engine:
    """The engine kept for a bare model (one per model, for the process's life)."""
    with _ENGINES_LOCK:
        found = _ENGINES.get(id(model))
        if found is None or found[0] is not model or not found[1].alive:
            found = _ENGINES[id(model)] = (model, Engine(model))
        return found[1]


_END = object()


async def _astream(start) -> AsyncIterator[GenerationResult]:
    """Run ``start()``'s stream on a worker thread; its results reach this task through a
    queue the loop is woken for, so the loop never waits on the model."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stream: list[Stream] = []
    stopped = threading.Event()

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop closed
            pass

    def produce() -> None:
        try:
            s = start()
            stream.append(s)
            if stopped.is_set():
                s.cancel()
            for r in s:
                put(r)
            put(_END)
        except BaseException as e:  # handed to the consumer
            put(e)

    threading.Thread(target=produce, daemon=True, name="mlxinfer-astream").start()
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stopped.set()
        if stream:
            stream[0].cancel()
