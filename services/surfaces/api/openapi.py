"""The OpenAPI 3.1 document of the HTTP API, as data.

Answer schemas are written out in `schemas.py`; request body schemas come from the very
msgspec Structs that decode the bodies (so they say `additionalProperties: false` exactly
where the server refuses unknown fields). A test checks that every route of the router is
documented and every documented operation is routed.
"""

from __future__ import annotations

import msgspec

from events.run import Status
from services.surfaces.api import (
    audit,
    changes,
    chat,
    grants,
    groups,
    idempotency,
    locks,
    logs,
    people,
    readiness,
    rollback,
    runs,
    secrets,
    state,
    whoami,
)
from services.surfaces.api import notifications as notifications_api
from services.surfaces.api import policies as policies_api
from services.surfaces.api import run_triggers as run_triggers_api
from services.surfaces.api import schedules as schedules_api
from services.surfaces.api import settings as settings_api
from services.surfaces.api import sso as sso_api
from services.surfaces.api import stack_runs as stack_runs_api
from services.surfaces.api import stacks as stacks_api
from services.surfaces.api import templates as templates_api
from services.surfaces.api import vcs as vcs_api
from services.surfaces.api.bodies import BODIES
from services.surfaces.api.problems import CONTENT_TYPE
from services.surfaces.api.schemas import (
    ID,
    INT,
    REF,
    SCHEMAS,
    SEQ_DOC,
    STR,
    Doc,
    operation,
    problems,
    ref,
)


def _path(name: str, what: str) -> Doc:
    return {"name": name, "in": "path", "required": True, "description": what, "schema": ID}


_ONE_STATUS = "|".join(s.value for s in Status)
_ITEM = rf"\s*({_ONE_STATUS})?\s*"
_STATUS_LIST: Doc = {**STR, "pattern": f"^{_ITEM}(,{_ITEM})*$"}


def _query(name: str, what: str, schema: Doc) -> Doc:
    return {"name": name, "in": "query", "required": False, "description": what, "schema": schema}


PARAMETERS: dict[str, Doc] = {
    "org": _path("org", "organization name"),
    "ws": _path("ws", "workspace name"),
    "run": _path("run", "run id"),
    "id": {**_path("id", "a listed state version's `id` (sv-...)"), "schema": STR},
    "source": _path("source", "a workspace this one follows (run triggers)"),
    "token": _path("token", "token id (the token_id of its creation, not the token)"),
    "min_seq": {
        "name": "RP-Min-Seq",
        "in": "header",
        "required": False,
        "description": "answer only from a projection at or past this stream sequence "
        "(the RP-Seq of the caller's last write); 503 stale-read if it cannot within ~5 s",
        "schema": {**INT, "minimum": 0},
    },
    "status": _query("status", "comma-separated run statuses", _STATUS_LIST),
    "workspace": _query("workspace", "only runs of this workspace", ID),
    "limit": _query("limit", "at most this many runs", {**INT, "minimum": 1, "maximum": 1000}),
    "before": _query("before", "only runs older than this run (the `next` of a page)", ID),
    "asset": {
        "name": "asset",
        "in": "path",
        "required": True,
        "description": "a file of the page (swagger-ui.css, swagger-ui-bundle.js, ...)",
        "schema": STR,
    },
    "fields": _query(
        "fields",
        "`full` (the default): each run as its GET shows it; `summary`: only the fields "
        "of RunSummary, for long lists (no snapshot, steps, policies, owner or deadline)",
        {"enum": ["full", "summary"], "default": "full"},
    ),
    **logs.PARAMETERS,
    **audit.PARAMETERS,
    **secrets.PARAMETERS,
    **settings_api.PARAMETERS,
    **groups.PARAMETERS,
    **people.PARAMETERS,
    **templates_api.PARAMETERS,
    **notifications_api.PARAMETERS,
    **schedules_api.PARAMETERS,
    **stacks_api.PARAMETERS,
    **stack_runs_api.PARAMETERS,
    **policies_api.PARAMETERS,
    **chat.PARAMETERS,
    **vcs_api.PARAMETERS,
    "idempotency_key": idempotency.PARAMETER,
}

_ERRORS = {
    "400": "invalid-body, invalid-query, invalid-header or as-of-unsupported",
    "401": "unauthorized (no token, an unknown or a revoked one) or token-expired",
    "403": "forbidden: the token's role lacks the permission in its organization",
    "404": "not-found: absent, or not visible to the token's organization",
    "408": "request-timeout: the body came slower than the route allows",
    "409": "conflict (with current_status), already-exists, workspace-deleted, "
    "idempotency-in-progress, workspace-not-locked, run-active or state-changed",
    "410": "state-version-pruned: its content is no longer stored; retention removed the "
    "run's stored logs (log-removed) or whole record, its events kept (run-removed)",
    "413": "body-too-large",
    "422": "invalid-id, invalid-command, invalid-policy, idempotency-key-reused or invalid-as-of",
    "503": "unavailable, stale-read or as-of-too-costly",
}


def _problem(what: str) -> Doc:
    return {"description": what, "content": {CONTENT_TYPE: {"schema": ref("Problem")}}}


RESPONSES: dict[str, Doc] = {code: _problem(what) for code, what in _ERRORS.items()}
_READ = ("min_seq",)
_LIST = ("status", "limit", "before", "fields", "min_seq", "as_of")
_RUN = ("org", "run")


def _run_command(op_id: str, summary: str, body: str, errors: tuple[int, ...]) -> Doc:
    return operation(
        op_id,
        summary,
        (200, "Run"),
        params=_RUN,
        body=body,
        body_required=False,
        errors=(400, 403, 404, 409, 422, *errors),
    )


def _html(op_id: str, summary: str, media: str, *codes: int) -> Doc:
    """A public page of the API reference (services/surfaces/api/docs.py)."""
    answer = {"description": summary, "content": {media: {}}}
    return {
        "get": {
            "operationId": op_id,
            "summary": summary,
            "security": [],
            "responses": {
                "200": answer,
                **{str(c): {"$ref": f"#/components/responses/{c}"} for c in codes},
            },
        }
    }


_DOCS: dict[str, Doc] = {
    "/api/docs": {
        "get": {
            "operationId": "apiReferenceRedirect",
            "summary": "Redirects to /api/docs/",
            "security": [],
            "responses": {"302": {"description": "to /api/docs/"}},
        }
    },
    "/api/docs/": _html(
        "apiReference", "This document in Swagger UI (no token needed)", "text/html", 503
    ),
    "/api/docs/{asset}": {
        "get": {
            **_html("apiReferenceAsset", "A file of the Swagger UI page", "*/*", 404)["get"],
            "parameters": [{"$ref": "#/components/parameters/asset"}],
        }
    },
}

WS_PARAM: Doc = {"$ref": "#/components/parameters/ws"}
PATHS: dict[str, Doc] = {
    **readiness.PATHS,
    "/api/v1/openapi.json": {
        "get": {
            "operationId": "openapi",
            "summary": "This document (no token needed)",
            "security": [],
            "responses": {
                "200": {"description": "OpenAPI 3.1", "content": {"application/json": {}}},
            },
        }
    },
    "/metrics": {
        "get": {
            "operationId": "metrics",
            "summary": "The deployment's figures for Prometheus (admin or metrics token)",
            "responses": {
                "200": {
                    "description": "Prometheus text format 0.0.4",
                    "content": {"text/plain": {}},
                },
                "401": {"$ref": "#/components/responses/401"},
                "403": _problem("forbidden"),
            },
        }
    },
    **_DOCS,
    **whoami.PATHS,
    **audit.PATHS,
    "/api/v1/orgs": {
        "post": operation(
            "createOrg",
            "Create an organization (admin token only)",
            (201, "Org"),
            body="CreateOrgBody",
            errors=(400, 403, 409, 422),
        )
    },
    "/api/v1/orgs/{org}": {
        "get": operation(
            "getOrg",
            "An organization",
            (200, "Org"),
            params=("org", *_READ),
            errors=(400, 404, 422, 503),
        )
    },
    "/api/v1/orgs/{org}/tokens": {
        "get": operation(
            "listTokens",
            "The organization's tokens not revoked (admin): never a secret nor its hash",
            (200, "TokenInfoList"),
            params=("org", *_READ),
            errors=(400, 403, 404, 422),
        ),
        "post": operation(
            "createToken",
            "Issue a token scoped to the organization, optionally expiring (expires_in or "
            "expires_at); an expired token is answered 401 token-expired",
            (201, "Token"),
            params=("org",),
            body="CreateTokenBody",
            body_required=False,
            errors=(400, 403, 404, 422),
        ),
    },
    "/api/v1/orgs/{org}/tokens/{token}": {
        "delete": {
            "operationId": "revokeToken",
            "summary": "Revoke a token (admin): every replica answers its next request 401; "
            "revoking it again changes nothing; the admin token is not an org token (404)",
            "parameters": [{"$ref": f"#/components/parameters/{p}"} for p in ("org", "token")],
            "responses": {
                "204": {"description": "revoked", "headers": {"RP-Seq": SEQ_DOC}},
                **problems(403, 404, 422),
            },
        }
    },
    "/api/v1/orgs/{org}/workspaces": {
        "get": operation(
            "listWorkspaces",
            "The organization's workspaces",
            (200, "WorkspaceList"),
            params=("org", *_READ),
            errors=(400, 404, 422, 503),
        ),
        "post": operation(
            "createWorkspace",
            "Create a workspace",
            (201, "Workspace"),
            params=("org",),
            body="CreateWorkspaceBody",
            errors=(400, 403, 404, 409, 422),
        ),
    },
    "/api/v1/orgs/{org}/workspaces/{ws}": {
        "get": operation(
            "getWorkspace",
            "A workspace",
            (200, "Workspace"),
            params=("org", "ws", *_READ, "as_of"),
            errors=(400, 404, 422, 503),
        ),
        "patch": operation(
            "updateWorkspace",
            "Change the workspace's plain variables and configuration (repository, branch, "
            "directory, triggers, VCS connection); runs already created keep theirs",
            (200, "Workspace"),
            params=("org", "ws"),
            body="UpdateWorkspaceBody",
            errors=(400, 403, 404, 409, 422),
        ),
        "delete": {
            "operationId": "deleteWorkspace",
            "summary": "Delete the workspace (no run may be open): it leaves lists and starts "
            "no run; its history stays readable, its name taken until a purge",
            "parameters": [{"$ref": "#/components/parameters/org"}, WS_PARAM],
            "responses": {"204": {"description": "deleted"}, **problems(403, 404, 409, 422)},
        },
    },
    "/api/v1/orgs/{org}/workspaces/{ws}/purge": {
        "post": {
            "operationId": "purgeWorkspace",
            "summary": "Free a deleted workspace's name: removes its secret variables, state "
            "head and lock and notification configurations (its events and audit stay)",
            "parameters": [{"$ref": "#/components/parameters/org"}, WS_PARAM],
            "responses": {"204": {"description": "purged"}, **problems(403, 404, 409, 422)},
        },
    },
    "/api/v1/orgs/{org}/workspaces/{ws}/runs": {
        "get": operation(
            "listWorkspaceRuns",
            "The workspace's runs, newest first",
            (200, "RunList"),
            params=("org", "ws", *_LIST),
            errors=(400, 404, 422, 503),
        ),
        "post": operation(
            "createRun",
            "Queue a run on the workspace",
            (201, "Run"),
            params=("org", "ws"),
            body="CreateRunBody",
            errors=(400, 403, 404, 422),
        ),
    },
    "/api/v1/orgs/{org}/runs": {
        "get": operation(
            "listRuns",
            "The organization's runs, newest first",
            (200, "RunList"),
            params=("org", "workspace", *_LIST),
            errors=(400, 404, 422, 503),
        )
    },
    "/api/v1/orgs/{org}/runs/{run}": {
        "get": operation(
            "getRun",
            "A run",
            (200, "Run"),
            params=(*_RUN, *_READ, "as_of"),
            errors=(400, 404, 410, 422, 503),
        )
    },
    "/api/v1/orgs/{org}/runs/{run}/approve": {
        "post": _run_command(
            "approveRun",
            "Approve a run awaiting approval: 403 (with the reason) unless one of the "
            "workspace's `approvers`, or with none set any operator or above (four_eyes: "
            "not its creator); 409 with `missing` unless `acknowledged` lists "
            "every deletion and replacement when confirm_destructive is on",
            "ApproveBody",
            (),
        )
    },
    "/api/v1/orgs/{org}/runs/{run}/discard": {
        "post": _run_command(
            "discardRun",
            "Discard a run awaiting approval (the workspace's approvers, or with none set any "
            "operator or above; 403 with the reason)",
            "DiscardBody",
            (),
        )
    },
    "/api/v1/orgs/{org}/runs/{run}/cancel": {
        "post": _run_command(
            "cancelRun", "Cancel a run before it changes anything", "CancelBody", ()
        )
    },
    "/api/v1/orgs/{org}/runs/{run}/rerun": {
        "post": operation(
            "rerunRun",
            "A new run of an ended run's type and template on its workspace's current "
            "commit and settings (cause rerun, rerun_of); the old run is kept as it was",
            (201, "Run"),
            params=_RUN,
            body="RerunBody",
            body_required=False,
            errors=(400, 403, 404, 409, 410, 422),
        )
    },
    "/api/v1/orgs/{org}/runs/{run}/events": {
        "get": operation(
            "runEvents",
            "The run's audit history, oldest first",
            (200, "RunEventList"),
            params=(*_RUN, *_READ),
            errors=(400, 404, 410, 422, 503),
        )
    },
    "/api/v1/orgs/{org}/runs/{run}/steps": {
        "get": operation(
            "runSteps",
            "The run's steps",
            (200, "StepList"),
            params=(*_RUN, *_READ),
            errors=(400, 404, 410, 422, 503),
        )
    },
    "/api/v1/orgs/{org}/runs/{run}/logs": logs.OPENAPI,
    **changes.PATHS,
    **state.PATHS,
    **rollback.PATHS,
    **secrets.PATHS,
    **settings_api.PATHS,
    **locks.PATHS,
    **groups.PATHS,
    **people.PATHS,
    **grants.PATHS,
    **templates_api.PATHS,
    **policies_api.PATHS,
    **notifications_api.PATHS,
    **schedules_api.PATHS,
    **stacks_api.PATHS,
    **stack_runs_api.PATHS,
    **chat.PATHS,
    **sso_api.PATHS,
    **vcs_api.PATHS,
    **run_triggers_api.PATHS,
}


def _body_schemas() -> dict[str, Doc]:
    _, components = msgspec.json.schema_components((*BODIES, runs.RerunBody), ref_template=REF)
    return components


def _keyed(paths: dict[str, Doc]) -> dict[str, Doc]:
    """The paths, each authenticated POST under /api/v1 taking an Idempotency-Key
    (services/surfaces/api/idempotency.py)."""
    key = {"$ref": "#/components/parameters/idempotency_key"}
    out: dict[str, Doc] = {}
    for path, ops in paths.items():
        ops = dict(ops)
        post = ops.get("post")
        if path.startswith("/api/v1/") and post is not None and post.get("security") != []:
            ops["post"] = {**post, "parameters": [*post.get("parameters", []), key]}
        out[path] = ops
    return out


def document() -> Doc:
    """The whole OpenAPI 3.1 document."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "runplane",
            "version": "1",
            "description": "Control plane for Terraform runs. Errors are RFC 9457 problem "
            "details. Every command answers with RP-Seq; send it back as RP-Min-Seq "
            "to read your own writes from any replica.",
        },
        "security": [{"bearer": []}],
        "paths": _keyed(PATHS),
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                **SCHEMAS,
                **changes.SCHEMAS,
                **state.SCHEMAS,
                **rollback.SCHEMAS,
                **secrets.SCHEMAS,
                **settings_api.SCHEMAS,
                **locks.SCHEMAS,
                **groups.SCHEMAS,
                **people.SCHEMAS,
                **grants.SCHEMAS,
                **templates_api.SCHEMAS,
                **policies_api.SCHEMAS,
                **notifications_api.SCHEMAS,
                **schedules_api.SCHEMAS,
                **stacks_api.SCHEMAS,
                **stack_runs_api.SCHEMAS,
                **chat.SCHEMAS,
                **sso_api.SCHEMAS,
                **whoami.SCHEMAS,
                **audit.SCHEMAS,
                **vcs_api.SCHEMAS,
                **run_triggers_api.SCHEMAS,
                **_body_schemas(),
            },
            "parameters": PARAMETERS,
            "responses": RESPONSES,
        },
    }
