"""Configuration versions: the Terraform CLI's working directory, uploaded as a run source.

`terraform plan` / `apply` with the `remote` backend creates a configuration version
(`POST /workspaces/:id/configuration-versions`), PUTs its tar.gz to the answer's
`upload-url` without an Authorization header, and polls the version until it is
`uploaded`. The URL is a capability (services/surfaces/tfe/capability.py) for that one version,
valid `UPLOAD_TTL_S`; the upload is capped at `executor.upload.MAX_UPLOAD` (422 beyond),
its sha256 taken while it streams to a private file, then sealed (AES-GCM, bound to its
bucket and name, as plans are: executor/custody.py) into `rp-plans`. A small record
beside it (`<id>.json`, sealed too) says pending or uploaded, with the digest and size;
the run made of it carries both in its `run.created` (`events.values.ConfigSource`), and
the executor checks the digest before it unpacks the archive (executor/upload.py).
A version is uploaded once: a second PUT is a 409.

What an organization's versions may hold of the shared store is bounded, and the ones no
run needs are deleted (services/surfaces/tfe/quota.py, sweep.py): creating a version
takes a slot of its workspace's unused ones, a PUT reserves its announced size (or the
cap) of the organization's budget before its body is read, a run made of a version frees
its slot, and the version is deleted once its runs are over (or unused, after its TTL).
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import msgspec
import nats.errors
import nats.js.errors
import structlog
from aiohttp import web
from nats.js import JetStreamContext

from events.run import ConfigSource
from executor.errors import ObjectStoreError
from executor.objects import PLANS_BUCKET, Objects
from executor.upload import MAX_UPLOAD
from infra.crypto import CryptoError, KeyRing
from infra.ids import new_id
from services.surfaces.api.context import API
from services.surfaces.tfe import ids
from services.surfaces.tfe import sweep as tfe_sweep
from services.surfaces.tfe.capability import CapabilityError
from services.surfaces.tfe.context import api_of, read_json, require, tfe_of
from services.surfaces.tfe.ids import config_id, parse_config_id
from services.surfaces.tfe.jsonapi import (
    Doc,
    TfeError,
    attributes,
    document,
    not_found,
    resource,
    response,
)
from services.surfaces.tfe.quota import Conflict, Limits, Quota
from services.surfaces.tfe.sweep import SWEEPER, Sweeper, sweeping

log = structlog.get_logger(__name__)
UPLOAD_PATH = "/api/v2/capabilities/configuration-versions/"
UPLOAD_KIND = "configuration-upload"
UPLOAD_TTL_S = 900
PREFIX = "tfe-config"
T = TypeVar("T")


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """What is known of a configuration version, stored beside its archive."""

    status: str = "pending"  # pending | uploaded
    speculative: bool = False
    created_at: datetime
    uploaded_at: datetime | None = None
    digest: str = ""
    size: int = 0


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Record).decode


@dataclass(frozen=True)
class ConfigStore:
    """Configuration versions in `rp-plans`, sealed with the deployment's key ring."""

    objects: Objects
    keyring: KeyRing
    quota: Quota

    @classmethod
    def of(
        cls, js: JetStreamContext, keyring: KeyRing, limits: Limits | None = None
    ) -> ConfigStore:
        return cls(Objects(js), keyring, Quota(js, limits or Limits.from_env()))

    @staticmethod
    def archive_name(org: str, ws: str, cv: str) -> str:
        return f"{PREFIX}/{org}/{ws}/{cv}.tar.gz"

    @staticmethod
    def record_name(org: str, ws: str, cv: str) -> str:
        return f"{PREFIX}/{org}/{ws}/{cv}.json"

    @classmethod
    def names(cls, org: str, ws: str, cv: str) -> tuple[str, ...]:
        """Every object a version has in the store."""
        return (cls.archive_name(org, ws, cv), cls.record_name(org, ws, cv))

    async def forget(self, org: str, ws: str, cv: str, *, archive_only: bool = False) -> None:
        """Delete the version's objects (those there are), or its archive alone."""
        store = await self.objects.js.object_store(PLANS_BUCKET)
        names = (self.archive_name(org, ws, cv),) if archive_only else self.names(org, ws, cv)
        for name in names:
            try:
                await store.delete(name)
            except nats.js.errors.ObjectNotFoundError:
                pass

    async def put_record(self, org: str, ws: str, cv: str, record: Record) -> None:
        name = self.record_name(org, ws, cv)
        with tempfile.TemporaryDirectory(prefix="runplane-tfe-") as tmp:
            path = Path(tmp) / "record"
            path.write_bytes(self.keyring.seal(_encode(record), f"{PLANS_BUCKET}/{name}"))
            await self.objects.upload(PLANS_BUCKET, name, path)

    async def record(self, org: str, ws: str, cv: str) -> Record | None:
        name = self.record_name(org, ws, cv)
        with tempfile.TemporaryDirectory(prefix="runplane-tfe-") as tmp:
            path = Path(tmp) / "record"
            if not await self.objects.download(PLANS_BUCKET, name, path, patience=2.0):
                return None
            try:
                return _decode(self.keyring.open(path.read_bytes(), f"{PLANS_BUCKET}/{name}"))
            except (CryptoError, msgspec.DecodeError) as e:
                raise TfeError(500, "configuration unreadable", str(e)) from e

    async def store_archive(self, org: str, ws: str, cv: str, clear: Path) -> None:
        name = self.archive_name(org, ws, cv)
        sealed = clear.with_name(clear.name + ".sealed")
        await asyncio.to_thread(self.keyring.seal_file, clear, sealed, f"{PLANS_BUCKET}/{name}")
        await self.objects.upload(PLANS_BUCKET, name, sealed)

    def source(self, org: str, ws: str, cv: str, record: Record) -> ConfigSource:
        return ConfigSource(
            id=cv,
            object=self.archive_name(org, ws, cv),
            bucket=PLANS_BUCKET,
            digest=record.digest,
            size=record.size,
        )


CONFIGS: web.AppKey[ConfigStore | None] = web.AppKey("runplane.tfe.configs", ConfigStore)


def install(web_app: web.Application, js: JetStreamContext, keyring: KeyRing | None) -> None:
    """The store of configuration versions and its sweep (services/surfaces/tfe/sweep.py), run
    by this api process beside any other replica's."""
    store = ConfigStore.of(js, keyring) if keyring else None
    web_app[CONFIGS] = store
    if store is None:
        web_app[SWEEPER] = None
        return
    app = web_app[API].app

    async def run_over(org: str, ws: str, run: str) -> bool | None:
        loaded = await app.load_run(org, ws, run)
        return loaded.state.terminal if loaded.state.exists else None

    sweeper = Sweeper(store.quota, run_over, store.names, prefix=PREFIX)
    web_app[SWEEPER] = sweeper
    web_app.cleanup_ctx.append(sweeping(sweeper, app.clock, tfe_sweep.SWEEP_EVERY_S))


def configs_of(request: web.Request) -> ConfigStore:
    store = request.app.get(CONFIGS)
    if store is None:
        raise TfeError(503, "unavailable", "this deployment has no encryption key")
    return store


# ---------------------------------------------------------------- rendering


def render(request: web.Request, cv: str, record: Record, *, upload_url: str = "") -> Doc:
    attrs: Doc = {
        "auto-queue-runs": False,
        "error": None,
        "error-message": None,
        "source": "tfe-api",
        "speculative": record.speculative,
        "status": record.status,
        "status-timestamps": _timestamps(record),
    }
    if upload_url:
        attrs["upload-url"] = upload_url  # only in the create's answer, as TFE does
    return resource("configuration-versions", cv, attrs)


def _timestamps(record: Record) -> Doc:
    out = {"pending-at": _iso(record.created_at)}
    if record.uploaded_at is not None:
        out["uploaded-at"] = _iso(record.uploaded_at)
    return out


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- handlers


async def create_config_version(request: web.Request) -> web.Response:
    """POST /workspaces/:id/configuration-versions: a pending version and its upload URL."""
    org, ws = ids.parse_workspace_id(request.match_info["workspace_id"])
    await require(request, org, "run.plan", ws)  # an apply of it needs write (runs.py)
    if await api_of(request).read.workspaces.get(org, ws) is None:
        raise not_found(f"workspace {ws} not found in organization {org}")
    body = await _optional_json(request)
    attrs = attributes(body, "configuration-versions") if body is not None else {}
    speculative = attrs.get("speculative", False)
    if not isinstance(speculative, bool):
        raise TfeError(422, "invalid attribute", "speculative must be a boolean")
    store = configs_of(request)
    signer = tfe_of(request).need_signer()
    cv = config_id(org, ws, new_id())
    record = Record(speculative=speculative, created_at=api_of(request).app.clock())
    await _counted(store.quota.reserve(org, ws, cv, record.created_at))
    try:
        await _stored(store.put_record(org, ws, cv, record))
    except BaseException:
        # the slot is given back once no object of it can be left (a write that timed
        # out may have landed); else its entry stays, and its sweep deletes both
        await asyncio.shield(_undo(store.forget(org, ws, cv), store.quota.release(org, cv)))
        raise
    token = signer.sign(UPLOAD_KIND, org, cv, UPLOAD_TTL_S)
    url = f"{request.url.origin()}{UPLOAD_PATH}{token}"
    return response(document(render(request, cv, record, upload_url=url)), status=201)


async def read_config_version(request: web.Request) -> web.Response:
    """GET /configuration-versions/:id: polled by the CLI until `uploaded`."""
    cv = request.match_info["cv_id"]
    org, ws, _ = parse_config_id(cv)
    await require(request, org, "workspace.read", ws)
    record = await _stored(configs_of(request).record(org, ws, cv))
    if record is None:
        raise not_found(f"configuration version {cv} not found")
    return response(document(render(request, cv, record)))


async def upload(request: web.Request) -> web.Response:
    """PUT <upload-url>: the archive, no Authorization header: the URL is the authority."""
    signer = tfe_of(request).need_signer()
    try:
        org, cv = signer.verify(request.match_info["token"], UPLOAD_KIND)
    except CapabilityError as e:
        raise not_found("no such upload") from e
    got_org, ws, _ = parse_config_id(cv)
    if got_org != org:
        raise not_found("no such upload")
    store = configs_of(request)
    record = await _stored(store.record(org, ws, cv))
    if record is None:
        raise not_found("no such upload")
    if record.status != "pending":
        raise TfeError(409, "already uploaded", f"configuration version {cv} has its archive")
    if request.content_length is not None and request.content_length > MAX_UPLOAD:
        raise _too_large()
    # the organization's budget, before a byte of the body is read: what it announces,
    # else the cap; the real size once it is stored
    reserve = request.content_length if request.content_length is not None else MAX_UPLOAD
    announced = request.content_length is not None
    await _counted(store.quota.begin_upload(org, cv, reserve, announced=announced))
    try:
        done = await _store_upload(request, store, org, ws, cv, record)
    except BaseException:
        # pending again once its archive cannot be in the store uncounted; else the bytes
        # stay reserved until its sweep
        forget = store.forget(org, ws, cv, archive_only=True)
        await asyncio.shield(_undo(forget, store.quota.abort_upload(org, cv)))
        raise
    now = api_of(request).app.clock()
    if not await _counted(store.quota.end_upload(org, cv, done.size, now)):
        await _stored(store.forget(org, ws, cv))  # a sweep took it meanwhile
        raise not_found(f"configuration version {cv} has expired")
    return response(None, status=200)


async def _store_upload(
    request: web.Request, store: ConfigStore, org: str, ws: str, cv: str, record: Record
) -> Record:
    """The body received, sealed and stored, then its record: what the record says."""
    # A directory of its own (mkdtemp: new, 0700), never a fixed name in a shared /tmp
    # that another user could have made first, or made a link.
    spool = Path(tempfile.mkdtemp(prefix="runplane-tfe-upload-"))
    try:
        clear = spool / "configuration.tar.gz"
        digest, size = await _receive(request, clear)
        await _stored(store.store_archive(org, ws, cv, clear))
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    done = msgspec.structs.replace(
        record,
        status="uploaded",
        uploaded_at=api_of(request).app.clock(),
        digest=digest,
        size=size,
    )
    await _stored(store.put_record(org, ws, cv, done))
    return done


async def _receive(request: web.Request, dest: Path) -> tuple[str, int]:
    """The request body into `dest`, hashed on the way; 422 past `MAX_UPLOAD`."""
    if request.content_length is not None and request.content_length > MAX_UPLOAD:
        raise _too_large()
    h = hashlib.sha256()
    size = 0
    with dest.open("wb") as out:
        async for chunk in request.content.iter_chunked(256 * 1024):
            size += len(chunk)
            if size > MAX_UPLOAD:
                raise _too_large()
            h.update(chunk)
            out.write(chunk)
    if size == 0:
        raise TfeError(422, "empty configuration", "the upload has no archive")
    return h.hexdigest(), size


def _too_large() -> TfeError:
    return TfeError(
        422,
        "configuration too large",
        f"the configuration archive passes {MAX_UPLOAD // (1024 * 1024)} MiB: leave large "
        "files out of the working directory (a .terraformignore file)",
    )


async def _optional_json(request: web.Request) -> object | None:
    if not request.can_read_body:
        return None
    return await read_json(request, limit=64 * 1024)


async def _stored(work: Awaitable[T]) -> T:
    try:
        return await work
    except (ObjectStoreError, *_NATS_ERRORS) as e:
        raise TfeError(503, "unavailable", "the object store is unavailable: try again") from e


_NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)


async def _undo(clean: Awaitable[None], then: Awaitable[None]) -> None:
    """`clean`, then `then`; neither's failure hides the error being answered."""
    try:
        await clean
        await then
    except (Conflict, *_NATS_ERRORS) as e:
        log.warning("tfe_config_undo_failed", error=repr(e))
    finally:
        for work in (clean, then):  # never awaited when an earlier step failed
            if asyncio.iscoroutine(work):
                work.close()


async def _counted(work: Awaitable[T]) -> T:
    """A step of the quota's ledger (services/surfaces/tfe/quota.py): 503 if NATS failed it."""
    try:
        return await work
    except (Conflict, *_NATS_ERRORS) as e:
        raise TfeError(
            503, "unavailable", "the configuration ledger is unavailable: try again"
        ) from e


async def source_of(request: web.Request, org: str, ws: str, cv: str, *, run: str) -> ConfigSource:
    """The run source of an uploaded version of `org`/`ws`, claimed for `run` (kept
    until its runs are over: `unclaim` if the run is not made); 404 / 409 otherwise."""
    got_org, got_ws, _ = parse_config_id(cv)
    if (got_org, got_ws) != (org, ws):
        raise not_found(f"configuration version {cv} not found in this workspace")
    store = configs_of(request)
    record = await _stored(store.record(org, ws, cv))
    if record is None:
        raise not_found(f"configuration version {cv} not found")
    if record.status != "uploaded":
        raise TfeError(409, "configuration not uploaded", f"{cv} has no archive yet")
    await _counted(store.quota.claim(org, cv, run, api_of(request).app.clock()))
    return store.source(org, ws, cv, record)


async def unclaim(request: web.Request, org: str, cv: str, run: str) -> None:
    """The run `source_of` was asked for was not made."""
    await _counted(configs_of(request).quota.unclaim(org, cv, run))
