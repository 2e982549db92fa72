"""Runs, plans, applies and policy checks, as the CLI's remote operations drive them.

`terraform plan` makes a speculative run of an uploaded configuration; `terraform apply`
a run whose plan waits for the CLI's "yes" (the apply action: an approval under
runplane's rules, so four-eyes, approvers and confirm_destructive hold), or for an
approval given in runplane's API, UI or chat while the CLI waits. Every run is
`App.create_run` with `Cause(kind="cli")`, the configuration as its source and the
CLI's -refresh-only / -target / -replace / -var as its options: the workspace's FIFO
queue, policies and audit are the same as for any run.

A run's TFE view is folded from its events (`App.load_run`), never the read model, so
the CLI polling it sees each transition as soon as it is recorded. Statuses map as
services/surfaces/tfe/statuses.py says.

The module serves the handlers; how a run reads is services/surfaces/tfe/run_view.py,
how a POST /runs body is read run_options.py, and the plans, applies and policy checks
of a run plans.py.
"""

from __future__ import annotations

import contextlib
from typing import Any

from aiohttp import web

from events import approval
from events.errors import DomainError, Forbidden
from events.run import (
    ApproveRun,
    CancelRun,
    Cause,
    ConfigSource,
    DiscardRun,
    RunOptions,
    RunState,
    Status,
)
from services.app.commands import App
from services.app.execute import Result
from services.surfaces.api.approvals import caller
from services.surfaces.api.auth import Principal
from services.surfaces.api.runs import PLAN_ONLY
from services.surfaces.tfe import configs, ids
from services.surfaces.tfe.context import api_of, read_json, require
from services.surfaces.tfe.jsonapi import (
    TfeError,
    document,
    listing,
    not_found,
    page_of,
    resource,
    response,
)
from services.surfaces.tfe.run_options import flag, options_of, related
from services.surfaces.tfe.run_view import level_on, load, render_run, row_doc
from services.surfaces.tfe.statuses import (
    ENDED,
    STOPPED,
    cancelable,
    force_cancelable,
    not_cancelable,
)
from services.surfaces.tfe.workspaces import CLI_REPOSITORY

VIA = "cli"


async def _position(app: App, request: web.Request, s: RunState) -> int:
    """How many runs of the workspace are ahead of this pending one (FIFO): the older
    ones not over yet (the list is newest first)."""
    if s.status != Status.PENDING or s.speculative:
        return 0
    rows = await api_of(request).read.runs.find(s.org, workspace=s.workspace, full=False)
    over = {str(x) for x in ENDED | STOPPED}
    seen = [r["id"] for r in rows]
    if s.run_id not in seen:
        return 0
    older = rows[seen.index(s.run_id) + 1 :]
    return sum(1 for r in older if r["status"] not in over)


# ---------------------------------------------------------------- handlers: runs


async def create_run(request: web.Request) -> web.Response:
    """POST /runs: a run of an uploaded configuration, its options from the CLI's flags."""
    body = await read_json(request, limit=1024 * 1024)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, dict) or data.get("type") not in (None, "runs"):
        raise TfeError(422, "invalid body", "a JSON:API document of type runs is required")
    attrs = data.get("attributes") or {}
    rels = data.get("relationships") or {}
    if not isinstance(attrs, dict) or not isinstance(rels, dict):
        raise TfeError(422, "invalid body", "attributes and relationships must be objects")
    ws_id = related(rels, "workspace")
    org, ws = ids.parse_workspace_id(ws_id)
    who = await require(request, org, "run.plan", ws)
    cv = related(rels, "configuration-version", required=False)
    api = api_of(request)
    run_id = api.app.ids()  # named before it exists: the version is claimed for it
    if cv:
        speculative = await _speculative(request, org, ws, cv)
        if not speculative:  # a run that may apply needs write; a plan, plan
            await require(request, org, "run.apply", ws)
        source = await configs.source_of(request, org, ws, cv, run=run_id)
    else:
        raise TfeError(
            422,
            "configuration version required",
            "runplane starts runs of a workspace's repository through its own API; the "
            "TFE API runs uploaded configurations (relationships.configuration-version)",
        )
    try:
        result = await _create(api.app, who, org, ws, speculative, source, run_id, attrs)
    except BaseException:
        # the claim is taken back unless the run was made after all (its run.created
        # landed, then something failed): that run reads the version
        with contextlib.suppress(Exception):
            if not (await api.app.load_run(org, ws, run_id)).state.exists:
                await configs.unclaim(request, org, cv, run_id)
        raise
    await api.after_write(result.seq)
    level = await level_on(request, org, ws)
    doc = await render_run(api.app, result.state, who, level=level)
    return response(document(doc), status=201)


async def _create(
    app: App,
    who: Principal,
    org: str,
    ws: str,
    speculative: bool,
    source: ConfigSource,
    run_id: str,
    attrs: dict[str, Any],
) -> Result[RunState]:
    if not speculative:
        await _cli_driven(app, org, ws)
    # `auto-apply` (newer clients' -auto-approve): no "yes" will come, so the plan does
    # not wait for one (runplane's own require_approval still holds it).
    auto_apply = flag(attrs, "auto-apply", False)
    options = options_of(attrs, confirm=not speculative and not auto_apply)
    destroy = flag(attrs, "is-destroy", False)
    if speculative:
        run_type = "plan"
        options = RunOptions(**{**_fields(options), "destroy": destroy})
    else:
        run_type = "destroy" if destroy else "apply"
    message = attrs.get("message") or "Queued manually via the Terraform CLI"
    if not isinstance(message, str):
        raise TfeError(422, "invalid attribute", "message must be a string")
    return await app.create_run(
        org,
        ws,
        run_type,
        who.user,
        message[:2000],
        cause=Cause(kind="cli", user=who.user),
        speculative=speculative,
        source=source,
        options=options,
        run_id=run_id,
    )


async def _cli_driven(app: App, org: str, ws: str) -> None:
    """422 unless the workspace's code is the CLI's uploads: one of a repository has its
    code reviewed there, and an operator (who may start its runs, not change where its
    code comes from) must not apply any other with its variables and credentials. Its
    speculative plans are taken, as HCP Terraform takes them."""
    w = await app.load_ws(org, ws)
    if w.state.config is not None and w.state.config.repository != CLI_REPOSITORY:
        raise TfeError(
            422,
            "apply not allowed",
            f"Apply not allowed for workspaces with a VCS connection: {ws} runs the code "
            "of its repository (plan from the CLI, or start its run in runplane)",
        )


def _fields(options: RunOptions) -> dict[str, Any]:
    return {f: getattr(options, f) for f in options.__struct_fields__}


async def _speculative(request: web.Request, org: str, ws: str, cv: str) -> bool:
    record = await configs.configs_of(request).record(org, ws, cv)
    return bool(record and record.speculative)


async def read_run(request: web.Request) -> web.Response:
    """GET /runs/:id (any `include=`: ignored)."""
    s, who = await load(request, "run")
    app = api_of(request).app
    level = await level_on(request, s.org, s.workspace)
    doc = await render_run(app, s, who, await _position(app, request, s), level=level)
    return response(document(doc))


async def list_workspace_runs(request: web.Request) -> web.Response:
    """GET /workspaces/:id/runs: newest first; the CLI counts the runs ahead of its own."""
    org, ws = ids.parse_workspace_id(request.match_info["workspace_id"])
    await require(request, org, "workspace.read", ws)
    api = api_of(request)
    if await api.read.workspaces.get(org, ws) is None:
        raise not_found(f"workspace {ws} not found in organization {org}")
    rows = await api.read.runs.find(org, workspace=ws, full=False)
    items = [row_doc(org, ws, r) for r in rows]
    return response(listing(items, page_of(request)))


async def run_queue(request: web.Request) -> web.Response:
    """GET /organizations/:org/runs/queue: runplane queues per workspace (the CLI reads
    the workspace's runs for its position), and executors pull in FIFO order: no org-wide
    queue to show."""
    org = ids.check_org(request.match_info["org"])
    await require(request, org, "org.read")
    return response(listing([], page_of(request)))


async def capacity(request: web.Request) -> web.Response:
    org = ids.check_org(request.match_info["org"])
    await require(request, org, "org.read")
    attrs = {"pending": 0, "running": 0}
    return response(document(resource("organization-capacity", org, attrs)))


async def run_events(request: web.Request) -> web.Response:
    """GET /runs/:id/run-events: Terraform >= 1.5 reads it; nothing to show."""
    await load(request, "run")
    return response(listing([], page_of(request)))


# ---------------------------------------------------------------- handlers: actions


async def apply_action(request: web.Request) -> web.Response:
    """POST /runs/:id/actions/apply: the CLI's "yes", an approval under runplane's rule."""
    s, who = await load(request, "run", "run.approve")
    api = api_of(request)
    asking = await caller(api, s.org, who, s.run_id)
    command = ApproveRun(actor=who.user, caller=asking, via=VIA)
    await _act(api.app, s, command)
    return response(None, status=202)


async def discard_action(request: web.Request) -> web.Response:
    s, who = await load(request, "run", "run.approve")
    api = api_of(request)
    reason = await _comment(request, "discarded from the Terraform CLI")
    asking = await caller(api, s.org, who, s.run_id)
    command = DiscardRun(actor=who.user, reason=reason, caller=asking, via=VIA)
    await _act(api.app, s, command)
    return response(None, status=202)


async def cancel_action(request: web.Request) -> web.Response:
    """POST /runs/:id/actions/cancel (the CLI's Ctrl-C, answered "yes"): a waiting run is
    canceled, a planning one asked to stop (its executor interrupts Terraform, then
    cancels the run); 409 exactly when `is-cancelable` is false."""
    s, who = await load(request, "run", "run.cancel_plan")
    await _may_cancel(request, s)
    if not cancelable(s):
        raise TfeError(409, "transition not allowed", not_cancelable(s))
    reason = await _comment(request, "canceled from the Terraform CLI")
    await _act(api_of(request).app, s, CancelRun(actor=who.user, reason=reason))
    return response(None, status=202)


async def force_cancel_action(request: web.Request) -> web.Response:
    """POST /runs/:id/actions/force-cancel: taken once a cancel was asked and the run is
    still stopping (`is-force-cancelable`), 409 otherwise. runplane has no harder stop
    than the one under way: its executor interrupts Terraform and kills it after its
    grace period, and a dead executor's run is ended by the reaper; so this confirms
    that stop (a stop asked again records nothing) and never ends the run early, which
    would let another run write the state while this Terraform may still hold it."""
    s, who = await load(request, "run", "run.cancel_plan")
    await _may_cancel(request, s)
    if not force_cancelable(s):
        detail = not_cancelable(s) if not cancelable(s) else "cancel the run first"
        raise TfeError(409, "transition not allowed", detail)
    reason = await _comment(request, "force-canceled from the Terraform CLI")
    await _act(api_of(request).app, s, CancelRun(actor=who.user, reason=reason))
    return response(None, status=202)


async def _may_cancel(request: web.Request, s: RunState) -> None:
    """A plan-only run is canceled by whoever may plan; any other needs write."""
    if s.run_type not in PLAN_ONLY:
        await require(request, s.org, "run.cancel", s.workspace)


async def _comment(request: web.Request, default: str) -> str:
    if not request.can_read_body:
        return default
    body = await read_json(request, limit=64 * 1024)
    comment = body.get("comment") if isinstance(body, dict) else None
    return comment[:1000] if isinstance(comment, str) and comment else default


async def _act(app: App, s: RunState, command: Any) -> None:
    """The command on the run; a refusal the CLI reads as 409 (not allowed now)."""
    try:
        await app.run_command(s.org, s.workspace, s.run_id, command)
    except Forbidden as e:
        raise TfeError(409, "transition not allowed", str(e)) from e
    except approval.Unacknowledged as e:
        raise TfeError(
            409,
            "transition not allowed",
            f"{e}: confirm_destructive needs them acknowledged in runplane (the CLI cannot)",
        ) from e
    except DomainError as e:
        if e.retryable:
            raise
        raise TfeError(409, "transition not allowed", str(e)) from e
