"""How much of the shared object store an organization's configuration uploads may hold:
the ledger of its configuration versions (the sweep that deletes the ones no run needs
is services/surfaces/tfe/sweep.py).

`rp-plans` is one bucket for every tenant, and anyone with an operator's token can make
configuration versions (services/surfaces/tfe/configs.py), each up to `MAX_UPLOAD`: without a
bound one organization could fill the store for all. So each organization has a ledger,
one key `<org>` in the KV bucket `rp-tfe-configs` (infra/kv.py), naming every
configuration version it has in the store with its state and the bytes it holds:

- `pending` (made, no archive yet; 0 bytes), `uploading` (a PUT is being received: the
  bytes it announced, or `MAX_UPLOAD` when it announced none, are reserved before its
  body is read), `uploaded` (its archive's size), `consumed` (a run was made of it: the
  runs named), `expiring` (being deleted by a sweep).
- Limits (`Limits`, deployment settings): at most `pending_per_workspace` versions of a
  workspace that no run has used (pending, uploading or uploaded); at most
  `versions_per_org` entries in all (this bounds the ledger itself); at most
  `bytes_per_org` bytes held, consumed versions included (they are in the store until
  their runs end). A refusal is a 422 `configuration quota exceeded` that names the
  limit and how to free it, and writes nothing.

The ledger is changed only by compare-and-set on its revision (`kv.update(last=...)`),
so api replicas never both take the last slot, and it is what is stored, not a
per-process count: a crash leaves at worst an entry reserved for nothing, which its
expiry frees. An entry is written before its objects and removed after them, so the
store never holds an object the ledger does not count.

The sweep (services/surfaces/tfe/sweep.py) deletes the versions no run needs: it marks
their entries `expiring`, deletes their objects, then removes the entries.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from infra.kv import TFE_CONFIGS_BUCKET, stored_keys
from services.surfaces.tfe.jsonapi import TfeError

PENDING_PER_WORKSPACE_ENV = "RUNPLANE_TFE_CONFIG_PENDING_PER_WORKSPACE"
VERSIONS_PER_ORG_ENV = "RUNPLANE_TFE_CONFIG_VERSIONS_PER_ORG"
MB_PER_ORG_ENV = "RUNPLANE_TFE_CONFIG_MB_PER_ORG"
UNUSED_TTL_ENV = "RUNPLANE_TFE_CONFIG_UNUSED_TTL_S"
PENDING_TTL_ENV = "RUNPLANE_TFE_CONFIG_PENDING_TTL_S"

QUOTA_TITLE = "configuration quota exceeded"
RUNS_PER_VERSION = 20  # the CLI makes one; the bound keeps an entry small
MAX_VERSIONS_PER_ORG = 2000  # a ledger is one KV value (1 MiB at most): ~330 bytes each
_CAS_ATTEMPTS = 20
_MIB = 1024 * 1024

UNUSED = ("pending", "uploading", "uploaded")  # what the per-workspace limit counts


@dataclass(frozen=True)
class Limits:
    """The deployment's limits on configuration versions (environment, else defaults)."""

    pending_per_workspace: int = 20
    versions_per_org: int = 500
    bytes_per_org: int = 1024 * _MIB
    unused_ttl_s: float = 24 * 3600.0
    pending_ttl_s: float = 3600.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Limits:
        env = os.environ if environ is None else environ
        d = cls()
        versions = _count(env, VERSIONS_PER_ORG_ENV, d.versions_per_org)
        if versions > MAX_VERSIONS_PER_ORG:
            raise ValueError(
                f"{VERSIONS_PER_ORG_ENV} must be at most {MAX_VERSIONS_PER_ORG}, not {versions}"
            )
        return cls(
            pending_per_workspace=_count(env, PENDING_PER_WORKSPACE_ENV, d.pending_per_workspace),
            versions_per_org=versions,
            bytes_per_org=int(_setting(env, MB_PER_ORG_ENV, d.bytes_per_org / _MIB) * _MIB),
            unused_ttl_s=_setting(env, UNUSED_TTL_ENV, d.unused_ttl_s),
            pending_ttl_s=_setting(env, PENDING_TTL_ENV, d.pending_ttl_s),
        )


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    value = _setting(env, name, default)
    if value != int(value):
        raise ValueError(f"{name} must be a whole number, not {env.get(name)!r}")
    return int(value)


def _setting(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive number, not {raw!r}")
    return value


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One configuration version in its organization's ledger."""

    ws: str
    state: str  # pending | uploading | uploaded | consumed | expiring
    created_at: datetime
    size: int = 0  # bytes held in the store, or reserved for the upload under way
    uploaded_at: datetime | None = None
    runs: tuple[str, ...] = ()  # the runs made of it
    consumed_at: datetime | None = None


class Ledger(msgspec.Struct, frozen=True, kw_only=True):
    versions: dict[str, Entry] = {}

    def held(self) -> int:
        return sum(e.size for e in self.versions.values())

    def unused_in(self, ws: str) -> int:
        return sum(1 for e in self.versions.values() if e.ws == ws and e.state in UNUSED)


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Ledger).decode


class QuotaError(TfeError):
    """The organization's configuration versions are at a limit: 422, nothing written."""

    def __init__(self, detail: str) -> None:
        super().__init__(422, QUOTA_TITLE, detail)


class Conflict(Exception):
    """The ledger moved under a compare-and-set too many times in a row."""


def _mib(n: int) -> str:
    return f"{n / _MIB:.1f} MiB"


@dataclass(frozen=True)
class Quota:
    """The ledgers of `rp-tfe-configs`, changed by compare-and-set only."""

    js: JetStreamContext
    limits: Limits

    async def _kv(self) -> KeyValue:
        return await self.js.key_value(TFE_CONFIGS_BUCKET)

    async def orgs(self) -> list[str]:
        """The organizations that have a ledger (ledgers are emptied, never deleted)."""
        return await stored_keys(self.js, TFE_CONFIGS_BUCKET)

    async def ledger(self, org: str) -> Ledger:
        return (await self._entry(org))[0]

    async def _entry(self, org: str) -> tuple[Ledger, int]:
        """The ledger and its revision (0: none yet), read from the bucket's stream
        leader, not by direct get: on a cluster a follower that is behind would answer
        an older ledger, and every compare-and-set on it would fail."""
        try:
            raw = await self.js.get_msg(
                f"KV_{TFE_CONFIGS_BUCKET}", subject=f"$KV.{TFE_CONFIGS_BUCKET}.{org}"
            )
        except nats.js.errors.NotFoundError:
            return Ledger(), 0
        revision = int(raw.seq or 0)
        if (raw.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE) or not raw.data:
            return Ledger(), revision
        return _decode(raw.data), revision

    async def change(self, org: str, edit: Callable[[Ledger], Ledger | None]) -> Ledger:
        """Apply `edit` to `org`'s ledger as it is stored, by compare-and-set, again from
        the new value when another writer got there first. `edit` may raise (nothing is
        written) or answer None (nothing to write)."""
        kv = await self._kv()
        for _ in range(_CAS_ATTEMPTS):
            current, revision = await self._entry(org)
            new = edit(current)
            if new is None:
                return current
            try:
                if not revision:
                    await kv.create(org, _encode(new))
                else:
                    await kv.update(org, _encode(new), last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                await asyncio.sleep(random.uniform(0.0, 0.02))
                continue
            return new
        raise Conflict(f"the ledger of {org} kept moving")

    # ------------------------------------------------------------ the handlers' steps

    async def reserve(self, org: str, ws: str, cv: str, now: datetime) -> None:
        """A slot for a new pending version, or QuotaError."""
        limits = self.limits

        def edit(led: Ledger) -> Ledger:
            unused = led.unused_in(ws)
            if unused >= limits.pending_per_workspace:
                raise QuotaError(
                    f"workspace {ws} has {_versions(unused)} no run has used (the limit "
                    f"is {limits.pending_per_workspace}): "
                    "start a run of one, or wait until they expire (unused uploads are "
                    f"deleted {_hours(limits.unused_ttl_s)} after their upload, versions "
                    f"never uploaded after {_hours(limits.pending_ttl_s)})"
                )
            if len(led.versions) >= limits.versions_per_org:
                raise QuotaError(
                    f"organization {org} has {_versions(len(led.versions))} in the store "
                    f"(the limit is {limits.versions_per_org}): they are deleted "
                    "when their runs end, or unused ones when they expire"
                )
            entry = Entry(ws=ws, state="pending", created_at=now)
            return Ledger(versions={**led.versions, cv: entry})

        await self.change(org, edit)

    async def release(self, org: str, cv: str) -> None:
        """Forget a version whose objects were never written (its create failed)."""

        def edit(led: Ledger) -> Ledger | None:
            if cv not in led.versions:
                return None
            return Ledger(versions={k: v for k, v in led.versions.items() if k != cv})

        await self.change(org, edit)

    async def begin_upload(self, org: str, cv: str, reserve: int, *, announced: bool) -> None:
        """Reserve `reserve` bytes for the archive about to be received, before its body
        is read: QuotaError past the organization's budget, 404 if the version is gone
        (expired), 409 if it has its archive or one is being received."""
        budget = self.limits.bytes_per_org

        def edit(led: Ledger) -> Ledger:
            entry = led.versions.get(cv)
            if entry is None or entry.state == "expiring":
                raise TfeError(404, "not found", f"configuration version {cv} has expired")
            if entry.state != "pending":
                raise TfeError(
                    409, "already uploaded", f"configuration version {cv} has its archive"
                )
            held = led.held()
            if held + reserve > budget:
                this = (
                    f"this upload: {_mib(reserve)}"
                    if announced
                    else f"an upload without a Content-Length reserves the cap, {_mib(reserve)}"
                )
                raise QuotaError(
                    f"organization {org}'s configuration versions hold {_mib(held)} of its "
                    f"{_mib(budget)} ({this}): start runs of the uploaded ones (a version "
                    "is deleted when its runs are over) or wait until unused ones expire "
                    f"({_hours(self.limits.unused_ttl_s)} after their upload); a "
                    ".terraformignore file makes the upload smaller"
                )
            taken = msgspec.structs.replace(entry, state="uploading", size=reserve)
            return Ledger(versions={**led.versions, cv: taken})

        await self.change(org, edit)

    async def end_upload(self, org: str, cv: str, size: int, now: datetime) -> bool:
        """The archive is stored: the entry holds its real size. False if a sweep took
        the version meanwhile (the caller deletes what it wrote)."""
        done = False

        def edit(led: Ledger) -> Ledger | None:
            nonlocal done
            entry = led.versions.get(cv)
            if entry is None or entry.state != "uploading":
                return None
            done = True
            up = msgspec.structs.replace(entry, state="uploaded", size=size, uploaded_at=now)
            return Ledger(versions={**led.versions, cv: up})

        await self.change(org, edit)
        return done

    async def abort_upload(self, org: str, cv: str) -> None:
        """The upload failed before its archive was stored: pending again, 0 bytes."""

        def edit(led: Ledger) -> Ledger | None:
            entry = led.versions.get(cv)
            if entry is None or entry.state != "uploading":
                return None
            back = msgspec.structs.replace(entry, state="pending", size=0)
            return Ledger(versions={**led.versions, cv: back})

        await self.change(org, edit)

    async def claim(self, org: str, cv: str, run: str, now: datetime) -> None:
        """`run` is made of the version: it leaves the unused ones, and is kept until its
        runs end. 404 if a sweep has taken it."""

        def edit(led: Ledger) -> Ledger:
            entry = led.versions.get(cv)
            if entry is None or entry.state == "expiring":
                raise TfeError(404, "not found", f"configuration version {cv} has expired")
            if entry.state not in ("uploaded", "consumed"):
                raise TfeError(409, "configuration not uploaded", f"{cv} has no archive yet")
            if len(entry.runs) >= RUNS_PER_VERSION:
                raise TfeError(
                    409,
                    "configuration used up",
                    f"{RUNS_PER_VERSION} runs were made of {cv}: upload the configuration "
                    "again (terraform plan / apply makes a new version each time)",
                )
            used = msgspec.structs.replace(
                entry, state="consumed", runs=(*entry.runs, run), consumed_at=now
            )
            return Ledger(versions={**led.versions, cv: used})

        await self.change(org, edit)

    async def unclaim(self, org: str, cv: str, run: str) -> None:
        """The run was not made after all: the claim is taken back."""

        def edit(led: Ledger) -> Ledger | None:
            entry = led.versions.get(cv)
            if entry is None or run not in entry.runs:
                return None
            runs = tuple(r for r in entry.runs if r != run)
            back = msgspec.structs.replace(
                entry, runs=runs, state="consumed" if runs else "uploaded"
            )
            return Ledger(versions={**led.versions, cv: back})

        await self.change(org, edit)


def _versions(n: int) -> str:
    return f"{n} configuration version{'' if n == 1 else 's'}"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:g} h"
