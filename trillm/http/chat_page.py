"""The chat page at `/`: static files shipped in the package (trillm/http/static), no build step;
the page talks to the server's own /v1/models and /v1/chat/completions, with the API key where the
server has one (the page asks for it once). `--no-ui` leaves these routes out.

The files hold no data, so they are served without the key (trillm.http.auth.OPEN_PATHS), and
only the files the package ships: a name is looked up in a fixed set, never joined to a path.
"""
from __future__ import annotations

from importlib import resources

from quart import Blueprint, Response

from trillm.http.errors import APIError

blueprint = Blueprint("chat_page", __name__)
STATIC = resources.files("trillm.http") / "static"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}
FILES = ("app.js", "style.css", "vendor/marked.umd.js", "vendor/purify.min.js")
UI_PREFIX = "/ui/"


def _file(name: str) -> Response:
    data = (STATIC / name).read_bytes()
    media_type = MEDIA_TYPES[name[name.rindex("."):]]
    # the page's own scripts only: no inline script, no other origin (an answer's markdown is
    # sanitized before it is shown; this is the second wall)
    headers = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'",
               "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
    return Response(data, content_type=media_type, headers=headers)


@blueprint.get("/")
async def page():
    return _file("index.html")


@blueprint.get(UI_PREFIX + "<path:name>")
async def asset(name: str):
    if name not in FILES:
        raise APIError(404, "The page has no such file.")
    return _file(name)
