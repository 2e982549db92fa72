"""The one consumer loop over the event log: the scheduler and every subscriber run on it.

A `Subscription` is a handler plus a registration: a name (its durable consumer, shared
by every replica that runs it), the subjects it follows, how messages are put in lanes,
and whether it wants the aggregate's state. `Consumer` does the rest:

- fetches in batches from its durable pull consumer on RP_EVENTS and hands each message
  to its lane (`lane(received)`, by default its workspace): a lane's messages are handled
  one at a time in the order fetched, lanes run in parallel, so a slow handler (a
  `git ls-remote`, a receiver that hangs) holds its own lane only. A lane that has
  `lane_limit` messages in hand has the next ones put back (nak, `OVERFLOW_DELAY`), so
  one stuck lane never fills the room every lane shares (`4 * batch` messages in hand);
- tells the server "in progress" every `PROGRESS_EVERY` seconds for every message in
  hand, so the consumer's short ack wait redelivers only a dead process's messages;
- sets the event store's `floor` to the message's stream sequence before the handler,
  so every read it makes is at least as new as the message (a follower that is behind
  never makes it decide nothing: infra/eventstore.py);
- decodes the event, and with `with_state` folds its aggregate (a run or a workspace)
  through the message's sequence, not later, and upcasts the event on it (an event
  recorded before it carried its outcome gets the status its day derived);
- settles the message by the handler's outcome: it returns, ack; it raises `Retry(d)`,
  nak with delay d; it raises an error whose `retryable` is False, term (logged: it
  would fail again); anything else, nak after a short delay (logged).

Delivery is at least once: a handler sees a message again after a crash, a nak or an
ack lost on the way, so it must be idempotent. Order holds within a lane as fetched; a
message put back (Retry, overflow) comes again after later ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import TracebackType
from typing import Literal

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from events import run as run_agg
from events import workspace as ws_agg
from events.codec import AnyEvent, decode, tag_of
from events.errors import DomainError
from events.run import RunState
from events.workspace import WorkspaceState
from infra import streams, tracing
from infra.eventstore import StoreError, floor
from infra.folds import States
from infra.tasks import cancel_and_wait

log = structlog.get_logger(__name__)

PROGRESS_EVERY = 2.0  # well inside every consumer's ack wait (streams.py)
FAILED_DELAY = 2.0  # an unexpected error: again soon, not at once
TRANSIENT_DELAY = 0.5  # the broker or the store hiccuped
OVERFLOW_DELAY = 1.0  # a lane full: its next messages come back later
LEADERLESS_LOG_S = 30.0  # a fetch answered 503 (no leader) is logged this often
# A durable's declaration that JetStream does not answer (its meta leader, or the
# stream's, being elected: a replica restarted with a node of its cluster) is sent again
# for up to this long before the process gives up; it used to exit 1 at once.
DECLARE_WAIT_S = 30.0


@dataclass(frozen=True)
class Received:
    """One event as a handler sees it."""

    seq: int  # stream sequence of the event
    subject: str  # rp.run.<org>.<ws>.<run> | rp.ws.<org>.<ws> | rp.org.<org>...
    type: str  # the event's tag, e.g. "run.plan_finished"
    event: AnyEvent  # decoded (and upcast when its state was folded)
    timestamp: datetime  # when the server stored it (UTC)
    num_delivered: int
    headers: Mapping[str, str]  # includes `traceparent` when the writer had one
    state: RunState | WorkspaceState | None = None  # folded through `seq` (with_state)
    # With its state: the last sequence its subject had when read (== seq: the state is
    # the latest too, as of that read; a handler that would load it again need not).
    last_seq: int = 0

    @property
    def org(self) -> str:
        return self.subject.split(".")[2]

    @property
    def ws(self) -> str:
        """The workspace of a run or workspace event ("" for an organization's)."""
        parts = self.subject.split(".")
        return parts[3] if parts[1] in ("run", "ws") and len(parts) > 3 else ""

    @property
    def run_id(self) -> str:
        parts = self.subject.split(".")
        return parts[4] if parts[1] == "run" and len(parts) > 4 else ""


class Retry(Exception):
    """The handler asks to be called again for this event after `delay` seconds."""

    def __init__(self, delay: float, reason: str = "") -> None:
        super().__init__(reason or f"again in {delay}s")
        self.delay = delay
        self.reason = reason


def by_workspace(r: Received) -> str:
    """One lane per workspace (its runs' events and its own), one per organization."""
    parts = r.subject.split(".")
    if parts[1] in ("run", "ws"):
        return ".".join(parts[2:4])
    return f"org:{parts[2] if len(parts) > 2 else ''}"


def by_subject(r: Received) -> str:
    """One lane per aggregate (a run, a workspace, an organization's subject)."""
    return r.subject


@dataclass(frozen=True)
class Subscription:
    name: str  # its durable consumer is "rp-sub-<name>", shared by its replicas
    handle: Callable[[Received], Awaitable[None]]
    subjects: tuple[str, ...] = ("rp.run.>",)  # filters on RP_EVENTS
    lane: Callable[[Received], str] = by_workspace  # in order within, in parallel across
    # The aggregate folded through the event: for every event, or for those it says
    # (the scheduler's: `lambda e: not react.quiet(e)`, events that call for nothing).
    with_state: bool | Callable[[AnyEvent], bool] = False
    start: Literal["new", "all"] = "new"  # where a new durable starts
    lane_limit: int = 256  # messages in hand per lane before the next are put back


Declare = Callable[[JetStreamContext], Awaitable[None]]


@dataclass
class _Lane:
    msgs: deque[tuple[Msg, Received]] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None
    horizon: int = 0  # the highest stream sequence handed to this lane so far
    held: int = 0  # messages in hand (queued or being handled)


class Consumer:
    """Run a subscription: `async with Consumer(nc, sub, states=states) as c: ...`.

    `states`, the process's aggregates as folded (infra/folds.py), is needed for
    `with_state`. `durable` and `declare`
    are the scheduler's (its own consumer, infra/streams.py); a subscriber's
    default is `rp-sub-<name>`, declared by `streams.ensure_subscriber_consumer`.
    `linger`: after a fetch that did not fill a batch, wait that long before the next,
    so a trickle of events comes in batches (the subscribers': they are off the run
    path, and each fetch of a message or two cost about what a full one does).
    `reuse_folds`: a state this process folded through the same event already (another
    subscription's consumer) is taken with no read, and `Received.last_seq` is 0.
    """

    def __init__(
        self,
        nc: NATS,
        subscription: Subscription,
        *,
        states: States | None = None,
        batch: int = 256,
        durable: str | None = None,
        declare: Declare | None = None,
        linger: float = 0.0,
        reuse_folds: bool = False,
    ) -> None:
        if subscription.with_state and states is None:
            raise ValueError(f"subscription {subscription.name}: with_state needs states")
        self.nc = nc
        self.js = nc.jetstream()
        self.sub = subscription
        self.states = states
        self.batch = batch
        self.durable = durable or streams.subscriber_consumer(subscription.name)
        self._declare = declare
        self.linger = linger
        self.reuse_folds = reuse_folds
        self.ready = asyncio.Event()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lanes: dict[str, _Lane] = {}
        self._in_flight = asyncio.Semaphore(max(4 * batch, 64))
        # Messages fetched and not yet settled, told "in progress" every PROGRESS_EVERY.
        self._in_hand: dict[int, Msg] = {}  # by id(): a Msg is an unhashable dataclass
        self._log = log.bind(consumer=self.durable)

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        deadline = time.monotonic() + DECLARE_WAIT_S
        while True:
            try:
                await self._declared()
                break
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                    nats.js.errors.ServiceUnavailableError) as e:  # fmt: skip
                if time.monotonic() > deadline:
                    raise
                log.warning("consumer_declare_unanswered", consumer=self.durable, error=repr(e))
                await asyncio.sleep(TRANSIENT_DELAY)
        self._task = asyncio.create_task(self._run(), name=f"consumer-{self.durable}")

    async def _declared(self) -> None:
        if self._declare is not None:
            await self._declare(self.js)
        else:
            await streams.ensure_subscriber_consumer(
                self.js, self.sub.name, self.sub.subjects, start=self.sub.start
            )

    async def stop(self) -> None:
        """Stop fetching and handling; what is in hand and unsettled is redelivered."""
        self._stopping.set()
        await cancel_and_wait(self._task)
        self._task = None
        for lane in list(self._lanes.values()):
            await cancel_and_wait(lane.task)
        self._lanes.clear()

    def horizon(self, lane: str) -> int:
        """The highest stream sequence handed to `lane` so far (0: none in hand): what a
        handler's read at that floor has seen, messages of its lane still waiting too."""
        known = self._lanes.get(lane)
        return known.horizon if known else 0

    async def drain(self) -> None:
        """Wait until every message in hand is handled (tests and benchmarks)."""
        while tasks := [lane.task for lane in self._lanes.values() if lane.task]:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ fetching

    async def _run(self) -> None:
        sub = await self.js.pull_subscribe_bind(durable=self.durable, stream=streams.EVENTS)
        self.ready.set()
        self._log.info("consumer_started")
        progress = asyncio.create_task(self._progress(), name=f"progress-{self.durable}")
        try:
            await self._fetching(sub)
        finally:
            await cancel_and_wait(progress)

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY)
            for m in list(self._in_hand.values()):
                try:
                    await m.in_progress()
                except (nats.errors.Error, OSError):  # reconnecting: redelivered if it lasts
                    pass

    async def _fetching(self, sub: JetStreamContext.PullSubscription) -> None:
        leaderless = warned = 0.0  # since when it has had no leader (0: it has one)
        while not self._stopping.is_set():
            try:
                msgs = await sub.fetch(self.batch, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):  # answered: nothing new
                leaderless = self._leader_back(leaderless)
                continue
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
                await asyncio.sleep(0.5)
                continue
            except nats.js.errors.ServiceUnavailableError:
                # A cluster electing the consumer's leader (its node lost) answers 503
                # for a few seconds: an expected fault, logged as it starts and every
                # LEADERLESS_LOG_S while it lasts (a consumer deleted would never end).
                t = time.monotonic()
                if not leaderless or t - warned >= LEADERLESS_LOG_S:
                    leaderless, warned = leaderless or t, t
                    self._log.warning("consumer_leaderless", for_s=round(t - leaderless, 1))
                await asyncio.sleep(0.5)
                continue
            except Exception:  # keep consuming through broker hiccups
                log.exception("consumer_fetch_failed", consumer=self.durable)
                await asyncio.sleep(0.5)
                continue
            leaderless = self._leader_back(leaderless)
            try:
                await self._hand_out(msgs)
            except Exception:  # unhandled ones are redelivered after the ack wait
                log.exception("consumer_batch_failed", consumer=self.durable)
            if self.linger and len(msgs) < self.batch:
                await self._lingered()

    async def _lingered(self) -> None:
        """A short batch: let the next messages gather before fetching them (a fetch of one
        message costs about what one of a hundred does), unless told to stop."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), self.linger)

    def _leader_back(self, leaderless: float) -> float:
        """A fetch answered: the end of a leaderless spell, if one was on (logged)."""
        if leaderless:
            self._log.info("consumer_leader_back", after_s=round(time.monotonic() - leaderless, 2))
        return 0.0

    async def _hand_out(self, msgs: list[Msg]) -> None:
        """Hand a batch to its lanes and return without waiting for them (only for room:
        at most `4 * batch` messages are in hand at once)."""
        for m in msgs:
            received = self._receive(m)
            if received is None:
                await _settle(m.term)
                continue
            key = self.sub.lane(received)
            lane = self._lanes.setdefault(key, _Lane())
            if lane.held >= self.sub.lane_limit:
                await _settle(m.nak, OVERFLOW_DELAY)  # a stuck lane keeps no room of others'
                continue
            await self._in_flight.acquire()
            self._in_hand[id(m)] = m
            lane.held += 1
            lane.horizon = max(lane.horizon, received.seq)
            lane.msgs.append((m, received))
            if lane.task is None:
                lane.task = asyncio.create_task(self._lane(key, lane), name=f"lane-{key}")

    def _receive(self, m: Msg) -> Received | None:
        """The message as a handler sees it, its state still to fold; None if it does not
        decode (a message no handler could read: it is dropped, logged)."""
        try:
            event = decode(m.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._log.warning("consumer_undecodable", subject=m.subject, error=str(e))
            return None
        meta = m.metadata
        return Received(
            seq=meta.sequence.stream,
            subject=m.subject,
            type=tag_of(event),
            event=event,
            timestamp=meta.timestamp.astimezone(UTC),
            num_delivered=meta.num_delivered,
            headers=dict(m.headers or {}),
        )

    # ------------------------------------------------------------ handling

    async def _lane(self, key: str, lane: _Lane) -> None:
        """Handle a lane's messages one at a time, in the order they were fetched."""
        try:
            while lane.msgs:
                m, received = lane.msgs.popleft()
                try:
                    await self._one(m, received)
                finally:
                    self._done(lane, m)
        finally:
            for m, _ in lane.msgs:  # only if cancelled: redelivered after the ack wait
                self._done(lane, m)
            lane.msgs.clear()
            lane.task = None
            if self._lanes.get(key) is lane:
                del self._lanes[key]

    def _done(self, lane: _Lane, m: Msg) -> None:
        if self._in_hand.pop(id(m), None) is not None:
            lane.held -= 1
            self._in_flight.release()

    async def _one(self, m: Msg, received: Received) -> None:
        # A delivery is a span, the child of the event's writer's (its `traceparent`): what
        # the handler appends and publishes carries the same trace.
        with tracing.span_from_headers(
            f"deliver {self.durable}",
            received.headers,
            event=received.type,
            seq=received.seq,
            delivered=received.num_delivered,
        ):
            await self._handled(m, received)

    async def _handled(self, m: Msg, received: Received) -> None:
        # Every read for this message is at least as new as the message itself.
        floor.set(max(floor.get(), received.seq))
        subject = m.subject
        try:
            wanted = self.sub.with_state
            if wanted is True or (callable(wanted) and wanted(received.event)):
                received = await self._with_state(received)
            await self.sub.handle(received)
        except Retry as r:
            self._log.debug("consumer_retry_later", subject=subject, delay=r.delay, why=r.reason)
            await _settle(m.nak, r.delay)
        except (StoreError, DomainError, nats.errors.Error, TimeoutError) as e:
            retry = getattr(e, "retryable", True)
            self._log.warning(
                "consumer_retry" if retry else "consumer_drop", subject=subject, error=str(e)
            )
            await (_settle(m.nak, TRANSIENT_DELAY) if retry else _settle(m.term))
        except Exception as e:  # one bad message must not stop the others
            if getattr(e, "retryable", True) is False:
                self._log.warning("consumer_drop", subject=subject, error=repr(e))
                await _settle(m.term)
            else:
                log.exception("consumer_handler_failed", consumer=self.durable, subject=subject)
                await _settle(m.nak, FAILED_DELAY)
        else:
            await _settle(m.ack)

    async def _with_state(self, r: Received) -> Received:
        """`r` with its aggregate folded through its sequence (an organization's: None),
        on from the nearest state this process folded of it (infra/folds.py): a run's
        events cost one fold, not one per event (folding each from scratch cost 13 ms of
        CPU for a 27-event run)."""
        kind = r.subject.split(".")[1]
        if kind not in ("run", "ws"):
            return r
        assert self.states is not None  # checked when built
        if kind == "run":
            run, last = await self.states.through(
                "run", r.subject, r.seq, run_agg.fold, run_agg.INITIAL, reuse=self.reuse_folds
            )
            return replace(r, state=run, event=upcast(r.event, run), last_seq=last)
        ws, last = await self.states.through(
            "workspace", r.subject, r.seq, ws_agg.fold, ws_agg.INITIAL, reuse=self.reuse_folds
        )
        return replace(r, state=ws, last_seq=last)


def upcast(event: AnyEvent, run: RunState) -> AnyEvent:
    """A run event with the outcome `run` (folded through it) has: what an event recorded
    before it carried its outcome led to (events/run_upcast.py), as the fold found it."""
    match event:
        case run_agg.PhaseStarted(status=None):
            return msgspec.structs.replace(event, status=run.status)
        case (
            run_agg.RunQueued(status=None)
            | run_agg.PlanFinished(status=None)
            | run_agg.RunApproved(status=None)
            | run_agg.ApplyFinished(status=None)
            | run_agg.CustomStepFinished(status=None)
        ):
            return msgspec.structs.replace(event, status=run.status, step_at=run.step_at)
        case _:
            return event


async def _settle(action: Callable[..., Awaitable[None]], delay: float | None = None) -> None:
    """Ack, nak or term; a failure to tell the server is not the handler's: the message
    comes back after the ack wait."""
    try:
        await (action(delay=delay) if delay is not None else action())
    except (nats.errors.Error, OSError) as e:
        log.warning("consumer_settle_failed", error=repr(e))
