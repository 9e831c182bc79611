"""Tiny random Qwen2.5-VL and Qwen3-VL checkpoints, as transformers 5 saves them.

``make_qwen_vl(path, family)`` writes ``Qwen2_5_VLForConditionalGeneration`` or
``Qwen3VLForConditionalGeneration`` (float32) with a byte-level BPE tokenizer trained here
whose special tokens hold the config's ids, a Qwen-like chat template, and
``processor_config.json`` with the PIL image processor's settings nested under
``image_processor`` (what transformers 5 writes). The towers are small but every path is real:

- Qwen2.5-VL: depth 3, 14 px patches, merge 2, ``window_size`` 56 (2 x 2 merged blocks per
  window: the test images' 4 x 5 and 6 x 5 grids are cut into several windows, ragged at the
  edges), ``fullatt_block_indexes`` [1];
- Qwen3-VL: depth 3, 16 px patches, a 4 x 4 learned position table (resampled to every
  grid), ``deepstack_visual_indexes`` [0, 1];
- the language models: 3 layers, head_dim 16, ``mrope_section`` [2, 3, 3] (chunked for
  2.5, interleaved for 3).

Weights are widened (std 0.3 for matrices, norms and biases moved off their neutral value)
so that different images give different greedy tokens: with the default std-0.02 init an
image changes nothing visible. The Qwen Processor classes cannot be built here (their video
processor needs torchvision), so the tests build input ids with mlxinfer's processor and
tokenizer (test_processors.py proves them equal to the Processor's).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Describe this image in one word. What color is it? A cat sat on the mat.",
    "the quick brown fox jumps over the lazy dog; red green blue image picture photo",
] * 20

FAMILIES = {
    "qwen2_5_vl": dict(
        config="Qwen2_5_VLConfig",
        model="Qwen2_5_VLForConditionalGeneration",
        vision=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            out_hidden_size=32,
            fullatt_block_indexes=[1],
        ),
        text=dict(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            }
        ),
        image=dict(size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 30}),
    ),
    "qwen3_vl": dict(
        config="Qwen3VLConfig",
        model="Qwen3VLForConditionalGeneration",
        vision=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=32,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
        ),
        text=dict(
            head_dim=16,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        ),
        image=dict(
            size={"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 30},
            patch_size=16,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
        ),
    ),
}


def write_tokenizer(path: Path, vocab_size: int = 300) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json (with the chat template); the specials' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {s: tok.token_to_id(s) for s in SPECIALS} | {"vocab": tok.get_vocab_size()}


def make_qwen_vl(path: Path, family: str, seed: int = 0):
    """Write the checkpoint to ``path``; returns (path, torch model)."""
    spec = FAMILIES[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path)
    torch.manual_seed(seed)
    text = dict(
        vocab_size=ids["vocab"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **spec["text"],
    )
    config = getattr(transformers, spec["config"])(
        text_config=text,
        vision_config=spec["vision"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = getattr(transformers, spec["model"])(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:  # matrices, the patch kernel, the position table
                p.normal_(0, 0.3)
            else:  # norms and biases off their neutral value
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    image = Qwen2VLImageProcessorPil(**spec["image"]).to_dict()
    image.pop("processor_class", None)
    image["image_processor_type"] = "Qwen2VLImageProcessor"
    (path / "processor_config.json").write_text(json.dumps({"image_processor": image}, indent=2))
    return path, model
