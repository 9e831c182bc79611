"""The forward: token-id rows in batches through the network, pooled to one vector each.

Rows are sorted by length and right-padded into batches. A decoder (Qwen3-Embedding) runs
without its LM head (``hidden_states``: the final norm's output) under its causal mask, so no
real token ever sees a pad; a long row runs in chunks through a KV cache. An encoder (BERT:
``model.encoder_only``) sees both ways, so each row's pads are masked out of attention
(``model.encode(ids, lengths)``), and a row runs whole (it fits the model's positions). Then
each row is pooled over its own tokens only (the last real one, their mean, or the first),
cut to ``dimensions``, and L2-normalised when the checkpoint says so.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from ..errors import ConfigError
from .checkpoint import MODES, Pooling, read_pooling
from .inputs import EmbeddingError, check_dimensions, encode_inputs

BATCH_TOKENS = 2048  # padded tokens per forward: bounds the activations (measured: docs/server.md)
STEP = 512  # tokens per forward along a decoder's row; longer rows run in chunks through a KV cache


def hidden_states(model, inputs: mx.array, cache=None) -> mx.array:
    """A decoder's network before its LM head: the final norm's output, (B, L, hidden)."""
    inner = getattr(model, "inner_name", None)
    if inner is None:
        raise EmbeddingError(
            f"{type(model).__name__}: not a decoder with an inner network to embed with"
        )
    return model[inner](inputs, cache)


def hidden_size(model) -> int:
    """The width of the model's states (a quantized embedding packs 32 / bits per column)."""
    embedding = model.embedding
    width = int(embedding.weight.shape[-1])
    if "scales" in embedding:
        width = width * 32 // embedding.bits
    return width


def _picked(at: mx.array, n: mx.array, mode: str) -> mx.array:
    """(B, chunk, 1) weights of the states at positions ``at`` (1, chunk) of rows with ``n``
    (B, 1) real tokens: the pooled vector is the weighted sum."""
    if mode == "lasttoken":
        return (at == n - 1)[..., None]  # the row's last real token
    if mode == "cls":
        return (at == 0)[..., None]
    return (at < n)[..., None] / n[..., None]  # mean over the real tokens


def _pool_batch(model, rows: list[list[int]], mode: str, step: int) -> mx.array:
    """The pooled states of ``rows``, right-padded into one batch: (B, hidden) float32.

    A decoder: padding follows each row's tokens, so under the causal mask a real token never
    attends to one and its state is what the row alone would give; a row longer than ``step``
    runs in chunks through a KV cache (bounding the attention scores), each chunk adding its
    share. An encoder: one pass, the pads masked out of every row's attention."""
    lengths = [len(r) for r in rows]
    width = max(lengths)
    ids = mx.array([r + [0] * (width - len(r)) for r in rows])  # (B, L); 0: any valid id
    n = mx.array(lengths)[:, None]  # (B, 1)
    if getattr(model, "encoder_only", False):
        h = model.encode(ids, n[:, 0]).astype(mx.float32)  # (B, L, hidden)
        pooled = (h * _picked(mx.arange(width)[None], n, mode)).sum(axis=1)
        mx.eval(pooled)  # per batch: its activations are freed before the next batch's exist
        return pooled
    cache = model.make_cache() if width > step else None
    pooled = mx.zeros((len(rows), hidden_size(model)), dtype=mx.float32)
    for start in range(0, width, step):
        h = hidden_states(model, ids[:, start : start + step], cache).astype(mx.float32)
        at = mx.arange(start, start + h.shape[1])[None]  # (1, chunk) positions of this chunk
        pooled = pooled + (h * _picked(at, n, mode)).sum(axis=1)
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


def check_width(model, pooling: Pooling) -> None:
    """A ConfigError unless the pooling config's declared width is the model's."""
    width = hidden_size(model)
    if pooling.dimension is not None and pooling.dimension != width:
        raise ConfigError(
            f"1_Pooling/config.json: 'word_embedding_dimension' is {pooling.dimension}, "
            f"but the model's hidden size is {width}"
        )


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
            to the tokenizer's files; sentence_bert_config.json's ``max_seq_length`` cuts long
            texts); a :class:`Pooling`, or "lasttoken", "mean" or "cls" (normalised) to pool
            any model's hidden states.
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
    rows = encode_inputs(model, tokenizer, texts, pooling=pooling)
    return embed_ids(model, rows, pooling, dimensions=dimensions, batch_tokens=batch_tokens)
