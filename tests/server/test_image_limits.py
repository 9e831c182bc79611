"""``serve``'s caps on images (``--max-images``, ``--max-image-bytes``, ``--max-image-pixels``),
remote image URLs fetched with ``--allow-remote-images``, and OpenAI's ``detail``: each API's
own error shape and status past a cap (413 for too many images or bytes, 400 for too many
pixels), the message naming the cap and its flag; through the official clients, to a tiny
random Gemma 3 image-text checkpoint served with small caps."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import anthropic
import httpx
import ollama
import openai
import pytest
from gemma3_vlm import random_image
from servers import serving
from vlm_serving import data_url, vlm_with_images

from mlxinfer.generation import generate
from mlxinfer.loading.loader import load
from mlxinfer.server import make_app

NAME = "tiny-gemma3-vlm"
TEXT = "Describe this image."
CAPS = {"max_images": 2, "max_image_bytes": 40_000, "max_image_pixels": 20_000}


def _padded_png() -> bytes:
    """A 10 x 10 PNG of 60 KB (a text chunk): over the byte cap, under the pixel cap."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("pad", "x" * 60_000)
    out = io.BytesIO()
    random_image(5, (10, 10)).save(out, "PNG", pnginfo=info)
    return out.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("image_limits")
    path, files = vlm_with_images(root)  # 150 x 118 (17,700 px) and 131 x 170 (22,270 px)
    (root / "padded.png").write_bytes(_padded_png())
    model, tokenizer = load(path)
    expected = generate(model, tokenizer, TEXT, images=[files[0]], chat_template=True, max_tokens=8)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    files_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files_server.serve_forever, daemon=True).start()
    remote = f"http://127.0.0.1:{files_server.server_address[1]}"
    app = make_app(model, tokenizer, NAME, allow_remote_images=True, **CAPS)
    try:
        with serving(app) as base:
            yield base, files, expected, remote, path
    finally:
        files_server.shutdown()


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def _bodies(urls: list[str]) -> dict[str, dict]:
    """One request with the images of ``urls`` (data URLs) through each API's route."""
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": u[22:]}}
        for u in urls
    ]
    return {
        "/v1/chat/completions": {
            "model": NAME,
            "max_tokens": 2,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls],
                }
            ],
        },
        "/v1/messages": {
            "model": NAME,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": blocks}],
        },
        "/v1/messages/count_tokens": {
            "model": NAME,
            "messages": [{"role": "user", "content": blocks}],
        },
        "/v1/responses": {
            "model": NAME,
            "max_output_tokens": 2,
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": u} for u in urls],
                }
            ],
        },
        "/api/chat": {
            "model": NAME,
            "stream": False,
            "messages": [{"role": "user", "content": "x", "images": [u[22:] for u in urls]}],
        },
    }


def _refused(base: str, urls: list[str], status: int, flag: str) -> None:
    for route, body in _bodies(urls).items():
        r = httpx.post(base + route, json=body, timeout=60)
        assert r.status_code == status, (route, r.text)
        error = r.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert flag in message and "\n" not in message, (route, message)
        if route.startswith("/v1/messages"):
            kind = "request_too_large" if status == 413 else "invalid_request_error"
            assert r.json()["type"] == "error" and error["type"] == kind
        elif route.startswith("/v1/"):
            assert error["code"] in ("too_many_images", "image_too_large"), error


def test_too_many_images_is_a_413_naming_the_flag(served):
    base, files, _, _, _ = served
    _refused(
        base, [data_url(files[0])] * 3, 413, "over the cap of 2 per request (serve --max-images)"
    )
    with pytest.raises(openai.APIStatusError) as e:  # the official client sees the status
        _openai(base).chat.completions.create(
            model=NAME,
            messages=_bodies([data_url(files[0])] * 3)["/v1/chat/completions"]["messages"],
        )
    assert e.value.status_code == 413
    with pytest.raises(ollama.ResponseError) as o:
        ollama.Client(host=base, timeout=60).chat(
            model=NAME, messages=[{"role": "user", "content": "x", "images": [files[0]] * 3}]
        )
    assert o.value.status_code == 413 and "--max-images" in str(o.value)


def test_an_image_over_the_byte_cap_is_a_413_and_over_the_pixel_cap_a_400(served, tmp_path):
    base, files, _, _, _ = served
    padded = "data:image/png;base64," + base64.b64encode(_padded_png()).decode()
    _refused(base, [padded], 413, "(serve --max-image-bytes)")
    _refused(base, [data_url(files[1])], 400, "over the cap of 20000 px (serve --max-image-pixels)")
    with pytest.raises(anthropic.BadRequestError, match="--max-image-pixels"):
        anthropic.Anthropic(base_url=base, api_key="none", max_retries=0).messages.create(
            model=NAME,
            max_tokens=2,
            messages=_bodies([data_url(files[1])])["/v1/messages"]["messages"],
        )


def test_remote_urls_are_fetched_with_allow_remote_images(served):
    base, files, expected, remote, _ = served
    url = f"{remote}/{files[0].name}"
    reply = _openai(base).chat.completions.create(
        model=NAME,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": TEXT},
                ],
            }
        ],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.content == expected  # the file's bytes, as a data URL's
    source = {"type": "url", "url": url}
    message = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0).messages.create(
        model=NAME,
        max_tokens=8,
        extra_body={"temperature": 0},
        messages=[
            {
                "role": "user",
                "content": [{"type": "image", "source": source}, {"type": "text", "text": TEXT}],
            }
        ],
    )
    assert message.content[0].text == expected
    over = _bodies([f"{remote}/padded.png"])["/v1/chat/completions"]
    r = httpx.post(base + "/v1/chat/completions", json=over, timeout=60)
    assert r.status_code == 413 and "--max-image-bytes" in r.json()["error"]["message"]
    missing = _bodies([f"{remote}/none.png"])["/v1/chat/completions"]
    r = httpx.post(base + "/v1/chat/completions", json=missing, timeout=60)
    assert r.status_code == 400 and "HTTP 404" in r.json()["error"]["message"]


def test_detail_is_accepted_and_a_bad_one_is_a_400(served):
    base, files, expected, _, _ = served
    client = _openai(base)
    for detail in ("low", "high", "auto"):
        part = {"type": "image_url", "image_url": {"url": data_url(files[0]), "detail": detail}}
        reply = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": [part, {"type": "text", "text": TEXT}]}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.choices[0].message.content == expected  # the processor sets the size
    part = {"type": "image_url", "image_url": {"url": data_url(files[0]), "detail": "ultra"}}
    with pytest.raises(openai.BadRequestError, match="detail: expected one of low, high, auto"):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": [part]}], max_tokens=2
        )
    image = {"type": "input_image", "image_url": data_url(files[0]), "detail": "huge"}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=NAME, input=[{"role": "user", "content": [image]}], max_output_tokens=2
        )
    assert e.value.body["param"] == "input[0].content[0].detail"


def test_serve_passes_the_image_flags(served, monkeypatch):
    from click.testing import CliRunner

    import mlxinfer.server
    from mlxinfer.cli.main import cli

    *_, path = served
    asked: list[dict] = []
    monkeypatch.setattr(mlxinfer.server, "serve", lambda *a, **options: asked.append(options))
    flags = ["--max-images", "3", "--max-image-bytes", "1M", "--max-image-pixels", "1000"]
    result = CliRunner().invoke(cli, ["serve", "-m", str(path), *flags, "--allow-remote-images"])
    assert result.exit_code == 0, result.output
    got = {k: asked[-1].get(k) for k in (*CAPS, "allow_remote_images")}
    assert got == {
        "max_images": 3,
        "max_image_bytes": 1 << 20,
        "max_image_pixels": 1000,
        "allow_remote_images": True,
    }
    result = CliRunner().invoke(cli, ["serve", "-m", str(path)])
    assert result.exit_code == 0, result.output
    assert not asked[-1].get("allow_remote_images")  # off unless asked (the Limits default)
