"""Images through the app API: ``ModelHandle`` and ``astream_generate`` take ``images=`` as
``stream_generate`` does, on a tiny random Gemma 3 image-text checkpoint; the replies are the
library's, through the batching engine and through the single-request path a model whose images
the engine cannot run yet takes."""

from __future__ import annotations

import asyncio

import pytest
from vlm_serving import text_only_copy, vlm_with_images

from mlxinfer.errors import MediaError
from mlxinfer.generation import generate
from mlxinfer.handle import ModelHandle, astream_generate

TEXT = "Describe this image."


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("app_images")
    path, files = vlm_with_images(root)
    with ModelHandle(path) as handle:
        handle.load()
        expected = [
            generate(
                handle.model, handle.tokenizer, TEXT, images=[f], chat_template=True, max_tokens=8
            )
            for f in files
        ]
        assert expected[0] != expected[1]  # else the tests are blind
        yield root, path, files, handle, expected


def test_a_handle_takes_images(vlm):
    _, _, files, handle, expected = vlm
    for f, want in zip(files, expected):
        assert handle.generate(TEXT, images=[f], chat_template=True, max_tokens=8) == want

    async def both():
        async def one(f):
            pieces = astream_generate(
                handle, prompt=TEXT, images=[f.read_bytes()], chat_template=True, max_tokens=8
            )
            return "".join([r.text async for r in pieces])

        return await asyncio.gather(*(one(f) for f in files))  # one batch, two images

    assert asyncio.run(both()) == expected


def test_images_the_engine_cannot_run_go_through_stream_generate(vlm, monkeypatch):
    _, _, files, handle, expected = vlm
    monkeypatch.setattr(handle.engine, "image_refusal", lambda: "images: not in the engine")

    def engine_start(*args, **kwargs):
        raise AssertionError("the engine was asked")

    monkeypatch.setattr(handle.engine, "start", engine_start)
    stream = handle.start(TEXT, images=[files[1]], chat_template=True, max_tokens=8)
    assert "".join(r.text for r in stream) == expected[1]
    stream = handle.start(TEXT, images=[files[0]], chat_template=True, max_tokens=200)
    next(stream)
    stream.cancel()
    assert stream.cancelled and not handle._streams


def test_a_bad_image_or_a_text_only_model_is_one_line(vlm):
    root, path, files, handle, _ = vlm
    with pytest.raises(MediaError, match="image 1"):
        handle.generate(TEXT, images=[b"not an image"], chat_template=True, max_tokens=2)
    with ModelHandle(text_only_copy(path, root / "text-only")) as text_only:
        with pytest.raises(MediaError, match="vision tower"):
            text_only.generate(TEXT, images=[files[0]], chat_template=True, max_tokens=2)
