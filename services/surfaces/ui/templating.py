"""The helpers every template may call: asset paths, ages, values, page links."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import jinja2
import msgspec


def static(name: str) -> str:
    return f"/static/{name}"


def age(iso: str | None) -> str:
    """How long ago, coarsely (s, min, h, d)."""
    if not iso:
        return ""
    try:
        then = datetime.fromisoformat(iso)
    except ValueError:
        return iso
    seconds = max(0, int((datetime.now(UTC) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


def show(value: Any) -> str:
    """An attribute's value as text: strings as they are (so "(sensitive)" reads as
    such), anything else as JSON."""
    if isinstance(value, str):
        return value
    return msgspec.json.encode(value).decode()


@jinja2.pass_context
def query(context: Any, **changes: str) -> str:
    """The current page's query string with `changes` (for the next page's link)."""
    visit = context.get("visit")
    current = dict(visit.request.query) if visit is not None else {}
    return urlencode({**current, **changes})


GLOBALS = {"static": static, "age": age, "show": show, "query": query}
