"""BERT: a bidirectional encoder (sentence-embedding models such as all-MiniLM-L6-v2).

The input is ``LayerNorm(word(ids) + position(0..L-1) + token_type(0))``; each layer is
post-norm: ``h = LayerNorm(h + attn(h))`` then ``h = LayerNorm(h + out(gelu(inter(h))))``.
Attention sees every real token of its row, before and after; a padded row's pad keys are
masked out (``lengths``), so a row's states are the same padded or alone. Names are
transformers' ``BertModel`` (``embeddings.word_embeddings``, ``encoder.layer.N.attention.self.
query`` ...); ``sanitize`` takes ``BertForMaskedLM``'s ``bert.`` prefix off and drops its head.

An encoder has no LM head and no KV cache: :meth:`Model.encode` gives the hidden states
(``mlxinfer.embed`` pools them), and generating with it is a one-line error.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from . import layers
from .base import BaseArgs
from .layers import activation

MAX_TOKEN_TYPES = 1024  # released BERTs have 1 or 2 (segment A and B)


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_embedding_type: str = "absolute"

    def __post_init__(self):
        # build_model reports a ValueError here as a ConfigError naming config.json.
        if self.position_embedding_type != "absolute":
            raise ValueError(
                f"position_embedding_type {self.position_embedding_type!r} is not supported "
                "(absolute only)"
            )
        if not 1 <= self.type_vocab_size <= MAX_TOKEN_TYPES:
            raise ValueError(f"type_vocab_size must be in 1..{MAX_TOKEN_TYPES}")
        if not 0 <= self.layer_norm_eps < 1:
            raise ValueError("layer_norm_eps must be in [0, 1)")


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, inputs: mx.array, token_types: mx.array | None) -> mx.array:
        L = inputs.shape[1]
        if token_types is None:  # one segment (a sentence): type 0 everywhere
            token_types = mx.zeros_like(inputs)
        h = self.word_embeddings(inputs) + self.position_embeddings(mx.arange(L))[None]
        return self.LayerNorm(h + self.token_type_embeddings(token_types))  # (B, L, hidden)


class SelfAttention(layers.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.scale = (args.hidden_size // self.n_heads) ** -0.5
        self.query = nn.Linear(args.hidden_size, args.hidden_size)
        self.key = nn.Linear(args.hidden_size, args.hidden_size)
        self.value = nn.Linear(args.hidden_size, args.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array | None, cache: None = None) -> mx.array:
        B, L, D = x.shape
        # (B, L, D) -> (B, n_heads, L, head_dim)
        q, k, v = (
            proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            for proj in (self.query, self.key, self.value)
        )
        out = self.attend(q, k, v, scale=self.scale, mask=mask, cache=None)
        return out.transpose(0, 2, 1, 3).reshape(B, L, D)


class Output(nn.Module):
    """``LayerNorm(residual + dense(x))``: BERT's post-norm (``attention.output`` and ``output``)."""

    def __init__(self, n_in: int, args: ModelArgs):
        super().__init__()
        self.dense = nn.Linear(n_in, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(residual + self.dense(x))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self = SelfAttention(args)  # HF's name: attention.self.query ...
        self.output = Output(args.hidden_size, args)

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        return self.output(self.self(x, mask, None), x)


class Intermediate(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.intermediate_size)
        self.act = activation(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.intermediate = Intermediate(args)
        self.output = Output(args.intermediate_size, args)

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        h = self.attention(x, mask)
        return self.output(self.intermediate(h), h)


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.layer = [Layer(args) for _ in range(args.num_hidden_layers)]


def padding_mask(lengths: mx.array, width: int) -> mx.array:
    """Boolean (B, 1, L, L) mask: every query of row b sees the keys before ``lengths[b]``
    (its real tokens), in both directions. Full size, not (B, 1, 1, L): attention that runs
    queries in blocks slices the mask along the query axis."""
    keys = mx.arange(width)[None] < lengths[:, None]  # (B, L)
    return mx.broadcast_to(keys[:, None, None, :], (lengths.shape[0], 1, width, width))


def encoder_error(model_type: str = "bert") -> ConfigError:
    return ConfigError(
        f"model_type '{model_type}' is an encoder (sentence embeddings): it has no LM head and "
        "no KV cache, so it cannot generate text; embed with `mlxinfer embed` or mlxinfer.embed()"
    )


class Model(nn.Module):
    """BERT's encoder: ``encode(ids, lengths) -> (B, L, hidden)``; no LM head, no cache."""

    encoder_only = True  # read by mlxinfer.embeddings: one bidirectional pass per row

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)

    @property
    def embedding(self) -> nn.Module:
        """The token embedding (its rows bound the ids the model may be fed)."""
        return self.embeddings.word_embeddings

    @property
    def layers(self) -> list[Layer]:
        return self.encoder.layer

    def encode(
        self,
        inputs: mx.array,
        lengths: mx.array | None = None,
        token_types: mx.array | None = None,
    ) -> mx.array:
        """The last layer's states (B, L, hidden) of ``inputs`` (B, L): rows right-padded to
        ``lengths`` (B,) real tokens (None: no padding); ``token_types`` (B, L), default 0."""
        L = inputs.shape[1]
        if L > self.args.max_position_embeddings:
            raise ValueError(
                f"BERT has {self.args.max_position_embeddings} learned positions; "
                f"this input has {L} tokens"
            )
        h = self.embeddings(inputs, token_types)
        mask = None if lengths is None else padding_mask(lengths, L)
        for layer in self.encoder.layer:
            h = layer(h, mask)
        return h

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        raise encoder_error(self.args.model_type)

    def make_cache(self, **_) -> list:
        raise encoder_error(self.args.model_type)

    def quant_predicate(self, path: str, module: nn.Module) -> bool:
        # The position and token-type tables are small and added to every token: keep them exact.
        return not path.endswith(("position_embeddings", "token_type_embeddings"))

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        # BertForMaskedLM / BertForPreTraining name the encoder "bert." and carry heads ("cls.")
        # that embeddings do not use; BertModel saves a pooler (a tanh layer over [CLS] for the
        # next-sentence task) that sentence-transformers ignores; position_ids is a buffer.
        out = {}
        for key, value in weights.items():
            key = key.removeprefix("bert.")
            if key.startswith(("cls.", "pooler.")) or key.endswith("position_ids"):
                continue
            out[key] = value
        return out
