"""A workspace's managed state in NATS: sealed versions, the head pointer and the lock.

- versions: object store bucket `rp-state`, object `<org>/<ws>/<serial>-<sha256[:16]>`,
  sealed with the key ring and bound to the object's name;
- head: KV `rp-state-head`, key `<org>.<ws>` -> the current version (`Head`), moved only
  with optimistic concurrency, so a writer that read an older head cannot overwrite a newer;
- lock: KV `rp-state-locks`, key `<org>.<ws>` -> Terraform's lock and who holds it
  (`LockRecord`), taken with `create` so there is at most one holder.

Executors need nothing else: no shared disk, no database.

Head, pending and lock are read from each bucket's stream leader (`$JS.API.STREAM.MSG.GET`),
not by direct get: on a cluster a follower that is behind would serve Terraform an older
state to plan on, or hide a lock that exists.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from executor import stateledger
from executor.errors import ExecutorError
from executor.statefile import MAX_STATE_DEPTH, StateFile, too_large
from executor.stateledger import Entry
from infra import jsonbody
from infra.crypto import CryptoError, KeyRing
from infra.kv import STATE_HEAD_BUCKET, STATE_LOCKS_BUCKET
from infra.quotas import Quotas
from infra.streams import STATE_BUCKET, WRONG_LAST_SEQUENCES

log = structlog.get_logger(__name__)

_NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)


class StateStoreError(ExecutorError):
    """The state could not be read or written (NATS unreachable, a version unreadable)."""

    retryable = True


class HeadMoved(StateStoreError):
    """Someone else moved the head since this writer read it."""

    retryable = False


class Head(msgspec.Struct, frozen=True, kw_only=True):
    """The workspace's current state version."""

    object: str
    serial: int
    lineage: str = ""
    digest: str
    size: int = 0
    run_id: str = ""


class VersionGone(StateStoreError):
    """The version's object is no longer in the store (the state quotas let it go)."""

    retryable = False


class LockRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A held state lock: Terraform's lock info as it sent it, and the run holding it."""

    id: str
    info: dict[str, Any]
    org: str
    ws: str
    run_id: str
    lease_id: str
    executor_id: str = ""


def ws_key(org: str, ws: str) -> str:
    return f"{org}.{ws}"


def pending_key(org: str, ws: str) -> str:
    """Three tokens, so it never collides with a head key (two)."""
    return f"pending.{org}.{ws}"


def version_object(org: str, ws: str, serial: int, digest: str) -> str:
    return f"{org}/{ws}/{serial}-{digest[:16]}"


def object_context(name: str) -> str:
    """What a sealed state version is bound to: its bucket and object name."""
    return f"{STATE_BUCKET}/{name}"


def initial_state(org: str, ws: str) -> bytes:
    """The state of a workspace that has none yet: empty, serial 0, a lineage of its own.

    Served instead of "no state" because Terraform 1.0's remote state manager, when it
    starts from no state and persists twice in one command (an interrupted apply does),
    re-reads its first write and sends that instead of the second: the resources being
    created are lost. Derived from the workspace's name, it is the same for every phase on
    every executor, so a plan made against it is not stale at apply.
    """
    lineage = uuid.uuid5(uuid.NAMESPACE_URL, f"runplane:state:{org}/{ws}")
    doc = {
        "version": 4,
        "terraform_version": "1.0.0",  # the oldest runplane runs: never "newer than you"
        "serial": 0,
        "lineage": str(lineage),
        "outputs": {},
        "resources": [],
    }
    return json.dumps(doc).encode()


class _StateHead(msgspec.Struct):
    serial: int
    lineage: str = ""


_state_head = msgspec.json.Decoder(_StateHead).decode


def parse_state(data: bytes) -> tuple[int, str]:
    """The serial and lineage of a Terraform state file; ValueError if it is not one.

    Only those two are built: the rest is checked as JSON and skipped, never made into
    objects (a tenant's 72 MiB state of `{}`s took 1.9 GB and 4 s as `json.loads`). One
    nested deeper than MAX_STATE_DEPTH is refused before msgspec recurses into it."""
    try:
        jsonbody.check_depth(data, MAX_STATE_DEPTH)
        head = _state_head(data)
    except (msgspec.DecodeError, jsonbody.TooDeep) as e:  # not JSON, no integer serial
        raise ValueError(f"not a Terraform state: {e}") from e
    return head.serial, head.lineage


_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def with_serial(data: bytes, serial: int) -> bytes:
    """The same Terraform state with another serial: its other members kept byte for
    byte, in their order (only the top level is decoded; the rest stays raw JSON, never
    made into objects, as in `parse_state`). ValueError if it is not a state."""
    parse_state(data)  # a state, and not nested past MAX_STATE_DEPTH
    try:
        members = _members(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a Terraform state: {e}") from e
    members["serial"] = msgspec.Raw(str(int(serial)).encode())
    return msgspec.json.encode(members)


class StateStore:
    """Reads and writes managed state for any workspace; one per executor."""

    def __init__(
        self, js: JetStreamContext, keyring: KeyRing, quotas: Quotas | None = None
    ) -> None:
        self.js = js
        self.keyring = keyring
        self.quotas = quotas or Quotas()

    async def _kv(self, bucket: str) -> KeyValue:
        try:
            return await self.js.key_value(bucket)
        except _NATS_ERRORS as e:
            raise StateStoreError(f"opening {bucket}: {e!r}") from e

    async def _entry(self, bucket: str, key: str, what: str) -> tuple[bytes | None, int]:
        """A key's value (None: no such key, or deleted) and revision, from the leader."""
        try:
            raw = await self.js.get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")
        except nats.js.errors.NotFoundError:
            return None, 0
        except _NATS_ERRORS as e:
            raise StateStoreError(f"reading {what}: {e!r}") from e
        revision = int(raw.seq or 0)
        if (raw.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE):
            return None, revision
        return raw.data or b"", revision

    # ------------------------------------------------------------ versions and head

    async def head(self, org: str, ws: str) -> tuple[Head | None, int]:
        """The current version and the head's revision (None: the workspace has no state;
        the revision is then 0, or the purge marker's a purged workspace left, which the
        first head move of a workspace created again under the name must expect)."""
        data, revision = await self._entry(
            STATE_HEAD_BUCKET, ws_key(org, ws), f"the state head of {org}/{ws}"
        )
        if data is None:
            return None, revision
        return msgspec.json.decode(data, type=Head), revision

    async def read(self, head: Head) -> bytes:
        """The clear state of a version, checked against its digest."""
        buf = io.BytesIO()
        try:
            store = await self.js.object_store(STATE_BUCKET)
            await store.get(head.object, writeinto=buf)
        except nats.js.errors.NotFoundError as e:  # ObjectNotFound, ObjectDeleted
            raise VersionGone(f"state version {head.object} is no longer stored") from e
        except _NATS_ERRORS as e:
            raise StateStoreError(f"reading {STATE_BUCKET}/{head.object}: {e!r}") from e
        try:
            data = self.keyring.open(buf.getvalue(), object_context(head.object))
        except CryptoError as e:
            raise StateStoreError(f"state version {head.object} does not open: {e}") from e
        if hashlib.sha256(data).hexdigest() != head.digest:
            raise StateStoreError(f"state version {head.object} does not match its digest")
        return data

    async def put_version(self, org: str, ws: str, data: bytes, run_id: str = "") -> Head:
        """Seal and store a new version; the head does not move yet (see `move_head`).
        The state is in memory already (a test's, out of band): `put_state` is the way
        for what the network brings."""
        if len(data) > self.quotas.state_max_bytes:
            raise too_large(self.quotas.state_max_bytes)
        serial, lineage = parse_state(data)
        digest = hashlib.sha256(data).hexdigest()
        name = version_object(org, ws, serial, digest)
        gone = await self._admit(org, ws, name, len(data), keep=frozenset())
        sealed = self.keyring.seal(data, object_context(name))
        await self._store(name, sealed)
        await self._let_go(org, gone)
        return Head(
            object=name,
            serial=serial,
            lineage=lineage,
            digest=digest,
            size=len(data),
            run_id=run_id,
        )

    async def put_state(
        self,
        org: str,
        ws: str,
        state: StateFile,
        parsed: tuple[int, str],
        *,
        head: Head | None,
        run_id: str = "",
    ) -> Head:
        """Seal and store a state received into a file, judged already (its serial and
        lineage `parsed` by `StateFile.parse`, its continuing `head` checked), a chunk at a
        time: admitted to the organization's ledger first (executor/stateledger.py;
        `StateQuotaExceeded`: nothing is stored), the versions it lets go deleted after.
        The head does not move yet (see `move_head`)."""
        serial, lineage = parsed
        name = version_object(org, ws, serial, state.digest)
        keep = frozenset({head.object} if head is not None else ())
        gone = await self._admit(org, ws, name, state.size, keep=keep)
        sealed = state.path.with_name(f".{state.path.name}.sealed")
        try:
            await asyncio.to_thread(self._seal_file, state, sealed, name)
            with sealed.open("rb") as f:
                await self._store(name, f)
        finally:
            sealed.unlink(missing_ok=True)
        await self._let_go(org, gone)
        return Head(
            object=name,
            serial=serial,
            lineage=lineage,
            digest=state.digest,
            size=state.size,
            run_id=run_id,
        )

    def _seal_file(self, state: StateFile, sealed: Path, name: str) -> None:
        fd = os.open(sealed, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with state.open() as fin, os.fdopen(fd, "wb") as fout:
            self.keyring.seal_stream(fin, fout, object_context(name))

    async def _admit(
        self, org: str, ws: str, name: str, size: int, keep: frozenset[str]
    ) -> list[Entry]:
        try:
            return await stateledger.record(
                self.js, self.quotas, org, Entry(ws, name, size), keep, self._current(org)
            )
        except stateledger.LedgerUnavailable as e:
            raise StateStoreError(str(e)) from e

    def _current(self, org: str) -> stateledger.Current:
        """The objects a workspace of `org` has as its current state: head and pending."""

        async def current(ws: str) -> frozenset[str]:
            head, _ = await self.head(org, ws)
            pending = await self.pending(org, ws)
            return frozenset(h.object for h in (head, pending) if h is not None)

        return current

    async def _store(self, name: str, sealed: bytes | io.BufferedIOBase) -> None:
        try:
            store = await self.js.object_store(STATE_BUCKET)
            await store.put(name, sealed)  # a file is read a chunk at a time
        except _NATS_ERRORS as e:
            raise StateStoreError(f"storing {STATE_BUCKET}/{name}: {e!r}") from e

    async def _let_go(self, org: str, gone: list[Entry]) -> None:
        """Delete the objects of the versions the ledger let go, unless admitted again or
        become a head meanwhile (best effort: the ledger no longer counts them either
        way)."""
        if not gone:
            return
        try:
            gone = await stateledger.still_gone(self.js, org, gone, self._current(org))
            store = await self.js.object_store(STATE_BUCKET)
        except (*_NATS_ERRORS, stateledger.LedgerUnavailable, StateStoreError):
            log.warning("state_versions_not_pruned", objects=[e.object for e in gone])
            return
        for entry in gone:
            try:
                await store.delete(entry.object)
            except nats.js.errors.NotFoundError:
                pass
            except _NATS_ERRORS as e:
                log.warning("state_version_not_pruned", object=entry.object, error=repr(e))
        log.info("state_versions_pruned", objects=[e.object for e in gone])

    # A version between being recorded on its run and becoming the head is "pending": a
    # writer that dies in that window leaves the head one version behind, and the next
    # reader promotes the pending version if, and only if, its run recorded it.

    async def mark_pending(self, org: str, ws: str, head: Head) -> None:
        kv = await self._kv(STATE_HEAD_BUCKET)
        try:
            await kv.put(pending_key(org, ws), msgspec.json.encode(head))
        except _NATS_ERRORS as e:
            raise StateStoreError(f"marking a pending state of {org}/{ws}: {e!r}") from e

    async def pending(self, org: str, ws: str) -> Head | None:
        data, _ = await self._entry(
            STATE_HEAD_BUCKET, pending_key(org, ws), f"the pending state of {org}/{ws}"
        )
        if not data:  # none, or deleted
            return None
        return msgspec.json.decode(data, type=Head)

    async def clear_pending(self, org: str, ws: str) -> None:
        """Best effort: a stale pending entry is ignored by readers anyway."""
        try:
            kv = await self._kv(STATE_HEAD_BUCKET)
            await kv.delete(pending_key(org, ws))
        except (*_NATS_ERRORS, StateStoreError):
            log.warning("state_pending_not_cleared", org=org, ws=ws)

    async def move_head(self, org: str, ws: str, head: Head, last: int) -> int:
        """Point the head at `head` if it is still at revision `last`; the new revision."""
        kv = await self._kv(STATE_HEAD_BUCKET)
        try:
            return await kv.update(ws_key(org, ws), msgspec.json.encode(head), last=last)
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise HeadMoved(f"the state of {org}/{ws} changed since it was read") from e
        except _NATS_ERRORS as e:
            raise StateStoreError(f"moving the state head of {org}/{ws}: {e!r}") from e

    # ------------------------------------------------------------ locks

    async def lock(self, record: LockRecord) -> tuple[LockRecord | None, int]:
        """Take the lock: (None, revision) if taken, else (the holder, its revision)."""
        kv = await self._kv(STATE_LOCKS_BUCKET)
        key = ws_key(record.org, record.ws)
        for _ in range(3):  # the holder may release between our create and our read
            try:
                return None, await kv.create(key, msgspec.json.encode(record))
            except nats.js.errors.KeyWrongLastSequenceError:
                pass
            except _NATS_ERRORS as e:
                raise StateStoreError(f"locking the state of {record.org}/{record.ws}") from e
            holder, rev = await self.holder(record.org, record.ws)
            if holder is not None:
                return holder, rev
        raise StateStoreError(f"the state lock of {record.org}/{record.ws} keeps changing hands")

    async def holder(self, org: str, ws: str) -> tuple[LockRecord | None, int]:
        data, revision = await self._entry(
            STATE_LOCKS_BUCKET, ws_key(org, ws), f"the state lock of {org}/{ws}"
        )
        if data is None:
            return None, 0
        return msgspec.json.decode(data, type=LockRecord), revision

    async def take_over(self, record: LockRecord, last: int) -> bool:
        """Replace a dead holder's lock if it is still at revision `last`."""
        kv = await self._kv(STATE_LOCKS_BUCKET)
        try:
            await kv.update(ws_key(record.org, record.ws), msgspec.json.encode(record), last=last)
            return True
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        except _NATS_ERRORS as e:
            raise StateStoreError(f"breaking the state lock of {record.org}/{record.ws}") from e

    async def unlock(self, org: str, ws: str, last: int) -> None:
        """Release the lock if it is still at revision `last`."""
        kv = await self._kv(STATE_LOCKS_BUCKET)
        try:
            await kv.delete(ws_key(org, ws), last=last)
        except nats.js.errors.APIError as e:
            if e.err_code in WRONG_LAST_SEQUENCES:
                raise HeadMoved(f"the state lock of {org}/{ws} changed hands") from e
            raise StateStoreError(f"unlocking the state of {org}/{ws}: {e!r}") from e
        except _NATS_ERRORS as e:
            raise StateStoreError(f"unlocking the state of {org}/{ws}: {e!r}") from e
