"""Policy sets (`events/policies.py`): OPA Rego modules checked against each plan.

One flat collection per organization, each set with its `scope`: `org`, `folder:<name>`
or `workspace:<name>`. `PUT .../policies/{policy}` `{"enforcement", "source",
"description"?, "scope"?}` saves one (admin): the source is compiled first, and one that
does not compile (or has no `package` or `deny` rule) is 422 `invalid-policy` with the
compiler's message; a folder or workspace scope must name an existing one (404). The check
runs in the policy sandbox (infra/policy/sandbox.py): one that passes its memory or time
cap is 422 `policy-limit-exceeded`, saying which. `GET
.../policies` lists them (`?scope=` filters), `GET .../policies/{policy}` answers one,
`DELETE` removes one. Read from the organization aggregate, not the read model. A run
pins its workspace's sets at admission, so a change reaches only runs admitted later.

A set scoped to a workspace names it: to a caller who may not read that workspace
(events/access.py) the set does not exist (left out of lists, 404 to GET and DELETE), a
PUT scoping one to it is 404 exactly as for a missing workspace (`manage-policies` is no
way to probe names), and a PUT over such a set's name is 409 `conflict` (taken, never
replaced by someone who may not see it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import msgspec
from aiohttp import web

from events import policies as po
from events.workspace import WorkspaceState
from infra.policy.sandbox import (
    InvalidPolicy,
    PolicyCrashed,
    PolicyLimitExceeded,
    PolicySandbox,
    SandboxUnavailable,
)
from infra.policy.wire import package_of
from services.surfaces.api.auth import Principal
from services.surfaces.api.bodies import Body, read_body
from services.surfaces.api.common import (
    SEQ_HEADER,
    Row,
    command_answer,
    items,
    json_response,
    org_state,
    path_id,
    readable,
    require_on,
    scope,
)
from services.surfaces.api.context import Api
from services.surfaces.api.paths import ORG
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import (
    REF,
    SEQ_DOC,
    STR,
    Doc,
    list_of,
    ok,
    path_param,
    problems,
    ref,
)

PREFIX = "/api/v1/orgs"
_SCOPE_DOC = "org, folder:<folder> or workspace:<workspace>"
# Where the save-time check runs; build_app sets it (the deployment's caps by default).
SANDBOX: web.AppKey[PolicySandbox] = web.AppKey("runplane.policy_sandbox", PolicySandbox)


class PolicyBody(Body, frozen=True, kw_only=True):
    enforcement: Annotated[
        str,
        msgspec.Meta(
            description="advisory (recorded only), soft-mandatory (a failure needs an "
            "approval, whose override is recorded) or hard-mandatory (a failure fails the "
            "run `policy_failed`)",
            extra_json_schema={"enum": list(po.ENFORCEMENTS)},
        ),
    ]
    source: Annotated[
        str,
        msgspec.Meta(
            description="a Rego module with a `package` and a `deny` rule (a set of "
            "messages), evaluated with the plan's JSON (`terraform show -json`) as `input`",
            extra_json_schema={"minLength": 1},
        ),
    ]
    description: Annotated[str, msgspec.Meta(max_length=1000)] = ""
    scope: Annotated[
        str, msgspec.Meta(description=f"where it applies: {_SCOPE_DOC} (default org)")
    ] = "org"


def row(policy: po.PolicySet) -> Row:
    return {
        "name": policy.name,
        "enforcement": policy.enforcement,
        "scope": policy.scope,
        "description": policy.description,
        "package": package_of(policy.source),
        "source": policy.source,
    }


def _order(policy: po.PolicySet) -> tuple[int, str, str]:
    kind = policy.scope.partition(":")[0]
    return ({"org": 0, "folder": 1, "workspace": 2}.get(kind, 3), policy.scope, policy.name)


async def list_policies(request: web.Request) -> web.Response:
    """GET .../policies[?scope=...]: the organization's, then folders', then workspaces'."""
    api, org, who = await scope(request, "org.read")
    unknown = sorted(set(request.query) - {"scope"})
    if unknown:
        raise Problem("invalid-query", f"unknown query parameter {', '.join(unknown)}")
    wanted = request.query.get("scope")
    state = await org_state(api, org)
    seen = await readable(api, who, org)
    chosen = [
        p
        for p in state.policies.values()
        if (wanted is None or p.scope == wanted) and not _hidden(p, seen)
    ]
    return items([row(p) for p in sorted(chosen, key=_order)])


def _hidden(policy: po.PolicySet, seen: Callable[[str], bool]) -> bool:
    """Whether the set names a workspace the caller may not read."""
    kind, _, target = policy.scope.partition(":")
    return kind == "workspace" and not seen(target)


async def _visible(api: Api, who: Principal, org: str, name: str) -> po.PolicySet:
    """The set `name`, or 404 (missing, or scoped to a workspace the caller may not read)."""
    policy = (await org_state(api, org)).policies.get(name)
    if policy is None or _hidden(policy, await readable(api, who, org)):
        raise Problem("not-found", f"policy {name} not found")
    return policy


async def get_policy(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.read")
    return json_response(row(await _visible(api, who, org, path_id(request, "policy"))))


async def put_policy(request: web.Request) -> web.Response:
    """Create (201) or replace (200) a policy set, once its source compiles."""
    api, org, who = await scope(request, "policies.manage")
    name = path_id(request, "policy")
    body = await read_body(request, PolicyBody)
    before = await org_state(api, org)
    policy = po.PolicySet(
        name=name,
        enforcement=body.enforcement,
        source=body.source,
        scope=body.scope,
        description=body.description,
    )
    po.check(policy, before.folders)  # 422 with the reason; 404 for a missing folder
    kind, _, target = policy.scope.partition(":")
    old = before.policies.get(name)
    if old is not None and _hidden(old, await readable(api, who, org)):
        raise Problem("conflict", f"policy {name} exists: choose another name")
    if kind == "workspace":
        await require_on(api, who, org, "workspace.read", target)  # as if missing
        ws: WorkspaceState = (await api.app.load_ws(org, target)).state
        if not ws.exists:
            raise Problem("not-found", f"workspace {target} not found")
    await _check(request.app[SANDBOX], name, policy.source)
    result = await api.app.org_command(org, po.SavePolicy(actor=who.user, policy=policy))
    new = name not in before.policies
    answer = row(result.state.policies[name])
    where = f"{PREFIX}/{org}/policies/{name}" if new else ""
    return command_answer(answer, result.seq, status=201 if new else 200, location=where)


async def _check(sandbox: PolicySandbox, name: str, source: str) -> None:
    """The sandbox's compile check as problems: 422 for the policy's own failures."""
    try:
        await sandbox.compile_check(name, source)
    except InvalidPolicy as e:
        raise Problem("invalid-policy", str(e)) from e
    except PolicyLimitExceeded as e:
        detail = f"the policy {e.what} (the deployment's {e.limit} cap for a policy)"
        raise Problem("policy-limit-exceeded", detail, limit=e.limit) from e
    except PolicyCrashed as e:
        raise Problem("invalid-policy", f"the policy stopped the evaluator: {e.why}") from e
    except SandboxUnavailable as e:
        raise Problem("unavailable", str(e), headers={"Retry-After": "1"}) from e


async def delete_policy(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "policies.manage")
    name = path_id(request, "policy")
    if name in (await org_state(api, org)).policies:
        await _visible(api, who, org, name)
    result = await api.app.org_command(org, po.DeletePolicy(actor=who.user, name=name))
    return web.Response(status=204, headers={SEQ_HEADER: str(result.seq)})


# ---------------------------------------------------------------- OpenAPI

_POLICY: Doc = {
    "type": "object",
    "required": ["name", "enforcement", "scope", "description", "package", "source"],
    "properties": {
        "name": STR,
        "enforcement": {"enum": list(po.ENFORCEMENTS)},
        "scope": {**STR, "description": _SCOPE_DOC},
        "description": STR,
        "package": {
            **STR,
            "description": "the module's package: runplane reads data.<package>.deny",
        },
        "source": {**STR, "description": "the Rego module"},
    },
}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((PolicyBody,), ref_template=REF)[1],
    "PolicySet": _POLICY,
    "PolicySetList": list_of("PolicySet"),
    "PolicyResult": {
        "type": "object",
        "required": ["name", "enforcement", "scope", "passed", "messages"],
        "properties": {
            "name": STR,
            "enforcement": {"enum": list(po.ENFORCEMENTS)},
            "scope": STR,
            "passed": {"type": "boolean", "description": "`deny` was undefined or empty"},
            "messages": {
                "type": "array",
                "items": STR,
                "description": "the `deny` messages, or the error that kept the policy from "
                "being evaluated (which counts as a failure)",
            },
        },
    },
}
PARAMETERS: dict[str, Doc] = {
    "policy": path_param("policy", "policy set name"),
    "policy_scope": {
        "name": "scope",
        "in": "query",
        "required": False,
        "description": f"only the sets of this scope: {_SCOPE_DOC}",
        "schema": STR,
    },
}
_PARAMS = [{"$ref": f"#/components/parameters/{p}"} for p in ("org", "policy")]


PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/policies": {
        "get": {
            "operationId": "listPolicies",
            "summary": "The organization's policy sets (every scope), or one scope's",
            "parameters": [
                _PARAMS[0],
                {"$ref": "#/components/parameters/policy_scope"},
            ],
            "responses": {"200": ok("PolicySetList"), **problems(400, 404, 422)},
        },
    },
    "/api/v1/orgs/{org}/policies/{policy}": {
        "get": {
            "operationId": "getPolicy",
            "summary": "A policy set",
            "parameters": _PARAMS,
            "responses": {"200": ok("PolicySet"), **problems(404, 422)},
        },
        "put": {
            "operationId": "putPolicy",
            "summary": "Create (201) or replace (200) a policy set; a source that does not "
            "compile is 422 invalid-policy with the compiler's message, one whose check "
            "passes the deployment's memory or time cap 422 policy-limit-exceeded (with "
            "`limit`: memory or time); runs already admitted keep the sets they pinned",
            "parameters": _PARAMS,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref("PolicyBody")}},
            },
            "responses": {
                "200": ok("PolicySet", seq=True),
                "201": ok("PolicySet", seq=True),
                **problems(400, 403, 404, 422),
            },
        },
        "delete": {
            "operationId": "deletePolicy",
            "summary": "Delete a policy set; runs already admitted keep the sets they pinned",
            "parameters": _PARAMS,
            "responses": {
                "204": {"description": "deleted", "headers": {"RP-Seq": SEQ_DOC}},
                **problems(403, 404, 422),
            },
        },
    },
}


ROUTES = [
    web.get(ORG + "/policies", list_policies, allow_head=False),
    web.get(ORG + "/policies/{policy}", get_policy, allow_head=False),
    web.put(ORG + "/policies/{policy}", put_policy),
    web.delete(ORG + "/policies/{policy}", delete_policy),
]
