"""The chat page at ``/`` (web/ built into mlxinfer/server/static/), in a real headless
Chromium driven by Playwright.

The page's job is to stream and render what the model writes, so the server here answers
from a scripted engine: a reply with a fenced code block, TeX math and HTML that must not run,
streamed a piece at a time. Needs the server extra, the ``playwright`` package and a Chromium
(``MLXINFER_CHROMIUM``, else ``chromium`` on the PATH; `.ci/run` installs Debian's).

Every step waits on the page's state (the model list filled, the reply's note written, the page
no longer busy), never for a time, and the server answers the model list late, as a loaded
machine does: a prompt sent before the list arrived went out with no model, was refused, and
the test read the previous request's messages as this one's."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path

import pytest
from hf_models import add_tokenizer, make_tiny

pytest.importorskip("fastapi", reason="the server extra (FastAPI) is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the server extra (uvicorn) is not installed")
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
)
CHROMIUM = os.environ.get("MLXINFER_CHROMIUM") or shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip(
        "no Chromium: set MLXINFER_CHROMIUM or install one (apt-get install chromium)",
        allow_module_level=True,
    )

from scripted import REPLY, ScriptedEngine  # noqa: E402
from servers import serving  # noqa: E402

from mlxinfer import load  # noqa: E402
from mlxinfer.server import make_app  # noqa: E402

ARTIFACTS = Path(os.environ.get("MLXINFER_ARTIFACTS", "test-artifacts"))
# How long a step may take before the test fails: a bound for a loaded machine, not a wait.
STEP_MS = 60_000
sync_api.expect.set_options(timeout=STEP_MS)
MODEL_LIST_DELAY_S = 0.5


def late_model_list(app):
    """``app`` with ``GET /v1/models`` answered ``MODEL_LIST_DELAY_S`` late."""

    async def slower(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/v1/models":
            await asyncio.sleep(MODEL_LIST_DELAY_S)
        await app(scope, receive, send)

    return slower


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("page"), vocab_size=320, hidden_size=64)
    add_tokenizer(path)
    model, tokenizer = load(str(path))
    engine = ScriptedEngine()
    with serving(late_model_list(make_app(model, tokenizer, "scripted", engine=engine))) as url:
        yield f"{url}/", engine


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _new_page(browser, **options):
    page = browser.new_page(**options)
    page.set_default_timeout(STEP_MS)
    return page


def _models_listed(page) -> None:
    # Locators, not wait_for_function: the page's policy forbids eval, which that uses.
    page.locator("#model option").first.wait_for(state="attached")


def _ask(page, text: str) -> None:
    """Send ``text`` once the page can: the model list filled (a request without a model is
    refused) and no reply streaming."""
    _models_listed(page)
    sync_api.expect(page.locator("#prompt")).to_be_enabled()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _replies_done(page, count: int):
    """Wait until ``count`` replies have ended (each gets its note when its stream ends) and the
    page is idle again; the last reply."""
    sync_api.expect(page.locator(".message.assistant .note")).to_have_count(count)
    sync_api.expect(page.locator("body")).not_to_have_attribute("data-busy", "1")
    return page.locator(".message.assistant").last


def test_a_streamed_reply_renders_code_math_and_no_model_html(page_server, browser):
    url, engine = page_server
    page = _new_page(browser, viewport={"width": 1000, "height": 760})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    _models_listed(page)
    assert page.input_value("#model") == "scripted"
    _ask(page, "Show me some code and math.")
    reply = _replies_done(page, 1)
    sync_api.expect(reply.locator(".note")).to_have_text(re.compile(r"^\d+ tokens, "))

    assert engine.prompts[-1] == [{"role": "user", "content": "Show me some code and math."}]
    code = reply.locator("pre.hljs code")
    assert "def square(x):" in code.inner_text()
    assert code.locator(".hljs-keyword").first.inner_text() == "def"  # highlighted
    math = reply.locator(".katex")
    assert math.count() == 1 and math.locator("annotation").text_content() == "e^{i\\pi}+1=0"
    # The model's HTML is shown as text, and none of it ran.
    assert reply.locator("script, img").count() == 0
    assert "<script>window.__ran = 1</script>" in reply.inner_text()
    assert page.evaluate("window.__ran") is None
    assert "Done." in reply.inner_text() and errors == []

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-page.png"))

    # The conversation is kept for the browser session: a reload shows it again, and the next
    # request sends it back to the model.
    page.reload()
    page.wait_for_selector(".message.assistant .katex")
    assert page.locator(".message").count() == 2
    _ask(page, "And again?")  # after the model list has arrived again
    again = _replies_done(page, 2)
    sync_api.expect(again.locator(".note")).to_have_text(re.compile(r"^\d+ tokens, "))
    sent = engine.prompts[-1]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"] == REPLY and sent[2]["content"] == "And again?"
    page.close()


def test_stop_ends_the_stream_and_cancels_it_on_the_server(page_server, browser):
    url, engine = page_server
    page = _new_page(browser)
    page.goto(url)
    engine.closed.clear()
    _ask(page, "Write something long.")
    reply = page.locator(".message.assistant").last
    sync_api.expect(reply).to_contain_text("word " * 8)  # streaming has started
    page.click("#stop")
    reply = _replies_done(page, 1)
    sync_api.expect(reply.locator(".note")).to_have_text("stopped")
    assert engine.closed.wait(STEP_MS / 1000), "the server's stream was not closed after Stop"
    # The page's record of the reply, written once its stream ended: what was shown, cut short.
    saved = page.evaluate("JSON.parse(sessionStorage.getItem('mlxinfer.chat')).at(-1)")
    assert saved["note"] == "stopped" and ScriptedEngine.LONG.startswith(saved["content"])
    assert 40 <= len(saved["content"]) < len(ScriptedEngine.LONG)
    assert reply.inner_text().split("\n")[0] == saved["content"].strip()
    assert page.is_visible("#send") and not page.is_visible("#stop")
    page.close()


def test_the_page_sends_a_servers_api_key(page_server, browser, tmp_path):
    """With --api-key, the page asks for the key, then sends it as a Bearer token."""
    path, _ = make_tiny(tmp_path, vocab_size=320, hidden_size=64)
    add_tokenizer(path)
    model, tokenizer = load(str(path))
    app = make_app(model, tokenizer, "scripted", api_key="sk-page", engine=ScriptedEngine())
    with serving(app) as url:
        page = _new_page(browser)
        page.goto(f"{url}/")
        page.wait_for_selector("#key", state="visible")
        assert page.locator("#model option").count() == 0
        page.fill("#key", "sk-page")
        page.dispatch_event("#key", "change")
        _models_listed(page)  # the key opened the model list: asking before it fills races it
        _ask(page, "Hello")
        assert "Done." in _replies_done(page, 1).inner_text()
        page.close()


def test_the_page_is_served_with_a_policy_that_runs_only_its_own_script(page_server):
    import httpx

    url, _ = page_server
    # A browser's Accept (a client that does not ask for HTML gets Ollama's "Ollama is running")
    r = httpx.get(url, headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}, timeout=10)
    assert r.status_code == 200 and "static/chat.js" in r.text
    policy = r.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy
    for asset in ("static/chat.js", "static/chat.css", "static/fonts/KaTeX_Main-Regular.woff2"):
        assert httpx.get(url + asset, timeout=10).status_code == 200, asset


# --- images ---------------------------------------------------------------------------------

VLM, TEXT_ONLY = "tiny-gemma3-vlm", "text-only"


@pytest.fixture(scope="module")
def vlm_page(tmp_path_factory):
    """The tiny random Gemma 3 image-text checkpoint served for real (no scripted engine), with
    a text-only copy of it from a models directory; its two test pictures."""
    from vlm_serving import text_only_copy, vlm_with_images

    root = tmp_path_factory.mktemp("page_images")
    path, files = vlm_with_images(root)
    text_only_copy(path, root / "models" / TEXT_ONLY)
    model, tokenizer = load(str(path))
    with serving(make_app(model, tokenizer, VLM, models_dir=root / "models")) as url:
        yield url, files


def _greedy(page, sent: list) -> None:
    """The page's chat requests answered greedily (8 tokens), so its reply can be compared with
    the API's; ``sent`` gets each body as the page wrote it."""
    import json

    def handle(route):
        body = route.request.post_data_json
        sent.append(body)
        route.continue_(post_data=json.dumps({**body, "temperature": 0, "max_tokens": 8}))

    page.route("**/v1/chat/completions", handle)


def _api_reply(url: str, content) -> str:
    import httpx

    body = {
        "model": VLM,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 8,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_an_image_picked_or_pasted_is_shown_and_sent(vlm_page, browser):
    url, files = vlm_page
    page = _new_page(browser, viewport={"width": 1000, "height": 760})
    errors, sent = [], []
    page.on("pageerror", lambda e: errors.append(str(e)))
    _greedy(page, sent)
    page.goto(f"{url}/")
    _models_listed(page)
    page.select_option("#model", VLM)
    sync_api.expect(page.locator("#attach")).to_be_visible()
    page.set_input_files("#image", str(files[0]))
    sync_api.expect(page.locator("#attached img")).to_have_count(1)
    _ask(page, "Describe this image.")
    reply = _replies_done(page, 1)
    sync_api.expect(reply.locator(".note")).to_have_text(re.compile(r"^\d+ tokens, "))
    shown = page.locator(".message.user img")
    assert shown.count() == 1 and shown.evaluate("img => img.naturalWidth") == 150
    assert page.locator("#attached img").count() == 0  # sent, so no longer attached

    parts = sent[-1]["messages"][-1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text"]
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    saved = page.evaluate("JSON.parse(sessionStorage.getItem('mlxinfer.chat')).at(-1)")
    assert saved["content"] == _api_reply(url, parts)
    assert saved["content"] != _api_reply(url, "Describe this image.")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-page-image.png"))

    # The conversation's image is kept for the tab: a reload shows it again.
    page.reload()
    _models_listed(page)
    sync_api.expect(page.locator(".message.user img")).to_have_count(1)
    assert page.locator(".message.user img").evaluate("img => img.naturalWidth") == 150

    # A pasted or dropped image is attached too; a text-only model hides the picker and drops
    # what was attached.
    data = list(files[1].read_bytes())
    for event in ("paste", "drop"):
        page.locator("#prompt").evaluate(
            """(el, [data, event]) => {
                const dt = new DataTransfer();
                dt.items.add(new File([new Uint8Array(data)], "p.png", { type: "image/png" }));
                const e = event === "paste"
                    ? new ClipboardEvent("paste", { clipboardData: dt, bubbles: true })
                    : new DragEvent("drop", { dataTransfer: dt, bubbles: true, cancelable: true });
                el.dispatchEvent(e);
            }""",
            [data, event],
        )
    sync_api.expect(page.locator("#attached img")).to_have_count(2)
    page.select_option("#model", TEXT_ONLY)
    sync_api.expect(page.locator("#attach")).to_be_hidden()
    sync_api.expect(page.locator("#attached img")).to_have_count(0)
    assert errors == []
    page.close()


def test_a_text_only_model_has_no_image_picker(page_server, browser):
    url, _ = page_server
    page = _new_page(browser)
    page.goto(url)
    _models_listed(page)
    assert page.locator("#attach").is_hidden()
    page.close()
