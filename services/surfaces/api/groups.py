"""Groups of users in an organization, named in the `approvers` setting as `group:<name>`.

Users are the `user` of the organization's tokens. Groups live in the organization
aggregate (`org.group_set`) and are read from it, so a change shows at once. Writes are
an admin's.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from aiohttp import web

from events import groups as gr
from events.org import OrgState
from services.surfaces.api.bodies import Body, Name, check_name, read_body
from services.surfaces.api.common import (
    Row,
    command_answer,
    items,
    org_state,
    path_id,
    scope,
)
from services.surfaces.api.paths import ORG
from services.surfaces.api.schemas import REF, STR, Doc, list_of, operation, path_param

PREFIX = "/api/v1/orgs"
Members = Annotated[
    list[Annotated[str, msgspec.Meta(min_length=1, max_length=gr.MAX_USER)]],
    msgspec.Meta(max_length=gr.MAX_MEMBERS, description="user names (each token's `user`)"),
]


class CreateGroupBody(Body, frozen=True, kw_only=True):
    name: Name
    members: Members = []


class GroupMembersBody(Body, frozen=True, kw_only=True):
    members: Members


def _row(state: OrgState, name: str) -> Row:
    return {"name": name, "members": list(state.groups[name])}


async def create_group(request: web.Request) -> web.Response:
    """POST .../groups {"name", "members"}: 409 if the group exists."""
    api, org, who = await scope(request, "org.access")
    body = await read_body(request, CreateGroupBody)
    name = check_name("name", body.name)
    await org_state(api, org)
    cmd = gr.CreateGroup(actor=who.user, name=name, members=list(body.members))
    result = await api.app.org_command(org, cmd)
    where = f"{PREFIX}/{org}/groups/{name}"
    return command_answer(_row(result.state, name), result.seq, status=201, location=where)


async def set_group_members(request: web.Request) -> web.Response:
    """PUT .../groups/{group}/members {"members"}: replaces every member."""
    api, org, who = await scope(request, "org.access")
    name = path_id(request, "group")
    body = await read_body(request, GroupMembersBody)
    await org_state(api, org)
    cmd = gr.SetGroupMembers(actor=who.user, name=name, members=list(body.members))
    result = await api.app.org_command(org, cmd)
    return command_answer(_row(result.state, name), result.seq)


async def list_groups(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "org.read")
    state = await org_state(api, org)
    return items([_row(state, name) for name in state.groups])


# ---------------------------------------------------------------- OpenAPI

_GROUP: Doc = {
    "type": "object",
    "required": ["name", "members"],
    "properties": {"name": STR, "members": {"type": "array", "items": STR}},
}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((CreateGroupBody, GroupMembersBody), ref_template=REF)[1],
    "Group": _GROUP,
    "GroupList": list_of("Group"),
}
PARAMETERS: dict[str, Doc] = {"group": path_param("group", "group name")}


def _op(
    op_id: str, summary: str, answer: tuple[int, str], params: tuple[str, ...], body: str = ""
) -> Doc:
    errors = (400, 403, 404, 409, 422) if body else (404, 422)
    return operation(op_id, summary, answer, params=params, body=body, errors=errors)


PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/groups": {
        "get": _op("listGroups", "The organization's groups", (200, "GroupList"), ("org",)),
        "post": _op(
            "createGroup",
            "Create a group of users (409 if it exists)",
            (201, "Group"),
            ("org",),
            "CreateGroupBody",
        ),
    },
    "/api/v1/orgs/{org}/groups/{group}/members": {
        "put": _op(
            "setGroupMembers",
            "Replace the group's members",
            (200, "Group"),
            ("org", "group"),
            "GroupMembersBody",
        ),
    },
}


ROUTES = [
    web.get(ORG + "/groups", list_groups, allow_head=False),
    web.post(ORG + "/groups", create_group),
    web.put(ORG + "/groups/{group}/members", set_group_members),
]
