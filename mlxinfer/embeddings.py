"""Sentence embeddings from a decoder's hidden states (Qwen3-Embedding and its kind).

An embedding checkpoint is an ordinary model directory plus sentence-transformers' files,
which say how a text's token states become one vector::

    modules.json             [Transformer, Pooling (path "1_Pooling"), Normalize?]
    1_Pooling/config.json    {"pooling_mode_lasttoken": true, ...}

The model runs without its LM head (``hidden_states``: the final norm's output); the rows of
a batch are right-padded, so under the causal mask no real token ever sees a pad, and each
row is pooled over its own tokens only (the last real one, their mean, or the first), then
L2-normalised when modules.json lists a ``Normalize`` module. The tokenizer adds what the
checkpoint says (Qwen3-Embedding's post-processor appends ``<|endoftext|>``, the token it
pools). Instructions are the caller's: a query is embedded as
``"Instruct: <task>\\nQuery:<text>"``, a document as itself (the model card's usage).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx

from .errors import ConfigError, MlxInferError, PromptTooLongError
from .generation.prefill import check_token_ids, token_ids

MODULES = "modules.json"
MAX_CONFIG_BYTES = 1 << 16  # modules.json, 1_Pooling/config.json: a few hundred bytes in practice
MAX_MODULES = 16
BATCH_TOKENS = 2048  # padded tokens per forward: bounds the activations (measured: docs/server.md)
STEP = 512  # tokens per forward along a row; longer rows run in chunks through a KV cache
MODES = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean"}
MODES["pooling_mode_cls_token"] = "cls"
UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_MODULE_TYPE = "sentence_transformers.models."
_KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}
_SUBDIR = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


class EmbeddingError(MlxInferError, ValueError):
    """An input that cannot be embedded: an empty one, a wrong type, a bad ``dimensions``."""


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector: ``mode`` "lasttoken" (the last token's state),
    "mean" (the mean over the tokens) or "cls" (the first token's); ``normalize``: to unit
    L2 norm; ``dimension``: the width the checkpoint declares (checked against the model)."""

    mode: str = "lasttoken"
    normalize: bool = True
    dimension: int | None = None


def is_embedding_dir(path: str | Path) -> bool:
    """Whether ``path`` is a sentence-transformers checkpoint (has a modules.json)."""
    return (Path(path) / MODULES).is_file()


def _read_json(file: Path) -> Any:
    try:
        with open(file, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{file}: cannot read ({e.strerror or e})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{file}: larger than {MAX_CONFIG_BYTES} bytes; not a pooling config")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{file}: not valid JSON ({' '.join(str(e).split())[:120]})") from None


def read_pooling(path: str | Path) -> Pooling:
    """The pooling a sentence-transformers checkpoint declares (modules.json and its Pooling
    module's config.json); a ConfigError naming the file and key for anything else."""
    path = Path(path)
    file = path / MODULES
    if not file.is_file():
        raise ConfigError(
            f"{file}: missing; not a sentence-transformers embedding checkpoint "
            "(modules.json and 1_Pooling/config.json)"
        )
    modules = _read_json(file)
    if not isinstance(modules, list) or not 0 < len(modules) <= MAX_MODULES:
        raise ConfigError(
            f"{file}: expected a list of 1..{MAX_MODULES} modules, found {modules!r:.80}"
        )
    kinds: dict[str, str] = {}  # module kind -> its path
    for i, module in enumerate(modules):
        kind = module.get("type") if isinstance(module, dict) else None
        where = module.get("path", "") if isinstance(module, dict) else None
        if not isinstance(kind, str) or not isinstance(where, str):
            raise ConfigError(
                f"{file}: module {i} should be an object with string 'type' and 'path', "
                f"found {module!r:.80}"
            )
        short = kind.removeprefix(_MODULE_TYPE)
        if short not in _KNOWN_MODULES or short in kinds:
            raise ConfigError(
                f"{file}: module {i} has type {kind!r:.80}; supported: one each of "
                + ", ".join(_MODULE_TYPE + k for k in sorted(_KNOWN_MODULES))
            )
        kinds[short] = where
    if "Pooling" not in kinds:
        raise ConfigError(f"{file}: no {_MODULE_TYPE}Pooling module")
    subdir = kinds["Pooling"]
    if not _SUBDIR.fullmatch(subdir) or subdir.strip(".") == "":
        raise ConfigError(
            f"{file}: the Pooling module's 'path' should name a subdirectory, found {subdir!r:.80}"
        )
    return _pooling(path / subdir / "config.json", normalize="Normalize" in kinds)


def _pooling(file: Path, normalize: bool) -> Pooling:
    config = _read_json(file)
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: expected a JSON object, found {type(config).__name__}")
    for key in (*MODES, *UNSUPPORTED_MODES, "include_prompt"):
        if key in config and not isinstance(config[key], bool):
            raise ConfigError(f"{file}: '{key}' should be true or false, found {config[key]!r:.40}")
    for key in UNSUPPORTED_MODES:
        if config.get(key):
            raise ConfigError(f"{file}: '{key}' is not supported (lasttoken, mean or cls pooling)")
    chosen = [mode for key, mode in MODES.items() if config.get(key)]
    if len(chosen) != 1:
        raise ConfigError(
            f"{file}: expected exactly one of {', '.join(MODES)} true, found {len(chosen)}"
        )
    dimension = config.get("word_embedding_dimension")
    if dimension is not None and (
        not isinstance(dimension, int) or isinstance(dimension, bool) or dimension <= 0
    ):
        raise ConfigError(
            f"{file}: 'word_embedding_dimension' should be a positive int, found {dimension!r:.40}"
        )
    return Pooling(chosen[0], normalize, dimension)


# --- the forward ---------------------------------------------------------------------------------


def hidden_states(model, inputs: mx.array, cache=None) -> mx.array:
    """The network before its LM head: the final norm's output, (B, L, hidden)."""
    inner = getattr(model, "inner_name", None)
    if inner is None:
        raise EmbeddingError(
            f"{type(model).__name__}: not a decoder with an inner network to embed with"
        )
    return model[inner](inputs, cache)


def hidden_size(model) -> int:
    return int(model.embedding.weight.shape[-1])


def _pool_batch(model, rows: list[list[int]], mode: str, step: int) -> mx.array:
    """The pooled states of ``rows``, right-padded into one batch: (B, hidden) float32.

    Padding follows each row's tokens, so under the causal mask a real token never attends to
    one and its state is what the row alone would give. A row longer than ``step`` runs in
    chunks through a KV cache (bounding the attention scores); each chunk adds its share."""
    lengths = [len(r) for r in rows]
    width = max(lengths)
    ids = mx.array([r + [0] * (width - len(r)) for r in rows])  # (B, L); 0: any valid id
    n = mx.array(lengths)[:, None]  # (B, 1)
    cache = model.make_cache() if width > step else None
    pooled = mx.zeros((len(rows), hidden_size(model)), dtype=mx.float32)
    for start in range(0, width, step):
        h = hidden_states(model, ids[:, start : start + step], cache).astype(mx.float32)
        at = mx.arange(start, start + h.shape[1])[None]  # (1, chunk) positions of this chunk
        if mode == "lasttoken":
            pick = (at == n - 1)[..., None]  # (B, chunk, 1): the row's last real token
        elif mode == "cls":
            pick = (at == 0)[..., None]
        else:  # mean
            pick = (at < n)[..., None] / n[..., None]
        pooled = pooled + (h * pick).sum(axis=1)
        # Evaluated per chunk: the graph, and the chunk's activations, stay one chunk deep.
        mx.eval(pooled, *([c.state for c in cache] if cache is not None else []))
    return pooled


def _finish(vectors: mx.array, normalize: bool, dimensions: int | None) -> mx.array:
    """Truncate to ``dimensions`` (Matryoshka models keep meaning in the leading ones), then
    normalise, as the checkpoint says."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        norm = mx.sqrt((vectors * vectors).sum(axis=-1, keepdims=True))
        vectors = vectors / mx.maximum(norm, 1e-12)  # sentence-transformers' eps: a zero stays zero
    return vectors


def embed_ids(
    model,
    ids: Sequence[Sequence[int]],
    pooling: Pooling,
    *,
    dimensions: int | None = None,
    batch_tokens: int = BATCH_TOKENS,
    step: int = STEP,
    cancelled: Callable[[], bool] | None = None,
) -> mx.array:
    """Embeddings (N, D) float32 of token-id rows already checked (see :func:`embed`).

    Rows are sorted by length and batched up to ``batch_tokens`` padded tokens per forward
    (a row longer than that runs alone); ``cancelled()`` is asked between batches."""
    check_width(model, pooling)
    check_dimensions(dimensions, hidden_size(model))
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[mx.array | None] = [None] * len(ids)
    i = 0
    while i < len(order):
        if cancelled is not None and cancelled():
            raise EmbeddingError("embedding cancelled")
        j = i + 1  # the batch: order[i:j], its longest row (the last) times its rows in budget
        while j < len(order) and len(ids[order[j]]) * (j + 1 - i) <= batch_tokens:
            j += 1
        pooled = _pool_batch(model, [list(ids[k]) for k in order[i:j]], pooling.mode, step)
        for row, k in enumerate(order[i:j]):
            out[k] = pooled[row]
        i = j
    vectors = _finish(mx.stack(out), pooling.normalize, dimensions)
    mx.eval(vectors)
    return vectors


def check_width(model, pooling: Pooling) -> None:
    """A ConfigError unless the pooling config's declared width is the model's."""
    width = hidden_size(model)
    if pooling.dimension is not None and pooling.dimension != width:
        raise ConfigError(
            f"1_Pooling/config.json: 'word_embedding_dimension' is {pooling.dimension}, "
            f"but the model's hidden size is {width}"
        )


def check_dimensions(dimensions: Any, width: int) -> None:
    if dimensions is None:
        return
    if (
        not isinstance(dimensions, int)
        or isinstance(dimensions, bool)
        or not 0 < dimensions <= width
    ):
        raise EmbeddingError(
            f"dimensions: expected an int in 1..{width} (the model's width), found {dimensions!r:.40}"
        )


def encode_inputs(
    model, tokenizer, inputs: Any, *, max_inputs: int | None = None
) -> list[list[int]]:
    """``inputs`` (a string, a list of strings, or a list of token-id lists) as token-id rows,
    each checked: not empty, every id in the vocabulary, within the model's context."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs:
        raise EmbeddingError(
            "input: expected a string, a non-empty list of strings or of token-id lists, "
            f"found {_kind(inputs)}"
        )
    if max_inputs is not None and len(inputs) > max_inputs:
        raise EmbeddingError(f"input: {len(inputs)} items, at most {max_inputs} per request")
    texts = isinstance(inputs[0], str)
    context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    rows = []
    for i, item in enumerate(inputs):
        what = f"input[{i}]"
        if texts and isinstance(item, str):
            if isinstance(context, int) and len(item) > 16 * context:
                raise PromptTooLongError(
                    f"{what}: {len(item)} characters, past the model's context of {context} tokens"
                )
            row = tokenizer.encode(item, add_special_tokens=True)
        elif not texts and isinstance(item, list):
            row = token_ids(item, what)
            check_token_ids(model, row, what)
        else:
            first = "strings" if texts else "token-id lists"
            raise EmbeddingError(f"{what}: expected {first} like input[0], found {_kind(item)}")
        if not row:
            raise EmbeddingError(f"{what}: empty; nothing to embed")
        if isinstance(context, int) and len(row) > context:
            raise PromptTooLongError(
                f"{what}: {len(row)} tokens, more than the model's context of {context}"
            )
        rows.append(row)
    return rows


def _kind(value: Any) -> str:
    return "an empty list" if value == [] else type(value).__name__


def embed(
    model,
    tokenizer,
    texts: str | list[str] | list[list[int]],
    *,
    pooling: Pooling | str | None = None,
    dimensions: int | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> mx.array:
    """Embed ``texts`` with an embedding checkpoint: an (N, D) float32 array, one row per text.

    Args:
        model, tokenizer: from :func:`mlxinfer.load` of the checkpoint's directory.
        texts: a string, a list of strings, or a list of token-id lists (used as given).
        pooling: None reads the checkpoint's sentence-transformers config (modules.json next
            to the tokenizer's files); a :class:`Pooling`, or "lasttoken", "mean" or "cls"
            (normalised) to pool any decoder's hidden states.
        dimensions: keep the leading ``dimensions`` of each vector (then normalise again):
            for Matryoshka-trained models such as Qwen3-Embedding.
        batch_tokens: padded tokens per forward (memory against speed).
    """
    if pooling is None:
        pooling = read_pooling(tokenizer.path)
    elif isinstance(pooling, str):
        if pooling not in MODES.values():
            raise EmbeddingError(
                f"pooling: expected one of {', '.join(MODES.values())}, found {pooling!r:.40}"
            )
        pooling = Pooling(pooling)
    check_dimensions(dimensions, hidden_size(model))
    rows = encode_inputs(model, tokenizer, texts)
    return embed_ids(model, rows, pooling, dimensions=dimensions, batch_tokens=batch_tokens)


class Embedder:
    """An embedding model as the server's registry holds it (in place of a generation engine):
    one forward at a time (the lock), with the counters ``/metrics`` reads."""

    alive = True
    failure = None

    def __init__(self, model, tokenizer, pooling: Pooling) -> None:
        check_width(model, pooling)
        self.model, self.tokenizer, self.pooling = model, tokenizer, pooling
        self._lock = threading.Lock()  # one forward at a time
        self._count = threading.Lock()  # the counters
        self.running = self.waiting = self.done = self.tokens = 0

    def embed(self, rows: list[list[int]], dimensions: int | None = None, cancelled=None):
        """:func:`embed_ids` of ``rows`` (checked: :func:`encode_inputs`), after the forwards
        other threads asked for first."""
        self._counted(waiting=1)
        with self._lock:
            self._counted(waiting=-1, running=1)
            try:
                return embed_ids(
                    self.model, rows, self.pooling, dimensions=dimensions, cancelled=cancelled
                )
            finally:
                self._counted(running=-1, done=1, tokens=sum(len(r) for r in rows))

    def _counted(self, **changes: int) -> None:
        with self._count:
            for name, change in changes.items():
                setattr(self, name, getattr(self, name) + change)

    def metrics(self) -> dict[str, float]:
        return {
            "requests_running": self.running,
            "requests_waiting": self.waiting,
            "requests_done": self.done,
            "prompt_tokens": self.tokens,
            "kv_bytes": 0,
        }

    def close(self, timeout: float | None = None) -> None:
        pass
