"""Terraform's `http` backend, served by the executor on loopback for the length of a phase.

Terraform finds it through `TF_HTTP_*` environment variables (the override file written
into the working directory only says `backend "http" {}`): addresses taken from the
environment are not stored in the plan file, so the apply phase, on another port or
another executor, serves the same state. Basic auth with a password drawn per phase keeps
other local processes out.

- `GET`: the workspace's current state version; a workspace with none gets an empty
  initial state (see `executor.statestore.initial_state` for why not a 404);
- `POST`: a new version, accepted only from the holder of the lock; it is sealed into
  `rp-state`, recorded on the run (`RecordStateVersion`, fenced by the lease: a zombie's
  write is refused and Terraform keeps it in `errored.tfstate`), and the head moves with
  optimistic concurrency;
- `LOCK` / `UNLOCK`: the lock in KV. A second locker gets 423 and the holder's lock info,
  without its `ID`: the ID is what a write or an unlock must name, and any process of a
  phase may ask (Terraform needs none to report the lock). A lock whose run has ended (or
  moved on to a later phase) is dead and is broken.

One write at a time: a `POST` while another is being received or stored is refused (429),
so what a phase spools in `<work>/unsaved-state/` outside its caps is at most one state
of `--state-max-mb` (Terraform itself never writes two at once).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import os
import secrets
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

import structlog
from aiohttp import web

from events.errors import DomainError
from events.run import RecordStateVersion, RunCommand, RunState
from executor.linksafe import write_new
from executor.ports import RunReader
from executor.statefile import CHUNK, StateFile, StateRefused, StateTooLarge, continues
from executor.statehead import current_head
from executor.statestore import (
    Head,
    HeadMoved,
    LockRecord,
    StateStore,
    StateStoreError,
    initial_state,
)
from infra import jsonbody
from infra.eventstore import LATEST, StoreError

log = structlog.get_logger(__name__)

OVERRIDE_FILE = "runplane_backend_override.tf"
OVERRIDE = """\
# Written by runplane for this step: state is served by the executor (TF_HTTP_* settings).
terraform {
  backend "http" {
    lock_method   = "LOCK"
    unlock_method = "UNLOCK"
  }
}
"""
USER = "runplane"
# aiohttp's own bound on a body read whole: the lock's. A state is streamed to a file,
# bounded by the deployment's --state-max-mb (executor/statefile.py).
MAX_LOCK_BODY = 1024 * 1024
ERRORED_STATE = "errored.tfstate"
# Pauses between tries to record a new state while NATS is away (about 30 s in all):
# Terraform waits on its POST meanwhile; after that it keeps `errored.tfstate`.
RECORD_BACKOFF = (0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0)
# Terraform's own tries of a request that fails (no answer, or a 5xx): 2 more, after 2 s
# and 4 s. This is also the grace a killed executor's Terraform gets: on its parent death
# signal it first tries to save the state it has (these 6 s against a dead backend), and
# only then stops what is in flight (a provisioner stopped then taints its resource);
# meanwhile its apply goes on. Then 6 s more to save at the end, and `errored.tfstate`
# (Terraform's 1.0 default of 1 s and 2 s stopped a 4 s provisioner half way).
RETRY_MAX, RETRY_WAIT_MIN_S, RETRY_WAIT_MAX_S = 2, 2, 4
T = TypeVar("T")


class Lessee(Protocol):
    """The phase a backend serves: whose lease it is (an `executor.job.PhaseContext`).
    One with a `keep_dir` keeps each state received there until it is recorded."""

    @property
    def org(self) -> str: ...

    @property
    def ws(self) -> str: ...

    @property
    def run_id(self) -> str: ...

    @property
    def lease_id(self) -> str: ...

    @property
    def executor_id(self) -> str: ...

    @property
    def actor(self) -> str: ...


# How the phase reports to its run (`executor.job.Job.report`: masked, fenced by the lease).
Report = Callable[[RunCommand], Awaitable[None]]


def write_override(workdir: Path, *, within: Path | None = None) -> Path:
    """Point the configuration at the http backend (replacing any backend it declares).

    A repository's own file of that name is replaced, never written through: it may be a
    link to anywhere (executor/linksafe.py). `within`: the checkout `workdir` must be in."""
    path = workdir / OVERRIDE_FILE
    return write_new(path, OVERRIDE.encode(), within=within or workdir, step="init", mode=0o644)


def _text(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message + "\n")


async def _retrying(attempt: Callable[[], Awaitable[T]]) -> T:
    """Try a step of storing a new state until it lands while NATS is away (bounded:
    `RECORD_BACKOFF`); a refusal (not retryable) is raised at once."""
    for pause in RECORD_BACKOFF:
        try:
            return await attempt()
        except (StateStoreError, StoreError) as e:
            if not e.retryable:
                raise
            log.warning("state_version_retry", error=str(e), pause=pause)
            await asyncio.sleep(pause)
    return await attempt()


def _spool(lessee: Lessee) -> Path:
    """Where a state being received is written: the phase's keep directory (the
    executor's, never the job's), else the system's temporary directory."""
    keep: Path | None = getattr(lessee, "keep_dir", None)
    return keep if keep is not None else Path(tempfile.gettempdir())


def _keep(lessee: Lessee, incoming: StateFile, serial: int) -> Path | None:
    """Keep a state received in `<work>/unsaved-state/` (0600) until it is recorded."""
    keep: Path | None = getattr(lessee, "keep_dir", None)
    if keep is None:
        return None
    incoming.move(keep / f"{lessee.org}.{lessee.ws}.{lessee.run_id}.{serial}.tfstate")
    return incoming.path


class StateBackend:
    """One phase's state server; an async context manager. `env()` configures Terraform."""

    def __init__(
        self,
        lessee: Lessee,
        store: StateStore,
        *,
        runs: RunReader,
        report: Report,
        socket: Path | None = None,
    ) -> None:
        self.lessee = lessee
        # also served there (a job without a network reaches it through its init)
        self.socket = socket
        self.store = store
        self.runs = runs  # what the backend reads of the runs: pushes, records, dead locks
        self.report = report
        self.password = secrets.token_urlsafe(24)
        self.url = ""
        self.problems: list[str] = []  # why a request was refused, for the run's error
        self._head: Head | None = None
        self._revision = 0
        self._read = False
        self._locked_by_us = False  # a LOCK of ours served and no UNLOCK of it since
        self.served: dict[str, int] = {}  # requests by method, logged at the end
        self._writing = False  # a POST is in flight: the next is refused
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> StateBackend:
        app = web.Application(middlewares=[self._auth], client_max_size=MAX_LOCK_BODY)
        for method, handler in (
            ("GET", self._get),
            ("POST", self._post),
            ("LOCK", self._lock),
            ("UNLOCK", self._unlock),
        ):
            app.router.add_route(method, "/state", handler)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/state"
        if self.socket is not None:
            await web.UnixSite(self._runner, str(self.socket)).start()
            os.chmod(self.socket, 0o666)  # the job's uid connects; basic auth keeps others out
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._release_ours()
        finally:
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None

    def env(self) -> dict[str, str]:
        """Terraform's http backend settings, by environment so no plan file keeps them."""
        return {
            "TF_HTTP_ADDRESS": self.url,
            "TF_HTTP_LOCK_ADDRESS": self.url,
            "TF_HTTP_UNLOCK_ADDRESS": self.url,
            "TF_HTTP_UPDATE_METHOD": "POST",
            "TF_HTTP_LOCK_METHOD": "LOCK",
            "TF_HTTP_UNLOCK_METHOD": "UNLOCK",
            "TF_HTTP_USERNAME": USER,
            "TF_HTTP_PASSWORD": self.password,
            "TF_HTTP_RETRY_MAX": str(RETRY_MAX),
            "TF_HTTP_RETRY_WAIT_MIN": str(RETRY_WAIT_MIN_S),
            "TF_HTTP_RETRY_WAIT_MAX": str(RETRY_WAIT_MAX_S),
        }

    # ------------------------------------------------------------ plumbing

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not self._authorized(request.headers.get("Authorization", "")):
            return _text(401, "authentication required")
        self.served[request.method] = self.served.get(request.method, 0) + 1
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except StateStoreError as e:
            return self._refuse(503, str(e))

    def _authorized(self, header: str) -> bool:
        scheme, _, encoded = header.partition(" ")
        try:
            user, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        expected = f"{USER}:{self.password}".encode()
        given = f"{user}:{password}".encode()
        return scheme.lower() == "basic" and hmac.compare_digest(given, expected)

    def _refuse(self, status: int, message: str) -> web.Response:
        self.problems.append(message)
        log.warning("state_request_refused", status=status, why=message)
        return _text(status, message)

    # ------------------------------------------------------------ state

    async def _get(self, request: web.Request) -> web.Response:
        self._head, self._revision = await current_head(
            self.store, self.runs, self.lessee.org, self.lessee.ws
        )
        self._read = True
        if self._head is None:
            data = initial_state(self.lessee.org, self.lessee.ws)
            return web.Response(body=data, content_type="application/json")
        data = await self.store.read(self._head)
        return web.Response(body=data, content_type="application/json")

    async def _post(self, request: web.Request) -> web.Response:
        """A new version: from the lock's holder only (checked before the body is read),
        received into a file up to the deployment's bound, and taken only if it is a
        Terraform state that continues the workspace's (executor/statefile.py)."""
        if self._writing:
            return self._refuse(429, "refusing a state write while another is in progress")
        self._writing = True
        try:
            return await self._write(request)
        finally:
            self._writing = False

    async def _write(self, request: web.Request) -> web.Response:
        holder, _ = await self.store.holder(self.lessee.org, self.lessee.ws)
        if not self._holds(holder, request.query.get("ID", "")):
            return self._refuse(409, "refusing a state write from a step that holds no lock")
        limit = self.store.quotas.state_max_bytes
        try:
            incoming = await StateFile.receive(
                request.content.iter_chunked(CHUNK),
                _spool(self.lessee),
                limit,
                announced=request.content_length,
            )
        except StateTooLarge as e:
            return self._refuse_state(e)
        with incoming:
            return await self._take(incoming)

    async def _take(self, incoming: StateFile) -> web.Response:
        if not self._read:
            self._head, self._revision = await current_head(
                self.store, self.runs, self.lessee.org, self.lessee.ws
            )
        if self._head is not None and incoming.digest == self._head.digest:
            return _text(200, "unchanged")
        now = self._head
        try:
            serial, lineage = await asyncio.to_thread(incoming.parse)
            continues(
                (now.serial, now.lineage, now.digest) if now is not None else None,
                serial,
                lineage,
                incoming.digest,
            )
        except StateRefused as e:
            return self._refuse_state(e)
        kept = _keep(self.lessee, incoming, serial)  # on disk until recorded: a restart records it
        lease = self.lessee
        try:
            head = await _retrying(
                lambda: self.store.put_state(
                    lease.org, lease.ws, incoming, (serial, lineage), head=now, run_id=lease.run_id
                )
            )
        except StateRefused as e:  # a quota: nothing stored, so nothing to recover either
            if kept is not None:
                kept.unlink(missing_ok=True)
            return self._refuse_state(e)
        response = await self._record(head)
        if response.status == 200 and kept is not None:
            kept.unlink(missing_ok=True)
        return response

    def _refuse_state(self, e: StateRefused) -> web.Response:
        return self._refuse(e.status, f"{e.kind}: {e}")

    async def _record(self, head: Head) -> web.Response:
        """Record the version on the run (fenced), then move the head; pending between
        the two, so a crash there is repaired by the next reader (`current_head`)."""
        lease = self.lessee
        await _retrying(lambda: self.store.mark_pending(lease.org, lease.ws, head))
        record = RecordStateVersion(
            actor=lease.actor,
            lease_id=lease.lease_id,
            serial=head.serial,
            lineage=head.lineage,
            digest=head.digest,
            object=head.object,
            size=head.size,
        )
        try:
            await _retrying(lambda: self.report(record))
        except DomainError as e:
            # Never recorded: not a version. Its sealed object is kept: objects are named
            # by serial and content, so it may be one a head names (the same state written
            # by another run or a CLI push). The pending mark is cleared only if it is
            # still this write's.
            with contextlib.suppress(StateStoreError):
                if await self.store.pending(lease.org, lease.ws) == head:
                    await self.store.clear_pending(lease.org, lease.ws)
            return self._refuse(409, f"state version not recorded: {e}")
        try:
            self._revision = await self.store.move_head(lease.org, lease.ws, head, self._revision)
        except HeadMoved as e:
            log.error("state_head_moved", object=head.object)
            return self._refuse(409, str(e))
        self._head = head
        await self.store.clear_pending(lease.org, lease.ws)
        log.info("state_version_stored", serial=head.serial, object=head.object)
        return _text(200, "stored")

    # ------------------------------------------------------------ locks

    def _holds(self, holder: LockRecord | None, lock_id: str) -> bool:
        return (
            holder is not None
            and holder.lease_id == self.lessee.lease_id
            and (holder.id == lock_id)
        )

    async def _lock(self, request: web.Request) -> web.Response:
        try:
            info = jsonbody.decode(await request.read())  # too deep, a key twice: refused
            record = self._record_of(info)
        except (ValueError, KeyError, TypeError):
            return self._refuse(400, "not a Terraform lock")
        self._locked_by_us = True  # (or maybe: a lost answer may still have taken it)
        holder, revision = await self.store.lock(record)
        if holder is None or self._holds(holder, record.id):
            return _text(200, "locked")
        if await self._dead(holder) and await self.store.take_over(record, revision):
            log.warning("state_lock_broken", holder_run=holder.run_id, holder=holder.lease_id)
            return _text(200, "locked (a dead run's lock was broken)")
        return self._locked(holder)

    def _record_of(self, info: dict[str, Any]) -> LockRecord:
        lease = self.lessee
        return LockRecord(
            id=str(info["ID"]),
            info=info,
            org=lease.org,
            ws=lease.ws,
            run_id=lease.run_id,
            lease_id=lease.lease_id,
            executor_id=lease.executor_id,
        )

    def _locked(self, holder: LockRecord) -> web.Response:
        """423 with the holder's lock info, which Terraform prints, but not its ID."""
        by = f"runplane run {holder.run_id} (executor {holder.executor_id})"
        info = {k: v for k, v in holder.info.items() if k != "ID"}
        info["Info"] = holder.info.get("Info") or by
        self.problems.append(f"the state is locked by {by}")
        return web.json_response(info, status=423)

    async def _dead(self, holder: LockRecord) -> bool:
        """A lock is dead once its run has ended, or the same run moved to a later lease."""
        # As the leader has it: a follower behind keeps a dead lock alive.
        loaded = await self.runs.load_run(holder.org, holder.ws, holder.run_id, min_seq=LATEST)
        run: RunState = loaded.state
        if not run.exists or run.terminal:
            return True
        return holder.run_id == self.lessee.run_id and holder.lease_id != run.lease_id

    async def _unlock(self, request: web.Request) -> web.Response:
        try:
            lock_id = str(jsonbody.decode(await request.read())["ID"])
        except (ValueError, KeyError, TypeError):
            return self._refuse(400, "not a Terraform lock")
        holder, revision = await self.store.holder(self.lessee.org, self.lessee.ws)
        if holder is None:
            return _text(200, "not locked")
        if holder.id != lock_id:
            return self._locked(holder)
        await self.store.unlock(self.lessee.org, self.lessee.ws, revision)
        self._locked_by_us = holder.lease_id != self.lessee.lease_id
        return _text(200, "unlocked")

    async def _release_ours(self) -> None:
        """At the end of the phase no Terraform of ours runs: release a lock it left (none
        to look for if every LOCK it asked was followed by its UNLOCK: one round trip less
        per phase)."""
        log.info("state_backend_served", requests=self.served)
        if not self._locked_by_us:
            return
        try:
            holder, revision = await self.store.holder(self.lessee.org, self.lessee.ws)
            if holder is not None and holder.lease_id == self.lessee.lease_id:
                await self.store.unlock(self.lessee.org, self.lessee.ws, revision)
                log.warning("state_lock_released", lock_id=holder.id)
        except StateStoreError as e:  # the next run breaks it once this one has ended
            log.warning("state_lock_not_released", error=str(e))
