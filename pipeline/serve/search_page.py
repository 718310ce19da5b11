"""The search page of ``newsvec serve`` (``GET /``): a query box and filters over ``POST
/v1/search``, the hits grouped by story with their copies, and the model and output of ``GET
/info`` in its footer (docs/serving.md, "The search page").

Its HTML, script and style are the package's own files (``pipeline/serve/static/``, package data:
in the wheel and the worker image), read once when the app is made; nothing comes from the
internet. Every answer carries a Content-Security-Policy that runs the page's own script file
alone (no inline script, no remote script, style, font or image) and lets it call only its own
origin; the script writes what an article holds as text, never as markup.

The page's files hold no data, so they need no API key (``auth.OPEN_PATHS`` holds ``PATHS``):
with a key configured the page still loads, and asks for the key, which it keeps in the browser
tab's ``sessionStorage`` and sends to ``/v1/search`` and ``/info`` as ``Authorization: Bearer``.
"""
from __future__ import annotations

from importlib import resources
from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

# path -> (file of static/, its media type)
FILES: dict[str, tuple[str, str]] = {
    "/": ("search.html", "text/html; charset=utf-8"),
    "/static/search.js": ("search.js", "text/javascript; charset=utf-8"),
    "/static/search.css": ("search.css", "text/css; charset=utf-8"),
}
PATHS = frozenset(FILES)
"""The page's routes: served without the API key (``auth.OPEN_PATHS``)."""

CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'none'",  # nothing else: no font, image, frame or object, from anywhere
    "script-src 'self'",  # static/search.js alone: no inline script, no eval
    "style-src 'self'",
    "connect-src 'self'",  # /v1/search and /info
    "base-uri 'none'",
    "form-action 'self'",
    "frame-ancestors 'none'",
))
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",  # revalidated: a new release's page is never mixed with old script
}


def read(name: str) -> bytes:
    """A file of ``pipeline/serve/static/``, as the installed package holds it."""
    return resources.files("pipeline.serve").joinpath("static", name).read_bytes()


def routes() -> dict[str, Callable[[Request], Awaitable[Response]]]:
    """``PATHS`` -> the handler answering that file (each read here, once)."""

    def answer(body: bytes, media_type: str) -> Callable[[Request], Awaitable[Response]]:
        async def page(request: Request) -> Response:
            return Response(body, media_type=media_type, headers=HEADERS)

        return page

    return {path: answer(read(name), media_type) for path, (name, media_type) in FILES.items()}
