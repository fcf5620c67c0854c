"""The page for people at `/`: a chat and a status view (tokenizer_proc/web/), plain files shipped
in the package and served as they are; no CDN, no build step.

The files are public (they hold no data and no key: with `--api-key` the page asks for the key
and sends it on each call, like any client); everything they show comes through the engine's
own endpoints, under the same key.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

WEB = Path(__file__).parent / "web"
FILES = {
    "index.html": "text/html",
    "app.js": "text/javascript",
    "style.css": "text/css",
}
# NOTE: nothing but this origin's own files and calls; no inline script
CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'"


def is_public(path: str) -> bool:
    return path == "/" or path.startswith("/ui/")


async def index(request: web.Request) -> web.Response:
    return _file("index.html")


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in FILES:  # NOTE: a fixed list: no path of the client's reaches the disk
        raise web.HTTPNotFound()
    return _file(name)


def _file(name: str) -> web.Response:
    body = (WEB / name).read_bytes()
    headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache"}
    return web.Response(body=body, content_type=FILES[name], charset="utf-8", headers=headers)
