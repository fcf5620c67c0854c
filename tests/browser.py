"""A real headless Chromium for tests, driven over the DevTools protocol (aiohttp's websocket):
open a page, run JavaScript in it, wait for a condition, take a screenshot."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

NAMES = ("chromium", "chromium-browser", "google-chrome")


def find() -> str | None:
    return next((p for p in map(shutil.which, NAMES) if p), None)


class Browser:
    """One headless Chromium with one page; use `async with Browser(profile) as b`."""

    def __init__(self, profile: Path, width: int = 1100, height: int = 900) -> None:
        exe = find()
        assert exe is not None, "no Chromium on this machine"
        cmd = [exe, "--headless=new", "--remote-debugging-port=0", f"--user-data-dir={profile}"]
        cmd += ["--no-first-run", "--disable-gpu", f"--window-size={width},{height}"]
        # NOTE: root (CI containers) cannot use Chromium's sandbox
        cmd += ["--no-sandbox"] if os.geteuid() == 0 else []
        self.proc = subprocess.Popen(
            [*cmd, "about:blank"],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Browser:
        port = self._devtools_port()
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in await r.json() if t["type"] == "page"]
        self._ws = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._ws.close()
        await self._session.close()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def _devtools_port(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if found:
                return int(found.group(1))
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError("Chromium did not start its DevTools endpoint")

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        await self._ws.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            msg = json.loads((await self._ws.receive(timeout=60)).data)
            if msg.get("id") == ident:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    async def open(self, url: str) -> None:
        await self.call("Page.enable")
        await self.call("Page.navigate", url=url)
        await self.until("document.readyState === 'complete'")

    async def js(self, expression: str) -> Any:
        """The value of `expression` in the page (awaited when it is a promise)."""
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll `expression` until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"never true in the page: {expression}")
            await asyncio.sleep(0.1)

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))
