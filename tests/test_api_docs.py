"""The API reference: the OpenAPI document and its Swagger UI page need no token, and the
page loads only files runplane serves itself (no CDN). Real aiohttp server, real NATS."""

from __future__ import annotations

import re

from services.surfaces.api import docs
from tests.api_support import Http, http_fixture  # noqa: F401  # registers the `http` fixture


async def test_the_openapi_document_is_readable_without_a_token(http: Http) -> None:
    a = await http.get("/api/v1/openapi.json", token=None)
    assert a.status == 200, a.body
    assert a.body["paths"]["/api/v1/openapi.json"]["get"]["security"] == []
    assert a.body["paths"]["/api/docs/"]["get"]["security"] == []
    # The endpoints it describes still need one.
    (await http.get("/api/v1/orgs/demo/runs", token=None)).problem("unauthorized", 401)


async def test_the_reference_page_loads_only_runplane_s_own_files(http: Http) -> None:
    """Every script and stylesheet of the page is served here, without a token; the page
    points Swagger UI at the document; a name off the list is 404, a path never read."""
    client = http.client
    async with client.get("/api/docs", allow_redirects=False) as resp:
        assert (resp.status, resp.headers["Location"]) == (302, "/api/docs/")
    async with client.get("/api/docs/") as resp:
        assert resp.status == 200 and resp.content_type == "text/html"
        html = await resp.text()
    assert 'url: "/api/v1/openapi.json"' in html
    assert not re.search(r"https?:|//", html)  # no CDN: nothing from another host
    loaded = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert len(loaded) >= 4
    for url in loaded:
        assert url.startswith("/api/docs/"), url
        async with client.get(url) as resp:
            assert resp.status == 200, url
            body = await resp.read()
        assert len(body) > 100, url
    async with client.get("/api/docs/swagger-ui-bundle.js") as resp:
        assert resp.content_type == "text/javascript"
        assert "SwaggerUIBundle" in await resp.text()
    for name in ("swagger-editor.js", "LICENSE", "..%2F..%2Fcore.py", "%2e%2e%2fetc%2fpasswd"):
        a = await http.get(f"/api/docs/{name}", token=None)
        a.problem("not-found", 404)


def test_the_vendored_swagger_ui_renders_openapi_3_1() -> None:
    """Swagger UI before 5 refuses `openapi: 3.1.0`; the document is 3.1."""
    root = docs.static_dir()
    assert root is not None, "swagger-ui-py is a dependency"
    assert "oas31" in (root / "swagger-ui-bundle.js").read_text()
    assert docs.ASSETS <= {p.name for p in root.iterdir()}
