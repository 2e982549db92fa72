"""The auditor: every command the event log records becomes a record of its organization's
audit chain (events/audit_facts.py says which, infra/auditlog.py appends), and each
chain is checkpointed (signed) at intervals.

It reads the event log in stream order with an ordered consumer from its cursor (KV
`rp-audit`, key `cursor`), not with the subscribers' shared durable consumer: that one
hands a message it put back (a nak) after later ones, and a chain must follow the log's
order, since a record whose event is at or below the chain's high-water mark is taken
as already recorded (events/audit.py `after`). The cursor is written after the records
of what it covers are appended, so a kill at any line loses nothing (the log is read
again from the cursor) and doubles nothing (the high-water mark and each record's
`Nats-Msg-Id` skip what landed). Replicas of `runplane subscribers` each run one: they
race on the same records and each lands once.

A chain is checkpointed `CHECKPOINT_S` after its first unsigned record, or after
`CHECKPOINT_EVERY` of them, whoever appended them (the api's refusals too: every append
is seen on the core subject `audit.>`); of replicas racing, one checkpoint lands and the
others find the head signed. At a start every chain is due (one that ends with a
checkpoint is left alone): what a stopped auditor left unsigned is signed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from datetime import UTC, datetime
from types import TracebackType

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from events.audit_facts import AUDITED, facts_of
from events.codec import decode, tag_of
from infra.auditkeys import AuditKeys
from infra.auditlog import AuditLog
from infra.directget import InfraError, as_raw, leader_get
from infra.kv import AUDIT_BUCKET
from infra.streams import AUDIT, EVENTS
from infra.tasks import cancel_and_wait
from projections.ordered import Delivered, OrderedReader

log = structlog.get_logger(__name__)

CURSOR = "cursor"
CHECKPOINT_EVERY = 1000  # records of an organization between two checkpoints at most
CHECKPOINT_S = 30.0  # seconds a new record waits for its chain's checkpoint at most
CURSOR_EVERY_S = 1.0
BATCH = 512


async def read_cursor(nc: NATS, *, timeout: float = 5.0) -> tuple[int, int]:
    """The last event sequence the auditor has recorded up to, and the key's revision."""
    raw = await leader_get(
        nc, f"KV_{AUDIT_BUCKET}", as_raw, subject=f"$KV.{AUDIT_BUCKET}.{CURSOR}",
        what="the audit cursor", timeout=timeout,
    )  # fmt: skip
    if raw is None or raw.headers.get(KV_OP) in (KV_DEL, KV_PURGE) or not raw.data:
        return 0, raw.seq if raw is not None else 0
    return int(raw.data), raw.seq


class Auditor:
    """`async with Auditor(nc, keys):` records the log's commands until left."""

    def __init__(
        self,
        nc: NATS,
        keys: AuditKeys,
        *,
        checkpoint_every: int = CHECKPOINT_EVERY,
        checkpoint_s: float = CHECKPOINT_S,
        audit: AuditLog | None = None,
    ) -> None:
        self.nc = nc
        self.keys = keys
        self.audit = audit or AuditLog(nc)
        self.checkpoint_every = checkpoint_every
        self.checkpoint_s = checkpoint_s
        self.position = 0  # the last event sequence handled
        self.recorded = 0  # records this process appended
        self._saved = 0
        self._saved_at = 0.0
        self._pending: Counter[str] = Counter()  # records since each org's last checkpoint
        self._since: dict[str, float] = {}  # when each org's oldest unsigned record came
        self._task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None

    async def __aenter__(self) -> Auditor:
        # Every record appended to any chain (the auditor's, the api's refusals, another
        # replica's) makes its chain due for a checkpoint: seen on the core subject (a
        # refused append too: the checkpoint reads the head again and skips a signed one).
        self._sub = await self.nc.subscribe("audit.>", cb=self._appended)
        self._task = asyncio.create_task(self._run(), name="auditor")
        return self

    async def _appended(self, msg: Msg) -> None:
        if b'"kind":"checkpoint"' in msg.data:
            return
        org = msg.subject.removeprefix("audit.")
        self._pending[org] += 1
        self._since.setdefault(org, time.monotonic())

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await cancel_and_wait(self._task)
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):  # the connection closed first
                await sub.unsubscribe()

    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
            except (InfraError, nats.errors.Error, TimeoutError, ValueError) as e:
                log.warning("auditor_retry", error=repr(e), position=self.position)
                await asyncio.sleep(1.0)

    async def _follow(self) -> None:
        self.position, _ = await read_cursor(self.nc)
        self._saved = self.position
        await self._unsigned_since_before()
        log.info("auditor_started", cursor=self.position)
        async with OrderedReader(self.nc, EVENTS, start_seq=self.position + 1) as reader:
            while True:
                try:
                    batch = await reader.next_batch(BATCH, timeout=1.0)
                except TimeoutError:
                    batch = []
                for d in batch:
                    await self._one(d)
                    self.position = d.seq
                await self._checkpoints()
                await self._save_cursor()

    async def _one(self, d: Delivered) -> None:
        tag = (d.headers or {}).get("Rp-Type")
        if tag is not None and tag not in AUDITED:
            return  # most of the log (steps, heartbeats' marks, queues): never decoded
        try:
            event = decode(d.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # not an event runplane reads (the consumer logs those)
        facts = facts_of(
            seq=d.seq, subject=d.subject, tag=tag_of(event), data=d.data, event=event,
            at=event.at, headers=d.headers or {},
        )  # fmt: skip
        if facts is None:
            return
        if await self.audit.append(facts):
            self.recorded += 1

    async def _unsigned_since_before(self) -> None:
        """Every chain is due for a checkpoint after a start (one that ends with one is
        skipped by `AuditLog.checkpoint`): what a stopped auditor left unsigned."""
        try:
            info = await self.nc.jetstream().stream_info(AUDIT, subjects_filter="audit.>")
        except nats.js.errors.NotFoundError:
            return
        now = time.monotonic()
        for subject in info.state.subjects or {}:
            org = subject.removeprefix("audit.")
            self._pending[org] += 0
            self._since.setdefault(org, now)

    async def _checkpoints(self) -> None:
        """Sign the chains due. One that fails stays due and is logged; the others and
        the cursor go on (a failure raised here held the cursor: each pass read the log
        again from the old one, for as long as, say, the key did not open)."""
        now = time.monotonic()
        for org in list(self._pending):
            due = self._pending[org] >= self.checkpoint_every
            if due or now - self._since[org] >= self.checkpoint_s:
                count, since = self._pending.pop(org), self._since.pop(org)
                try:  # what is appended meanwhile makes the chain due again
                    await self.audit.checkpoint(org, self.keys, datetime.now(UTC))
                except BaseException as e:
                    self._pending[org] += count
                    self._since[org] = min(since, self._since.get(org, since))
                    if not isinstance(e, InfraError):
                        raise
                    log.warning("audit_checkpoint_failed", org=org, error=repr(e))

    async def _save_cursor(self) -> None:
        if self.position == self._saved or time.monotonic() - self._saved_at < CURSOR_EVERY_S:
            return
        try:
            kv = await self.nc.jetstream().key_value(AUDIT_BUCKET)
            await kv.put(CURSOR, str(self.position).encode())
        except (nats.js.errors.Error, nats.errors.Error, TimeoutError) as e:
            log.warning("auditor_cursor_unsaved", error=repr(e))
            return
        self._saved, self._saved_at = self.position, time.monotonic()
