"""The chat page at ``/`` (web/ built into mlxinfer/server/static/), in a real headless
Chromium driven by Playwright.

The page's job is to stream and render what the model writes, so the server here answers
from a scripted engine: a reply with a fenced code block, TeX math and HTML that must not run,
streamed a piece at a time. Needs the server extra, the ``playwright`` package and a Chromium
(``MLXINFER_CHROMIUM``, else ``chromium`` on the PATH; `.ci/run` installs Debian's)."""

from __future__ import annotations

import os
import shutil
import time
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


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("page"), vocab_size=320, hidden_size=64)
    add_tokenizer(path)
    model, tokenizer = load(str(path))
    engine = ScriptedEngine()
    with serving(make_app(model, tokenizer, "scripted", engine=engine)) as url:
        yield f"{url}/", engine


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _models_listed(page) -> None:
    # Locators, not wait_for_function: the page's policy forbids eval, which that uses.
    page.locator("#model option").first.wait_for(state="attached", timeout=10_000)


def _ask(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_a_streamed_reply_renders_code_math_and_no_model_html(page_server, browser):
    url, engine = page_server
    page = browser.new_page(viewport={"width": 1000, "height": 760})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    _models_listed(page)
    assert page.input_value("#model") == "scripted"
    _ask(page, "Show me some code and math.")
    page.wait_for_selector(".message.assistant .note", timeout=20_000)  # written when it ended
    reply = page.locator(".message.assistant").last

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
    page.wait_for_selector(".message.assistant .katex", timeout=10_000)
    assert page.locator(".message").count() == 2
    _ask(page, "And again?")
    sync_api.expect(page.locator(".message .note")).to_have_count(2, timeout=20_000)
    sent = engine.prompts[-1]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"] == REPLY and sent[2]["content"] == "And again?"
    page.close()


def test_stop_ends_the_stream_and_cancels_it_on_the_server(page_server, browser):
    url, engine = page_server
    page = browser.new_page()
    page.goto(url)
    _models_listed(page)
    engine.closed.clear()
    _ask(page, "Write something long.")
    reply = page.locator(".message.assistant").last
    deadline = time.monotonic() + 20
    while len(reply.inner_text()) <= 30:
        assert time.monotonic() < deadline, "the long reply did not start streaming"
        time.sleep(0.05)
    page.click("#stop")
    page.wait_for_selector(".message.assistant:last-child .note", timeout=5_000)
    assert reply.locator(".note").inner_text() == "stopped"
    assert engine.closed.wait(5), "the server's stream was not closed after Stop"
    shown = reply.inner_text()
    time.sleep(0.5)
    assert reply.inner_text() == shown  # nothing more arrives
    assert len(shown) < len(ScriptedEngine.LONG)
    assert page.is_visible("#send") and not page.is_visible("#stop")
    page.close()


def test_the_page_sends_a_servers_api_key(page_server, browser, tmp_path):
    """With --api-key, the page asks for the key, then sends it as a Bearer token."""
    path, _ = make_tiny(tmp_path, vocab_size=320, hidden_size=64)
    add_tokenizer(path)
    model, tokenizer = load(str(path))
    app = make_app(model, tokenizer, "scripted", api_key="sk-page", engine=ScriptedEngine())
    with serving(app) as url:
        page = browser.new_page()
        page.goto(f"{url}/")
        page.wait_for_selector("#key", state="visible", timeout=10_000)
        assert page.locator("#model option").count() == 0
        page.fill("#key", "sk-page")
        page.dispatch_event("#key", "change")
        _models_listed(page)
        _ask(page, "Hello")
        page.wait_for_selector(".message.assistant .note", timeout=20_000)
        assert "Done." in page.locator(".message.assistant").last.inner_text()
        page.close()


def test_the_page_is_served_with_a_policy_that_runs_only_its_own_script(page_server):
    import httpx

    url, _ = page_server
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200 and "static/chat.js" in r.text
    policy = r.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy
    for asset in ("static/chat.js", "static/chat.css", "static/fonts/KaTeX_Main-Regular.woff2"):
        assert httpx.get(url + asset, timeout=10).status_code == 200, asset
