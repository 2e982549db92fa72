"""The UI's live parts, as server-sent events of HTML fragments (htmx's sse extension
swaps them in; without script the pages are whole at load and a reload shows news).

- `/orgs/{org}/live`: the active runs bar, sent again whenever it changes.
- `/orgs/{org}/runs/{run}/live`: the run's log lines as they come (through the API's own
  follower, services/surfaces/api/follow.py, so the UI costs no consumer of its own), stdout and
  stderr apart, each with its `id` so a reconnecting browser (`Last-Event-ID`) skips
  what it has; the run's status, steps and per-resource apply states, sent again when
  they change; `end` once the run is over (the page then closes the stream).

Every fragment is rendered by the same autoescaped templates as the pages: a log line
or a resource address is text, never markup.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp_jinja2
import structlog
from aiohttp import web

from events.run import TERMINAL
from events.templates import valid_phase
from infra.steplogs import LogError
from services.surfaces.api.bodies import check_name
from services.surfaces.api.context import Api
from services.surfaces.api.follow import Follower
from services.surfaces.api.logs import is_removed, removal
from services.surfaces.api.problems import Problem
from services.surfaces.api.removed import missing_run
from services.surfaces.api.runlog import Lines, Out, Target
from services.surfaces.ui import pages
from services.surfaces.ui.web import JINJA, Visit, base, page, render, still_signed_in

log = structlog.get_logger("runplane.ui")

KEEPALIVE_S = 15.0
WATCH_S = 1.0  # how often a stream looks whether the projection moved


def fragment(request: web.Request, name: str, context: dict[str, Any]) -> str:
    env = aiohttp_jinja2.get_env(request.app, app_key=JINJA)
    return str(env.get_template(name).render(context))


def sse(event: str, html: str, event_id: str | None = None) -> bytes:
    """One event; every line of the fragment is a `data:` line (the client rejoins them)."""
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id else "")
    body = "".join(f"data: {line}\n" for line in html.replace("\r", "").split("\n"))
    return (head + body + "\n").encode()


async def _open(visit: Visit) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
    resp.content_type = "text/event-stream"
    await resp.prepare(visit.request)
    return resp


class Closing(Exception):
    """The api process is stopping: every live stream ends (the browser reconnects to
    another replica, or to this one once it is back)."""

    retryable = True


async def _moved(visit: Visit, seen: int, timeout: float) -> int:
    """The projection's sequence once past `seen`, or as it is after `timeout`; Closing
    once the process stops (a stream never holds up its shutdown)."""
    projector, closing = visit.api.projector, visit.request.app[CLOSING]
    moved = asyncio.ensure_future(projector.wait_for(seen + 1, timeout=timeout))
    stop = asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait((moved, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (moved, stop):
            task.cancel()
        await asyncio.gather(moved, stop, return_exceptions=True)
    if closing.is_set():
        raise Closing
    if not await still_signed_in(visit):  # revoked, expired, suspended: the stream ends
        raise Closing
    return int(projector.seq)


CLOSING: web.AppKey[asyncio.Event] = web.AppKey("runplane.ui.closing", asyncio.Event)


async def close_streams(app: web.Application) -> None:
    """on_shutdown: end the live streams."""
    app[CLOSING].set()


@page("org.read")
async def bar_feed(visit: Visit) -> web.StreamResponse:
    """The active runs bar, each time it changes, until the browser goes."""
    resp = await _open(visit)
    last = ""
    seen = -1
    with contextlib.suppress(ConnectionError, Closing):
        while True:
            seq = await _moved(visit, seen, KEEPALIVE_S)
            if seq == seen:
                await resp.write(b": keep-alive\n\n")
                continue
            seen = seq
            html = fragment(visit.request, "_bar.html", await base(visit))
            if html != last:
                last = html
                await resp.write(sse("bar", html))
    return resp


@page("workspace.read")
async def run_feed(visit: Visit) -> web.StreamResponse:
    """The run's log, status and resource states live, until it ends."""
    run_id = visit.path_id("run")
    run = await visit.api.read.runs.get(visit.org, run_id)
    if run is None:
        raise await missing_run(visit.api, visit.org, run_id)
    skip = _last_event_id(visit.request)
    target = Target(org=visit.org, ws=run["workspace"], run_id=run_id)
    gone = None
    if run["status"] in TERMINAL and not run["log_removed_at"]:
        gone = await _removal(visit.api, target)  # the read model may not have it yet
    resp = await _open(visit)
    feed = _RunFeed(visit, run, resp, skip, gone)
    with contextlib.suppress(ConnectionError, Closing):
        try:
            await feed.run()
        except (ConnectionError, Closing):
            raise
        except Exception as e:  # noqa: BLE001 - the answer is under way: an event, not a page
            log.warning("ui_run_feed_failed", error=repr(e))
            await resp.write(sse("error", "the live view stopped; reload the page"))
    return resp


def _last_event_id(request: web.Request) -> int:
    raw = request.headers.get("Last-Event-ID", "")
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 12 else 0


class _RunFeed:
    """One browser's run stream: the follower's lines, and the state when it moves."""

    def __init__(
        self,
        visit: Visit,
        run: dict[str, Any],
        resp: web.StreamResponse,
        skip: int,
        gone: str | None = None,
    ) -> None:
        self.gone = gone  # when retention removed the log, if the read model lags
        self.visit = visit
        self.row = run
        self.resp = resp
        self.skip = skip
        self.sent = 0  # lines counted, sent or skipped
        self.lock = asyncio.Lock()
        self.last_state = ""

    async def run(self) -> None:
        if self.row.get("log_removed_at"):  # retention removed it: no line to send
            await self._state()
            await self._write(sse("end", "ended"))
            return
        if self.gone is not None:
            await self._removed(self.gone)
            return
        api = self.visit.api
        target = Target(org=self.visit.org, ws=self.row["workspace"], run_id=self.row["id"])
        follower = Follower(
            api.app.store.nc, target, self._lines, keepalive=KEEPALIVE_S,
            removed=lambda: is_removed(api, target),
        )  # fmt: skip
        follow = asyncio.create_task(follower.run())
        watch = asyncio.create_task(self._watch())
        try:
            done, _ = await asyncio.wait((follow, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (follow, watch):
                task.cancel()
            await asyncio.gather(follow, watch, return_exceptions=True)
        if follow not in done:  # the watch ended: the browser went, or the process stops
            raise watch.exception() or Closing()
        if (error := follow.exception()) is not None:
            if isinstance(error, LogError) and (at := await _removal(api, target)) is not None:
                await self._removed(at)
                return
            raise error
        await api.reached(await api.app.store.last_seq(), api.read_wait)  # the run's end
        await self._state()
        await self._write(sse("end", "ended"))

    async def _removed(self, at: str) -> None:
        """Retention removed the log (the read model did not say so yet): the log's place
        says when, never an empty log that passes for whole."""
        text = f"Log removed by retention on {at[:10]}."
        html = fragment(self.visit.request, "_removed.html", {"text": text})
        await self._write(sse("line", html))
        await self._state()
        await self._write(sse("end", "ended"))

    async def _write(self, data: bytes) -> None:
        async with self.lock:
            await self.resp.write(data)

    async def _lines(self, batch: list[Out]) -> None:
        if not batch:
            await self._write(b": keep-alive\n\n")
            return
        out = []
        for name, data in batch:
            if name != "line":
                continue
            self.sent += 1
            if self.sent <= self.skip:
                continue
            html = fragment(self.visit.request, "_line.html", {"line": data})
            out.append(sse("line", html, str(self.sent)))
        if out:
            await self._write(b"".join(out))

    async def _watch(self) -> None:
        seen = -1
        while True:
            seq = await _moved(self.visit, seen, KEEPALIVE_S)
            if seq != seen:
                seen = seq
                await self._state()

    async def _state(self) -> None:
        """Status, steps and resources, if they changed since last sent."""
        run = await self.visit.api.read.runs.get(self.visit.org, self.row["id"])
        if run is None:
            return
        context = await pages.run_context(self.visit, run)
        html = fragment(
            self.visit.request,
            "_run_live.html",
            {"visit": self.visit, "org": self.visit.org, **context},
        )
        if html != self.last_state:
            self.last_state = html
            await self._write(sse("state", html))


async def _removal(api: Api, target: Target) -> str | None:
    """When retention removed the run's log, as the event log's leader has it (the API's
    own check, services/surfaces/api/logs.py `removal`), else None; the run's whole
    record removed is its 410 page."""
    gone = await removal(api, target)
    if gone is None:
        return None
    if gone.slug == "run-removed":
        raise gone
    return str(gone.extra["log_removed_at"])


def _step_query(request: web.Request) -> tuple[str | None, str | None]:
    """`phase` and `step` of a step's own log (both or neither)."""
    phase, step = request.query.get("phase"), request.query.get("step")
    if phase is None and step is None:
        return None, None
    if phase is None or step is None or not valid_phase(phase):
        raise Problem("invalid-query", "a step's log needs phase (plan, apply, custom-N) and step")
    return phase, check_name("step", step)


@page("workspace.read")
async def log_page(visit: Visit) -> web.StreamResponse:
    """The whole log as a page, for a browser without script (and for keeping)."""
    run_id = visit.path_id("run")
    run = await visit.api.read.runs.get(visit.org, run_id)
    if run is None:
        raise await missing_run(visit.api, visit.org, run_id)
    phase, step = _step_query(visit.request)
    target = Target(org=visit.org, ws=run["workspace"], run_id=run_id, phase=phase, step=step)
    gone = run["log_removed_at"]
    if not gone and run["status"] in TERMINAL:  # the read model may not have it yet
        gone = await _removal(visit.api, target)
    shown = [] if gone else await _shown(visit.api, target)
    if isinstance(shown, str):  # found removed while read
        shown, gone = [], shown
    context = await base(
        visit, run={**run, "log_removed_at": gone}, lines=shown, phase=phase, step=step
    )
    return render(visit.request, "log.html", context)


async def _shown(api: Api, target: Target) -> list[Any] | str:
    """The log's first 20,000 lines, or when retention removed it (found while read)."""
    lines = Lines(
        api.app.store.nc, api.read, target, ended=True, removed=lambda: is_removed(api, target)
    )
    shown: list[Any] = []
    try:
        async for batch in lines.batches():
            shown.extend(batch)
            if len(shown) >= 20_000:
                break
    except LogError as e:
        if (at := await _removal(api, target)) is not None:
            return at
        raise Problem("unavailable", f"the log store is unavailable: {e}") from e
    return shown
