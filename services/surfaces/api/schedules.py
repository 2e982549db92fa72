"""Schedules of a workspace (events/schedule.py): runs started on a cron, in a time zone.

`POST .../workspaces/{ws}/schedules` `{"cron", "timezone"?, "run_type": "plan" | "drift" |
"apply" | "destroy", "template"?, "enabled"?, "missed"?: "run_once" | "skip"}` creates one
(operator; 201), `GET` lists them (viewer), `GET|PATCH|DELETE .../schedules/{id}` reads,
changes (only the fields given) and deletes one. Each is answered with its next fire
times (`next_fires`: UTC and the zone's local time) and what it fired last.

A cron that is not five fields, fires more often than once a minute (a seconds field),
never fires or is `@reboot`, a time zone that is not an IANA name, a template that does
not exist or does not suit the run type: 422 `invalid-schedule`, with `field`. More than
`MAX_SCHEDULES` on a workspace: 422 `schedule-limit-exceeded`.

Reads come from the event store (a workspace's schedules are one subject), not the read
model: no projection to lag behind a write.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Annotated

import msgspec
from aiohttp import web
from msgspec import Meta

from events import schedule as sc
from events import templates as te
from events.errors import Invalid
from services.processes.schedules import store
from services.surfaces.api.bodies import Body, read_body
from services.surfaces.api.common import (
    SEQ_HEADER,
    Row,
    command_answer,
    items,
    json_response,
    path_id,
    scope,
)
from services.surfaces.api.context import Api
from services.surfaces.api.middleware import MIN_SEQ
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import (
    BOOL,
    REF,
    STR,
    Doc,
    list_of,
    ok,
    path_param,
    problems,
    ref,
)

NEXT_SHOWN = 5

RunType = Annotated[str, Meta(description="plan, drift, apply or destroy")]
Missed = Annotated[
    str,
    Meta(
        description="a fire missed while no scheduler ran: run_once (fired once when one "
        "starts; the default) or skip (recorded as skipped)"
    ),
]
Cron = Annotated[
    str,
    Meta(
        description="five fields (minute hour day-of-month month day-of-week), or @hourly, @daily"
        " ..."
    ),
]
Zone = Annotated[str, Meta(description="an IANA time zone, e.g. Europe/Paris")]


class ScheduleBody(Body, frozen=True, kw_only=True):
    cron: Cron
    timezone: Zone = "UTC"
    run_type: RunType
    template: str = ""
    enabled: bool = True
    missed: Missed = "run_once"


class SchedulePatchBody(Body, frozen=True, kw_only=True):
    cron: Cron | None = None
    timezone: Zone | None = None
    run_type: RunType | None = None
    template: str | None = None
    enabled: bool | None = None
    missed: Missed | None = None


def _iso(dt: datetime | None) -> str | None:
    return dt.isoformat().replace("+00:00", "Z") if dt else None


def _row(s: sc.Schedule, fires: sc.FireState, now: datetime) -> Row:
    tz = sc.zone(s.timezone)
    upcoming = sc.next_fires(s, max(now, s.since), NEXT_SHOWN) if s.enabled else []
    return {
        "id": s.id,
        "workspace": s.workspace,
        "cron": s.cron,
        "timezone": s.timezone,
        "run_type": s.run_type,
        "template": s.template or None,
        "enabled": s.enabled,
        "missed": s.missed,
        "next_fires": [{"at": _iso(t), "local": t.astimezone(tz).isoformat()} for t in upcoming],
        "last_fire_time": _iso(fires.last_fire),
        "last_run": fires.last_run or None,
        "created_at": _iso(s.created_at),
        "created_by": s.created_by,
        "updated_at": _iso(s.updated_at),
    }


async def _workspace(api: Api, org: str, ws: str) -> None:
    if not (await api.app.load_ws(org, ws)).state.exists:
        raise Problem("not-found", f"workspace {ws} not found")


async def _template(api: Api, org: str, run_type: str, template: str) -> None:
    """A template the schedule names must exist and suit its run type (else every fire
    would be refused)."""
    if not template or run_type not in sc.RUN_TYPES:
        return
    saved = (await api.app.load_org(org)).state.templates
    try:
        te.resolve(run_type, template, saved, {})
    except Invalid as e:
        raise Problem("invalid-schedule", str(e), field="template") from e


async def _command(
    api: Api, org: str, ws: str, cmd: sc.SaveSchedule | sc.DeleteSchedule
) -> tuple[sc.SchedulesState, int]:
    try:
        return await store.command(api.app, org, ws, cmd)
    except sc.InvalidSchedule as e:
        raise Problem("invalid-schedule", str(e), field=e.field) from e
    except sc.TooManySchedules as e:
        raise Problem("schedule-limit-exceeded", str(e), limit=sc.MAX_SCHEDULES) from e


async def _shown(api: Api, s: sc.Schedule) -> Row:
    fires = await store.fire_state(api.app, s.org, s.workspace, s.id)
    return _row(s, fires, api.app.clock())


def _floor(request: web.Request) -> int:
    """The caller's RP-Min-Seq (checked by the middleware): a read at least that new."""
    raw = request.headers.get(MIN_SEQ, "")
    return int(raw) if raw.isdigit() else 0


async def _found(api: Api, org: str, ws: str, schedule_id: str, min_seq: int = 0) -> sc.Schedule:
    state, _ = await store.load(api.app, org, ws, min_seq=min_seq)
    s = state.schedules.get(schedule_id)
    if s is None or s.org != org or s.workspace != ws:
        raise Problem("not-found", f"schedule {schedule_id} not found")
    return s


async def create(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "schedules.write")
    ws = path_id(request, "ws")
    body = await read_body(request, ScheduleBody)
    await _workspace(api, org, ws)
    await _template(api, org, body.run_type, body.template)
    schedule_id = api.app.ids()
    cmd = sc.SaveSchedule(
        actor=who.user,
        schedule_id=schedule_id,
        org=org,
        workspace=ws,
        create=True,
        **msgspec.structs.asdict(body),
    )
    state, seq = await _command(api, org, ws, cmd)
    row = _row(state.schedules[schedule_id], sc.FireState(), api.app.clock())
    where = f"/api/v1/orgs/{org}/workspaces/{ws}/schedules/{schedule_id}"
    return command_answer(row, seq, status=201, location=where)


async def list_schedules(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "workspace.read")
    ws = path_id(request, "ws")
    await _workspace(api, org, ws)
    state, _ = await store.load(api.app, org, ws, min_seq=_floor(request))
    ordered = sorted(state.schedules.values(), key=lambda s: (s.created_at, s.id))
    return items(list(await asyncio.gather(*(_shown(api, s) for s in ordered))))


async def get_schedule(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "workspace.read")
    ws, schedule_id = path_id(request, "ws"), path_id(request, "schedule")
    found = await _found(api, org, ws, schedule_id, _floor(request))
    return json_response(await _shown(api, found))


async def patch_schedule(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "schedules.write")
    ws, schedule_id = path_id(request, "ws"), path_id(request, "schedule")
    body = await read_body(request, SchedulePatchBody)
    s = await _found(api, org, ws, schedule_id)
    template = s.template if body.template is None else body.template
    await _template(api, org, body.run_type or s.run_type, template)
    cmd = sc.SaveSchedule(
        actor=who.user,
        schedule_id=schedule_id,
        org=org,
        workspace=ws,
        **msgspec.structs.asdict(body),
    )
    state, seq = await _command(api, org, ws, cmd)
    row = await _shown(api, state.schedules[schedule_id])
    return command_answer(row, seq)


async def delete_schedule(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "schedules.write")
    ws, schedule_id = path_id(request, "ws"), path_id(request, "schedule")
    await _found(api, org, ws, schedule_id)
    _, seq = await _command(
        api, org, ws, sc.DeleteSchedule(actor=who.user, schedule_id=schedule_id)
    )
    return web.Response(status=204, headers={SEQ_HEADER: str(seq)})


async def list_fires(request: web.Request) -> web.Response:
    """The schedule's fire records from the read model, newest first: each fire time it
    handled, fired (with its run) or skipped (with why)."""
    api, org, _ = await scope(request, "workspace.read")
    ws, schedule_id = path_id(request, "ws"), path_id(request, "schedule")
    await _found(api, org, ws, schedule_id, _floor(request))
    return items(await api.read.workspaces.schedule_fires(org, ws, schedule_id))


def routes(ws: str) -> list[web.RouteDef]:
    one = ws + "/schedules/{schedule}"
    return [
        web.get(ws + "/schedules", list_schedules, allow_head=False),
        web.post(ws + "/schedules", create),
        web.get(one, get_schedule, allow_head=False),
        web.patch(one, patch_schedule),
        web.delete(one, delete_schedule),
        web.get(one + "/fires", list_fires, allow_head=False),
    ]


# ---------------------------------------------------------------- OpenAPI

_FIRE: Doc = {
    "type": "object",
    "properties": {
        "at": {**STR, "description": "UTC"},
        "local": {**STR, "description": "in the schedule's time zone"},
    },
}
_SCHEDULE: Doc = {
    "type": "object",
    "required": ["id", "cron", "timezone", "run_type", "enabled", "missed", "next_fires"],
    "properties": {
        "id": STR,
        "workspace": STR,
        "cron": STR,
        "timezone": STR,
        "run_type": {"enum": list(sc.RUN_TYPES)},
        "template": {"type": ["string", "null"]},
        "enabled": BOOL,
        "missed": {"enum": list(sc.MISSED)},
        "next_fires": {"type": "array", "items": _FIRE, "maxItems": NEXT_SHOWN},
        "last_fire_time": {"type": ["string", "null"]},
        "last_run": {"type": ["string", "null"]},
        "created_at": STR,
        "created_by": STR,
        "updated_at": STR,
    },
}
_FIRE_RECORD: Doc = {
    "type": "object",
    "properties": {
        "fire_time": STR,
        "outcome": {"enum": ["fired", "skipped"]},
        "run_id": {"type": ["string", "null"]},
        "reason": {
            "type": ["null", "string"],
            "enum": [None, sc.WAITING, sc.MISSED_SKIPPED, sc.REFUSED],
        },
        "waiting_run": {"type": ["string", "null"]},
        "missed": {"type": "integer", "description": "earlier fire times this one stood for"},
        "detail": {"type": ["string", "null"]},
        "at": STR,
    },
}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((ScheduleBody, SchedulePatchBody), ref_template=REF)[1],
    "Schedule": _SCHEDULE,
    "ScheduleList": list_of("Schedule"),
    "ScheduleFire": _FIRE_RECORD,
    "ScheduleFireList": list_of("ScheduleFire"),
}
PARAMETERS: dict[str, Doc] = {"schedule": path_param("schedule", "schedule id")}


def _body(name: str) -> Doc:
    return {"required": True, "content": {"application/json": {"schema": ref(name)}}}


_WS_PARAMS = [{"$ref": "#/components/parameters/org"}, {"$ref": "#/components/parameters/ws"}]
_ONE = [*_WS_PARAMS, {"$ref": "#/components/parameters/schedule"}]
PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/workspaces/{ws}/schedules": {
        "get": {
            "operationId": "listSchedules",
            "summary": "A workspace's schedules, with their next fire times",
            "parameters": _WS_PARAMS,
            "responses": {"200": ok("ScheduleList"), **problems(403, 404, 422)},
        },
        "post": {
            "operationId": "createSchedule",
            "summary": "Create a schedule (operator)",
            "parameters": _WS_PARAMS,
            "requestBody": _body("ScheduleBody"),
            "responses": {"201": ok("Schedule", seq=True), **problems(400, 403, 404, 422)},
        },
    },
    "/api/v1/orgs/{org}/workspaces/{ws}/schedules/{schedule}": {
        "get": {
            "operationId": "getSchedule",
            "summary": "A schedule, with its next fire times and its last fire",
            "parameters": _ONE,
            "responses": {"200": ok("Schedule"), **problems(403, 404, 422)},
        },
        "patch": {
            "operationId": "patchSchedule",
            "summary": "Change the fields given (operator)",
            "parameters": _ONE,
            "requestBody": _body("SchedulePatchBody"),
            "responses": {"200": ok("Schedule", seq=True), **problems(400, 403, 404, 422)},
        },
        "delete": {
            "operationId": "deleteSchedule",
            "summary": "Delete a schedule (operator)",
            "parameters": _ONE,
            "responses": {"204": {"description": "deleted"}, **problems(403, 404, 422)},
        },
    },
    "/api/v1/orgs/{org}/workspaces/{ws}/schedules/{schedule}/fires": {
        "get": {
            "operationId": "listScheduleFires",
            "summary": "What the schedule fired or skipped, newest first (at most 100)",
            "parameters": _ONE,
            "responses": {"200": ok("ScheduleFireList"), **problems(403, 404, 422, 503)},
        },
    },
}
