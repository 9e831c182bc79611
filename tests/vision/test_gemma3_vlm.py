"""Gemma 3 with images against transformers: a tiny random Gemma3ForConditionalGeneration.

transformers' own processor (Gemma3Processor with the PIL image processor) gives the
pixel values, the expanded input ids and token_type_ids; our tower, projector and text
network must give its image features, its logits at every position (f32, within 1e-3) and its
greedy tokens through our KV cache, with one image, two, and none.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from gemma3_vlm import make_gemma3_vlm, random_image

from mlxinfer.loading.loader import load_model
from mlxinfer.models.gemma3 import image_blocks

TOL = 1e-3


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path, torch_model, processor = make_gemma3_vlm(tmp_path_factory.mktemp("gemma3_vlm"))
    model, _ = load_model(path)
    return path, torch_model, processor, model


def _inputs(processor, n_images: int, text: str = "Describe this image."):
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    rendered = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    images = [random_image(i + 1, (150 - 20 * i, 118 + 30 * i)) for i in range(n_images)] or None
    return processor(text=rendered, images=images, return_tensors="pt")


def _reference(torch_model, batch) -> np.ndarray:
    with torch.no_grad():
        return torch_model(**batch).logits[0].numpy()


def _ours(model, batch, cache=None, blocks=True) -> np.ndarray:
    ids = batch["input_ids"][0].tolist()
    if "pixel_values" not in batch:
        return np.array(model(mx.array([ids]), cache)[0])
    features = model.encode_images(mx.array(batch["pixel_values"].numpy()))
    extra = model.image_inputs(ids, features)
    if not blocks:
        extra.pop("blocks")
    return np.array(model(mx.array([ids]), cache, **extra)[0])


def test_the_model_loads_with_its_tower(vlm):
    _, _, _, model = vlm
    assert type(model).__module__ == "mlxinfer.models.gemma3"
    assert model.vision_tower.vision_model.embeddings.patch_embedding.weight.shape == (
        32,
        14,
        14,
        3,
    )


def random_image_features_match_transformers(vlm):
    _, torch_model, processor, model = vlm
    batch = _inputs(processor, 2)
    with torch.no_grad():
        expected = torch_model.get_image_features(batch["pixel_values"]).pooler_output.numpy()
    ours = np.array(model.encode_images(mx.array(batch["pixel_values"].numpy())))
    assert ours.shape == expected.shape == (2, 4, 32)
    assert np.abs(ours - expected).max() <= 1e-4


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_match_at_every_position(vlm, n_images):
    _, torch_model, processor, model = vlm
    batch = _inputs(processor, n_images)
    assert int((batch["token_type_ids"] == 1).sum()) == 4 * n_images
    expected = _reference(torch_model, batch)
    assert np.abs(_ours(model, batch) - expected).max() <= TOL
    assert np.abs(_ours(model, batch, model.make_cache()) - expected).max() <= TOL
    # Not blind: without the image blocks' two-way attention the logits move.
    assert np.abs(_ours(model, batch, blocks=False) - expected).max() > 10 * TOL


def test_a_text_only_prompt_on_the_same_checkpoint_matches(vlm):
    _, torch_model, processor, model = vlm
    batch = _inputs(processor, 0, "What is a cat?")
    assert "pixel_values" not in batch
    assert np.abs(_ours(model, batch) - _reference(torch_model, batch)).max() <= TOL


def _torch_greedy(torch_model, batch, steps: int) -> list[int]:
    ids, types = batch["input_ids"], batch["token_type_ids"]
    out = []
    for _ in range(steps):
        with torch.no_grad():
            logits = torch_model(
                input_ids=ids, pixel_values=batch["pixel_values"], token_type_ids=types
            ).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        types = torch.cat([types, torch.zeros((1, 1), dtype=types.dtype)], dim=1)
    return out


def _our_greedy(model, batch, steps: int) -> list[int]:
    """Prefill in two chunks (the text before the first image, then the rest: the images'
    chunk starts at an offset, past the sliding window), then decode with the cache."""
    ids = batch["input_ids"][0].tolist()
    extra = model.image_inputs(ids, model.encode_images(mx.array(batch["pixel_values"].numpy())))
    cut = ids.index(model.args.boi_token_index)
    cache = model.make_cache()
    model(mx.array([ids[:cut]]), cache, embeds=extra["embeds"][:, :cut])
    logits = model(
        mx.array([ids[cut:]]), cache, embeds=extra["embeds"][:, cut:], blocks=extra["blocks"][cut:]
    )
    out = []
    for _ in range(steps):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache)
    return out


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_tokens_match_with_the_kv_cache(vlm, n_images):
    _, torch_model, processor, model = vlm
    batch = _inputs(processor, n_images)
    expected = _torch_greedy(torch_model, batch, 8)
    assert _our_greedy(model, batch, 8) == expected


def test_different_images_give_different_tokens(vlm):
    """The checkpoint is not blind to its images (else every image test above could pass
    with the image ignored)."""
    _, torch_model, processor, model = vlm
    a = _inputs(processor, 1)
    b = dict(a)
    b["pixel_values"] = processor.image_processor(
        [random_image(99, (131, 170))], return_tensors="pt"
    )["pixel_values"]
    assert _our_greedy(model, a, 8) != _our_greedy(model, b, 8)


def test_the_hub_layout_of_the_weights_loads_too(vlm, tmp_path):
    """transformers 4's names (the released checkpoints'): ``language_model.model.*``,
    ``vision_tower.vision_model.*``, ``multi_modal_projector.*``."""
    import shutil

    from safetensors.numpy import load_file, save_file

    path, torch_model, processor, _ = vlm
    for f in path.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    renamed = {}
    for key, value in load_file(path / "model.safetensors").items():
        key = key.replace("model.language_model.", "language_model.model.")
        key = key.replace("model.vision_tower.", "vision_tower.vision_model.")
        key = key.replace("model.multi_modal_projector.", "multi_modal_projector.")
        renamed[key] = value
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, _ = load_model(tmp_path)
    batch = _inputs(processor, 1)
    assert np.abs(_ours(model, batch) - _reference(torch_model, batch)).max() <= TOL


def random_image_blocks_number_each_run_of_image_tokens():
    is_image = np.array([0, 1, 1, 0, 0, 1, 1, 1, 0], dtype=bool)
    assert image_blocks(is_image).tolist() == [-1, 0, 0, -1, -1, 1, 1, 1, -1]
