"""`GET /api/v1/whoami`: who the caller's token is. A client (`runplane login`) checks a
token with it before storing it and learns the organization to act in, which an
organization's token has no other way to find (another organization's paths answer 404).
"""

from __future__ import annotations

from aiohttp import web

from events.org import ROLES
from services.surfaces.api.auth import PRINCIPAL
from services.surfaces.api.common import json_response
from services.surfaces.api.schemas import STR, Doc, operation

PATH = "/api/v1/whoami"
_OR_NULL: Doc = {"anyOf": [STR, {"type": "null"}]}


async def whoami(request: web.Request) -> web.Response:
    """The caller: user, role, organization (null for the admin token: all of them)."""
    who = request[PRINCIPAL]
    return json_response(
        {"user": who.user, "role": who.role, "org": who.org, "token_id": who.token_id or None}
    )


ROUTES = [web.get(PATH, whoami, allow_head=False)]

SCHEMAS: dict[str, Doc] = {
    "Whoami": {
        "type": "object",
        "required": ["user", "role", "org", "token_id"],
        "properties": {
            "user": STR,
            "role": {"enum": list(ROLES)},
            "org": {**_OR_NULL, "description": "null for the admin token: every organization"},
            "token_id": {**_OR_NULL, "description": "null for the admin token"},
        },
    }
}

PATHS: dict[str, Doc] = {
    PATH: {
        "get": operation(
            "whoami",
            "Who the token is: its user, role and organization",
            (200, "Whoami"),
            errors=(401, 503),
        )
    }
}
