"""A tiny random Qwen3.5 image-text checkpoint, as transformers 5 saves it.

``make_qwen3_5_vl(path)`` writes ``Qwen3_5ForConditionalGeneration`` (float32) with the
tokenizer, chat template and ``processor_config.json`` of tests/support/qwen_vl.py. Every path
is real: the tower (depth 3, 16 px patches, merge 2, a 4 x 4 learned position table resampled
to every grid; Qwen3.5 has no deepstack), and the hybrid trunk: 4 layers, Gated DeltaNet,
full attention, DeltaNet, full attention, head_dim 32 with half of it rotated
(``partial_rotary_factor`` 0.5: 8 frequencies, ``mrope_section`` [3, 3, 2] interleaved).
Weights are widened as qwen_vl.py's, so different images give different greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from qwen_vl import write_tokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=32,
    num_position_embeddings=16,
)
IMAGE = dict(
    size={"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 30},
    patch_size=16,
    image_mean=[0.5] * 3,
    image_std=[0.5] * 3,
)
LINEAR, FULL = "linear_attention", "full_attention"


def make_qwen3_5_vl(path: Path, seed: int = 0, moe: bool = False):
    """Write the checkpoint to ``path``; returns (path, torch model). ``moe``:
    ``Qwen3_5MoeForConditionalGeneration`` (4 experts, top 2, a shared expert; its text config
    names no dense ``intermediate_size``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path)
    torch.manual_seed(seed)
    text = dict(
        vocab_size=ids["vocab"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        layer_types=[LINEAR, FULL, LINEAR, FULL],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    )
    if moe:
        del text["intermediate_size"]
        text.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        )
    kind = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{kind}Config")(
        text_config=text,
        vision_config=VISION,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:  # matrices, the patch kernel, the position table, the conv
                # the DeltaNet's a bit narrower: float32's rounding through its chunked
                # recurrence stays well under the tests' 1e-3
                p.normal_(0, 0.15 if "linear_attn" in name else 0.3)
            else:  # norms, biases, A_log, dt_bias off their initial value
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    image = Qwen2VLImageProcessorPil(**IMAGE).to_dict()
    image.pop("processor_class", None)
    image["image_processor_type"] = "Qwen2VLImageProcessor"
    (path / "processor_config.json").write_text(json.dumps({"image_processor": image}, indent=2))
    return path, model
