"""`GET .../runs/{run}/logs`: a run's log lines as JSON, or followed as server-sent events.

Without `follow`: `{"items": [{"phase", "step", "stream", "line", "text"}, ...]}`, step
after step in start order, written as it is read (a 200,000-line log is never whole in
the server's memory). With `offset` and/or `limit` (in lines of that answer, from 0) it
is one page, and the answer has `next_offset`: the offset of the next page, or null once
the run has ended and nothing is left. With `follow=1`: `text/event-stream` of `event: line` (data:
one item as above), `event: step` (a step started or ended: phase, step, status, and at
the end error and metrics), and finally `event: end` (data: the run's terminal status and
reason), after which the server closes the stream. A comment line is sent every 15
seconds of silence so that proxies keep the connection open. The stream stands only while
its token may read the workspace (services/surfaces/api/standing.py): once it may not (a
revocation, a suspension, a grant taken back), an `event: error` says why and the stream
ends, without `end`.
"""

from __future__ import annotations

import contextlib
import re

import msgspec
import structlog
from aiohttp import web

from events.run import TERMINAL
from events.templates import valid_phase
from infra.eventstore import LATEST
from infra.steplogs import STREAMS, LogError, LogLine
from projections.working import iso
from services.surfaces.api.bodies import check_name
from services.surfaces.api.common import path_id, scope
from services.surfaces.api.context import Api
from services.surfaces.api.follow import Follower
from services.surfaces.api.paths import RUN
from services.surfaces.api.problems import Problem, run_removed
from services.surfaces.api.removed import missing_run
from services.surfaces.api.runlog import Lines, Out, Page, Target, encode_sse
from services.surfaces.api.schemas import INT, STR, Doc
from services.surfaces.api.standing import Lapsed, Standing

log = structlog.get_logger("runplane.api")
_encoder = msgspec.json.Encoder()

_PARAMS = frozenset({"follow", "phase", "step", "offset", "limit"})
MAX_LIMIT = 10_000  # lines of one page
_NUMBER = re.compile(r"^[0-9]{1,12}$")
PHASE_SCHEMA = {"type": "string", "pattern": "^(plan|apply|custom-[1-9][0-9]{0,4})$"}
_FOLLOW = {"1": True, "true": True, "0": False, "false": False, "": False}


def _page(request: web.Request, follow: bool) -> Page | None:
    """`offset` and `limit`, if either is given (not with `follow`)."""
    query = request.query
    if "offset" not in query and "limit" not in query:
        return None
    if follow:
        raise Problem("invalid-query", "offset and limit page a log that is not followed")
    offset, limit = query.get("offset", "0"), query.get("limit", str(MAX_LIMIT))
    if not _NUMBER.match(offset):
        raise Problem("invalid-query", "offset must be a whole number of lines, from 0")
    if not _NUMBER.match(limit) or not 1 <= int(limit) <= MAX_LIMIT:
        raise Problem("invalid-query", f"limit must be a whole number from 1 to {MAX_LIMIT}")
    return Page(int(offset), int(limit))


def _query(request: web.Request) -> tuple[bool, str | None, str | None]:
    """`follow`, `phase` and `step` of the query string; anything unknown is refused."""
    query = request.query
    unknown = sorted(set(query) - _PARAMS)
    if unknown:
        raise Problem("invalid-query", f"unknown query parameter {', '.join(unknown)}")
    follow = query.get("follow", "0").lower()
    if follow not in _FOLLOW:
        raise Problem("invalid-query", "follow must be 1 or 0")
    phase = query.get("phase")
    if phase is not None and not valid_phase(phase):
        raise Problem(
            "invalid-query", "phase must be plan, apply or custom-<number> (a custom step)"
        )
    step = query.get("step")
    return _FOLLOW[follow], phase, None if step is None else check_name("step", step)


async def run_logs(request: web.Request) -> web.StreamResponse:
    api, org, _ = await scope(request, "workspace.read")
    run_id = path_id(request, "run")
    follow, phase, step = _query(request)
    page = _page(request, follow)
    run = await api.read.runs.get(org, run_id)
    if run is None:
        raise await missing_run(api, org, run_id)
    if run["log_removed_at"]:
        raise removed(run["log_removed_at"])
    target = Target(org=org, ws=run["workspace"], run_id=run_id, phase=phase, step=step)
    ended = run["status"] in TERMINAL
    if ended:  # only an ended run's log is ever removed
        await check_kept(api, target)
    nc = api.app.store.nc
    if follow:
        return await _follow_stream(request, api, target)
    lines = Lines(nc, api.read, target, ended=ended, removed=lambda: is_removed(api, target))
    return await _lines_stream(request, api, lines, page)


def removed(at: str) -> Problem:
    """410 `log-removed`: retention removed the run's stored logs at `at` (ISO 8601)."""
    return Problem("log-removed", f"log removed by retention on {at[:10]}", log_removed_at=at)


async def removal(api: Api, target: Target) -> Problem | None:
    """The 410 a read of the run's log answers if retention recorded the removal of its
    logs (`log-removed`, with `log_removed_at`) or of its whole record (`run-removed`,
    with `removed_at`), as the event log's leader has it now (the read model may not
    have folded that record yet); None while the log is kept. The one check of every
    surface that shows a log (this API, the web UI's log page and live view)."""
    state = (await api.app.load_run(target.org, target.ws, target.run_id, min_seq=LATEST)).state
    if state.removed_at is not None:
        return run_removed(target.run_id, iso(state.removed_at))
    if state.log_removed_at is not None:
        return removed(iso(state.log_removed_at))
    return None


async def check_kept(api: Api, target: Target) -> None:
    """Raises `removal`'s 410, if any."""
    if (gone := await removal(api, target)) is not None:
        raise gone


async def is_removed(api: Api, target: Target) -> bool:
    """Whether retention recorded the removal of the run's logs, alone or with its whole
    record (the leader's answer)."""
    return await removal(api, target) is not None


async def _lines_stream(
    request: web.Request, api: Api, lines: Lines, page: Page | None
) -> web.StreamResponse:
    """The JSON answer, written batch by batch. A failure before the first batch is 410
    if retention removed the log meanwhile, else a 503 problem; after it, the connection
    is cut (the client sees an incomplete body, never a 200 that passes for whole)."""
    batches = aiter(lines.batches(page or Page()))
    try:
        first = await anext(batches, None)
    except LogError as e:
        await check_kept(api, lines.target)
        raise Problem("unavailable", f"the log store is unavailable: {e}") from e
    resp = web.StreamResponse(headers={"Cache-Control": "no-cache"})
    resp.content_type = "application/json"
    await resp.prepare(request)
    await resp.write(b'{"items":[' + _items(first or []))
    wrote = bool(first)
    try:
        async for batch in batches:
            if batch:
                await resp.write(b"," + _items(batch) if wrote else _items(batch))
                wrote = True
    except LogError as e:
        # Raising here would reach the problems middleware, whose 500 answer aiohttp then
        # wrote into this 200's body: a client read it as more chunks and hung.
        log.warning("log_read_cut", error=str(e))
        if request.transport is not None:
            request.transport.abort()
        return resp
    tail = b"]"
    if page is not None:
        done = lines.ended and not lines.more
        tail += b',"next_offset":' + (b"null" if done else str(page.offset + lines.count).encode())
    await resp.write(tail + b"}")
    await resp.write_eof()
    return resp


def _items(batch: list[LogLine]) -> bytes:
    return _encoder.encode(batch)[1:-1]


async def _follow_stream(request: web.Request, api: Api, target: Target) -> web.StreamResponse:
    """Server-sent events until the run ends. Once the headers are out, a failure can only
    be told as an `error` event; the client reconnects and skips lines it already has."""
    resp = web.StreamResponse(headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    standing = Standing(request, target.org, target.ws)

    async def send(batch: list[Out]) -> None:
        await standing.check(now=not batch)  # a keep-alive: a quiet stream is checked too
        await resp.write(encode_sse(batch))

    try:
        # A stored log found gone that retention took fails the stream (its `error`
        # says reconnect; the next request is the 410), never RP_LOGS's remains as whole.
        removed = lambda: is_removed(api, target)  # noqa: E731 - a closure over target
        await Follower(api.app.store.nc, target, send, removed=removed).run()
    except Lapsed as e:
        log.info("log_follow_lapsed", reason=str(e))
        with contextlib.suppress(ConnectionError):
            await resp.write(encode_sse([("error", {"detail": f"{e}: the stream ends"})]))
    except ConnectionError:
        log.info("log_follow_client_gone")
    except Exception as e:  # noqa: BLE001 - the response is under way: no problem document now
        log.warning("log_follow_failed", error=repr(e))
        with contextlib.suppress(ConnectionError):
            await send([("error", {"detail": "the log stream failed; reconnect to resume"})])
    return resp


# ---------------------------------------------------------------- OpenAPI


def _param(name: str, what: str, schema: Doc) -> Doc:
    return {"name": name, "in": "query", "required": False, "description": what, "schema": schema}


PARAMETERS: dict[str, Doc] = {
    "log_follow": _param(
        "follow", "1: server-sent events until the run ends", {"enum": ["0", "1", "false", "true"]}
    ),
    "log_phase": _param("phase", "only this phase", PHASE_SCHEMA),
    "log_step": _param("step", "only this step", STR),
    "log_offset": _param(
        "offset", "a page from this line of the answer (0: the first)", {**INT, "minimum": 0}
    ),
    "log_limit": _param(
        "limit", "a page of at most this many lines", {**INT, "minimum": 1, "maximum": MAX_LIMIT}
    ),
}
_LINE: Doc = {
    "type": "object",
    "required": ["phase", "step", "stream", "line", "text"],
    "properties": {
        "phase": PHASE_SCHEMA,
        "step": STR,
        "stream": {"enum": list(STREAMS)},
        "line": {**INT, "description": "1, 2, ... per step, across both streams"},
        "text": {**STR, "description": "masked; without its newline"},
    },
}
_SSE = (
    "`event: line` (data: one item of the JSON answer), `event: step` (data: phase, step, "
    "status running | ok | failed, error, metrics), `event: error` (data: detail; "
    "reconnect), then `event: end` (data: status, reason) once the run is terminal; "
    "comments keep it alive"
)

OPENAPI: Doc = {
    "get": {
        "operationId": "runLogs",
        "summary": "The run's log lines, stdout and stderr apart; followed live with follow=1",
        "parameters": [
            {"$ref": "#/components/parameters/org"},
            {"$ref": "#/components/parameters/run"},
            *({"$ref": f"#/components/parameters/{name}"} for name in PARAMETERS),
            {"$ref": "#/components/parameters/min_seq"},
        ],
        "responses": {
            "200": {
                "description": "the lines, step after step in start order",
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["items"],
                            "properties": {
                                "items": {"type": "array", "items": _LINE},
                                "next_offset": {
                                    "type": ["integer", "null"],
                                    "description": "with offset or limit: the next page's "
                                    "offset; null once the run ended and no line is left",
                                },
                            },
                        }
                    },
                    "text/event-stream": {"schema": {**STR, "description": _SSE}},
                },
            },
            **{
                str(code): {"$ref": f"#/components/responses/{code}"}
                for code in (400, 401, 404, 410, 422, 503)
            },
        },
    }
}


ROUTES = [
    web.get(RUN + "/logs", run_logs, allow_head=False),
]
