"""GPT-2: learned absolute positions, LayerNorm, GELU, fused Conv1D projections.

Pre-norm blocks ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``; the input is
``wte(ids) + wpe(positions)`` where the positions continue from the cache's
offset; the LM head is ``wte``. Names are transformers' ``GPT2LMHeadModel``
(``transformer.h.N.attn.c_attn`` ...).

HF stores c_attn / c_proj / c_fc as Conv1D weights, shaped (in, out); sanitize
transposes them to Linear's (out, in) so they quantize like any Linear.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache
from . import layers
from .base import BaseArgs, CausalLM, causal_mask, per_layer, positions
from .layers import activation
from .layers.rope import reach

CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    n_embd: int
    n_layer: int
    n_head: int
    vocab_size: int
    n_positions: int = 1024
    n_inner: int = 0  # 0 or absent: 4 * n_embd (__post_init__)
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False

    def __post_init__(self):
        self.n_inner = self.n_inner or 4 * self.n_embd
        self.max_position_embeddings = (
            self.n_positions
        )  # the context, under the name generation reads


class Attention(layers.Attention):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.n_heads = args.n_head
        head_dim = args.n_embd // args.n_head
        self.scale = head_dim**-0.5 if args.scale_attn_weights else 1.0
        if args.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1
        self.c_attn = nn.Linear(args.n_embd, 3 * args.n_embd)  # rows: [q | k | v]
        self.c_proj = nn.Linear(args.n_embd, args.n_embd)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        B, L, D = x.shape
        # (B, L, 3D) -> 3 × (B, n_heads, L, head_dim)
        q, k, v = (
            t.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            for t in mx.split(self.c_attn(x), 3, axis=-1)
        )
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = self.attend(
            q, k, v, scale=self.scale, mask=mask, cache=cache
        )  # (B, n_heads, L, head_dim)
        return self.c_proj(out.transpose(0, 2, 1, 3).reshape(B, L, D))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.c_fc = nn.Linear(args.n_embd, args.n_inner)
        self.c_proj = nn.Linear(args.n_inner, args.n_embd)
        self.act = activation(args.activation_function)

    def __call__(self, x: mx.array) -> mx.array:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.attn = Attention(args, layer_idx)
        self.ln_2 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.mlp = MLP(args)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = x + self.attn(self.ln_1(x), mask, cache)
        return h + self.mlp(self.ln_2(h))


class GPT2Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_positions = args.n_positions
        self.wte = nn.Embedding(args.vocab_size, args.n_embd)
        self.wpe = nn.Embedding(args.n_positions, args.n_embd)
        self.h = [Block(args, i) for i in range(args.n_layer)]
        self.ln_f = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        L = inputs.shape[1]
        offset = cache[0].offset if cache is not None else 0
        if reach(offset, L) > self.n_positions:
            raise ValueError(
                f"GPT-2 has {self.n_positions} learned positions; "
                f"this input reaches {reach(offset, L)}"
            )
        h = self.wte(inputs) + self.wpe(positions(offset, L))  # (B, L, n_embd)
        mask = causal_mask(L) if cache is None else cache[0].make_mask(L)
        for block, c in zip(self.h, per_layer(cache, len(self.h))):
            h = block(h, mask, c)
        return self.ln_f(h)


class Model(CausalLM):
    Inner = GPT2Model
    inner_name, embed_name, layers_name = "transformer", "wte", "h"
    tied = True  # GPT-2's head is always the token embedding (checkpoints carry no flag for it)

    def quant_predicate(self, path: str, module: nn.Module) -> bool:
        # The position table is small and is added to every token: keep it exact.
        return not path.endswith("wpe")

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        # Checkpoints saved from GPT2Model (openai-community/gpt2) lack the "transformer." prefix;
        # older ones carry the causal-mask buffers attn.bias / attn.masked_bias; the head is wte.
        out = {}
        for k, v in weights.items():
            if k.endswith((".attn.bias", ".attn.masked_bias")) or k.startswith("lm_head."):
                continue
            out[k if k.startswith("transformer.") else f"transformer.{k}"] = v
        # Conv1D (in, out) -> Linear (out, in). A converted checkpoint is already
        # transposed (and c_proj is square), so decide once from c_attn, which is
        # (n_embd, 3 n_embd) only in HF's layout.
        c_attn = out.get("transformer.h.0.attn.c_attn.weight")
        if c_attn is not None and tuple(c_attn.shape) == (args.n_embd, 3 * args.n_embd):
            out = {k: v.T if k.endswith(CONV1D) else v for k, v in out.items()}
        return out
