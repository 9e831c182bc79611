"""LLaVA with images against transformers: a tiny random LlavaForConditionalGeneration.

transformers' own processor (``LlavaProcessor`` with ``CLIPImageProcessorPil``) is the reference
for our processor (pixel values to the bit, identical input ids) and gives the model's inputs;
our CLIP tower (layer -2, class token dropped), projector and text network must give its image
features, its logits at every position (f32, within 1e-3) with and without the cache, and its
greedy tokens, through the model and through ``stream_generate(images=...)``. Pixtral-12B's
layout (``llava`` over a Pixtral tower) is checked on its logits too.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from gemma3_vlm import random_image
from llava_vlm import PATCH, make_llava_vlm
from PIL import Image

from mlxinfer.generation import prepare_prompt, stream_generate
from mlxinfer.generation.images import load_images
from mlxinfer.loading.loader import load
from mlxinfer.vision import load_image, load_processor
from mlxinfer.vision.processors import LlavaProcessor

TOL = 1e-3
TEXT = "Describe this image."
SIZES = [(150, 118), (20, 50)]  # the second is narrower than the crop: padded, then cropped


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava_vlm")
    path, torch_model, processor = make_llava_vlm(root / "model")
    files = []
    for i, size in enumerate(SIZES):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    model, tokenizer = load(path)
    return path, torch_model, processor, model, tokenizer, files


def _reference_inputs(processor, files):
    content = [{"type": "image"}] * len(files) + [{"type": "text", "text": TEXT}]
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    pictures = [Image.open(f).convert("RGB") for f in files]
    return processor(text=rendered, images=pictures, return_tensors="pt")


def _ours(model, ids, pixels, cache=None, chunk=None) -> np.ndarray:
    extra = model.image_inputs(ids, model.encode_images(mx.array(pixels)))
    if chunk is None:
        return np.array(model(mx.array([ids]), cache, **extra)[0])
    out = []
    for start in range(0, len(ids), chunk):
        end = start + chunk
        part = model(mx.array([ids[start:end]]), cache, embeds=extra["embeds"][:, start:end])
        out.append(np.array(part[0]))
    return np.concatenate(out)


@pytest.mark.parametrize(
    "size", [(150, 118), (20, 50), (33, 32), (7, 300), (300, 7), (1, 1), (64, 64)]
)
def test_pixels_match_the_clip_pil_processor(vlm, size):
    """Resize of the shortest edge (truncated), a center crop that pads a side shorter than
    the crop, rescale and normalize: the same float32 values."""
    path, _, processor, _, _, _ = vlm
    ours = load_processor(path)
    assert isinstance(ours, LlavaProcessor)
    picture = random_image(5, size) if min(size) > 6 else Image.new("RGB", size, (9, 200, 31))
    theirs = processor.image_processor([picture], return_tensors="np")["pixel_values"]
    processed = ours.prepare([load_image(picture)])
    assert processed.pixel_values.shape == theirs.shape == (1, 3, 32, 32)
    assert np.abs(processed.pixel_values - theirs).max() <= 1e-6
    assert processed.tokens_per_image == [16]


def test_input_ids_and_pixels_match_the_llava_processor(vlm):
    _, _, processor, model, tokenizer, files = vlm
    batch = _reference_inputs(processor, files)
    images = load_images(model, tokenizer, files)
    assert prepare_prompt(tokenizer, TEXT, images=images) == batch["input_ids"][0].tolist()
    assert np.abs(images.processed.pixel_values - batch["pixel_values"].numpy()).max() <= 1e-6


def test_image_features_match_transformers(vlm):
    _, torch_model, processor, model, _, files = vlm
    batch = _reference_inputs(processor, files)
    with torch.no_grad():
        expected = torch_model.model.get_image_features(batch["pixel_values"]).pooler_output
    expected = torch.cat(list(expected)).numpy()
    ours = np.array(model.encode_images(mx.array(batch["pixel_values"].numpy())))
    assert ours.shape == (2, 16, 32) and expected.shape == (2 * 16, 32)
    ours = ours.reshape(expected.shape)
    assert np.abs(ours - expected).max() <= 1e-4


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_match_at_every_position(vlm, n_images):
    _, torch_model, processor, model, _, files = vlm
    batch = _reference_inputs(processor, files[:n_images])
    with torch.no_grad():
        expected = torch_model(**batch).logits[0].numpy()
    ids, pixels = batch["input_ids"][0].tolist(), batch["pixel_values"].numpy()
    assert np.abs(_ours(model, ids, pixels) - expected).max() <= TOL
    chunked = _ours(model, ids, pixels, model.make_cache(), chunk=7)
    assert np.abs(chunked - expected).max() <= TOL


def _torch_greedy(torch_model, batch, steps: int) -> list[int]:
    ids, out = batch["input_ids"], []
    for _ in range(steps):
        with torch.no_grad():
            logits = torch_model(input_ids=ids, pixel_values=batch["pixel_values"]).logits
        out.append(int(logits[0, -1].argmax()))
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def _tokens(model, tokenizer, files, steps=8):
    results = stream_generate(
        model, tokenizer, TEXT, images=files, chat_template=True, max_tokens=steps
    )
    return [r.token for r in results]


def test_generate_gives_transformers_greedy_tokens(vlm):
    _, torch_model, processor, model, tokenizer, files = vlm
    expected = _torch_greedy(torch_model, _reference_inputs(processor, files), 8)
    assert _tokens(model, tokenizer, files) == expected
    # Not blind: another image, other tokens.
    assert _tokens(model, tokenizer, files[1:]) != _tokens(model, tokenizer, files[:1])


def test_convert_keeps_the_tower_float_and_the_processor(vlm, tmp_path):
    import mlx.nn as nn

    from mlxinfer.loading.convert import convert

    path, torch_model, processor, _, _, files = vlm
    expected = _torch_greedy(torch_model, _reference_inputs(processor, files[:1]), 4)
    convert(path, tmp_path / "f32", dtype="float32")
    again, tokenizer = load(tmp_path / "f32")
    assert _tokens(again, tokenizer, files[:1], 4) == expected
    convert(path, tmp_path / "q4", quantize=True, bits=4, group_size=32)
    assert (tmp_path / "q4" / "processor_config.json").is_file()
    quant, tokenizer = load(tmp_path / "q4")
    quantized = [p for p, m in quant.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert any(p.startswith("model.layers.") for p in quantized)
    assert not any(p.startswith(("vision_tower", "multi_modal_projector")) for p in quantized)
    assert len(_tokens(quant, tokenizer, files[:1], 4)) == 4


def test_the_hub_layout_of_the_weights_loads_too(vlm, tmp_path):
    """transformers 4's names (llava-hf's): ``language_model.model.*``,
    ``language_model.lm_head.*``, ``vision_tower.vision_model.*``, ``multi_modal_projector.*``."""
    import shutil

    from safetensors.numpy import load_file, save_file

    path, torch_model, processor, _, _, files = vlm
    for f in path.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    renamed = {}
    for key, value in load_file(path / "model.safetensors").items():
        key = key.replace("model.language_model.", "language_model.model.")
        key = key.replace("model.vision_tower.", "vision_tower.vision_model.")
        key = key.replace("model.multi_modal_projector.", "multi_modal_projector.")
        renamed["language_model." + key if key.startswith("lm_head.") else key] = value
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, _ = load(tmp_path)
    batch = _reference_inputs(processor, files)
    with torch.no_grad():
        expected = torch_model(**batch).logits[0].numpy()
    ours = _ours(model, batch["input_ids"][0].tolist(), batch["pixel_values"].numpy())
    assert np.abs(ours - expected).max() <= TOL


def test_pixtral_12b_layout_a_pixtral_tower_under_llava(tmp_path):
    """``llava`` over a Pixtral tower (the "full" strategy, no merge): two images of different
    sizes, ids and pixels from our Pixtral processor; logits within 1e-3 and the greedy tokens."""
    path, torch_model, _ = make_llava_vlm(tmp_path, seed=2, tower="pixtral")
    model, tokenizer = load(path)
    assert type(model.vision_tower).__name__ == "PixtralVisionModel"
    images = load_images(model, tokenizer, [random_image(1, (150, 118)), random_image(2, (60, 20))])
    ids = prepare_prompt(tokenizer, TEXT, images=images)
    pixels, grids = images.processed.pixel_values, images.processed.grid_thw
    sizes = torch.tensor(grids[:, 1:] * PATCH)
    with torch.no_grad():
        expected = torch_model(
            input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pixels), image_sizes=sizes
        ).logits[0]
    extra = model.image_inputs(ids, model.encode_images(mx.array(pixels), grids))
    ours = np.array(model(mx.array([ids]), None, **extra)[0])
    assert np.abs(ours - expected.numpy()).max() <= TOL
    results = stream_generate(
        model, tokenizer, TEXT, images=images_files(tmp_path), chat_template=True, max_tokens=1
    )
    assert [r.token for r in results] == [int(expected[-1].argmax())]


def images_files(root):
    files = []
    for i, size in enumerate([(150, 118), (60, 20)]):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    return files


def test_image_rows_in_the_batching_engine_equal_their_single_runs(vlm):
    """Two image rows and a text row at once, in chunks of 5 that cut the images, through the
    encoder cache's path (the second request's image is the first's): their single-run tokens."""
    from mlxinfer.batch import Engine

    _, _, _, model, tokenizer, files = vlm
    asks = [(TEXT, files[:1]), ("What is it?", files[:1]), ("What is a cat?", None)]
    single = [
        [
            r.token
            for r in stream_generate(
                model, tokenizer, p, images=i, chat_template=True, max_tokens=6
            )
        ]
        for p, i in asks
    ]
    with Engine(model, block_size=4, prefill_step=5) as engine:
        streams = [
            engine.start(tokenizer, p, images=i, chat_template=True, max_tokens=6) for p, i in asks
        ]
        assert [[r.token for r in s] for s in streams] == single
