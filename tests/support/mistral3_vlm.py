"""A tiny random Mistral 3 image-text checkpoint, as transformers 5 saves one, with its processor
settings.

``make_mistral3_vlm(path)`` writes ``Mistral3ForConditionalGeneration`` (float32): a Pixtral
tower (8 px patches, 2 blocks, head_dim 16), ``spatial_merge_size`` 2 (16 px per image token,
images capped at 64 px on their longest side: the test images give 4 x 4 and 2 x 4 image tokens
with their [IMG_BREAK] rows), a "mistral" or "ministral3" text model (2 layers), a byte-level
BPE tokenizer whose special tokens hold the config's ids, a Mistral-like chat template, and
``processor_config.json`` with the PIL image processor's settings nested under
``image_processor`` (what transformers 5 writes; its ``PixtralProcessor`` cannot be built here:
its module imports torchvision, so the tests build input ids with mlxinfer's processor, which
test_processors.py proves equal to it). Weights are widened (std 0.3 for matrices, norms moved
off 1) so that different images give different greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}[IMG]{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}[/INST]{% else %}"
    "{{ m['content'] if m['content'] is string else m['content'][0]['text'] }}"
    "{{ eos_token }}{% endif %}{% endfor %}"
)
CORPUS = [
    "Describe this image in one word. What color is it? A cat sat on the mat.",
    "the quick brown fox jumps over the lazy dog; red green blue image picture photo",
] * 20
PATCH, MERGE, LONGEST = 8, 2, 64


def write_tokenizer(
    path: Path, specials: list[str] = SPECIALS, vocab_size: int = 300
) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    return {s: tok.token_to_id(s) for s in specials} | {"vocab": tok.get_vocab_size()}


def widen(model: torch.nn.Module) -> None:
    """Weights loud enough that an image changes the greedy tokens."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
            else:
                p.add_(torch.randn_like(p) * 0.1)


def make_mistral3_vlm(
    path: Path, text_type: str = "mistral", seed: int = 0, feature_layer: int = -1
):
    """Write the checkpoint to ``path``; returns (path, torch model)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path)
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": TEMPLATE,
            }
        )
    )
    torch.manual_seed(seed)
    text = dict(
        model_type=text_type,
        vocab_size=ids["vocab"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
    )
    if text_type == "ministral3":  # Llama 4's query scaling, felt past 16 positions
        text["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 16,
            "llama_4_scaling_beta": 0.5,
        }
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=16,
        image_size=LONGEST,
        patch_size=PATCH,
        hidden_act="silu",
    )
    config = transformers.Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=ids["[IMG]"],
        spatial_merge_size=MERGE,
        vision_feature_layer=feature_layer,
        tie_word_embeddings=False,
    )
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    widen(model)
    model.save_pretrained(path, safe_serialization=True)
    processor = {
        "image_processor": {
            "image_processor_type": "PixtralImageProcessor",
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "patch_size": PATCH * MERGE,
            "resample": 3,
            "rescale_factor": 1 / 255,
            "size": {"longest_edge": LONGEST},
        },
        "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]",
        "image_token": "[IMG]",
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "processor_class": "PixtralProcessor",
    }
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return path, model
