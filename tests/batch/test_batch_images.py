"""Image requests in the batching engine (batch/images.py), on a tiny random Gemma 3 image-text
checkpoint whose sliding window (3) is shorter than an image (4 tokens): rows with images and
text rows decode together and each gets its single-request ``stream_generate(images=...)``
tokens (whose own test holds them to transformers'); the prefix cache names a block holding
image tokens by its images too, chained, so a new image keeps the shared system prompt and two
images never share a block past the first image token, in memory and on disk; the encoder cache
skips the tower for an image seen before."""

from __future__ import annotations

import pytest
from gemma3_vlm import make_gemma3_vlm, random_image

from mlxinfer.batch import Engine
from mlxinfer.batch.images import RowImages
from mlxinfer.batch.pool import chain_hashes
from mlxinfer.generation import prepare_prompt, stream_generate
from mlxinfer.generation.images import load_images
from mlxinfer.loading.loader import load

TEXT = "Describe this image."
SYSTEM = "the quick brown fox jumps over the lazy dog; red green blue image picture photo"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_images")
    path, _, _ = make_gemma3_vlm(root / "model")
    files = []
    for i, size in enumerate([(150, 118), (131, 170), (140, 100)]):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    model, tokenizer = load(path)
    return model, tokenizer, files


def _messages(text: str = TEXT, system: str | None = SYSTEM) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": text}]


def _single(model, tokenizer, prompt, images) -> list[int]:
    results = stream_generate(
        model, tokenizer, prompt, images=images, chat_template=True, max_tokens=8
    )
    return [r.token for r in results]


def _run(engine, tokenizer, prompt, images) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens served from shared blocks) of one request."""
    stream = engine.start(tokenizer, prompt, images=images, chat_template=True, max_tokens=8)
    return [r.token for r in stream], stream.handle.cached_tokens


@pytest.mark.parametrize("block_size, prefill_step", [(16, 256), (4, 5)])
def test_image_rows_and_a_text_row_decode_together_as_single_runs(vlm, block_size, prefill_step):
    """Two image rows (one with two images) and a text row in one batch; with 5-token chunks
    each 4-token image would be cut (the chunk stretches to its end instead)."""
    model, tokenizer, files = vlm
    asks = [(TEXT, files[:1]), (TEXT, files[1:3]), ("What color is it?", None)]
    expected = [_single(model, tokenizer, p, i) for p, i in asks]
    assert expected[0] != expected[1]  # the images are seen
    with Engine(model, block_size=block_size, prefill_step=prefill_step) as engine:
        streams = [
            engine.start(tokenizer, p, images=i, chat_template=True, max_tokens=8) for p, i in asks
        ]
        assert [[r.token for r in s] for s in streams] == expected
        assert engine.steps_run < sum(map(len, expected))  # rows shared decode steps


def test_a_new_image_keeps_the_shared_system_prompt(vlm):
    """The blocks before the first image token are shared with a request of another image
    (and with a text request); the blocks from it on are not."""
    model, tokenizer, files = vlm
    bs = 4
    images = load_images(model, tokenizer, files[:1])
    ids = prepare_prompt(tokenizer, _messages(), images=images)
    before = ids.index(images.processor.image_token_id) // bs  # blocks wholly before it
    with Engine(model, block_size=bs, hold_windows=False) as engine:
        first, cached = _run(engine, tokenizer, _messages(), files[:1])
        assert cached == 0
        other, cached = _run(engine, tokenizer, _messages(), files[1:2])
        assert cached == before * bs  # the system prompt, not the first image's blocks
        again, cached = _run(engine, tokenizer, _messages(), files[1:2])
        assert cached == (len(ids) - 1) // bs * bs  # every full block: the same image
        _, cached = _run(engine, tokenizer, _messages("What color is it?"), None)
        assert cached >= (before - 1) * bs  # a text prompt shares it too
    assert first == _single(model, tokenizer, _messages(), files[:1])
    assert other == again == _single(model, tokenizer, _messages(), files[1:2])
    assert first != other
    with Engine(model, block_size=bs) as engine:  # the sliding layers in a window pool
        runs = [_run(engine, tokenizer, _messages(), files[i : i + 1]) for i in (0, 1, 1)]
        assert [tokens for tokens, _ in runs] == [first, other, other]
        assert [cached for _, cached in runs] == [0, before * bs, (len(ids) - 1) // bs * bs]


def test_blocks_before_an_image_keep_their_text_names(vlm):
    """Chained per block: the salts start at the first block with an image token (one hash of
    the whole request salting every block, mlx-vlm's, would rename the system prompt), and a
    prefix hit never ends inside an image."""
    model, tokenizer, files = vlm
    bs = 4
    rows = []
    for f in files[:2]:
        images = load_images(model, tokenizer, [f])
        ids = prepare_prompt(tokenizer, _messages(), images=images)
        rows.append((ids, RowImages.make(ids, images, bs)))
    (ids, a), (ids_b, b) = rows
    assert ids == ids_b
    first = ids.index(load_images(model, tokenizer, files[:1]).processor.image_token_id)
    n = (len(ids) - 1) // bs
    text = chain_hashes(ids, bs, n)
    named_a, named_b = chain_hashes(ids, bs, n, a.salts), chain_hashes(ids, bs, n, b.salts)
    assert named_a[: first // bs] == named_b[: first // bs] == text[: first // bs]
    assert all(x != y for x, y in zip(named_a[first // bs :], named_b[first // bs :]))
    assert min(a.salts) == first // bs
    inside = first + 2  # the image's third token
    assert a.cut(inside // bs + 1, 1) <= first + 1 and a.cut(inside, 1) == first
    assert a.chunk_end(first + 1) == first + 4


def test_the_disk_tier_keeps_images_apart(vlm, tmp_path):
    """After a restart: another image reads only the system prompt's blocks back from disk;
    the first image reads its own blocks too; both give fresh runs' tokens."""
    model, tokenizer, files = vlm
    bs = 4
    options = dict(block_size=bs, hold_windows=False, prefix_cache_dir=tmp_path)
    images = load_images(model, tokenizer, files[:1])
    ids = prepare_prompt(tokenizer, _messages(), images=images)
    before = ids.index(images.processor.image_token_id) // bs
    with Engine(model, **options) as engine:
        first, _ = _run(engine, tokenizer, _messages(), files[:1])
        engine.pool.disk.flush()
    with Engine(model, **options) as engine:
        other, cached = _run(engine, tokenizer, _messages(), files[1:2])
        assert engine.pool.disk.loaded == before and cached == before * bs
    with Engine(model, **options) as engine:
        again, cached = _run(engine, tokenizer, _messages(), files[:1])
        assert engine.pool.disk.loaded == (len(ids) - 1) // bs
        assert cached == (len(ids) - 1) // bs * bs
    assert first == again == _single(model, tokenizer, _messages(), files[:1])
    assert other == _single(model, tokenizer, _messages(), files[1:2]) != first


def test_the_encoder_cache_skips_the_tower_for_an_image_seen_before(vlm, monkeypatch):
    model, tokenizer, files = vlm
    calls = []
    encode = model.encode_images
    monkeypatch.setattr(model, "encode_images", lambda p: calls.append(p.shape[0]) or encode(p))
    expected = _single(model, tokenizer, _messages(system="Be brief."), files[:1])
    calls.clear()
    with Engine(model, block_size=4) as engine:
        _run(engine, tokenizer, _messages(), files[:2])
        assert calls == [2]
        # Another system prompt: no image block shared, the features from the cache.
        tokens, _ = _run(engine, tokenizer, _messages(system="Be brief."), files[:1])
        assert calls == [2] and tokens == expected
        _run(engine, tokenizer, _messages(), files[1:3])  # one new image: the tower sees it alone
        assert calls == [2, 1]
        assert engine.encoder_cache.hits == 2 and len(engine.encoder_cache) == 3
        metrics = engine.metrics()
        assert metrics["image_encoder_calls"] == 2 and metrics["image_encoder_cache_hits"] == 2
    with Engine(model, block_size=4, encoder_cache_bytes=0) as engine:
        for _ in range(2):
            _run(engine, tokenizer, _messages(system="Be brief."), files[:1])
        assert calls == [2, 1, 1, 1] and len(engine.encoder_cache) == 0


def test_what_the_engine_cannot_take_with_images_is_one_line(vlm):
    from mlxinfer.generation.drafts import PromptLookup

    model, tokenizer, files = vlm
    with Engine(model) as engine:
        with pytest.raises(ValueError, match="speculative decoding does not take images"):
            engine.start(
                tokenizer, TEXT, images=files[:1], chat_template=True, draft=PromptLookup()
            )
        assert engine.image_refusal() is None


def test_an_image_that_fails_to_encode_fails_its_request_only(vlm, monkeypatch):
    model, tokenizer, files = vlm

    def broken(pixels):
        raise ValueError("pixel_values: expected something else")

    with Engine(model) as engine:
        monkeypatch.setattr(model, "encode_images", broken)
        stream = engine.start(tokenizer, TEXT, images=files[:1], chat_template=True)
        with pytest.raises(ValueError, match="expected something else"):
            list(stream)
        monkeypatch.undo()
        assert engine.alive and _run(engine, tokenizer, TEXT, None)[0]


def test_batch_generate_gives_every_prompt_the_images(vlm, monkeypatch):
    from mlxinfer.batch import batch_generate
    from mlxinfer.generation import generate

    model, tokenizer, files = vlm
    prompts = [TEXT, "What color is it?"]
    expected = [
        generate(model, tokenizer, p, images=files[:2], chat_template=True, max_tokens=8)
        for p in prompts
    ]
    calls = []
    encode = model.encode_images
    monkeypatch.setattr(model, "encode_images", lambda p: calls.append(p.shape[0]) or encode(p))
    texts = batch_generate(
        model, tokenizer, prompts, images=files[:2], chat_template=True, max_tokens=8
    )
    assert texts == expected and calls == [2]  # the tower saw the two images once


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen_vl(request, tmp_path_factory):
    from qwen_vl import make_qwen_vl

    root = tmp_path_factory.mktemp(request.param)
    path, _ = make_qwen_vl(root / "model", request.param)
    files = []
    for i, size in enumerate([(150, 118), (131, 170), (140, 100)]):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    model, tokenizer = load(path)
    return model, tokenizer, files


def test_qwen_vl_rows_decode_at_their_own_m_rope_positions(qwen_vl):
    """Qwen2.5-VL / Qwen3-VL: each image row's chunks take their slice of the (t, h, w)
    positions (and Qwen3-VL's deepstack), and it decodes at its index + its own delta beside a
    text row; again with every full block shared (its delta still its own)."""
    model, tokenizer, files = qwen_vl
    asks = [(TEXT, files[:1]), (TEXT, files[1:3]), ("What color is it?", None)]
    expected = [_single(model, tokenizer, p, i) for p, i in asks]
    assert expected[0] != expected[1]
    with Engine(model, block_size=4, prefill_step=5) as engine:
        assert engine.image_refusal() is None
        streams = [
            engine.start(tokenizer, p, images=i, chat_template=True, max_tokens=8) for p, i in asks
        ]
        assert [[r.token for r in s] for s in streams] == expected
        for prompt, images in asks[:2]:  # the whole prompt but its last token shared
            tokens, cached = _run(engine, tokenizer, prompt, images)
            ids = prepare_prompt(tokenizer, prompt, images=load_images(model, tokenizer, images))
            assert cached == (len(ids) - 1) // 4 * 4 and tokens == _single(
                model, tokenizer, prompt, images
            )
