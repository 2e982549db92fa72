"""The TFE routes and how they are mounted into runplane's API application."""

from __future__ import annotations

from aiohttp import web
from nats.js import JetStreamContext

from executor.statestore import StateStore
from infra.crypto import KeyRing
from infra.quotas import Quotas
from services.surfaces.api.middleware import SELF_AUTHENTICATED
from services.surfaces.tfe import (
    configs,
    discovery,
    login,
    logs,
    outputs,
    plans,
    runs,
    state,
    state_push,
    workspaces,
)
from services.surfaces.tfe.capability import Signer
from services.surfaces.tfe.context import TFE, Tfe, route

V2 = "/api/v2"
ORG = V2 + "/organizations/{org}"
WS = V2 + "/workspaces/{workspace_id}"

PUBLIC = [
    web.get("/.well-known/terraform.json", route(discovery.well_known, public=True)),
    # login.v1: the browser's session and the CLI's code verifier are their authority
    web.get(login.AUTHZ, login.authorize_page, allow_head=False),
    web.post(login.AUTHZ, login.authorize),
    web.post(login.TOKEN, login.token),
    web.get(V2 + "/ping", route(discovery.ping, public=True)),
    # a capability URL: its token is its authority (services/surfaces/tfe/capability.py)
    web.get(state.DOWNLOAD_PATH + "{token}", route(state.download, public=True)),
    web.put(configs.UPLOAD_PATH + "{token}", route(configs.upload, public=True)),
    web.get(logs.READ_PATH + "{phase}/{token}", route(logs.read_log, public=True)),
]
RUN = V2 + "/runs/{object_id}"
# the remote operations: configuration versions, runs, plans, applies, policy checks
OPERATIONS = [
    web.post(WS + "/configuration-versions", route(configs.create_config_version)),
    web.get(V2 + "/configuration-versions/{cv_id}", route(configs.read_config_version)),
    web.post(V2 + "/runs", route(runs.create_run)),
    web.get(RUN, route(runs.read_run)),
    web.get(RUN + "/run-events", route(runs.run_events)),
    web.post(RUN + "/actions/apply", route(runs.apply_action)),
    web.post(RUN + "/actions/discard", route(runs.discard_action)),
    web.post(RUN + "/actions/cancel", route(runs.cancel_action)),
    web.post(RUN + "/actions/force-cancel", route(runs.force_cancel_action)),
    web.get(WS + "/runs", route(runs.list_workspace_runs)),
    web.get(ORG + "/runs/queue", route(runs.run_queue)),
    web.get(ORG + "/capacity", route(runs.capacity)),
    web.get(V2 + "/plans/{object_id}", route(plans.read_plan)),
    web.get(V2 + "/applies/{object_id}", route(plans.read_apply)),
    web.get(V2 + "/policy-checks/{object_id}", route(plans.read_policy_check)),
    web.get(V2 + "/policy-checks/{object_id}/output", route(plans.policy_check_output)),
]
AUTHENTICATED = [
    web.get(V2 + "/account/details", route(workspaces.account_details)),
    web.get(ORG, route(workspaces.get_organization)),
    web.get(ORG + "/entitlement-set", route(workspaces.entitlement_set)),
    web.get(ORG + "/workspaces", route(workspaces.list_workspaces)),
    web.post(ORG + "/workspaces", route(workspaces.create_workspace)),
    web.get(ORG + "/workspaces/{name}", route(workspaces.read_workspace)),
    web.get(WS, route(workspaces.read_workspace_by_id)),
    web.patch(WS, route(workspaces.update_workspace)),
    web.post(WS + "/actions/lock", route(workspaces.lock_workspace)),
    web.post(WS + "/actions/unlock", route(workspaces.unlock_workspace)),
    web.post(WS + "/actions/force-unlock", route(workspaces.force_unlock_workspace)),
    web.get(WS + "/vars", route(workspaces.list_vars)),
    web.get(WS + "/current-state-version", route(state.current_state_version)),
    web.get(WS + "/current-state-version-outputs", route(outputs.current_outputs)),
    web.get(V2 + "/state-version-outputs/{output_id}", route(outputs.read_output)),
    web.post(WS + "/state-versions", route(state_push.create_state_version)),
    web.get(V2 + "/state-versions/{sv_id}", route(state.read_state_version)),
]
ROUTES = [*PUBLIC, *AUTHENTICATED, *OPERATIONS]


def mount(
    web_app: web.Application,
    *,
    keyring: KeyRing | None,
    js: JetStreamContext,
    browser_login: bool = True,
    quotas: Quotas | None = None,
) -> None:
    """Add the TFE routes. They authenticate themselves (JSON:API errors, not problem
    details), so runplane's middleware lets them through: call it after anything else
    that sets `SELF_AUTHENTICATED` (the web UI). `keyring` None: no key, so no
    capabilities and no state (503). `browser_login` False: discovery offers no login.v1
    (`terraform login` asks for a pasted token instead). `quotas`: the deployment's
    bounds on state (infra/quotas.py; default: the defaults)."""
    states = StateStore(js, keyring, quotas) if keyring is not None else None
    signer = Signer.of(keyring) if keyring is not None else None
    web_app[TFE] = Tfe(signer=signer, states=states)
    web_app[login.TAKEN] = login.TakenCodes(js)
    web_app[discovery.BROWSER_LOGIN] = browser_login
    configs.install(web_app, js, keyring)
    web_app[state_push.PUSHES] = {}
    web_app.add_routes(ROUTES)
    own = web_app.get(SELF_AUTHENTICATED, frozenset())
    resources = {r.path for r in ROUTES}
    web_app[SELF_AUTHENTICATED] = frozenset(own | resources)
