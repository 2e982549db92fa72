"""`GET /api/v1/whoami`: who the caller's token is. A client (`runplane login`) checks a
token with it before storing it and learns the organization to act in, which an
organization's token has no other way to find (another organization's paths answer 404).
It names the user (a personal token's: id, email, name), their teams and their access
(events/access.py `describe`: levels on the organization, folders and workspaces, rights).
"""

from __future__ import annotations

from aiohttp import web

from events import access
from events.org import ROLES
from services.surfaces.api.auth import PRINCIPAL
from services.surfaces.api.common import json_response
from services.surfaces.api.schemas import STR, Doc, operation

PATH = "/api/v1/whoami"
_OR_NULL: Doc = {"anyOf": [STR, {"type": "null"}]}


async def whoami(request: web.Request) -> web.Response:
    """The caller: user, role, organization (null for the admin token: all of them)."""
    who = request[PRINCIPAL]
    mine = who.access
    return json_response(
        {
            "user": who.user,
            "role": who.role,
            "org": who.org,
            "token_id": who.token_id or None,
            "user_id": mine.user_id or None,
            "kind": "admin" if who.superuser else _kind(mine),
            "teams": list(mine.teams),
            "access": access.describe(mine),
        }
    )


def _kind(mine: access.Access) -> str:
    if mine.user_id:
        return "user"
    return "team" if mine.teams else "org"


ROUTES = [web.get(PATH, whoami, allow_head=False)]

SCHEMAS: dict[str, Doc] = {
    "Whoami": {
        "type": "object",
        "required": ["user", "role", "org", "token_id", "user_id", "kind", "teams", "access"],
        "properties": {
            "user": STR,
            "role": {"enum": [*ROLES, ""], "description": "an organization token's role"},
            "user_id": {**_OR_NULL, "description": "a personal token's user"},
            "kind": {"enum": ["admin", "org", "user", "team"]},
            "teams": {"type": "array", "items": STR},
            "access": {
                "type": "object",
                "description": "levels on the organization, folders (inherited ones "
                "included) and workspaces granted; organization rights",
                "properties": {
                    "organization": STR,
                    "folders": {"type": "object", "additionalProperties": STR},
                    "workspaces": {"type": "object", "additionalProperties": STR},
                    "rights": {"type": "array", "items": STR},
                },
            },
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
