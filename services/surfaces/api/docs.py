"""The API reference in a browser: Swagger UI at `/api/docs/`, over `/api/v1/openapi.json`.

Both are public: the document describes endpoints, never data, and a reference a browser
cannot open without first forging an Authorization header is one nobody reads. Every
endpoint it lists still needs a token (its "Authorize" button takes one).

Swagger UI is served from the files the `swagger-ui-py` wheel vendors (Swagger UI 5,
which renders OpenAPI 3.1; `swagger-ui-bundle` stops at 4.15, which refuses
`openapi: 3.1.0`), never from a CDN: a runplane without internet shows its reference too.
The wheel's Python side (templates for other frameworks) is never imported; its package
directory is found by `find_spec`, which does not run it.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

from aiohttp import web

from services.surfaces.api.problems import Problem

DOCS = "/api/docs"
OPENAPI_URL = "/api/v1/openapi.json"
# Only what the page loads: the wheel also carries Swagger Editor and source maps.
ASSETS = frozenset(
    {
        "swagger-ui.css",
        "index.css",
        "swagger-ui-bundle.js",
        "swagger-ui-standalone-preset.js",
        "favicon-32x32.png",
        "favicon-16x16.png",
    }
)
_TYPES = {".css": "text/css", ".js": "text/javascript", ".png": "image/png"}

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="UTF-8">
  <title>runplane API reference</title>
  <link rel="stylesheet" href="{docs}/swagger-ui.css">
  <link rel="stylesheet" href="{docs}/index.css">
  <link rel="icon" type="image/png" href="{docs}/favicon-32x32.png" sizes="32x32">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="{docs}/swagger-ui-bundle.js"></script>
  <script src="{docs}/swagger-ui-standalone-preset.js"></script>
  <script>
    window.ui = SwaggerUIBundle({{
      url: "{openapi}",
      dom_id: "#swagger-ui",
      deepLinking: true,
      presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset],
      layout: "StandaloneLayout",
    }});
  </script>
</body>
</html>
"""


@cache
def static_dir() -> Path | None:
    """The wheel's `static/` directory, or None where it is not installed."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "static"
    return path if (path / "swagger-ui-bundle.js").is_file() else None


async def page(request: web.Request) -> web.Response:
    """The reference's HTML page; 503 where Swagger UI is not installed."""
    if static_dir() is None:
        raise Problem("unavailable", "the API reference needs the swagger-ui-py package")
    html = _PAGE.format(docs=DOCS, openapi=OPENAPI_URL)
    return web.Response(text=html, content_type="text/html", headers=_CACHE_PAGE)


async def redirect(request: web.Request) -> web.Response:
    raise web.HTTPFound(DOCS + "/")


async def asset(request: web.Request) -> web.Response:
    """One of the page's files, by a name from a fixed list (never a path from the URL)."""
    name = request.match_info["asset"]
    root = static_dir()
    if name not in ASSETS or root is None:
        raise Problem("not-found", f"no such file {name}")
    content_type = _TYPES[Path(name).suffix]
    return web.Response(body=_read(root / name), content_type=content_type, headers=_CACHE_ASSET)


@cache
def _read(path: Path) -> bytes:
    return path.read_bytes()  # six files, 2 MB in all: read once per process


_CACHE_PAGE = {"Cache-Control": "no-cache"}
_CACHE_ASSET = {"Cache-Control": "public, max-age=86400"}

# Routes that need no token (services/surfaces/api/middleware.py).
PUBLIC = frozenset({OPENAPI_URL, DOCS, DOCS + "/", DOCS + "/{asset}"})

ROUTES = [
    web.get(DOCS, redirect, allow_head=False),
    web.get(DOCS + "/", page, allow_head=False),
    web.get(DOCS + "/{asset}", asset, allow_head=False),
]
