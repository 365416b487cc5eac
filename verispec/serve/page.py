"""The chat page at GET / (verispec/serve/static/): files shipped in the package, no build step.

The page talks to the same server through /v1/chat/completions, so it is served wherever the
API is and nowhere else. The served model's name and the drafter are written into the page.
"""

from __future__ import annotations

import json
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

_STATIC = resources.files(__package__) / "static"
_ASSETS = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}
# Everything the page loads and calls is this server's own.
_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:", "Cache-Control": "no-cache"}


def page_html(model_name: str, drafter: str) -> str:
    """index.html with the page's settings filled in."""
    settings = json.dumps({"model": model_name, "drafter": drafter})
    # "<" escaped: a name holding "</script>" cannot end the script element early.
    settings = settings.replace("<", "\\u003c")
    return (_STATIC / "index.html").read_text(encoding="utf-8").replace("{{CONFIG}}", settings)


def install_web_ui(app: FastAPI, model_name: str, drafter: str) -> None:
    html = page_html(model_name, drafter)
    assets = {name: (_STATIC / name).read_bytes() for name in _ASSETS}

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(html, headers=_HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets:
            return Response(status_code=404)
        return Response(assets[name], media_type=_ASSETS[name], headers=_HEADERS)
