"""Request bodies: msgspec Structs that forbid unknown fields, and the one way to read them.

The OpenAPI document takes its request schemas from these Structs, so the documented and
the enforced shape cannot drift apart.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal, TypeVar

import msgspec
from aiohttp import web
from msgspec import Meta

from events.codec import ID_RE, valid_id
from infra import jsonbody
from services.surfaces.api.problems import Problem

NonEmpty = Annotated[str, Meta(min_length=1, max_length=1024)]
# Checked by `check_name` (a 422 invalid-id), not by msgspec (a 400), hence only documented.
Name = Annotated[
    str,
    Meta(
        description="lowercase letters, digits and dashes; starts with a letter or digit",
        extra_json_schema={"pattern": ID_RE.pattern},
    ),
]
# A glob on repository paths or tag names (services/processes/vcs): printable, bounded.
Glob = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
TriggerPaths = Annotated[
    list[Glob],
    Meta(
        max_length=50,
        description="globs on the repository's paths whose change starts a run "
        "(`**` any depth); empty: anything under `directory`",
    ),
]
TriggerTags = Annotated[
    list[Glob], Meta(max_length=20, description="tag name globs whose push starts a run")
]
VcsRunType = Annotated[
    Literal["plan", "apply"], Meta(description="what a push to the branch starts")
]


class Body(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every request body."""


class CreateOrgBody(Body, frozen=True, kw_only=True):
    name: Name


# Ten years: a bound that keeps the arithmetic sane; "never" is saying no expiry at all.
MAX_TOKEN_LIFETIME_S = 10 * 366 * 86400


class CreateTokenBody(Body, frozen=True, kw_only=True):
    user: Annotated[str, Meta(min_length=1, max_length=200)] = "admin"
    role: Annotated[str, Meta(description="viewer, operator, approver or admin")] = "admin"
    kind: Annotated[
        str,
        Meta(
            description='"" (an organization token of `role`), "user" (a personal token: '
            "the caller's own unless `user_id` names another, which needs an org admin) or "
            '"team" (of `team`)'
        ),
    ] = ""
    user_id: Annotated[str, Meta(max_length=64)] = ""
    team: Annotated[str, Meta(max_length=63)] = ""
    level: Annotated[
        str, Meta(description="a personal token's ceiling: read, plan, write or admin")
    ] = ""
    name: Annotated[
        str, Meta(max_length=100, description="what a personal or team token is called")
    ] = ""
    # Range-checked by `orgs.token_expiry` (a 422 invalid-command), hence only documented.
    expires_in: Annotated[
        int | None,
        Meta(
            description="seconds from now until the token expires; at most one of "
            "expires_in and expires_at; neither: the token never expires",
            extra_json_schema={"minimum": 1, "maximum": MAX_TOKEN_LIFETIME_S},
        ),
    ] = None
    expires_at: (
        Annotated[
            datetime, Meta(tz=True, description="when the token expires (RFC 3339, with an offset)")
        ]
        | None
    ) = None


# Seconds; RP_HEARTBEATS keeps an entry 24 h, so a timeout must end well before that.
MAX_TIMEOUT_S = 12 * 3600
# Range-checked by `check_timeouts` (a 422 invalid-command), hence only documented.
HeartbeatTimeout = Annotated[
    int,
    Meta(
        description="seconds without a heartbeat before the run fails (executor_unavailable)",
        extra_json_schema={"minimum": 1, "maximum": MAX_TIMEOUT_S},
    ),
]
DispatchTimeout = Annotated[
    int,
    Meta(
        description="seconds a step may wait for an executor before the run fails; 0: forever",
        extra_json_schema={"minimum": 0, "maximum": MAX_TIMEOUT_S},
    ),
]


class CreateWorkspaceBody(Body, frozen=True, kw_only=True):
    name: Name
    repository: Annotated[NonEmpty, Meta(description="git URL or local path")]
    branch: NonEmpty = "main"
    directory: NonEmpty = "."
    variables: dict[str, str] = {}
    heartbeat_timeout: HeartbeatTimeout = 600
    dispatch_timeout: DispatchTimeout = 0
    managed_state: Annotated[
        bool, Meta(description="false: the configuration brings its own backend")
    ] = True
    secret_variables: Annotated[
        dict[str, str], Meta(description="stored sealed; shown by name only, never again")
    ] = {}
    folder: Annotated[
        str, Meta(description="the folder it inherits settings from (it must exist)")
    ] = ""
    vcs_connection: Annotated[
        str, Meta(description="the VCS connection whose webhooks start its runs")
    ] = ""
    trigger_paths: TriggerPaths = []
    trigger_any_change: Annotated[
        bool, Meta(description="any changed file of the repository starts a run")
    ] = False
    trigger_tags: TriggerTags = []
    vcs_run_type: VcsRunType = "apply"


class UpdateWorkspaceBody(Body, frozen=True, kw_only=True):
    """Members left out (or null) are unchanged; runs already created keep theirs."""

    variables: Annotated[
        dict[str, str] | None,
        Meta(description="replaces the plain variables; existing runs keep theirs"),
    ] = None
    repository: Annotated[
        NonEmpty | None, Meta(description="git URL or local path, checked as at creation")
    ] = None
    branch: NonEmpty | None = None
    directory: NonEmpty | None = None
    trigger_paths: TriggerPaths | None = None
    trigger_any_change: Annotated[
        bool | None, Meta(description="any changed file of the repository starts a run")
    ] = None
    trigger_tags: TriggerTags | None = None
    vcs_run_type: VcsRunType | None = None
    vcs_connection: Annotated[
        Annotated[str, Meta(max_length=63)] | None,
        Meta(description="one of the organization's VCS connections; '': none"),
    ] = None


class CreateFolderBody(Body, frozen=True, kw_only=True):
    name: Name
    parent: Annotated[
        Name | None, Meta(description="the enclosing folder (it must exist); null: none")
    ] = None


class CreateRunBody(Body, frozen=True, kw_only=True):
    type: Annotated[str, Meta(description="plan, apply, destroy or drift")]
    message: Annotated[str, Meta(max_length=4096)] = ""
    template: Annotated[
        str,
        Meta(
            max_length=63,
            description="the template to run (GET .../templates); empty: the workspace's "
            "default for the run type (setting `templates`), else the built-in",
        ),
    ] = ""


class ApproveBody(Body, frozen=True, kw_only=True):
    acknowledged: Annotated[
        list[str],
        Meta(description="addresses confirmed; with confirm_destructive, every delete/replace"),
    ] = []


class DiscardBody(Body, frozen=True, kw_only=True):
    reason: Annotated[str, Meta(max_length=4096)] = ""


class CancelBody(Body, frozen=True, kw_only=True):
    reason: Annotated[str, Meta(max_length=4096)] = ""


BODIES: tuple[type[Body], ...] = (
    CreateOrgBody,
    CreateTokenBody,
    CreateWorkspaceBody,
    UpdateWorkspaceBody,
    CreateFolderBody,
    CreateRunBody,
    ApproveBody,
    DiscardBody,
    CancelBody,
)

B = TypeVar("B", bound=Body)
T = TypeVar("T")


async def read_body(request: web.Request, kind: type[B], *, optional: bool = False) -> B:
    """Decode the JSON body into `kind`; an empty body is allowed when every field has a
    default. Too deep, a key repeated, not JSON or not a `kind`: 400 invalid-body."""
    raw = await request.read()
    if not raw.strip():
        if optional:
            return kind()
        raise Problem("invalid-body", "a JSON object body is required")
    return decode_as(raw, kind)


def decode_as(raw: bytes, kind: type[T], prefix: str = "") -> T:
    """`raw` read by infra/jsonbody.py into `kind`; anything wrong with it, from its depth
    to a field's type, is 400 invalid-body (`prefix` leads its detail)."""
    try:
        return jsonbody.decode(raw, kind)
    except (msgspec.DecodeError, jsonbody.BodyError) as e:
        raise Problem("invalid-body", f"{prefix}{e}") from e


def check_timeouts(body: CreateWorkspaceBody) -> None:
    """Both timeouts are whole seconds in range; a heartbeat timeout of 0 would never fire."""
    for field, value, low in (
        ("heartbeat_timeout", body.heartbeat_timeout, 1),
        ("dispatch_timeout", body.dispatch_timeout, 0),
    ):
        if not low <= value <= MAX_TIMEOUT_S:
            raise Problem(
                "invalid-command",
                f"{field} must be between {low} and {MAX_TIMEOUT_S} seconds, got {value}",
            )


def check_name(field: str, value: str) -> str:
    """Names become NATS subject tokens: reject anything else at the edge."""
    if not valid_id(value):
        raise Problem(
            "invalid-id",
            f"{field} {value!r} is not a valid id: use 1 to 63 lowercase letters, digits "
            "and dashes, starting with a letter or digit",
        )
    return value
