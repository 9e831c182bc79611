"""Sentence embeddings: a checkpoint's token states pooled to one vector per text.

An embedding checkpoint is an ordinary model directory plus sentence-transformers' files,
which say how a text's token states become one vector (``checkpoint``: modules.json,
1_Pooling/config.json, sentence_bert_config.json). Two kinds of network run:

- a decoder (Qwen3-Embedding and its kind: any family), without its LM head, under its causal
  mask; the tokenizer adds what the checkpoint says (Qwen3-Embedding's post-processor appends
  ``<|endoftext|>``, the token it pools). Instructions are the caller's: a query is embedded
  as ``"Instruct: <task>\\nQuery:<text>"``, a document as itself (the model card's usage);
- an encoder (``bert``: all-MiniLM-L6-v2 and its kind), bidirectional, its pads masked out.

The modules: ``checkpoint`` (what the files say: :class:`Pooling`), ``inputs`` (texts and
token-id rows checked, lower-cased and cut as the checkpoint says), ``forward`` (the batches
through the network, pooled: :func:`embed`), ``embedder`` (the server's :class:`Embedder`).
"""

from .checkpoint import MODES, Pooling, is_embedding_dir, read_pooling
from .embedder import Embedder
from .forward import (
    BATCH_TOKENS,
    STEP,
    check_width,
    embed,
    embed_ids,
    hidden_size,
    hidden_states,
)
from .inputs import EmbeddingError, check_dimensions, encode_inputs, truncate

__all__ = [
    "BATCH_TOKENS",
    "MODES",
    "STEP",
    "Embedder",
    "EmbeddingError",
    "Pooling",
    "check_dimensions",
    "check_width",
    "embed",
    "embed_ids",
    "encode_inputs",
    "hidden_size",
    "hidden_states",
    "is_embedding_dir",
    "read_pooling",
    "truncate",
]
