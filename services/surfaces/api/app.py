"""The HTTP API: commands in through `App`, queries out of this replica's projection.

`build_app` wires handlers and middlewares around the adapters it is given; the process's
composition root owns their lifetimes (the projector is an async context manager).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from aiohttp import web

from infra.policy.sandbox import PolicySandbox
from infra.quotas import Quotas
from projections.metrics import Metrics
from projections.projector import Projector
from services.app.commands import App
from services.app.repositories import Sources
from services.app.secrets import SecretStore
from services.processes.audit_stream import failing_destinations
from services.processes.vcs.deliveries import Deliveries
from services.processes.vcs.heads import GitHeads, Heads
from services.surfaces.api import (
    audit,
    changes,
    chat,
    docs,
    grants,
    groups,
    idempotency,
    locks,
    logs,
    metrics,
    oidc,
    openapi,
    orgs,
    people,
    readiness,
    rollback,
    runs,
    secrets,
    state,
    whoami,
    workspaces,
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
from services.surfaces.api.common import json_response
from services.surfaces.api.context import API, Api
from services.surfaces.api.middleware import MIDDLEWARES
from services.surfaces.api.paths import ORG, V1, WS
from services.surfaces.tfe import routes as tfe
from services.surfaces.ui import app as ui
from services.surfaces.webhooks import vcs as vcs_webhook
from services.surfaces.webhooks.intake import INTAKE, Intake, Limits


async def openapi_document(request: web.Request) -> web.Response:
    return json_response(request.app[OPENAPI])


OPENAPI: web.AppKey[dict[str, object]] = web.AppKey("runplane.openapi", dict)

ROUTES = [
    *readiness.ROUTES,
    web.get("/metrics", metrics.metrics, allow_head=False),
    web.get(V1 + "/openapi.json", openapi_document, allow_head=False),
    *docs.ROUTES,
    *whoami.ROUTES,
    *audit.ROUTES,
    *orgs.ROUTES,
    *workspaces.ROUTES,
    *settings_api.ROUTES,
    *groups.ROUTES,
    *people.ROUTES,
    *grants.ROUTES,
    *templates_api.ROUTES,
    *policies_api.ROUTES,
    *runs.ROUTES,
    *state.ROUTES,
    *rollback.ROUTES,
    *secrets.ROUTES,
    *locks.ROUTES,
    *changes.ROUTES,
    *logs.ROUTES,
    *notifications_api.routes(ORG, WS),
    *run_triggers_api.routes(WS),
    *schedules_api.routes(WS),
    *stacks_api.ROUTES,
    *stack_runs_api.ROUTES,
    *chat.ROUTES,
    *sso_api.ROUTES,
    *vcs_api.routes(ORG),
]


def _figures(app: App, projector: Projector) -> Metrics:
    """`/metrics`' figures, the audit stream's failing destinations among them."""
    failing = partial(failing_destinations, app.store.nc)
    return Metrics(app.store.nc, projector.db_path, audit_failing=failing)


def build_app(
    *,
    app: App,
    projector: Projector,
    admin_token: str,
    ready: Callable[[], bool] | None = None,
    secret_store: SecretStore | None = None,
    repositories: Sources | None = None,
    policy_sandbox: PolicySandbox | None = None,
    metrics_token: str = "",
    behind_tls_proxy: bool = False,
    browser_login: bool = True,
    webhook_limits: Limits | None = None,
    vcs_heads: Heads | None = None,
    quotas: Quotas | None = None,
    workload_identity: oidc.Issuer | None = None,
) -> web.Application:
    """The aiohttp application of the API over `app` (writes) and `projector` (reads).

    Without a `secret_store` (no encryption key) secret variables answer 503. Without
    `repositories` a workspace may name any repository (the processes pass the
    deployment's, services/app/repositories.py). Without a `policy_sandbox`, policies are
    checked with the deployment's caps (environment). `metrics_token`: a token that
    opens `/metrics` and nothing else (services/surfaces/api/metrics.py). `behind_tls_proxy`: the
    web UI believes X-Forwarded-Proto (services/surfaces/ui/sessions.py). `browser_login` False:
    `terraform login` is not offered login.v1 (services/surfaces/tfe/discovery.py).
    `webhook_limits`: what an unproven webhook body may cost (services/surfaces/webhooks/intake.py).
    `vcs_heads`: what a webhook's push is checked against (services/processes/vcs/heads.py);
    without it, git with no mirror: only a push of its ref's head starts runs. `quotas`:
    the deployment's bounds on what a tenant grows (infra/quotas.py).
    """
    web_app = web.Application(middlewares=MIDDLEWARES)
    web_app[API] = Api(app=app, projector=projector, admin_token=admin_token, ready=ready)
    web_app[idempotency.IDEMPOTENCY] = idempotency.Idempotency(app.store.nc)
    if secret_store is not None:
        web_app[secrets.SECRETS] = secret_store
    if repositories is not None:
        web_app[orgs.SOURCES] = repositories
    web_app[policies_api.SANDBOX] = policy_sandbox or PolicySandbox()
    heads = vcs_heads or GitHeads(None, sources=repositories)
    web_app[vcs_webhook.DELIVERIES] = Deliveries(app, projector, heads)
    web_app[OPENAPI] = openapi.document()
    web_app[INTAKE] = Intake(webhook_limits or Limits())
    web_app[metrics.METRICS] = figures = _figures(app, projector)
    web_app[metrics.METRICS_TOKEN] = metrics.token_digest(metrics_token)
    web_app.on_cleanup.append(lambda _: figures.close())
    web_app.add_routes(ROUTES)
    # the web UI: its own routes, authenticated by its session cookie
    ui.mount(web_app, behind_tls_proxy=behind_tls_proxy)
    # the TFE API the Terraform CLI speaks (services/surfaces/tfe): after the UI, as it adds to
    # the routes that authenticate themselves
    tfe.mount(
        web_app,
        keyring=secret_store.keyring if secret_store is not None else None,
        js=app.store.nc.jetstream(),
        browser_login=browser_login,
        quotas=quotas,
    )
    oidc.mount(web_app, workload_identity)  # last: after the UI's public routes
    return web_app
