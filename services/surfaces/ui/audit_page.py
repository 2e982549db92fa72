"""`/orgs/{org}/audit`: the organization's audit log, newest page by page, for those who
may read it (events/access.py `audit.read`: admins, the right `read-audit`). The same
records, filters and cursor as `GET /api/v1/orgs/{org}/audit`
(services/surfaces/api/audit.py), shown as a table; nothing is written here."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.surfaces.api.audit import query, read_page
from services.surfaces.ui.web import Visit, base, page, render


@page("audit.read")
async def audit_page(visit: Visit) -> web.StreamResponse:
    """One page of records (`?action=`, `?actor=`, `?outcome=`, `?cursor=` as the API's)."""
    q = query(visit.request.query)
    items, nxt = await read_page(visit.api.audit, visit.org, q)
    kept = {k: v for k, v in visit.request.query.items() if k != "cursor"}
    context: dict[str, Any] = await base(visit, items=items, next=nxt, filters=kept)
    return render(visit.request, "audit.html", context)
