"""The audit streamer: each organization's audit log sent on to its destinations (a SIEM).

Every enabled destination (events/audit_stream.py) has a lane: one task that reads its
organization's chain (`audit.<org>` on RP_AUDIT, by direct get from its cursor) and sends
what follows the cursor in batches, in chain order, one request at a time, and moves the
cursor only once the destination answered 2xx. So delivery is at least once and in order
per organization; a batch a kill interrupted is sent again (the same records, the same
`delivery_id`s), never skipped. Any other answer, a timeout or a refused address is
tried again with backoff (`--audit-stream-retry`, the receiver's Retry-After if longer)
for as long as it takes: an audit record is never given up. A destination that keeps
failing is made visible instead: its cursor keeps `failing_since` and the last failure
(status, error, time; the destination's answer shows them), a warning is logged at most
once a minute per destination, and `/metrics` counts the failing destinations
(`failing_destinations`).

The cursor is the key `stream.<org>.<destination>` of the bucket `rp-audit` (the last
stream sequence and chain place delivered, and the last failure), so progress survives
a restart. It is also a lease: a lane takes it (a checked update naming its process)
before it sends and moves it after, so of several `runplane subscribers` one sends a
destination's records at a time; another takes over once the lease (three timeouts, at
least 30 s) has run out, from the cursor.

Nothing here is on the run path, and lanes hold nothing in common but a bound on
requests in flight (`concurrency`): a slow or dead destination holds its own lane (one
request, at most `timeout` each). Destinations come from the event log (an ordered
consumer over `rp.org.*.auditdest.*`, all of them at start, then each change); new
records wake their organization's lanes (the core subject `audit.>`), and each lane
looks every `poll` seconds anyway. A lane reads only its own organization's subject,
and sends only records whose `org` is that organization.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from types import TracebackType

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from events import audit_stream as ads
from events.audit import Record, decode
from events.codec import decode as decode_event
from infra.auditlog import AuditLog
from infra.crypto import KeyRing
from infra.directget import InfraError
from infra.kv import AUDIT_BUCKET
from infra.tasks import cancel_and_wait
from services.processes.notifications import NotifyError, signing
from services.processes.notifications.delivery import Answer, Policy, Sender
from services.processes.notifications.tokens import TokenStore

log = structlog.get_logger(__name__)

RETRY = (2.0, 10.0, 60.0, 300.0)
MAX_BODY = 1024 * 1024  # bytes of one request's body, at most (a record is < 2 KiB)
MAX_RETRY_AFTER = 3600.0
WARN_EVERY_S = 60.0  # a failing destination's warning, at most once this often


@dataclass(frozen=True)
class StreamSettings:
    """How the streamer sends (`--audit-stream-*`)."""

    retry: tuple[float, ...] = RETRY  # seconds before each try again; the last repeats
    timeout: float = 10.0  # one request, from connecting to the end of the answer
    batch: int = 100  # records in one request, at most
    allow: frozenset[str] = frozenset()  # address kinds besides public (RUNPLANE_NOTIFY_ALLOW)
    allow_http: bool = False  # http:// destinations (tests, a collector on the host)
    host: str = "runplane"  # HEC's `host`
    poll: float = 5.0  # seconds a lane waits for a wake-up before it looks anyway
    concurrency: int = 64  # requests in flight, all lanes together
    lease_s: float = 0.0  # how long a lane's lease holds; 0: three timeouts, at least 30 s

    @property
    def lease(self) -> float:
        return self.lease_s or max(30.0, 3 * self.timeout)

    def delay(self, failures: int, retry_after: float | None) -> float:
        wait = self.retry[min(failures, len(self.retry)) - 1] if self.retry else 1.0
        if retry_after is not None and retry_after > wait:
            wait = min(retry_after, MAX_RETRY_AFTER)
        return wait


class Progress(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A destination's cursor and lease (KV `rp-audit`, `cursor_key`)."""

    seq: int = 0  # the last RP_AUDIT sequence delivered
    n: int = 0  # that record's place in the chain
    holder: str = ""  # the process whose lane holds the lease
    until: float = 0.0  # unix time the lease runs out
    delivered_at: float = 0.0  # unix time of the last 2xx
    error: str = ""  # the last failure ("" once delivered)
    failures: int = 0  # failures in a row
    failing_since: float = 0.0  # unix time of the first of those failures (0: delivering)
    last_error: str = ""  # the last failure, kept once delivered again
    last_status: int = 0  # its HTTP status (0: no answer, a timeout, a refusal)
    last_failed_at: float = 0.0  # its unix time


_progress = msgspec.json.Decoder(Progress)
_encode = msgspec.json.Encoder().encode


def cursor_key(org: str, destination_id: str) -> str:
    return f"stream.{org}.{destination_id}"


async def failing_destinations(nc: NATS) -> int:
    """How many destinations' last tries failed (`failing_since` set), all
    organizations': the `/metrics` gauge (a count, no organization named)."""
    kv = await nc.jetstream().key_value(AUDIT_BUCKET)
    try:
        keys = await kv.keys()  # (its `filters` match substrings)
    except nats.js.errors.NoKeysError:
        return 0
    count = 0
    for key in (k for k in keys if k.startswith("stream.")):
        org, _, destination_id = key.removeprefix("stream.").partition(".")
        if (await read_progress(kv, org, destination_id))[0].failing_since:
            count += 1
    return count


class DestinationSecrets(TokenStore):
    """Destination secrets, sealed as notification tokens are, under their own keys."""

    @staticmethod
    def key(org: str, config_id: str) -> str:
        return f"{org}._auditdest.{config_id}"


async def read_progress(kv: KeyValue, org: str, destination_id: str) -> tuple[Progress, int]:
    """The destination's progress and its key's revision (0: none yet)."""
    try:
        entry = await kv.get(cursor_key(org, destination_id))
    except nats.js.errors.KeyDeletedError as e:
        return Progress(), e.entry.revision if e.entry is not None else 0
    except nats.js.errors.KeyNotFoundError:
        return Progress(), 0
    if not entry.value:
        return Progress(), entry.revision or 0
    return _progress.decode(entry.value), entry.revision or 0


class _Lost(Exception):
    """Another process moved the cursor first (it holds the lease now)."""


class AuditStreamer:
    """`async with AuditStreamer(nc, keyring, settings):` streams until left."""

    def __init__(self, nc: NATS, keyring: KeyRing | None, settings: StreamSettings) -> None:
        self.nc = nc
        self.settings = settings
        self.audit = AuditLog(nc)
        self.secrets = DestinationSecrets(nc, keyring)
        self.sender = Sender(
            Policy(allow=settings.allow, timeout=settings.timeout, concurrency=settings.concurrency)
        )
        self.holder = uuid.uuid4().hex
        self.slots = asyncio.Semaphore(settings.concurrency)
        self.lanes: dict[str, Lane] = {}  # by destination subject
        self.warned: dict[str, float] = {}  # destination subject: its last warning (monotonic)
        self._states: dict[str, ads.DestinationState] = {}
        self._subs: list[Subscription] = []
        self.kv: KeyValue | None = None

    async def __aenter__(self) -> AuditStreamer:
        await self.sender.__aenter__()
        self.kv = await self.nc.jetstream().key_value(AUDIT_BUCKET)
        self._subs.append(await self.nc.subscribe("audit.>", cb=self._appended))
        js = self.nc.jetstream()
        self._subs.append(
            await js.subscribe(ads.ALL_SUBJECTS, cb=self._config, ordered_consumer=True)
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):  # the connection closed first
                await sub.unsubscribe()
        self._subs.clear()
        for lane in list(self.lanes.values()):
            await cancel_and_wait(lane.task)
            await self._release(lane.d)
        self.lanes.clear()
        await self.sender.__aexit__(exc_type, exc, tb)

    async def _release(self, d: ads.AuditDestination) -> None:
        """Give the lease back at a clean stop: another replica (or this one restarted)
        goes on at once instead of when it runs out."""
        with contextlib.suppress(_Lost, nats.errors.Error, nats.js.errors.Error, TimeoutError):
            p, revision = await self.progress(d)
            if p.holder == self.holder:
                await self.save(d, msgspec.structs.replace(p, holder="", until=0.0), revision)

    async def _appended(self, msg: Msg) -> None:
        org = msg.subject.removeprefix("audit.")
        for lane in self.lanes.values():
            if lane.d.org == org:
                lane.wake.set()

    async def _config(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        state = ads.fold([event], self._states.get(msg.subject))
        self._states[msg.subject] = state
        self._reconcile(msg.subject, state)

    def _reconcile(self, subject: str, state: ads.DestinationState) -> None:
        """A lane for the destination as it now is, or none once deleted or disabled. The
        organization is the subject's: a destination saved elsewhere streams nothing."""
        d = state.destination if state.exists else None
        if d is not None and (not d.enabled or ads.subject(d.org, d.id) != subject):
            d = None
        lane = self.lanes.get(subject)
        if lane is not None and lane.d == d:
            return
        before = None
        if lane is not None:
            lane.task.cancel()
            before = lane.task
            del self.lanes[subject]
        if d is not None:  # once the lane it replaces has stopped: one request at a time
            self.lanes[subject] = Lane(self, d, after=before)

    async def progress(self, d: ads.AuditDestination) -> tuple[Progress, int]:
        assert self.kv is not None
        return await read_progress(self.kv, d.org, d.id)

    async def save(self, d: ads.AuditDestination, p: Progress, revision: int) -> int:
        """Write the destination's progress over `revision`; _Lost if it moved."""
        assert self.kv is not None
        try:
            return await self.kv.update(cursor_key(d.org, d.id), _encode(p), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise _Lost from e

    async def send(self, url: str, body: bytes, headers: dict[str, str]) -> Answer:
        if url.startswith("http://") and not self.settings.allow_http:
            return Answer(error="the destination must be https:// on this deployment", refused=True)
        async with self.slots:
            return await self.sender.send(url, body, headers)


class Lane:
    """One destination's records, in order, one request at a time."""

    def __init__(
        self,
        streamer: AuditStreamer,
        d: ads.AuditDestination,
        *,
        after: asyncio.Task[None] | None = None,
    ) -> None:
        self.s = streamer
        self.d = d
        self.wake = asyncio.Event()
        self.sent = 0  # records delivered by this lane
        self.task = asyncio.create_task(self._run(after), name=f"audit-stream-{d.org}-{d.id}")

    async def _run(self, after: asyncio.Task[None] | None) -> None:
        if after is not None:
            await asyncio.wait([after])
        failures = 0
        while True:
            self.wake.clear()
            try:
                done = await self._pass()
            except _Lost:  # another replica took it (or a follower answered behind)
                await asyncio.sleep(0.05)
                continue
            except (InfraError, NotifyError, nats.errors.Error, nats.js.errors.Error) as e:
                done = Answer(error=f"{type(e).__name__}: {e}")
            except TimeoutError:
                done = Answer(error="the audit stream or its bucket did not answer")
            except Exception as e:  # a cursor no longer JSON, ...: the lane must go on
                log.exception("audit_stream_pass_failed", org=self.d.org, destination=self.d.id)
                done = Answer(error=f"{type(e).__name__}: {e}")
            if done is None:
                failures = 0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), self.s.settings.poll)
            elif done.delivered:
                failures = 0
            else:
                failures += 1
                wait = self.s.settings.delay(failures, done.retry_after)
                self._tell(done, failures, wait)
                await asyncio.sleep(wait)

    def _tell(self, done: Answer, failures: int, wait: float) -> None:
        """A failure logged: a warning at most once a minute per destination (one that
        keeps failing is tried for ever: no record is skipped), the others at debug."""
        subject = ads.subject(self.d.org, self.d.id)
        now = time.monotonic()
        warn = now - self.s.warned.get(subject, -WARN_EVERY_S) >= WARN_EVERY_S
        if warn:
            self.s.warned[subject] = now
        (log.warning if warn else log.debug)(
            "audit_stream_failing", org=self.d.org, destination=self.d.id,
            error=done.error or None, status=done.status or None, failures=failures,
            retry_in=wait,
        )  # fmt: skip

    async def _pass(self) -> Answer | None:
        """Send the next batch: its answer, or None when there is nothing to send here
        (nothing new, or another process holds the lease)."""
        p, revision = await self.s.progress(self.d)
        now = time.time()
        if p.holder and p.holder != self.s.holder and p.until > now:
            return None
        batch, last = await self._next(p.seq)
        if not batch:
            if last > p.seq:  # only what is no record of this organization: stepped over
                await self.s.save(self.d, msgspec.structs.replace(p, seq=last), revision)
                return Answer(status=200)
            return None
        mine = msgspec.structs.replace(p, holder=self.s.holder, until=now + self.s.settings.lease)
        revision = await self.s.save(self.d, mine, revision)
        answer = await self._send(batch)
        if answer.delivered:
            done = Progress(
                seq=last, n=batch[-1][2].n, holder=self.s.holder,
                until=time.time() + self.s.settings.lease, delivered_at=time.time(),
                last_error=p.last_error, last_status=p.last_status,
                last_failed_at=p.last_failed_at,
            )  # fmt: skip
            await self.s.save(self.d, done, revision)
            self.sent += len(batch)
            return answer
        error = answer.error or f"HTTP {answer.status}: {answer.excerpt[:200]}"
        at = time.time()
        failed = msgspec.structs.replace(
            mine, error=error, failures=p.failures + 1, failing_since=p.failing_since or at,
            last_error=error, last_status=answer.status, last_failed_at=at,
        )  # fmt: skip
        await self.s.save(self.d, failed, revision)
        return answer

    async def _next(self, after: int) -> tuple[list[tuple[int, bytes, Record]], int]:
        """The records after stream sequence `after` (at most a batch, at most MAX_BODY
        bytes), and the last sequence they cover (what is not a record of this
        organization is stepped over: `runplane audit verify` names it)."""
        page = await self.s.audit.page(self.d.org, after + 1, limit=self.s.settings.batch)
        out: list[tuple[int, bytes, Record]] = []
        last, size = after, 0
        for raw in page:
            try:
                record = decode(raw.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                record = None
            if record is not None and record.org == self.d.org:
                size += len(raw.data) + 256
                if out and size > MAX_BODY:
                    break
                out.append((raw.seq, raw.data, record))
            last = raw.seq
        return out, last

    async def _send(self, batch: list[tuple[int, bytes, Record]]) -> Answer:
        d = self.d
        secret = await self.s.secrets.get(d.org, d.id)
        body = ads.render(d, batch, host=self.s.settings.host)
        delivery = ads.batch_id(d.org, batch[0][2].n, batch[-1][2].n)
        if d.format == ads.HEC:
            headers = {**signing.headers("", body, delivery, time.time())}
            headers["Authorization"] = f"Splunk {secret}"
        else:
            headers = signing.headers(secret, body, delivery, time.time())
        headers["Content-Type"] = ads.content_type(d)
        return await self.s.send(d.url, body, headers)
