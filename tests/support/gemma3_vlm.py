"""A tiny random Gemma 3 image-text checkpoint, as transformers saves one, with its processor.

``make_gemma3_vlm(path)`` writes ``Gemma3ForConditionalGeneration`` (float32) with a SigLIP
tower (56 px images, 14 px patches: 4 x 4 patches, pooled to 2 x 2 = 4 soft tokens), a small
byte-level BPE tokenizer whose special tokens include Gemma's image markers (their ids are
the config's), a Gemma-like chat template, and transformers' processor (``processor_config.json``:
the PIL image processor, bilinear, to 56 x 56). Weights are widened (std 0.3 for matrices,
norms and biases moved off their neutral value) so that different images give different logits
and greedy tokens: with the default std-0.02 init an image changes nothing visible.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CORPUS = [
    "Describe this image in one word. What color is it? A cat sat on the mat.",
    "the quick brown fox jumps over the lazy dog; red green blue image picture photo",
] * 20
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 56, 14, 4


def write_tokenizer(path: Path, vocab_size: int = 300) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json (Gemma 3's ``boi_token``/``eoi_token``/
    ``image_token`` keys); returns the special tokens' ids."""
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
        "bos_token": "<bos>",
        "eos_token": "<end_of_turn>",
        "pad_token": "<pad>",
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {s: tok.token_to_id(s) for s in SPECIALS} | {"vocab": tok.get_vocab_size()}


def make_gemma3_vlm(path: Path, seed: int = 0, sliding_window: int = 3):
    """Write the checkpoint to ``path``; returns (path, torch model, transformers' processor)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path)
    torch.manual_seed(seed)
    text = transformers.Gemma3TextConfig(
        vocab_size=ids["vocab"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=sliding_window,  # below an image's 4 tokens: the window meets the block
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        max_position_embeddings=512,
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<end_of_turn>"],
        pad_token_id=ids["<pad>"],
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        vision_use_head=False,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=ids["<image_soft_token>"],
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        # Untied: a tied head with random weights repeats the last token whatever the image.
        tie_word_embeddings=False,
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mm_input_projection" in name:
                p.normal_(0, 1.0)  # soft tokens as loud as the text's scaled embeddings
            elif p.dim() > 1:
                p.normal_(0, 0.3)
            elif "q_norm" in name or "k_norm" in name:
                p.add_(2.0)  # sharper attention, so the few image tokens carry weight
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    image_processor = transformers.Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=TOKENS_PER_IMAGE,
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(path)
    return path, model, processor


def random_image(seed: int, size: tuple[int, int] = (150, 118)) -> Image.Image:
    """A random RGB image, non-square and larger than the tower's input (resizing is real)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    # Smooth blocks, so bilinear resizing keeps something of the image.
    small = Image.fromarray(pixels[:: size[1] // 6 or 1, :: size[0] // 6 or 1])
    return small.resize(size, Image.Resampling.NEAREST)
