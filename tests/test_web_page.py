"""The page for people at `/` (tokenizer_proc/page.py, tokenizer_proc/web/): served as shipped, open
without the key (which it asks for and sends, never embeds), and in a real headless Chromium a
chat streams an answer through the engine's own endpoint while the status view shows the
request. `MLX_ENGINE_SCREENSHOTS=DIR` keeps the screenshots."""

from __future__ import annotations

import asyncio
import http.client
import os
import shutil
from pathlib import Path

import pytest
from browser import Browser, find
from engine_harness import LaunchedEngine

pytestmark = pytest.mark.timeout(240)
KEY = "sk-page-test-0001"
needs_chromium = pytest.mark.skipif(
    find() is None, reason="no Chromium here (./scripts/test installs Debian's where it can)"
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("page") / "launch.log"
    launched = LaunchedEngine(tiny_model_dir, log).wait_ready()
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("page-keyed") / "launch.log"
    launched = LaunchedEngine(tiny_model_dir, log, "--api-key", KEY).wait_ready()
    yield launched
    launched.stop()


def _get(engine: LaunchedEngine, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", engine.http_port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def test_the_page_is_served_as_shipped_and_needs_no_key(keyed):
    status, headers, body = _get(keyed, "/")
    assert status == 200 and b'<script src="/ui/app.js"' in body
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    assert KEY.encode() not in body
    for name in ("app.js", "style.css"):
        assert _get(keyed, f"/ui/{name}")[0] == 200
    assert _get(keyed, "/ui/page.py")[0] == 404
    assert _get(keyed, "/ui/..%2Fpage.py")[0] == 404
    assert _get(keyed, "/v1/models")[0] == 401  # NOTE: the data stays behind the key


def _keep(shot: Path) -> None:
    keep = os.environ.get("MLX_ENGINE_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / shot.name)


async def _chat(b: Browser, prompt: str) -> dict:
    """Ask `prompt` through the page's form; the reply's text, meta line and end state."""
    await b.js("document.getElementById('max_tokens').value = 24")
    await b.js("document.getElementById('temperature').value = 0")
    await b.js(f"document.getElementById('prompt').value = {prompt!r}")
    await b.js("document.getElementById('ask').requestSubmit()")
    done = await b.until("state.last && state.last.dataset.done")
    return await b.js(
        "({done: state.last.dataset.done, text: state.last.querySelector('.body').textContent,"
        " meta: state.last.querySelector('.meta').textContent})"
    ) | {"done": done}


@needs_chromium
def test_a_chat_streams_in_chromium_and_the_status_view_shows_it(engine, tmp_path):
    async def scenario() -> tuple[dict, dict]:
        async with Browser(tmp_path / "profile") as b:
            await b.open(engine.http + "/")
            await b.until("state.model !== null")
            # NOTE: count the deltas the page renders: a stream, not one whole reply
            await b.js(
                "window.renders = 0; new MutationObserver(() => window.renders++)"
                ".observe(document.getElementById('messages'), {subtree: true, childList: true})"
            )
            reply = await _chat(b, "Say hello")
            reply["renders"] = await b.js("window.renders")
            await b.screenshot(tmp_path / "chat.png")
            await b.js("document.getElementById('tab-status').click()")
            await b.until("Number(document.getElementById('s-finished').textContent) >= 1")
            await b.until("document.querySelectorAll('#h-ttft .bar').length > 0")
            status = await b.js(
                "({received: document.getElementById('s-received').textContent,"
                " kv: document.getElementById('s-kv').textContent})"
            )
            await b.screenshot(tmp_path / "status.png")
        return reply, status

    reply, status = asyncio.run(scenario())
    _keep(tmp_path / "chat.png")
    _keep(tmp_path / "status.png")
    assert reply["done"] == "ok" and reply["text"].strip(), reply
    assert "TTFT" in reply["meta"] and "24 tokens" in reply["meta"], reply
    assert reply["renders"] > 3, reply  # NOTE: rendered as the deltas came
    assert int(status["received"]) >= 1 and "%" in status["kv"], status


@needs_chromium
def test_with_a_key_the_page_asks_for_it_and_sends_it(keyed, tmp_path):
    async def scenario() -> dict:
        async with Browser(tmp_path / "profile") as b:
            await b.open(keyed.http + "/")
            await b.until("!document.getElementById('key-form').hidden")
            await b.js(f"document.getElementById('key').value = {KEY!r}")
            await b.js("document.getElementById('key-form').requestSubmit()")
            await b.until("state.model !== null")
            return await _chat(b, "Hi")

    reply = asyncio.run(scenario())
    assert reply["done"] == "ok" and "TTFT" in reply["meta"], reply
