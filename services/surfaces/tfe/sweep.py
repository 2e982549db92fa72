"""The sweep that deletes the configuration versions no run needs, from the store and
from their organization's ledger (services/surfaces/tfe/quota.py).

The sweep (`Sweeper`, in every api process, every `SWEEP_EVERY_S`) deletes:
- a version never uploaded (pending or uploading) `pending_ttl_s` after it was made
  (its upload URL expired long before: `UPLOAD_TTL_S`);
- an uploaded version no run used, `unused_ttl_s` after its upload;
- a consumed version once every run made of it is over (terminal): the executor reads
  the archive at both phases' checkout, so a run waiting for approval (for days) keeps
  it; once the run is over nothing reads it again (the run's events keep its digest and
  size for the audit, and runplane never re-plans an ended run: a new plan is a new run
  of a new upload). A run named by a claim that never landed (the api died between the
  claim and `run.created`) holds it `CLAIM_GRACE_S`.
Deleting is three steps, each safe to repeat and to run on two replicas at once: mark
the entries `expiring` (CAS: a claim or an upload racing it loses, or wins and the
entry is no longer expired), delete their objects (one already gone is fine), remove the
entries (CAS; only those still `expiring`). Every `ORPHANS_EVERY` sweeps, the objects
under `tfe-config/` that no ledger names and that were stored more than the pending TTL
ago are deleted too (`Sweeper.sweep_orphans`): versions made before the ledger existed,
or an archive whose api died in the one window that can leave one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from aiohttp import web

from executor.objects import PLANS_BUCKET
from infra.tasks import cancel_and_wait
from services.surfaces.tfe.quota import Conflict, Entry, Ledger, Quota

log = structlog.get_logger(__name__)

SWEEP_EVERY_S = 300.0
ORPHANS_EVERY = 12  # sweeps: the orphans' listing of the whole bucket, hourly
CLAIM_GRACE_S = 3600.0
_NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)

RunOver = Callable[[str, str, str], Awaitable[bool | None]]
"""(org, ws, run) -> True if the run is over, False if not, None if there is no such run."""


@dataclass(frozen=True)
class Sweeper:
    """Deletes the configuration versions no run needs (module docstring)."""

    quota: Quota
    run_over: RunOver
    names: Callable[[str, str, str], tuple[str, ...]]  # (org, ws, cv) -> its objects
    prefix: str = "tfe-config"  # what the versions' object names start with

    async def sweep(self, now: datetime) -> int:
        """One pass over every organization's ledger; how many versions this pass
        marked for deletion (another sweep at once may have marked others)."""
        deleted = 0
        for org in await self.quota.orgs():
            deleted += await self.sweep_org(org, now)
        return deleted

    async def sweep_org(self, org: str, now: datetime) -> int:
        led = await self.quota.ledger(org)
        doomed = {cv for cv, e in led.versions.items() if await self._expired(org, e, now)}
        if not doomed:
            return 0

        mine: set[str] = set()

        def mark(cur: Ledger) -> Ledger | None:
            # decided again on what is stored now: a claim may have landed since
            mine.clear()
            changed = {
                cv: msgspec.structs.replace(e, state="expiring")
                for cv, e in cur.versions.items()
                if cv in doomed
                and e.state == led.versions[cv].state
                and e.runs == led.versions[cv].runs
                and e.state != "expiring"
            }
            if not changed:
                return None
            mine.update(changed)
            return Ledger(versions={**cur.versions, **changed})

        marked = await self.quota.change(org, mark)
        going = {cv: e for cv, e in marked.versions.items() if e.state == "expiring"}
        store = await self.quota.js.object_store(PLANS_BUCKET)
        for cv, e in going.items():
            for name in self.names(org, e.ws, cv):
                with contextlib.suppress(nats.js.errors.ObjectNotFoundError):
                    await store.delete(name)

        def remove(cur: Ledger) -> Ledger | None:
            kept = {
                cv: e
                for cv, e in cur.versions.items()
                if not (cv in going and e.state == "expiring")
            }
            return Ledger(versions=kept) if len(kept) != len(cur.versions) else None

        await self.quota.change(org, remove)
        if going:
            log.info("tfe_configs_swept", org=org, versions=len(going), marked=len(mine))
        return len(mine)

    async def sweep_orphans(self, now: datetime) -> int:
        """Delete the configuration objects no ledger names, stored more than the
        pending TTL ago: those of versions made before the ledger existed, or the
        archive of an upload whose api died just after a sweep took its version. A
        listing of the whole bucket (plans too): run seldom (`ORPHANS_EVERY`)."""
        store = await self.quota.js.object_store(PLANS_BUCKET)
        try:
            infos = await store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return 0
        old = now - timedelta(seconds=self.quota.limits.pending_ttl_s)
        ledgers: dict[str, Ledger] = {}
        deleted = 0
        for info in infos:
            parts = (info.name or "").split("/")
            if len(parts) != 4 or parts[0] != self.prefix or not info.mtime:
                continue
            org, cv = parts[1], parts[3].removesuffix(".tar.gz").removesuffix(".json")
            try:
                stored_at = datetime.fromisoformat(info.mtime)
            except ValueError:
                continue
            if stored_at.tzinfo is None or stored_at > old:
                continue
            if org not in ledgers:
                ledgers[org] = await self.quota.ledger(org)
            if cv in ledgers[org].versions:
                continue
            with contextlib.suppress(nats.js.errors.ObjectNotFoundError):
                await store.delete(info.name)
                deleted += 1
        if deleted:
            log.info("tfe_configs_orphans_deleted", objects=deleted)
        return deleted

    async def _expired(self, org: str, e: Entry, now: datetime) -> bool:
        limits = self.quota.limits
        if e.state == "expiring":
            return True  # a sweep that stopped half way: finish it
        if e.state in ("pending", "uploading"):
            return now - e.created_at > timedelta(seconds=limits.pending_ttl_s)
        unused = e.uploaded_at is not None and now - e.uploaded_at > timedelta(
            seconds=limits.unused_ttl_s
        )
        if e.state == "uploaded":
            return unused
        # consumed: every run made of it over; a claim whose run never landed holds it
        # CLAIM_GRACE_S (and the version then counts as unused)
        found = [await self.run_over(org, e.ws, run) for run in e.runs]
        if all(f is None for f in found):
            late = e.consumed_at is None or now - e.consumed_at > timedelta(seconds=CLAIM_GRACE_S)
            return late and unused
        if any(f is False for f in found):
            return False
        if any(f is None for f in found):
            return e.consumed_at is None or now - e.consumed_at > timedelta(seconds=CLAIM_GRACE_S)
        return True


SWEEPER: web.AppKey[Sweeper | None] = web.AppKey("runplane.tfe.sweeper", Sweeper)


def sweeping(
    sweeper: Sweeper, clock: Callable[[], datetime], every: float | None = None
) -> Callable[[web.Application], AsyncIterator[None]]:
    """An aiohttp cleanup context sweeping every `every` seconds (`SWEEP_EVERY_S`; the
    first after a random part of it: replicas started together do not sweep together,
    though they may), and for orphans every `ORPHANS_EVERY` sweeps."""
    period = SWEEP_EVERY_S if every is None else every

    async def loop() -> None:
        await asyncio.sleep(random.uniform(0.1, 1.0) * period)
        for n in itertools.count():
            try:
                await sweeper.sweep(clock())
                if n % ORPHANS_EVERY == 0:
                    await sweeper.sweep_orphans(clock())
            except (*_NATS_ERRORS, Conflict) as e:
                log.warning("tfe_configs_sweep_failed", error=repr(e))
            except Exception:  # a bug must not end the sweeping for the process's life
                log.exception("tfe_configs_sweep_crashed")
            await asyncio.sleep(period)

    async def ctx(_: web.Application) -> AsyncIterator[None]:
        task: asyncio.Task[Any] = asyncio.create_task(loop())
        try:
            yield
        finally:
            await cancel_and_wait(task)

    return ctx
