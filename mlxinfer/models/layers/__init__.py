"""The layers the families share: attention, MLPs, norms, RoPE, masks, experts (MoE), latent
attention (MLA). They read as they run on Metal: ``mx.fast`` and ``mlx.nn`` only. A backend that
needs other kernels swaps its own subclasses in at load (``mlxinfer/backends``)."""

from .attention import Attention, RopeAttention, quantized_attention, softcap_attention
from .mlp import ACTIVATIONS, GatedMLP, activation
from .norms import OffsetRMSNorm, RMSNorm
from .rope import LongRoPE, RoPE, make_rope

__all__ = [
    "ACTIVATIONS",
    "Attention",
    "GatedMLP",
    "LongRoPE",
    "OffsetRMSNorm",
    "RMSNorm",
    "RoPE",
    "RopeAttention",
    "activation",
    "make_rope",
    "quantized_attention",
    "softcap_attention",
]
