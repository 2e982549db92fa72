"""Record retention: the whole record of a run that ended long enough ago is removed (off
unless an organization sets `record_retention_days`, or the deployment
`--record-retention-days`). Part of each retention pass (services/processes/retention.py).

What goes: the run's read-model rows (its row with approvals and cause, its steps with
their metrics, its plan's changes, its resource states: events.run REMOVED_ROWS), its
stored logs (`rp-logs`, and any live lines in RP_LOGS) and its saved plan (`rp-plans`).
What stays: its events. RP_EVENTS denies deletes and purges, and no stream update can
lift that (infra/streams.py): the log is append-only, so the removal is itself an event,
`run.removed` on the run's subject, naming every object with its bucket and SHA-256.
The projection drops the rows when it folds that event, so a replay (which folds the
run's events, then the removal) rebuilds the same read model; the auditor records it in
the organization's chain (actor `retention`, the objects listed in `detail`).

For each organization with record retention on, a pass lists its runs' subjects and
judges each run: never one not ended, nor one ended after the cutoff, nor one still
referenced: held by its workspace (its queue or its active run), or the run of the
workspace's current (or pending) state version. For the others it records `run.removed`
first, then (the readers' grace over, as for logs) deletes the objects, each deletion
idempotent: a pass killed at any line leaves nothing done, or the deletes that the next
pass (of any replica) finishes. Two passes racing record the event once: the append
expects the run's last sequence and the core refuses a second removal.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import ObjectInfo
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from events.errors import DomainError
from events.run import PrunedObject, RemoveRun, RunCommand, RunState
from events.settings import RECORD_RETENTION, days_problem
from executor.statestore import Head, pending_key, ws_key
from infra.directget import InfraError
from infra.kv import STATE_HEAD_BUCKET
from infra.steplogs import log_subject
from infra.streams import EVENTS, LOGS, LOGS_BUCKET, PLANS_BUCKET
from services.app.commands import App

ACTOR = "retention"


class RemovalError(InfraError):
    """A removal could not be judged or recorded (NATS unavailable); the next pass retries."""


def hex_digest(info: ObjectInfo) -> str:
    """The object store's `SHA-256=<base64url>` digest as hex ("" if it has none)."""
    algo, _, value = (info.digest or "").partition("=")
    if algo.upper() != "SHA-256" or not value:
        return ""
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()


async def listed(nc: NATS, bucket: str) -> list[ObjectInfo]:
    """Every object of `bucket` not deleted (none if the bucket does not exist)."""
    store = await nc.jetstream().object_store(bucket)
    try:
        infos = await store.list(ignore_deletes=True)
    except nats.js.errors.NotFoundError:
        return []
    return [i for i in infos if not i.deleted]


async def delete_objects(nc: NATS, bucket: str, infos: Iterable[ObjectInfo]) -> int:
    """Delete each object (chunks first, then its meta): idempotent, a gone one counts 0."""
    js = nc.jetstream()
    store = await js.object_store(bucket)
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    deleted = 0
    for info in infos:
        if info.nuid:
            chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid)
            await js.purge_stream(stream, subject=chunks)
        try:
            await store.delete(info.name)
        except (nats.js.errors.NotFoundError, nats.js.errors.ObjectDeletedError):
            continue
        deleted += 1
    return deleted


class _State(msgspec.Struct, frozen=True):
    subjects: dict[str, int] | None = None


class _Info(msgspec.Struct, frozen=True):
    total: int = 0
    state: _State = _State()


async def subjects(nc: NATS, pattern: str) -> list[str]:
    """Every subject of RP_EVENTS matching `pattern`, from its leader (stream info, paged)."""
    api = f"$JS.API.STREAM.INFO.{EVENTS}"
    out: dict[str, int] = {}
    while True:
        req = msgspec.json.encode({"subjects_filter": pattern, "offset": len(out)})
        try:
            resp = await nc.request(api, req, timeout=10.0)
            info = msgspec.json.decode(resp.data, type=_Info)
        except (TimeoutError, nats.errors.Error, msgspec.DecodeError) as e:
            raise RemovalError(f"listing {pattern}: {e!r}") from e
        page = info.state.subjects
        if not page:
            return sorted(out)
        out.update(page)
        if len(out) >= info.total:
            return sorted(out)


async def state_runs(nc: NATS, org: str, ws: str) -> set[str]:
    """The runs of the workspace's current and pending state versions (the head's KV)."""
    js = nc.jetstream()
    out = set()
    for key in (ws_key(org, ws), pending_key(org, ws)):
        try:
            raw = await js.get_msg(
                f"KV_{STATE_HEAD_BUCKET}", subject=f"$KV.{STATE_HEAD_BUCKET}.{key}"
            )
        except nats.js.errors.NotFoundError:
            continue
        except (TimeoutError, nats.errors.Error) as e:
            raise RemovalError(f"reading the state head of {org}/{ws}: {e!r}") from e
        if (raw.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE) or not raw.data:
            continue
        out.add(msgspec.json.decode(raw.data, type=Head).run_id)
    return out


class Removals:
    """One pass's record removals: `pass_once(now, days_of)`; what it did in its fields."""

    def __init__(
        self,
        nc: NATS,
        app: App,
        *,
        default_days: int,
        grace: timedelta,
        slots: asyncio.Semaphore | None = None,
    ) -> None:
        self.nc = nc
        self.slots = slots or asyncio.Semaphore(16)
        self.app = app
        self.default_days = default_days
        self.grace = grace
        self.removed: list[str] = []  # runs this pass recorded removed
        self.deleted = 0  # objects it deleted (its own and those a killed pass left)
        self.referenced = 0  # runs due but still referenced: kept
        self.waiting = 0  # runs recorded whose objects wait out the readers' grace
        self._done: set[str] = set()  # removed with every object gone (kept across passes)

    async def days(self, org: str) -> int:
        """The organization's record retention in days, 0: never (its setting, else the
        deployment's)."""
        value = (await self.app.load_org(org)).state.settings.get(RECORD_RETENTION)
        ok = isinstance(value, int) and not days_problem(value)
        return int(value) if ok and value is not None else self.default_days

    async def pass_once(self, now: datetime) -> None:
        """Judge every run of every organization that keeps records a limited time."""
        self.removed, self.deleted, self.referenced, self.waiting = [], 0, 0, 0
        orgs = [s.split(".")[2] for s in await subjects(self.nc, "rp.org.*")]
        due = {org: days for org in orgs if (days := await self.days(org)) > 0}
        if not due:
            return
        logs = _by_run(await listed(self.nc, LOGS_BUCKET), lambda n: n.split("/", 1)[0])
        plans = _by_run(await listed(self.nc, PLANS_BUCKET), lambda n: n.removesuffix(".tfplan"))
        for org, days in sorted(due.items()):
            cutoff = now - timedelta(days=days)
            runs = [s.split(".") for s in await subjects(self.nc, f"rp.run.{org}.*.*")]

            async def one(ws: str, run_id: str) -> None:
                objects = [(LOGS_BUCKET, i) for i in logs.get(run_id, [])]
                objects += [(PLANS_BUCKET, i) for i in plans.get(run_id, [])]
                async with self.slots:
                    await self._judge(org, ws, run_id, objects, now, cutoff, days)  # noqa: B023  # awaited in this iteration

            await asyncio.gather(*(one(p[3], p[4]) for p in runs if p[4] not in self._done))

    async def _judge(
        self, org: str, ws: str, run_id: str, objects: list[tuple[str, ObjectInfo]],
        now: datetime, cutoff: datetime, days: int,
    ) -> None:  # fmt: skip
        run = (await self.app.load_run(org, ws, run_id)).state
        recorded = run.removed_at
        if recorded is None:
            if not run.exists or not run.terminal or run.ended_at is None:
                return
            if run.ended_at > cutoff:
                return
            if await self._referenced(run):
                self.referenced += 1
                return
            if await self._record(run, objects, cutoff, days):
                self.removed.append(run_id)
            recorded = now
        if now - recorded < self.grace:
            self.waiting += 1
            return
        for bucket in (LOGS_BUCKET, PLANS_BUCKET):
            # (not `+= await`: the runs' judgements interleave)
            gone = await delete_objects(self.nc, bucket, [i for b, i in objects if b == bucket])
            self.deleted += gone
        await self.nc.jetstream().purge_stream(LOGS, subject=log_subject(run_id, "*", "*"))
        self._done.add(run_id)

    async def _referenced(self, run: RunState) -> bool:
        """Whether something still needs the run: its workspace holds it (queue, active),
        or it wrote the workspace's current or pending state version."""
        ws = (await self.app.load_ws(run.org, run.workspace)).state
        if ws.holds(run.run_id):
            return True
        return run.run_id in await state_runs(self.nc, run.org, run.workspace)

    async def _record(
        self, run: RunState, objects: list[tuple[str, ObjectInfo]], cutoff: datetime, days: int
    ) -> bool:
        """Append `run.removed` (the intent); False if another pass recorded it."""
        named = [
            PrunedObject(name=i.name, sha256=hex_digest(i), size=i.size or 0, bucket=b)
            for b, i in objects
        ]
        command = RemoveRun(actor=ACTOR, objects=named, ended_before=cutoff, days=days)
        return await record_once(self.app, run, command, lambda r: r.removed_at, "removal")


async def record_once(
    app: App,
    run: RunState,
    command: RunCommand,
    recorded: Callable[[RunState], object | None],
    what: str,
) -> bool:
    """Append a pass's intent (`run.removed`, `run.log_pruned`) on the run; False if
    another pass recorded it first (the run's fresh state has it `recorded`), RemovalError
    if the core refused it for any other reason."""
    try:
        await app.run_command(run.org, run.workspace, run.run_id, command)
    except DomainError as e:
        fresh = (await app.load_run(run.org, run.workspace, run.run_id)).state
        if recorded(fresh) is None:
            raise RemovalError(f"{what} of run {run.run_id} refused: {e}") from e
        return False
    return True


def _by_run(infos: list[ObjectInfo], run_of: Callable[[str], str]) -> dict[str, list[ObjectInfo]]:
    out: dict[str, list[ObjectInfo]] = {}
    for info in infos:
        out.setdefault(run_of(info.name), []).append(info)
    return out
