"""A tiny random LLaVA checkpoint, as transformers 5 saves one, with its processor.

``make_llava_vlm(path)`` writes ``LlavaForConditionalGeneration`` (float32): a CLIP tower (32 px
images, 8 px patches: 16 patches and the class token, 3 layers, quick-GELU), the
``vision_feature_layer`` -2 and the "default" strategy (the class token dropped: 16 image
tokens), a "llama" text model (2 layers), a byte-level BPE tokenizer whose ``<image>`` holds the
config's id, a LLaVA-1.5-like chat template, and transformers' processor (``LlavaProcessor``
with ``CLIPImageProcessorPil``: shortest edge 32, center crop 32 x 32, bicubic) saved beside it
(``processor_config.json`` with the image processor nested). Weights are widened (std 0.3 for
matrices, norms and biases moved off their neutral value) so that different images give
different greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from mistral3_vlm import widen, write_tokenizer
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

SPECIALS = ["<unk>", "<s>", "</s>", "<image>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'].upper() }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>\n{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:"
    "{% endif %}"
)
IMAGE_SIZE, PATCH = 32, 8


def make_llava_vlm(path: Path, seed: int = 0, tower: str = "clip"):
    """Write the checkpoint to ``path``; returns (path, torch model, transformers' processor).

    ``tower="pixtral"``: Pixtral-12B's layout instead (a Pixtral tower, 8 px patches, no merge,
    the "full" strategy, [IMG] rows; processor settings written as mistral3_vlm writes them,
    None for the processor)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tower == "pixtral":
        return _pixtral_llava(path, seed)
    ids = write_tokenizer(path, SPECIALS)
    torch.manual_seed(seed)
    text = dict(
        model_type="llama",
        vocab_size=ids["vocab"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=32,
    )
    config = transformers.LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=ids["<image>"],
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
        tie_word_embeddings=False,
    )
    model = transformers.LlavaForConditionalGeneration(config).eval()
    widen(model)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = TEMPLATE
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(path)
    return path, model, processor


def _pixtral_llava(path: Path, seed: int):
    import json

    from mistral3_vlm import SPECIALS as PIXTRAL_SPECIALS
    from mistral3_vlm import TEMPLATE as PIXTRAL_TEMPLATE

    ids = write_tokenizer(path, PIXTRAL_SPECIALS)
    tokens = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config_file = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}
    (path / "tokenizer_config.json").write_text(
        json.dumps({**config_file, "chat_template": PIXTRAL_TEMPLATE})
    )
    torch.manual_seed(seed)
    text = dict(
        model_type="mistral",
        vocab_size=ids["vocab"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
    )
    vision = transformers.PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=48,
        patch_size=PATCH,
        hidden_act="silu",
    )
    config = transformers.LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=ids["[IMG]"],
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    model = transformers.LlavaForConditionalGeneration(config).eval()
    widen(model)
    model.save_pretrained(path, safe_serialization=True)
    processor = {
        "image_processor": {
            "image_processor_type": "PixtralImageProcessor",
            "patch_size": PATCH,
            "resample": 3,
            "size": {"longest_edge": 48},
        },
        "patch_size": PATCH,
        "processor_class": "PixtralProcessor",
    }
    (path / "processor_config.json").write_text(json.dumps(processor))
    return path, model, None
