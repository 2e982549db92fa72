"""The delivery engine: each destination its own lane, attempts recorded as events.

A `Job` is one delivery (events/notification.py: its id, its body, from the log). The
`Dispatcher` keeps a lane per configuration: a lane has at most `per_destination`
attempts in flight, so a dead or hanging receiver holds only its own lane's few, for at
most the attempt's timeout each, while every other destination goes on; attempts across
lanes are bounded by one semaphore (`concurrency`). After each attempt the lane appends
`org.notify_delivery_attempted` to the delivery's subject before anything else; an
attempt to try again is put back on its lane when it is due (the schedule, or the
receiver's Retry-After if longer), and other deliveries of the same destination are not
held behind it.

A crash loses nothing: what was scheduled is in the log, and `recover`
(services/processes/notifications/subscriber.py) puts every delivery not finished back on its lane
at start. A retry after a crash sends the same `RP-Delivery`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from types import TracebackType

import aiohttp
import structlog
from opentelemetry.trace import SpanKind

from events import notification as nt
from infra import tracing
from infra.tasks import cancel_and_wait
from services.processes.notifications import NotifyError, Refused, guard, signing

log = structlog.get_logger(__name__)

USER_AGENT = "runplane-notifications/1"
READ_LIMIT = 4 * nt.MAX_EXCERPT  # bytes of an answer read, at most


@dataclass(frozen=True)
class Job:
    """One delivery, as scheduled (`org.notify_delivery_scheduled`), with its attempts so far."""

    org: str
    config_id: str
    delivery_id: str
    url: str
    trigger: str
    run_id: str
    body: bytes
    content_type: str = "application/json"
    attempts: int = 0  # made so far
    first_at: datetime | None = None  # of the first attempt
    due: float = 0.0  # time.monotonic() at which the next attempt may go
    last_seq: int = 0  # the delivery subject's last sequence, known to this job
    broken: int = 0  # attempts that raised (not recorded): put back, like a retry
    # The trace of the event that scheduled it (its `traceparent`; "" if recovered from
    # the log after a crash: its attempts then start a trace of their own).
    traceparent: str = ""


@dataclass(frozen=True)
class Answer:
    status: int = 0
    excerpt: str = ""
    error: str = ""
    retry_after: float | None = None
    refused: bool = False  # the guard refused the address: permanent

    @property
    def delivered(self) -> bool:
        return 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        """429, 5xx, no answer at all (timeout, refused connection): try again."""
        if self.status:
            return nt.retryable_status(self.status)
        return not self.refused


@dataclass(frozen=True)
class Policy:
    """How deliveries are made; tests shorten the schedule."""

    allow: frozenset[str] = frozenset()  # guard.KINDS the deployment allows
    schedule: tuple[float, ...] = nt.SCHEDULE
    give_up_after: timedelta = nt.GIVE_UP_AFTER
    timeout: float = 10.0  # one attempt, from connecting to the end of the answer
    concurrency: int = 256  # attempts in flight, all lanes together
    per_destination: int = 4  # attempts in flight to one destination (its lane's workers)
    # Attempts in flight for one organization, all its destinations together: one
    # tenant's hanging receivers hold at most these of `concurrency`, never all of it.
    per_org: int = 32
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))


SCHEDULE_ENV = "RUNPLANE_NOTIFY_SCHEDULE"  # seconds between attempts, comma separated
TIMEOUT_ENV = "RUNPLANE_NOTIFY_TIMEOUT"  # seconds one attempt may take


def policy_from_env() -> Policy:
    """The deployment's policy: allowed ranges, and (for tests) a shorter schedule."""
    raw = os.environ.get(SCHEDULE_ENV, "")
    try:
        schedule = tuple(float(x) for x in raw.split(",") if x.strip()) or nt.SCHEDULE
        timeout = float(os.environ.get(TIMEOUT_ENV, "") or 10.0)
    except ValueError as e:
        raise NotifyError(f"{SCHEDULE_ENV} / {TIMEOUT_ENV}: not seconds: {e}") from e
    return Policy(allow=guard.allowed_from_env(), schedule=schedule, timeout=timeout)


# Looks up the token (clear) of a configuration when an attempt is made.
Tokens = Callable[[str, str], Awaitable[str]]
# The configuration's URL now, or None if it was deleted or disabled: asked before a
# retry (a first attempt goes where it was scheduled to go).
Current = Callable[[Job], Awaitable[str | None]]
# Records an attempt on the job's delivery subject; returns its sequence (0: someone
# else recorded this delivery first, and it is finished: drop the job).
Recorder = Callable[[Job, nt.DeliveryAttempted], Awaitable[int]]


class Sender:
    """One HTTP attempt: the guard judges the address, redirects are not followed."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Sender:
        connector = aiohttp.TCPConnector(
            resolver=guard.GuardedResolver(self.policy.allow),
            limit=self.policy.concurrency,
            limit_per_host=0,
            use_dns_cache=False,  # each connection judged on a fresh answer (rebinding)
            ttl_dns_cache=None,
        )
        self._session = aiohttp.ClientSession(
            connector=connector, headers={"User-Agent": USER_AGENT}, trust_env=False
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(self, url: str, body: bytes, headers: dict[str, str]) -> Answer:
        assert self._session is not None, "use the Sender as an async context manager"
        try:
            await guard.check_url(url, self.policy.allow, timeout=self.policy.timeout)
        except Refused as e:
            return Answer(error=str(e), refused="does not resolve" not in str(e))
        timeout = aiohttp.ClientTimeout(total=self.policy.timeout)
        try:
            async with self._session.post(
                url, data=body, headers=headers, allow_redirects=False, timeout=timeout
            ) as resp:
                raw = await resp.content.read(READ_LIMIT)
                return Answer(
                    status=resp.status,
                    excerpt=nt.excerpt(raw.decode("utf-8", "replace")),
                    retry_after=_retry_after(resp.headers.get("Retry-After", "")),
                )
        except Refused as e:  # the connector's resolver: the name resolves elsewhere now
            return Answer(error=str(e), refused=True)
        except TimeoutError:
            return Answer(error=f"no answer within {self.policy.timeout:g} s")
        except (aiohttp.ClientError, OSError) as e:
            return Answer(error=f"{type(e).__name__}: {e}"[: nt.MAX_EXCERPT])


def _retry_after(value: str) -> float | None:
    """Retry-After in seconds (delta form; an HTTP date is read as its distance from now)."""
    value = value.strip()
    if not value:
        return None
    if value.isdigit():
        return float(value)
    with contextlib.suppress(TypeError, ValueError, IndexError):
        from email.utils import parsedate_to_datetime

        return max(0.0, (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds())
    return None


def outcome(job: Job, answer: Answer, policy: Policy, now: datetime) -> nt.DeliveryAttempted:
    """The event recording one attempt's answer, with when to try again if at all."""
    attempt = job.attempts + 1
    next_at = None
    if answer.delivered:
        result = nt.DELIVERED
    elif not answer.retryable or not policy.schedule:  # no schedule: one try (verify)
        result = nt.FAILED
    else:
        next_at = nt.next_retry(
            first_at=job.first_at or now,
            now=now,
            attempt=attempt,
            retry_after=answer.retry_after,
            schedule=policy.schedule,
            give_up_after=policy.give_up_after,
        )
        result = nt.RETRY if next_at is not None else nt.GAVE_UP
    return nt.DeliveryAttempted(
        at=now,
        actor="notifications",
        delivery_id=job.delivery_id,
        config_id=job.config_id,
        attempt=attempt,
        trigger=job.trigger,
        run_id=job.run_id,
        status_code=answer.status,
        excerpt=answer.excerpt,
        error=answer.error,
        outcome=result,
        next_retry_at=next_at,
    )


class Lane:
    """One destination's deliveries: at most `per_destination` attempts at a time (a
    hanging receiver holds that many of the shared slots, no more), retries when due."""

    def __init__(self, dispatcher: Dispatcher, key: str) -> None:
        self.d = dispatcher
        self.key = key
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.waiting = 0  # retries not yet due
        self.tasks = [
            asyncio.create_task(self._run(), name=f"notify-lane-{key}-{i}")
            for i in range(max(1, dispatcher.policy.per_destination))
        ]

    def put(self, job: Job) -> None:
        delay = job.due - time.monotonic()
        if delay <= 0:
            self.queue.put_nowait(job)
            return
        self.waiting += 1
        loop = asyncio.get_running_loop()
        loop.call_later(delay, self._due, job)

    def _due(self, job: Job) -> None:
        self.waiting -= 1
        self.queue.put_nowait(job)

    @property
    def idle(self) -> bool:
        return self.queue.empty() and not self.waiting

    async def _run(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                await self.d.attempt(job, self)
            except Exception:  # one bad job must not end its destination's lane
                log.exception("notify_attempt_failed", delivery=job.delivery_id)
                again = time.monotonic() + (self.d.policy.schedule or (10.0,))[0]
                self.put(replace(job, due=again, broken=job.broken + 1))
            finally:
                self.queue.task_done()


class Dispatcher:
    """Lanes by configuration; an async context manager (its Sender's session)."""

    def __init__(
        self, policy: Policy, tokens: Tokens, record: Recorder, current: Current | None = None
    ) -> None:
        self.policy = policy
        self.tokens = tokens
        self.record = record
        self.current = current
        self.sender = Sender(policy)
        self.lanes: dict[str, Lane] = {}
        self.slots = asyncio.Semaphore(policy.concurrency)
        self.org_slots: dict[str, asyncio.Semaphore] = {}
        self.in_hand: set[str] = set()  # delivery ids on a lane of this process
        self.sent = 0  # attempts made
        # Set once the sender is open: a delivery submitted before waits on its lane.
        self.opened = asyncio.Event()

    async def __aenter__(self) -> Dispatcher:
        await self.sender.__aenter__()
        self.opened.set()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tasks = [t for lane in self.lanes.values() for t in lane.tasks]
        for task in tasks:
            task.cancel()
        for task in tasks:
            await cancel_and_wait(task)  # a cancel wait_for swallowed: again
        self.lanes.clear()
        await self.sender.__aexit__(exc_type, exc, tb)

    def submit(self, job: Job) -> bool:
        """Put a delivery on its lane; False if this process has it in hand already."""
        if job.delivery_id in self.in_hand:
            return False
        self.in_hand.add(job.delivery_id)
        lane = self.lanes.get(job.config_id)
        if lane is None:
            lane = self.lanes[job.config_id] = Lane(self, job.config_id)
        lane.put(job)
        return True

    def _org_slot(self, org: str) -> asyncio.Semaphore:
        slot = self.org_slots.get(org)
        if slot is None:
            slot = self.org_slots[org] = asyncio.Semaphore(max(1, self.policy.per_org))
        return slot

    def busy(self) -> int:
        """Deliveries in hand (queued, in flight, or waiting for a retry)."""
        return len(self.in_hand)

    async def attempt(self, job: Job, lane: Lane) -> None:
        await self.opened.wait()
        if (job.attempts or job.broken) and self.current is not None:
            url = await self.current(job)
            if url is None:  # deleted or disabled meanwhile: no more tries
                self.in_hand.discard(job.delivery_id)
                log.info("notify_dropped", delivery=job.delivery_id, config=job.config_id)
                return
            job = replace(job, url=url)
        token = await self.tokens(job.org, job.config_id)
        parent = {tracing.TRACEPARENT: job.traceparent} if job.traceparent else None
        with tracing.span_from_headers(
            f"notify {job.trigger}",
            parent,
            kind=SpanKind.CLIENT,
            delivery=job.delivery_id,
            config=job.config_id,
            run_id=job.run_id,
            attempt=job.attempts + 1,
        ):
            # The organization's own slot first: waiting for it holds none of the others'.
            async with self._org_slot(job.org), self.slots:
                headers = tracing.inject(
                    {
                        "Content-Type": job.content_type,
                        **signing.headers(token, job.body, job.delivery_id, time.time()),
                    }
                )
                answer = await self.sender.send(job.url, job.body, headers)
            self.sent += 1
            now = self.policy.clock()
            event = outcome(job, answer, self.policy, now)
            tracing.annotate(status=answer.status, outcome=event.outcome)
            seq = await self.record(job, event)
        log.info(
            "notify_attempt",
            delivery=job.delivery_id,
            config=job.config_id,
            trigger=job.trigger,
            attempt=event.attempt,
            status=answer.status,
            outcome=event.outcome,
            error=answer.error or None,
        )
        if seq == 0 or event.outcome in nt.FINAL:
            self.in_hand.discard(job.delivery_id)
            return
        assert event.next_retry_at is not None
        wait = max(0.0, (event.next_retry_at - now).total_seconds())
        lane.put(
            replace(
                job,
                attempts=event.attempt,
                first_at=job.first_at or now,
                due=time.monotonic() + wait,
                last_seq=seq,
            )
        )


class DeliveryError(NotifyError):
    """A delivery could not be scheduled or recorded (the store failed): try again."""

    retryable = True
