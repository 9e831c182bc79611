"""Building blocks shared by the model families.

A model's whole contract is::

    model(inputs: (B, L) int array, cache: list[Cache] | None) -> logits (B, L, V)
    model.make_cache(max_kv_size=None, kv_bits=None) -> list[Cache]
    Model.sanitize(weights) -> weights           # checkpoint fix-ups, HF names kept
    model.layers                                 # the transformer blocks, in order
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from ..cache import Cache, KVCache, Mask, QuantizedKVCache, RotatingKVCache
from ..config import require
from ..errors import ConfigError
from . import cpu_ops, cpu_parallel, cpu_quant, masks
from .cpu_ops import use_cpu_ops


@dataclasses.dataclass
class BaseArgs:
    """Model hyperparameters; ``from_dict`` keeps only the declared fields."""

    @classmethod
    def required(cls) -> list[str]:
        return [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "BaseArgs":
        require(config, cls.required())
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})


def make_layer_caches(
    n_layers: int,
    *,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    sliding_window: int | None = None,
) -> list[Cache]:
    """The standard per-layer caches for a decoder, as chosen by the user's flags.

    A model with sliding-window attention always gets rotating caches of its
    window; ``max_kv_size`` bounds the others, keeping 4 leading "sink" tokens
    (attention mass collects on the first tokens, so dropping them hurts most).
    """
    if sliding_window is not None:
        if kv_bits is not None:
            raise ValueError("--kv-bits is not supported with sliding-window attention")
        return [RotatingKVCache(sliding_window) for _ in range(n_layers)]
    if max_kv_size is not None:
        if kv_bits is not None:
            raise ValueError("--kv-bits and --max-kv-size cannot be combined")
        return [RotatingKVCache(max_kv_size, keep=4) for _ in range(n_layers)]
    if kv_bits is not None:
        return [QuantizedKVCache(kv_group_size, kv_bits) for _ in range(n_layers)]
    return [KVCache() for _ in range(n_layers)]


def causal_mask(n_queries: int, offset: int = 0, window: int | None = None) -> Mask:
    """Mask for ``n_queries`` new tokens after ``offset`` cached ones, no cache object."""
    if n_queries == 1:
        return None
    return "causal" if window is None else masks.windowed(n_queries, offset, window)


def attention(
    q: mx.array, k: Any, v: Any, *, scale: float, mask: Mask, cache: Cache | None
) -> mx.array:
    """Scaled dot-product attention over (B, n_heads, L, head_dim) queries.

    Plain keys/values go to ``mx.fast.scaled_dot_product_attention`` (fused
    flash-style kernels on Metal); a quantized cache hands back packed triples
    that are multiplied without dequantizing them.
    """
    if cache is not None and cache.quantized:
        return _quantized_attention(
            q, k, v, scale=scale, mask=mask, group_size=cache.group_size, bits=cache.bits
        )
    if use_cpu_ops():
        return cpu_ops.attention(
            q, k, v, scale=scale, mask=mask, evaluate_blocks=cpu_quant.stepwise()
        )
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _quantized_attention(q, k, v, *, scale, mask, group_size, bits) -> mx.array:
    B, n_q, L, D = q.shape
    if use_cpu_ops() and L >= cpu_ops.DEQUANTIZED_ATTENTION_ROWS:
        # MLX's CPU quantized matmul is a scalar loop: for a prefill chunk it is far
        # cheaper to dequantize this layer's keys and values once (a transient copy).
        k, v = (cpu_quant.dequantize(*t, group_size=group_size, bits=bits) for t in (k, v))
        return cpu_ops.attention(
            q,
            k.astype(q.dtype),
            v.astype(q.dtype),
            scale=scale,
            mask=mask,
            evaluate_blocks=cpu_quant.stepwise(),
        )
    n_kv = k[0].shape[1]
    reps = n_q // n_kv
    q = (q * scale).reshape(
        B, n_kv, reps, L, D
    )  # (B, n_kv, reps, L, D): query groups share a kv head
    k = [a[:, :, None] for a in k]
    v = [a[:, :, None] for a in v]
    scores = masks.apply(
        mx.quantized_matmul(q, *k, transpose=True, group_size=group_size, bits=bits), mask
    )
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(probs, *v, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, n_q, L, -1)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm`` (one Metal kernel), or its compiled CPU version (see ``cpu_ops``)."""
    if use_cpu_ops():
        return cpu_ops.rms_norm(x, weight, eps)
    return mx.fast.rms_norm(x, weight, eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters and names) that takes the CPU path on MLX's CPU backend."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


def lm_head(h: mx.array, head: nn.Module) -> mx.array:
    """Logits from the last hidden states through ``head``: an ``nn.Embedding`` (tied) or a Linear.

    Float weights on the CPU backend go through ``cpu_parallel.project`` (blocked
    one-row products); quantized heads and other backends use the layer itself.
    """
    if (
        use_cpu_ops()
        and "scales" not in head
        and head["weight"].dtype in (mx.float32, mx.float16, mx.bfloat16)
    ):
        logits = cpu_parallel.project(h, head)
        return logits + head["bias"] if "bias" in head else logits
    if (
        use_cpu_ops()
        and "scales" in head
        and h.size // h.shape[-1] <= cpu_parallel.CPULinear.MAX_ROWS
        and head["weight"].shape[0] >= 128
    ):
        return cpu_parallel.quantized_product(h, head)
    return (
        head.as_linear(h) if hasattr(head, "as_linear") else head(h)
    )  # an embedding (tied) or a Linear


class CausalLM(nn.Module):
    """The shell every decoder family shares: ``Inner`` (embedding → blocks → final norm) plus a
    head tied to the embedding or a separate ``lm_head``.

    A family sets ``Inner`` and overrides ``make_cache`` or ``sanitize`` where it differs. The
    attribute names follow the checkpoints' weight names: ``model.embed_tokens`` and
    ``model.layers`` by default, ``transformer.wte`` and ``transformer.h`` for GPT-2, say.
    """

    Inner: type[nn.Module]
    inner_name, embed_name, layers_name = "model", "embed_tokens", "layers"

    def __init__(self, args):
        super().__init__()
        self.args = args
        setattr(self, self.inner_name, self.Inner(args))
        if not self.tied:
            hidden = self.embedding.weight.shape[-1]
            self.lm_head = nn.Linear(hidden, args.vocab_size, bias=False)

    @property
    def tied(self) -> bool:
        """Whether the LM head is the token embedding."""
        return self.args.tie_word_embeddings

    @property
    def embedding(self) -> nn.Module:
        return self[self.inner_name][self.embed_name]

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        h = self[self.inner_name](inputs, cache)
        return lm_head(h, self.embedding if self.tied else self.lm_head)  # (B, L, V)

    @property
    def layers(self) -> list[nn.Module]:
        return self[self.inner_name][self.layers_name]

    def make_cache(
        self, *, max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64
    ) -> list[Cache]:
        return make_layer_caches(
            len(self.layers),
            max_kv_size=max_kv_size,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            sliding_window=getattr(self.args, "sliding_window", None),
        )

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args) -> dict[str, mx.array]:
        # Precomputed RoPE tables are buffers, not weights; a tied head is the embedding.
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights


# --- Building blocks for the families beyond Llama ----------------------------------------------

# HF activation names (``hidden_act`` / ``hidden_activation`` / ``activation_function``).
# The "new"/"tanh"/"fast" GELUs are one formula: 0.5x(1 + tanh(√(2/π)(x + 0.044715x³))).
ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "silu": nn.silu,
    "swish": nn.silu,
    "relu": nn.relu,
    "gelu": nn.gelu,  # exact (erf)
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_fast": nn.gelu_approx,
}


def activation(name: str, source: str = "config.json") -> Callable[[mx.array], mx.array]:
    if name not in ACTIVATIONS:
        raise ConfigError(
            f"{source}: unsupported activation '{name}' (expected one of {', '.join(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with a GELU."""

    def __init__(
        self, dim: int, hidden: int, act: Callable[[mx.array], mx.array], bias: bool = False
    ):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = act

    def __call__(self, x: mx.array) -> mx.array:
        if cpu_quant.slices_mlp(x, self.gate_proj, self.up_proj, self.down_proj):
            return cpu_quant.sliced_mlp(
                x, self.gate_proj, self.up_proj, self.down_proj, self.combine
            )
        if cpu_parallel.runs_in_halves(x, self.down_proj):
            return cpu_parallel.mlp_in_halves(
                x, self.gate_proj, self.up_proj, self.down_proj, self.combine
            )
        return self.down_proj(self.combine(self.gate_proj(x), self.up_proj(x)))

    def combine(self, gate: mx.array, up: mx.array) -> mx.array:
        """act(gate) * up, with the CPU backend's SwiGLU kernel for silu."""
        if self.act is nn.silu and use_cpu_ops():
            return cpu_ops.swiglu(gate, up)
        return self.act(gate) * up


def softcap_attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Mask, softcap: float
) -> mx.array:
    """Attention whose logits are squashed to (-softcap, softcap) by ``softcap * tanh(s / softcap)``.

    The fused kernel cannot cap logits, so this one spells attention out:
    (B, n_heads, L, D) queries over (B, n_kv_heads, T, D) keys, query groups
    sharing a kv head without copying it.
    """
    B, n_q, L, D = q.shape
    n_kv = k.shape[1]
    reps = n_q // n_kv
    q = (q * scale).reshape(B, n_kv, reps, L, D)  # (B, n_kv, reps, L, D)
    scores = q @ k[:, :, None].swapaxes(-1, -2)  # (B, n_kv, reps, L, T)
    scores = masks.apply(mx.tanh(scores / softcap) * softcap, mask)
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ v[:, :, None]).reshape(B, n_q, L, -1)  # (B, n_heads, L, Dv)


class RopeAttention(nn.Module):
    """Grouped-query attention with RoPE under HF's names (``q_proj k_proj v_proj o_proj``).

    The options cover the Llama-like families: biases on q/k/v and on o
    (Qwen2 has the first only), one fused ``qkv_proj`` (Phi-3), a per-head norm
    on queries and keys before RoPE (``q_norm``/``k_norm``: Qwen3, Gemma 3), and
    tanh soft-capping of the logits (Gemma 2). ``rope`` is built by the family,
    so layers may differ in it (Gemma 3's local and global bases).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        rope: nn.Module,
        scale: float | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        fused_qkv: bool = False,
        qk_norm: Callable[[int], nn.Module] | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.fused_qkv = fused_qkv
        if fused_qkv:  # rows: [q heads | k heads | v heads]
            self.qkv_proj = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim, bias=qkv_bias)
        else:
            self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=qkv_bias)
            self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
            self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=o_bias)
        self.has_qk_norm = qk_norm is not None
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(head_dim), qk_norm(head_dim)
        self.rope = rope

    def __call__(self, x: mx.array, mask: Mask, cache: Cache | None) -> mx.array:
        B, L, _ = x.shape
        if self.fused_qkv:
            q_end = self.n_heads * self.head_dim
            q, k, v = mx.split(
                self.qkv_proj(x), [q_end, q_end + self.n_kv_heads * self.head_dim], axis=-1
            )
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # (B, L, n * head_dim) -> (B, L, n, head_dim); norms act per head, then -> (B, n, L, head_dim)
        q = q.reshape(B, L, self.n_heads, self.head_dim)
        k = k.reshape(B, L, self.n_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self.softcap is not None:
            out = softcap_attention(q, k, v, scale=self.scale, mask=mask, softcap=self.softcap)
        else:
            out = attention(
                q, k, v, scale=self.scale, mask=mask, cache=cache
            )  # (B, n_heads, L, head_dim)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


# Per-layer attention kinds, as transformers 5 writes them in config.json's ``layer_types``.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


def check_layer_types(
    layer_types: list[str], n_layers: int, source: str = "config.json"
) -> list[str]:
    if len(layer_types) != n_layers or not set(layer_types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ConfigError(
            f"{source}: 'layer_types' must list {n_layers} entries of '{FULL_ATTENTION}' or "
            f"'{SLIDING_ATTENTION}', found {layer_types!r}"
        )
    return list(layer_types)


def make_typed_caches(
    layer_types: list[str],
    sliding_window: int | None,
    *,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> list[Cache]:
    """Caches for a decoder whose layers mix sliding-window and full attention.

    Sliding layers always get a rotating cache of their window (float: it is
    small); full layers get what the user's flags choose (see make_layer_caches).
    """
    n_full = sum(t != SLIDING_ATTENTION or sliding_window is None for t in layer_types)
    full = iter(
        make_layer_caches(
            n_full, max_kv_size=max_kv_size, kv_bits=kv_bits, kv_group_size=kv_group_size
        )
    )
    return [
        RotatingKVCache(sliding_window)
        if t == SLIDING_ATTENTION and sliding_window is not None
        else next(full)
        for t in layer_types
    ]


def typed_masks(
    layer_types: list[str], cache: list[Cache] | None, n_queries: int, sliding_window: int | None
) -> dict[str, Mask]:
    """One mask per attention kind, from the first layer of that kind (its cache knows the positions)."""
    masks: dict[str, Mask] = {}
    for i, kind in enumerate(layer_types):
        if kind in masks:
            continue
        if cache is None:
            window = sliding_window if kind == SLIDING_ATTENTION else None
            masks[kind] = causal_mask(n_queries, window=window)
        else:
            masks[kind] = cache[i].make_mask(n_queries)
    return masks


def scaled_embedding(h: mx.array, scale: float) -> mx.array:
    """Multiply embeddings by ``scale`` rounded to their dtype first, as transformers does
    (Gemma's sqrt(3072) = 55.43 becomes 55.5 in bfloat16)."""
    return h * mx.array(scale, dtype=h.dtype)


def alibi_slopes(n_heads: int) -> mx.array:
    """ALiBi's per-head slopes: a geometric series 2^(-8/n), interleaved for non-powers of two."""
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = [2 ** (-(8.0 / closest) * i) for i in range(1, closest + 1)]
    if closest != n_heads:
        extra = [2 ** (-(8.0 / (2 * closest)) * i) for i in range(1, 2 * closest + 1, 2)]
        slopes += extra[: n_heads - closest]
    return mx.array(slopes, dtype=mx.float32)
