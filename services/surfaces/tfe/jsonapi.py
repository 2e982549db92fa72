"""JSON:API documents as go-tfe reads them: `data` with `type`, `id`, dashed
`attributes` and `relationships`; lists with `meta.pagination`; errors as JSON:API
error objects (go-tfe prints their `title` and `detail`).

Every TFE handler raises `TfeError` (or lets a `Problem` / domain error through, which
`errors` turns into the same shape), so the CLI never sees runplane's problem details,
which it could not read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from aiohttp import web

CONTENT_TYPE = "application/vnd.api+json"
DEFAULT_PAGE_SIZE = 20
MAX_PAGE_SIZE = 100
_encoder = msgspec.json.Encoder()

Doc = dict[str, Any]


class TfeError(Exception):
    """An error answered as a JSON:API error document."""

    retryable = False

    def __init__(self, status: int, title: str, detail: str = "", **headers: str) -> None:
        super().__init__(detail or title)
        self.status = status
        self.title = title
        self.detail = detail
        self.headers = headers


def not_found(what: str) -> TfeError:
    return TfeError(404, "not found", what)


def response(
    body: Doc | None, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    if body is None:
        return web.Response(status=status, headers=dict(headers or {}))
    return web.Response(
        status=status,
        body=_encoder.encode(body),
        content_type=CONTENT_TYPE,
        headers=dict(headers or {}),
    )


def error_response(error: TfeError) -> web.Response:
    body = {"errors": [{"status": str(error.status), "title": error.title, "detail": error.detail}]}
    return response(body, status=error.status, headers=error.headers)


def resource(
    kind: str,
    object_id: str,
    attributes: Mapping[str, Any],
    relationships: Mapping[str, Any] | None = None,
    links: Mapping[str, str] | None = None,
) -> Doc:
    """One resource object. `relationships`: name -> (type, id), None (no related
    object) or a ready relationship object."""
    out: Doc = {"id": object_id, "type": kind, "attributes": dict(attributes)}
    if relationships:
        out["relationships"] = {name: _relation(v) for name, v in relationships.items()}
    if links:
        out["links"] = dict(links)
    return out


def _relation(value: Any) -> Doc:
    if value is None:
        return {"data": None}
    if isinstance(value, tuple):
        kind, object_id = value
        return {"data": {"type": kind, "id": object_id}}
    return dict(value)


def document(data: Doc) -> Doc:
    return {"data": data}


class Page(msgspec.Struct, frozen=True):
    number: int
    size: int


def page_of(request: web.Request) -> Page:
    """`page[number]` and `page[size]`, as go-tfe's ListOptions sends them."""
    number = _positive(request, "page[number]", 1)
    size = min(_positive(request, "page[size]", DEFAULT_PAGE_SIZE), MAX_PAGE_SIZE)
    return Page(number, size)


def _positive(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    # ASCII digits only: "²" is a digit to str.isdigit and a ValueError to int
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9 or int(raw) < 1:
        raise TfeError(422, "invalid query", f"{name} must be a positive integer, got {raw!r}")
    return int(raw)


def listing(items: Sequence[Doc], page: Page) -> Doc:
    """A page of `items` with `meta.pagination` (go-tfe pages until current >= total)."""
    total = len(items)
    pages = max(1, math.ceil(total / page.size))
    start = (page.number - 1) * page.size
    return {
        "data": list(items[start : start + page.size]),
        "links": {},
        "meta": {
            "pagination": {
                "current-page": page.number,
                "page-size": page.size,
                "prev-page": page.number - 1 if page.number > 1 else None,
                "next-page": page.number + 1 if page.number < pages else None,
                "total-pages": pages,
                "total-count": total,
            }
        },
    }


def attributes(body: Any, kind: str) -> Doc:
    """The `data.attributes` of a request document of `kind` (an empty one if absent)."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), dict):
        raise TfeError(422, "invalid body", "a JSON:API document with data is required")
    data = body["data"]
    given = data.get("type")
    if given is not None and given != kind:
        raise TfeError(409, "invalid type", f"data.type must be {kind!r}, got {given!r}")
    attrs = data.get("attributes") or {}
    if not isinstance(attrs, dict):
        raise TfeError(422, "invalid body", "data.attributes must be an object")
    return attrs
