"""The batching engine's encoder cache, per image, for every image-text family (batch/images.py):
a request of images [A, B], then one of [B, C]: the tower runs on A and B together, then on C
alone (B from the cache), and the second request's features (embeddings, Qwen-VL's positions
and deepstack, Gemma 3's blocks) are within 1e-6 of a fresh encoding of [B, C], its greedy
tokens a fresh engine's. The processors cut their output per image differently (one pixel row,
Gemma 3's crops after the image, Qwen-VL's t*h*w flattened patches with grid_thw, Pixtral's
padded rows with their grids, Idefics3's frames), and the towers give it back differently (rows
per image; Qwen-VL's merged patches and deepstack levels of all images concatenated)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gemma3_vlm import random_image

from mlxinfer.batch import Engine
from mlxinfer.batch.images import EncoderCache
from mlxinfer.generation import prepare_prompt
from mlxinfer.generation.images import PromptImages, image_inputs, load_images
from mlxinfer.loading.loader import load
from mlxinfer.vision import load_processor

TEXT = "Describe this image."
# Different sizes, so Qwen-VL's grids, Pixtral's rows and Idefics3's frames differ per image.
SIZES = [(150, 118), (131, 170), (150, 40)]
OPTIONS = dict(chat_template=True, max_tokens=6)


def _make(family: str, path):
    if family == "gemma3":
        from gemma3_vlm import make_gemma3_vlm

        return make_gemma3_vlm(path)[0]
    if family in ("qwen2_5_vl", "qwen3_vl"):
        from qwen_vl import make_qwen_vl

        return make_qwen_vl(path, family)[0]
    if family == "qwen3_5":
        from qwen3_5_vl import make_qwen3_5_vl

        return make_qwen3_5_vl(path)[0]
    if family == "mistral3":
        from mistral3_vlm import make_mistral3_vlm

        return make_mistral3_vlm(path)[0]
    if family in ("llava", "llava_pixtral"):
        from llava_vlm import make_llava_vlm

        return make_llava_vlm(path, tower="pixtral" if family == "llava_pixtral" else "clip")[0]
    from idefics3_vlm import make_idefics3_vlm

    return make_idefics3_vlm(path)[0]


FAMILIES = [
    "gemma3",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5",
    "mistral3",
    "llava",
    "llava_pixtral",
    "idefics3",
]


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    path = _make(request.param, root / "model")
    files = []
    for i, size in enumerate(SIZES):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    model, tokenizer = load(path)
    return model, tokenizer, files


def _counting(monkeypatch, model) -> list[int]:
    """The pixel rows of each tower call from now on."""
    calls: list[int] = []
    encode = model.encode_images

    def counted(pixels, *grids):
        calls.append(pixels.shape[0])
        return encode(pixels, *grids)

    monkeypatch.setattr(model, "encode_images", counted)
    return calls


def _inputs_close(got: dict, want: dict, tolerance: float = 1e-5) -> None:
    """Within ``tolerance`` of the largest value (float32; 0: equal). An image's features from
    a tower call over other images round differently (Pixtral's and Qwen's attention runs over
    every image of the call, masked; products over another batch); what the cache itself does
    (cuts, copies, joins) is exact: the features of the call that fills it are equal."""
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        a, b = got[name].astype(mx.float32), want[name].astype(mx.float32)
        scale = max(1.0, float(mx.abs(b).max()))
        assert float(mx.abs(a - b).max()) <= tolerance * scale, name


def test_the_cache_keeps_each_image_and_encodes_only_the_new_one(vlm, monkeypatch):
    model, tokenizer, files = vlm
    a, b, c = files
    first = load_images(model, tokenizer, [a, b])
    second = load_images(model, tokenizer, [b, c])
    ids_first = prepare_prompt(tokenizer, TEXT, images=first)
    ids_second = prepare_prompt(tokenizer, TEXT, images=second)
    fresh_first = image_inputs(model, ids_first, first)
    fresh_second = image_inputs(model, ids_second, second)
    rows_c = second.processed.image_rows()[1]

    calls = _counting(monkeypatch, model)
    cache = EncoderCache()
    _inputs_close(model.image_inputs(ids_first, cache.features(model, first)), fresh_first, 0)
    assert calls == [len(first.processed.pixel_values)] and len(cache) == 2
    _inputs_close(model.image_inputs(ids_second, cache.features(model, second)), fresh_second)
    assert calls[1:] == [rows_c]  # C alone
    assert (cache.calls, cache.hits, cache.encoded, len(cache)) == (2, 1, 3, 3)
    again = model.image_inputs(ids_second, cache.features(model, second))
    _inputs_close(again, fresh_second)
    assert len(calls) == 2 and cache.hits == 3  # both cached: no tower call


def test_the_engine_runs_the_tower_on_new_images_only(vlm, monkeypatch):
    model, tokenizer, files = vlm
    a, b, c = files
    with Engine(model, block_size=4) as engine:
        expected = [r.token for r in engine.start(tokenizer, TEXT, images=[b, c], **OPTIONS)]
    calls = _counting(monkeypatch, model)
    with Engine(model, block_size=4) as engine:
        list(engine.start(tokenizer, TEXT, images=[a, b], **OPTIONS))
        tokens = [r.token for r in engine.start(tokenizer, TEXT, images=[b, c], **OPTIONS)]
        cache = engine.encoder_cache
        assert (cache.calls, cache.hits, cache.encoded) == (2, 1, 3)
    second = load_images(model, tokenizer, [b, c])
    assert calls[1:] == [second.processed.image_rows()[1]]  # C's rows alone
    assert tokens == expected


def test_the_same_image_twice_in_a_request_is_encoded_once(vlm, monkeypatch):
    model, tokenizer, files = vlm
    twice = load_images(model, tokenizer, [files[1], files[1]])
    ids = prepare_prompt(tokenizer, TEXT, images=twice)
    fresh = image_inputs(model, ids, twice)
    calls = _counting(monkeypatch, model)
    cache = EncoderCache()
    _inputs_close(model.image_inputs(ids, cache.features(model, twice)), fresh)
    assert calls == [twice.processed.image_rows()[0]] and (cache.encoded, cache.hits) == (1, 1)


def test_gemma3_pan_and_scan_crops_are_cached_with_their_image(tmp_path, monkeypatch):
    """Pan and scan: an image's crops follow its row in the pixels; the image (with its crops)
    is one entry."""
    from gemma3_vlm import make_gemma3_vlm

    path = make_gemma3_vlm(tmp_path / "model")[0]
    model, tokenizer = load(path)
    processor = load_processor(path, tokenizer=tokenizer, pan_and_scan=True)
    assert processor is not None
    pictures = [
        random_image(1, (600, 280)),
        random_image(2, (120, 120)),
        random_image(3, (280, 700)),
    ]
    for i, picture in enumerate(pictures):
        picture.save(tmp_path / f"{i}.png")
    from mlxinfer.vision import load_image

    loaded = [load_image(tmp_path / f"{i}.png") for i in range(3)]

    def images(*which: int) -> PromptImages:
        return PromptImages(processor, processor.prepare([loaded[i] for i in which]))

    first, second = images(0, 1), images(1, 2)
    assert first.processed.image_rows() == [3, 1] and second.processed.image_rows() == [1, 3]
    calls = _counting(monkeypatch, model)
    cache = EncoderCache()
    cache.features(model, first)
    ids = prepare_prompt(tokenizer, TEXT, images=second)
    got = model.image_inputs(ids, cache.features(model, second))
    assert calls == [4, 3]  # A's row and crops with B's row, then C's row and crops
    fresh = image_inputs(model, ids, second)
    _inputs_close(got, fresh)
    assert np.array_equal(np.array(got["blocks"]), np.array(fresh["blocks"]))
