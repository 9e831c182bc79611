"""mlxinfer/vision/processors: the same pixels and the same token ids as transformers.

The references are transformers' PIL image processors, named explicitly (transformers 5 has a
torchvision class under the plain name, ``Gemma3ImageProcessor``, whose resize differs):
``Gemma3ImageProcessorPil`` and ``Qwen2VLImageProcessorPil``, fed the very same Pillow images.
Pixel values must agree within 1e-6 (they agree to the bit) and the grids exactly.

Token ids: transformers' own Processor classes (``Gemma3Processor``, ``Qwen2_5_VLProcessor``,
``Qwen3VLProcessor``) with a tiny byte-level BPE tokenizer trained here (no Hub), called as
``processor(text=rendered, images=[...])``; ours is ``expand`` then mlxinfer's Tokenizer on the
same saved tokenizer. The Qwen-VL processors cannot be built as they are in this environment:
their constructor looks up the video processor class, which needs torchvision (not installed;
its PyPI wheel does not import with torch+cpu), so the tests skip that class check
(``ProcessorMixin.check_argument_for_proper_class``) and pass ``video_processor=None``; the
processor's own ``__call__``, image processor, text expansion and tokenizer run unchanged.
Their processor_config.json is what ``ProcessorMixin.to_json_string`` gives, which is what
``save_pretrained`` writes (it cannot save a None video processor).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage

from mlxinfer.errors import ConfigError, MediaError
from mlxinfer.tokenization import Tokenizer
from mlxinfer.vision import load_image, load_processor
from mlxinfer.vision.processors import (
    Gemma3Processor,
    PixtralProcessor,
    QwenVLProcessor,
    smart_resize,
)

transformers = pytest.importorskip(
    "transformers", reason="transformers (the test extras) is not installed"
)
pil_gemma3 = pytest.importorskip(
    "transformers.models.gemma3.image_processing_pil_gemma3",
    reason="this transformers has no Gemma3ImageProcessorPil (transformers >= 5 has)",
)
pil_qwen2_vl = pytest.importorskip(
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
    reason="this transformers has no Qwen2VLImageProcessorPil (transformers >= 5 has)",
)
Gemma3ImageProcessorPil = pil_gemma3.Gemma3ImageProcessorPil
Qwen2VLImageProcessorPil = pil_qwen2_vl.Qwen2VLImageProcessorPil

# (height, width): odd sides, odd aspect ratios, tiny ones; all small so the tests are fast.
SIZES = [(40, 70), (33, 17), (5, 200), (64, 64), (300, 20), (1, 1), (57, 29)]


def picture(height: int, width: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed + 7 * height + width)
    array = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    PILImage.fromarray(array).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def images():
    return [load_image(picture(h, w), label=f"image {i}") for i, (h, w) in enumerate(SIZES, 1)]


def assert_same_pixels(ours: np.ndarray, theirs: np.ndarray) -> None:
    theirs = np.asarray(theirs)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert float(np.max(np.abs(ours - theirs), initial=0.0)) <= 1e-6


# --- Gemma 3 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"size": {"height": 32, "width": 32}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
        {"size": {"height": 28, "width": 20}, "resample": 3},  # bicubic, ImageNet-standard
        {"size": {"height": 16, "width": 16}, "rescale_factor": 1 / 127.5, "do_normalize": False},
        {"size": {"height": 24, "width": 24}, "image_mean": [0.1, 0.2, 0.3], "resample": 1},
    ],
)
def test_gemma3_pixels_match_the_pil_processor(images, settings):
    theirs = Gemma3ImageProcessorPil(**settings)
    ours = Gemma3Processor(
        height=settings["size"]["height"],
        width=settings["size"]["width"],
        image_seq_length=4,
        image_token_id=0,
        resample=settings.get("resample", 2),
        rescale_factor=settings.get("rescale_factor", 1 / 255),
        do_normalize=settings.get("do_normalize", True),
        image_mean=tuple(settings.get("image_mean", [0.5] * 3)),
        image_std=tuple(settings.get("image_std", [0.5] * 3)),
    )
    reference = theirs([i.pixels for i in images], return_tensors="np")["pixel_values"]
    processed = ours.prepare(images)
    assert_same_pixels(processed.pixel_values, reference)
    assert processed.tokens_per_image == [4] * len(images)
    assert processed.sha256 == [i.sha256 for i in images] and processed.grid_thw is None


def test_gemma3_pan_and_scan_matches_the_pil_processor():
    wide = [
        load_image(picture(260, 600)),
        load_image(picture(900, 270)),
        load_image(picture(50, 60)),
    ]
    theirs = Gemma3ImageProcessorPil(
        size={"height": 16, "width": 16},
        do_pan_and_scan=True,
        pan_and_scan_min_crop_size=256,
        pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2,
    )
    ours = Gemma3Processor(
        height=16, width=16, image_seq_length=4, image_token_id=0, pan_and_scan=True
    )
    reference = theirs([i.pixels for i in wide], return_tensors="np")
    processed = ours.prepare(wide)
    assert_same_pixels(processed.pixel_values, reference["pixel_values"])
    crops = [n // 4 - 1 for n in processed.tokens_per_image]
    assert crops == list(reference["num_crops"]) and crops[:2] != [0, 0]


# The tiny vocabulary: each family's special tokens, ids inside it.
GEMMA_SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def tiny_tokenizer(specials: list[str], **tokens):
    """A byte-level BPE of ~300 tokens trained here, wrapped as transformers wraps tokenizer.json."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(
        ["Describe these images, please. What is in the picture?"] * 20, trainer
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, **tokens)


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory):
    """A Gemma 3 processor and config saved by transformers 5 (one processor_config.json)."""
    directory = tmp_path_factory.mktemp("gemma3")
    tokenizer = tiny_tokenizer(
        GEMMA_SPECIALS,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens={
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        },
    )
    image_processor = Gemma3ImageProcessorPil(
        size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4
    )
    processor.save_pretrained(directory)
    transformers.Gemma3Config(
        text_config={"vocab_size": 300},
        vision_config={"image_size": 32, "patch_size": 8},
        mm_tokens_per_image=4,
        image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
        boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
    ).save_pretrained(directory)
    assert not (directory / "preprocessor_config.json").exists()
    return directory, processor


GEMMA_PROMPT = (
    "<bos><start_of_turn>user\n<start_of_image>Describe these images, please."
    "<start_of_image><end_of_turn>\n<start_of_turn>model\n"
)


def test_gemma3_from_a_transformers_5_checkpoint_gives_its_input_ids(gemma3_checkpoint, images):
    directory, reference = gemma3_checkpoint
    tokenizer = Tokenizer.from_dir(directory)
    ours = load_processor(directory, tokenizer=tokenizer)
    assert isinstance(ours, Gemma3Processor)
    assert (ours.height, ours.width, ours.image_seq_length) == (32, 32, 4)
    assert ours.image_token == "<image_soft_token>" and ours.marker == "<start_of_image>"
    assert ours.image_token_id == tokenizer.token_to_id("<image_soft_token>")
    pair = [images[0], images[2]]
    expected = reference(text=GEMMA_PROMPT, images=[[i.pixels for i in pair]], return_tensors="np")
    processed = ours.prepare(pair)
    assert_same_pixels(processed.pixel_values, expected["pixel_values"])
    text = ours.expand(GEMMA_PROMPT, processed)
    ids = tokenizer.encode(text)
    assert ids == expected["input_ids"][0].tolist()
    assert ids.count(ours.image_token_id) == sum(processed.tokens_per_image) == 8
    assert "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n" in text


def test_gemma3_pan_and_scan_text_matches_the_processor(gemma3_checkpoint):
    directory, reference = gemma3_checkpoint
    ours = load_processor(directory, pan_and_scan=True)
    wide = [load_image(picture(260, 600)), load_image(picture(40, 50))]
    expected = reference(
        text=GEMMA_PROMPT,
        images=[[i.pixels for i in wide]],
        images_kwargs={"do_pan_and_scan": True},
        return_tensors="np",
    )
    processed = ours.prepare(wide)
    assert_same_pixels(processed.pixel_values, expected["pixel_values"])
    assert processed.tokens_per_image == [12, 4]  # the image and 2 crops; no crops
    ids = Tokenizer.from_dir(directory).encode(ours.expand(GEMMA_PROMPT, processed))
    assert ids == expected["input_ids"][0].tolist()


def test_a_marker_count_mismatch_is_one_line(gemma3_checkpoint, images):
    ours = load_processor(gemma3_checkpoint[0])
    processed = ours.prepare(images[:2])
    for text in ("<start_of_image>" * 3, "no image here", "<start_of_image>"):
        with pytest.raises(MediaError) as excinfo:
            ours.expand(text, processed)
        message = str(excinfo.value)
        assert "\n" not in message and "for 2 images" in message and "<start_of_image>" in message


def test_the_variant_follows_every_setting_that_changes_pixels_or_tokens():
    base = Gemma3Processor(height=32, width=32, image_seq_length=4, image_token_id=7)
    same = Gemma3Processor(height=32, width=32, image_seq_length=4, image_token_id=9)
    assert base.variant == same.variant  # the token id does not change the features
    for changed in (
        Gemma3Processor(height=32, width=32, image_seq_length=4, image_token_id=7, resample=3),
        Gemma3Processor(height=16, width=32, image_seq_length=4, image_token_id=7),
        Gemma3Processor(
            height=32, width=32, image_seq_length=4, image_token_id=7, pan_and_scan=True
        ),
    ):
        assert changed.variant != base.variant
    assert (
        QwenVLProcessor(image_token_id=1).variant
        != QwenVLProcessor(image_token_id=1, patch_size=16).variant
    )


# --- Qwen2-VL, Qwen2.5-VL, Qwen3-VL -----------------------------------------------------------

QWEN_VARIANTS = {
    # family: (transformers Processor, Config, image processor settings, vision_config)
    "qwen2_5_vl": (
        "Qwen2_5_VLProcessor",
        "Qwen2_5_VLConfig",
        {"size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}},
        {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    ),
    "qwen3_vl": (
        "Qwen3VLProcessor",
        "Qwen3VLConfig",
        {
            "size": {"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 12},
            "patch_size": 16,
            "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3,
        },
        {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    ),
}


@pytest.mark.parametrize(
    "settings",
    [
        {"size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}},
        {
            "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 8},
            "patch_size": 16,
            "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3,
        },
        {"size": {"shortest_edge": 56 * 56, "longest_edge": 200 * 200}, "temporal_patch_size": 3},
        {
            "size": {"shortest_edge": 8 * 8, "longest_edge": 8 * 8 * 40},
            "patch_size": 4,
            "merge_size": 2,
        },
        {"size": {"shortest_edge": 14 * 14, "longest_edge": 14 * 14 * 30}, "merge_size": 1},
    ],
)
def test_qwen_pixels_and_grids_match_the_pil_processor(images, settings):
    theirs = Qwen2VLImageProcessorPil(**settings)
    ours = QwenVLProcessor(
        image_token_id=0,
        min_pixels=settings["size"]["shortest_edge"],
        max_pixels=settings["size"]["longest_edge"],
        patch_size=settings.get("patch_size", 14),
        temporal_patch_size=settings.get("temporal_patch_size", 2),
        merge_size=settings.get("merge_size", 2),
        image_mean=tuple(settings.get("image_mean", QwenVLProcessor.image_mean)),
        image_std=tuple(settings.get("image_std", QwenVLProcessor.image_std)),
    )
    reference = theirs([i.pixels for i in images], return_tensors="np")
    processed = ours.prepare(images)
    assert_same_pixels(processed.pixel_values, reference["pixel_values"])
    assert np.array_equal(processed.grid_thw, reference["image_grid_thw"])
    merge = settings.get("merge_size", 2)
    assert processed.tokens_per_image == [
        int(np.prod(g)) // merge**2 for g in reference["image_grid_thw"]
    ]


def test_smart_resize_matches_transformers():
    theirs = pil_qwen2_vl.smart_resize
    for height, width in [(1, 1), (27, 29), (1000, 7), (4000, 3000), (333, 777), (28, 28 * 199)]:
        for factor, low, high in [(28, 56 * 56, 28 * 28 * 1280), (32, 64 * 64, 32 * 32 * 256)]:
            assert smart_resize(height, width, factor, low, high) == theirs(
                height, width, factor, low, high
            )


def test_qwen_refuses_an_aspect_ratio_over_200_in_one_line():
    ours = QwenVLProcessor(image_token_id=0)
    with pytest.raises(MediaError) as excinfo:
        ours.prepare([load_image(picture(2, 500))])
    message = str(excinfo.value)
    assert "\n" not in message and "image 1" in message and "250:1" in message


@pytest.fixture(params=sorted(QWEN_VARIANTS))
def qwen_checkpoint(request, tmp_path, monkeypatch):
    """A Qwen-VL checkpoint as transformers 5 writes it, and its transformers Processor."""
    from transformers.processing_utils import ProcessorMixin

    processor_name, config_name, image_settings, vision = QWEN_VARIANTS[request.param]
    processor_class = getattr(transformers, processor_name, None)
    config_class = getattr(transformers, config_name, None)
    if processor_class is None or config_class is None:
        pytest.skip(f"this transformers has no {processor_name} / {config_name}")
    # The video processor class lookup needs torchvision (see the module docstring).
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None)
    tokenizer = tiny_tokenizer(QWEN_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    image_processor = Qwen2VLImageProcessorPil(**image_settings)
    processor = processor_class(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None
    )
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "processor_config.json").write_text(processor.to_json_string())
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    config_class(
        text_config={"vocab_size": 300},
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    ).save_pretrained(tmp_path)
    return tmp_path, processor


QWEN_PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe these images, please."
    "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
)


def test_qwen_from_a_transformers_5_checkpoint_gives_its_input_ids(qwen_checkpoint, images):
    directory, reference = qwen_checkpoint
    tokenizer = Tokenizer.from_dir(directory)
    ours = load_processor(directory, tokenizer=tokenizer)
    assert isinstance(ours, QwenVLProcessor) and ours.marker == "<|image_pad|>"
    assert ours.image_token_id == tokenizer.token_to_id("<|image_pad|>")
    assert ours.vision_start_token_id == tokenizer.token_to_id("<|vision_start|>")
    pair = [images[0], images[4]]
    expected = reference(text=QWEN_PROMPT, images=[i.pixels for i in pair], return_tensors="np")
    processed = ours.prepare(pair)
    assert_same_pixels(processed.pixel_values, expected["pixel_values"])
    assert np.array_equal(processed.grid_thw, expected["image_grid_thw"])
    ids = tokenizer.encode(ours.expand(QWEN_PROMPT, processed))
    assert ids == expected["input_ids"][0].tolist()
    assert ids.count(ours.image_token_id) == sum(processed.tokens_per_image)


def test_qwen_older_preprocessor_config_with_top_level_pixel_counts(tmp_path, images):
    """Qwen2.5-VL as released: preprocessor_config.json, min_pixels / max_pixels at the top."""
    settings = {
        "min_pixels": 28 * 28 * 2,
        "max_pixels": 28 * 28 * 9,
        "size": {"shortest_edge": 3136, "longest_edge": 12845056},  # overridden by the two above
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(settings))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}, "image_token_id": 151655})
    )
    ours = load_processor(tmp_path)
    assert (ours.min_pixels, ours.max_pixels, ours.image_token_id) == (1568, 7056, 151655)
    theirs = Qwen2VLImageProcessorPil.from_dict(settings)
    reference = theirs([i.pixels for i in images], return_tensors="np")
    processed = ours.prepare(images)
    assert_same_pixels(processed.pixel_values, reference["pixel_values"])
    assert np.array_equal(processed.grid_thw, reference["image_grid_thw"])


# --- load_processor: which files, which errors --------------------------------------------------


def write(directory: Path, name: str, data: dict) -> None:
    (directory / name).write_text(json.dumps(data))


def test_text_only_models_have_no_processor(tmp_path):
    write(tmp_path, "config.json", {"model_type": "llama"})
    write(tmp_path, "preprocessor_config.json", {"image_processor_type": "Gemma3ImageProcessor"})
    assert load_processor(tmp_path) is None


def test_the_nested_image_processor_wins_over_preprocessor_config(tmp_path):
    write(
        tmp_path,
        "config.json",
        {"model_type": "gemma3", "vision_config": {}, "image_token_index": 9},
    )
    write(
        tmp_path,
        "processor_config.json",
        {"image_processor": {"size": {"height": 48, "width": 48}}, "image_seq_length": 16},
    )
    write(tmp_path, "preprocessor_config.json", {"size": {"height": 896, "width": 896}})
    ours = load_processor(tmp_path)
    assert (ours.height, ours.image_seq_length, ours.image_token_id) == (48, 16, 9)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 16}))
    assert load_processor(tmp_path).height == 896  # older layout: processor keys only


def test_real_gemma3_settings_are_read_from_the_older_layout(tmp_path):
    """gemma-3-4b-it's files, as published (transformers 4.50): nulls are the processor's
    defaults, token strings are top-level keys of tokenizer_config.json."""
    write(
        tmp_path,
        "config.json",
        {
            "model_type": "gemma3",
            "boi_token_index": 255999,
            "eoi_token_index": 256000,
            "image_token_index": 262144,
            "mm_tokens_per_image": 256,
            "vision_config": {
                "image_size": 896,
                "patch_size": 14,
                "model_type": "siglip_vision_model",
            },
        },
    )
    write(
        tmp_path,
        "preprocessor_config.json",
        {
            "do_convert_rgb": None,
            "do_normalize": True,
            "do_pan_and_scan": None,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "Gemma3ImageProcessor",
            "image_seq_length": 256,
            "image_std": [0.5, 0.5, 0.5],
            "pan_and_scan_max_num_crops": None,
            "pan_and_scan_min_crop_size": None,
            "pan_and_scan_min_ratio_to_activate": None,
            "processor_class": "Gemma3Processor",
            "resample": 2,
            "rescale_factor": 0.00392156862745098,
            "size": {"height": 896, "width": 896},
        },
    )
    write(
        tmp_path,
        "processor_config.json",
        {"image_seq_length": 256, "processor_class": "Gemma3Processor"},
    )
    write(
        tmp_path,
        "tokenizer_config.json",
        {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    ours = load_processor(tmp_path)
    assert (ours.height, ours.width, ours.image_seq_length, ours.resample) == (896, 896, 256, 2)
    assert (ours.image_token_id, ours.boi_token_id, ours.eoi_token_id) == (262144, 255999, 256000)
    assert not ours.pan_and_scan
    sequence = ours.full_image_sequence
    assert sequence.startswith("\n\n<start_of_image><image_soft_token>")
    assert (
        sequence.endswith("<image_soft_token><end_of_image>\n\n")
        and sequence.count("<image_soft_token>") == 256
    )


@pytest.mark.parametrize(
    "files, expected",
    [
        (
            {
                "config.json": {"model_type": "paligemma", "vision_config": {}},
                "preprocessor_config.json": {"image_processor_type": "SiglipImageProcessor"},
            },
            "SiglipImageProcessor",
        ),
        (
            {"config.json": {"model_type": "gemma3", "vision_config": {}}},
            "without image processor settings",
        ),
        (
            {
                "config.json": {"model_type": "gemma3", "vision_config": {}},
                "preprocessor_config.json": {"image_processor_type": "Gemma3ImageProcessor"},
            },
            "image_token_index",
        ),
        (
            {
                "config.json": {
                    "model_type": "gemma3",
                    "vision_config": {"image_size": 896},
                    "image_token_index": 1,
                },
                "preprocessor_config.json": {"size": {"height": 224, "width": 224}},
            },
            "vision_config.image_size is 896",
        ),
        (
            {
                "config.json": {
                    "model_type": "gemma3",
                    "vision_config": {},
                    "image_token_index": 1,
                    "mm_tokens_per_image": 256,
                },
                "preprocessor_config.json": {"image_seq_length": 64},
            },
            "mm_tokens_per_image is 256",
        ),
        (
            {
                "config.json": {
                    "model_type": "qwen2_5_vl",
                    "vision_config": {},
                    "image_token_id": 1,
                },
                "preprocessor_config.json": {"image_mean": [0.5, 0.5]},
            },
            "image_mean",
        ),
        (
            {
                "config.json": {
                    "model_type": "qwen2_5_vl",
                    "vision_config": {"patch_size": 16},
                    "image_token_id": 1,
                },
                "preprocessor_config.json": {"patch_size": 14},
            },
            "vision_config.patch_size is 16",
        ),
        ({"config.json": ["not", "an", "object"]}, "expected an object"),
    ],
)
def test_load_processor_errors_are_one_line_config_errors(tmp_path, files, expected):
    for name, data in files.items():
        write(tmp_path, name, data)
    with pytest.raises(ConfigError) as excinfo:
        load_processor(tmp_path)
    message = str(excinfo.value)
    assert "\n" not in message and expected in message, message


def test_a_config_id_the_tokenizer_contradicts_is_refused(gemma3_checkpoint, tmp_path):
    directory, _ = gemma3_checkpoint
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    config = json.loads((directory / "config.json").read_text())
    config["image_token_index"] = 3
    write(tmp_path, "config.json", config)
    with pytest.raises(ConfigError) as excinfo:
        load_processor(tmp_path, tokenizer=Tokenizer.from_dir(tmp_path))
    assert "image_token_index is 3" in str(excinfo.value) and "\n" not in str(excinfo.value)


# --- Mistral 3 / Pixtral ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "patch, merge, longest",
    [(14, 2, 64), (16, 1, 48), (8, 2, 100), (16, 1, 64)],
)
def test_pixtral_pixels_match_the_pil_processor(images, patch, merge, longest):
    """As ``PixtralProcessor`` calls it: ``patch_size`` = patch x spatial_merge_size. 130 x 34
    at (16, 1, 64) scales to 64 x 16.7: floor keeps one column of patches, rounding two."""
    images = [*images, load_image(picture(130, 34))]
    pil_pixtral = pytest.importorskip(
        "transformers.models.pixtral.image_processing_pil_pixtral",
        reason="this transformers has no PixtralImageProcessorPil",
    )
    theirs = pil_pixtral.PixtralImageProcessorPil(size={"longest_edge": longest})
    ours = PixtralProcessor(
        image_token_id=0,
        patch_size=patch,
        spatial_merge_size=merge,
        max_height=longest,
        max_width=longest,
    )
    reference = theirs([i.pixels for i in images], patch_size=patch * merge, return_tensors="np")
    processed = ours.prepare(images)
    assert_same_pixels(processed.pixel_values, reference["pixel_values"])
    sizes = [tuple(s) for s in np.asarray(reference["image_sizes"]).tolist()]
    assert [(h * patch, w * patch) for _, h, w in processed.grid_thw.tolist()] == sizes
    assert processed.tokens_per_image == [
        (h // (patch * merge)) * (w // (patch * merge)) for h, w in sizes
    ]


def pixtral_reference_text(monkeypatch, text: str, image_sizes, patch: int, merge: int) -> str:
    """``PixtralProcessor``'s own expansion (``replace_image_token`` and ProcessorMixin's
    ``get_text_with_replacements``) run on a stand-in for the processor: the module cannot be
    imported as it is here (its image_processing_pixtral imports torchvision at the top, and the
    class requires torch and torchvision), so that one import is stubbed with the PIL module's
    ``get_resize_output_image_size``, both for this test only."""
    import importlib.util
    import sys
    import types

    pil_pixtral = pytest.importorskip("transformers.models.pixtral.image_processing_pil_pixtral")
    from transformers.processing_utils import ProcessorMixin

    stub = types.ModuleType("transformers.models.pixtral.image_processing_pixtral")
    stub.get_resize_output_image_size = pil_pixtral.get_resize_output_image_size
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    origin = Path(pil_pixtral.__file__).with_name("processing_pixtral.py")
    spec = importlib.util.spec_from_file_location(
        "transformers.models.pixtral.processing_pixtral", origin
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # removed again after the test
    spec.loader.exec_module(module)
    stand_in = types.SimpleNamespace(
        patch_size=patch,
        spatial_merge_size=merge,
        image_token="[IMG]",
        image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]",
        all_special_multimodal_tokens=["[IMG]"],
    )
    inputs = {"image_sizes": image_sizes}
    replacements = [
        module.PixtralProcessor.replace_image_token(stand_in, inputs, i)
        for i in range(len(image_sizes))
    ]
    expanded, _ = ProcessorMixin.get_text_with_replacements(stand_in, [text], replacements)
    return expanded[0]


PIXTRAL_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
]


def test_mistral3_from_its_checkpoint_files_gives_pixtrals_text(tmp_path, monkeypatch, images):
    """Mistral-Small-3.1's layout (transformers 4.5x): processor_config.json holds the
    processor's patch_size, spatial_merge_size and token strings; preprocessor_config.json the
    image processor (its own patch_size is not the one used)."""
    tokenizer = tiny_tokenizer(
        PIXTRAL_SPECIALS, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(tmp_path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in PIXTRAL_SPECIALS}
    write(
        tmp_path,
        "config.json",
        {
            "model_type": "mistral3",
            "image_token_index": ids["[IMG]"],
            "spatial_merge_size": 2,
            "vision_config": {"model_type": "pixtral", "patch_size": 8, "image_size": 64},
        },
    )
    write(
        tmp_path,
        "processor_config.json",
        {
            "image_break_token": "[IMG_BREAK]",
            "image_end_token": "[IMG_END]",
            "image_token": "[IMG]",
            "patch_size": 8,
            "processor_class": "PixtralProcessor",
            "spatial_merge_size": 2,
        },
    )
    image_settings = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_processor_type": "PixtralImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": {"height": 14, "width": 14},
        "processor_class": "PixtralProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": 64},
    }
    write(tmp_path, "preprocessor_config.json", image_settings)
    mlx_tokenizer = Tokenizer.from_dir(tmp_path)
    ours = load_processor(tmp_path, tokenizer=mlx_tokenizer)
    assert isinstance(ours, PixtralProcessor)
    assert (ours.patch_size, ours.spatial_merge_size, ours.max_height) == (8, 2, 64)
    assert (ours.image_break_token_id, ours.image_end_token_id) == (
        ids["[IMG_BREAK]"],
        ids["[IMG_END]"],
    )
    pil_pixtral = pytest.importorskip("transformers.models.pixtral.image_processing_pil_pixtral")
    theirs = pil_pixtral.PixtralImageProcessorPil.from_dict(image_settings)
    trio = [images[0], images[3], images[4]]
    reference = theirs([i.pixels for i in trio], patch_size=16, return_tensors="np")
    processed = ours.prepare(trio)
    assert_same_pixels(processed.pixel_values, reference["pixel_values"])
    prompt = "<s>[INST][IMG]Describe these images, please.[IMG][IMG][/INST]"
    sizes = [tuple(s) for s in np.asarray(reference["image_sizes"]).tolist()]
    expected = pixtral_reference_text(monkeypatch, prompt, sizes, patch=8, merge=2)
    text = ours.expand(prompt, processed)
    assert text == expected
    token_ids = mlx_tokenizer.encode(text)
    assert token_ids == tokenizer(expected)["input_ids"]
    assert token_ids.count(ours.image_token_id) == sum(processed.tokens_per_image)
    assert token_ids.count(ids["[IMG_END]"]) == 3


def test_pixtral_12b_as_llava_is_read_by_its_processor_type(tmp_path):
    """mistral-community/pixtral-12b: model_type llava, a pixtral tower, patch 16, no merge."""
    write(
        tmp_path,
        "config.json",
        {
            "model_type": "llava",
            "image_token_index": 10,
            "vision_config": {"model_type": "pixtral", "patch_size": 16},
        },
    )
    write(
        tmp_path, "processor_config.json", {"patch_size": 16, "processor_class": "PixtralProcessor"}
    )
    write(
        tmp_path,
        "preprocessor_config.json",
        {
            "image_processor_type": "PixtralImageProcessor",
            "size": {"longest_edge": 1024},
            "patch_size": {"height": 16, "width": 16},
        },
    )
    ours = load_processor(tmp_path)
    assert isinstance(ours, PixtralProcessor)
    assert (ours.patch_size, ours.spatial_merge_size, ours.max_height, ours.image_token_id) == (
        16,
        1,
        1024,
        10,
    )
    assert (ours.image_token, ours.image_break_token, ours.image_end_token) == (
        "[IMG]",
        "[IMG_BREAK]",
        "[IMG_END]",
    )
    processed = ours.prepare([load_image(picture(40, 70))])  # 48 x 80: 3 rows of 5
    assert processed.tokens_per_image == [15] and processed.grid_thw.tolist() == [[1, 3, 5]]
    assert (
        ours.expand("a[IMG]b", processed)
        == "a" + ("[IMG]" * 5 + "[IMG_BREAK]") * 2 + "[IMG]" * 5 + "[IMG_END]b"
    )
