"""The event log as the outbox: configurations read, deliveries scheduled and attempts
recorded on their own subjects (events/notification.py), and what a crash left unfinished
found again.

Scheduling a delivery appends `org.notify_delivery_scheduled` to a subject of its own,
expecting it empty, with the delivery's id as `Nats-Msg-Id`: scheduling it again (the
triggering event redelivered after a crash, or handled by two replicas) lands nothing
new, and the delivery's history, read back, says how far it got.
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy

from events import notification as nt
from events.codec import decode, encode, tag_of
from events.errors import Conflict
from infra import tracing
from infra.eventstore import Append, EventStore
from infra.streams import EVENTS, WRONG_LAST_SEQUENCES
from services.app.aggregates import NOTIFICATION
from services.app.execute import Repository
from services.processes.notifications import formats
from services.processes.notifications.delivery import Current, DeliveryError, Job, Recorder

PENDING_FILTER = "rp.org.*.notify.*.d.*"


async def configs(store: EventStore, org: str) -> list[nt.NotificationConfig]:
    """Every configuration of the organization (and of its workspaces) that exists."""
    by_subject = defaultdict(list)
    for env in await store.read(nt.configs_subject(org)):
        by_subject[env.subject].append(env.event)
    states = (nt.fold(events) for events in by_subject.values())
    return [s.config for s in states if s.exists and s.config is not None]


async def config(store: EventStore, org: str, config_id: str) -> nt.ConfigState:
    return nt.fold([e.event for e in await store.read(nt.config_subject(org, config_id))])


async def command(
    repo: Repository, org: str, cmd: nt.SaveConfig | nt.DeleteConfig
) -> tuple[nt.ConfigState, int]:
    """Decide and append on the configuration's subject (`Repository.execute`). Returns
    the state after and the last sequence of the subject."""
    done = await repo.execute(NOTIFICATION, nt.config_subject(org, cmd.config_id), cmd)
    return done.state, done.seq


async def schedule(
    store: EventStore,
    cfg: nt.NotificationConfig,
    view: formats.RunView,
    trigger: str,
    event_seq: int,
    now: datetime,
    *,
    delivery: str = "",
) -> Job | None:
    """Record the delivery (once) and answer its job, or None if it is finished."""
    did = delivery or nt.delivery_id(cfg.id, event_seq, trigger)
    event = nt.DeliveryScheduled(
        at=now,
        actor="notifications",
        delivery_id=did,
        config_id=cfg.id,
        org=cfg.org,
        workspace=view.workspace,
        run_id=view.run_id,
        trigger=trigger,
        event_seq=event_seq,
        body=formats.render(cfg.destination, view, trigger, cfg.id).decode(),
    )
    subject = nt.delivery_subject(cfg.org, cfg.id, did)
    seq = await _first(store, subject, event, did)
    if not seq:  # scheduled before: its history says how far it got
        return await job_of(store, cfg, did)
    return Job(
        org=cfg.org,
        config_id=cfg.id,
        delivery_id=did,
        url=cfg.url,
        trigger=trigger,
        run_id=view.run_id,
        body=event.body.encode(),
        content_type=event.content_type,
        last_seq=seq,
        traceparent=tracing.inject(dict[str, str]()).get(tracing.TRACEPARENT, ""),
    )


async def _first(store: EventStore, subject: str, event: nt.DeliveryScheduled, did: str) -> int:
    """Append the delivery's first event, expecting its subject empty: its sequence, or
    0 if it was there already (a duplicate msg id, or a subject not empty). One round
    trip for a new delivery, the usual case, and no read back of what it just wrote."""
    headers = tracing.inject(
        {
            "Nats-Msg-Id": did,
            "Nats-Expected-Last-Subject-Sequence": "0",
            "Rp-Type": tag_of(event),
        }
    )
    try:
        ack = await store.nc.jetstream().publish(
            subject, encode(event), timeout=store.timeout, stream=EVENTS, headers=headers
        )
    except nats.js.errors.APIError as e:
        if e.err_code in WRONG_LAST_SEQUENCES:
            return 0
        raise DeliveryError(f"scheduling {did}: {e}") from e
    except (TimeoutError, nats.errors.Error) as e:
        raise DeliveryError(f"scheduling {did}: {e!r}") from e
    return 0 if ack.duplicate else ack.seq


async def job_of(
    store: EventStore, cfg: nt.NotificationConfig, did: str, *, overdue: timedelta | None = None
) -> Job | None:
    """The delivery's job as its history has it, due when its last attempt said; None
    if it is finished, or (`overdue`) if it has not been due for that long: a live
    replica holding it will make its next attempt."""
    envs = await store.read(nt.delivery_subject(cfg.org, cfg.id, did))
    state = nt.delivery_fold([e.event for e in envs])
    if state.scheduled is None or state.done:
        return None
    if overdue is not None:
        due_at = state.next_retry_at or envs[-1].event.at
        if due_at > datetime.now(UTC) - overdue:
            return None
    first_at = next((e.event.at for e in envs if isinstance(e.event, nt.DeliveryAttempted)), None)
    due = time.monotonic()
    if state.next_retry_at is not None:
        due += max(0.0, (state.next_retry_at - datetime.now(UTC)).total_seconds())
    s = state.scheduled
    return Job(
        org=cfg.org,
        config_id=cfg.id,
        delivery_id=did,
        url=cfg.url,
        trigger=s.trigger,
        run_id=s.run_id,
        body=s.body.encode(),
        content_type=s.content_type,
        attempts=state.attempts,
        first_at=first_at,
        due=due,
        last_seq=envs[-1].seq,
    )


def current(store: EventStore) -> Current:
    """The configuration's URL as it is now, None once deleted or disabled."""

    async def url(job: Job) -> str | None:
        state = await config(store, job.org, job.config_id)
        if not state.exists or state.config is None or not state.config.enabled:
            return None
        return state.config.url

    return url


def recorder(store: EventStore) -> Recorder:
    """Record attempts on the delivery's subject, expecting the sequence the job knows;
    0 if the delivery was finished by someone else meanwhile."""

    async def record(job: Job, event: nt.DeliveryAttempted) -> int:
        expected = job.last_seq
        for _ in range(5):
            subject = nt.delivery_subject(job.org, job.config_id, job.delivery_id)
            mid = f"{job.delivery_id}-{expected}"
            try:
                return await store.append(
                    [Append(subject=subject, event=event, expected=expected, msg_id=mid)]
                )
            except Conflict:
                envs = await store.read(subject)
                if nt.delivery_fold([e.event for e in envs]).done:
                    return 0
                expected = envs[-1].seq
        raise Conflict(f"delivery {job.delivery_id}: its subject keeps moving")

    return record


class Unfinished:
    """The deliveries not finished, kept up to date by reading only what is new.

    The first `refresh` reads the delivery subjects' events from `window` ago (a
    delivery older than that was retried to its end or given up), each later one from
    where the last stopped: a periodic rescan costs what was written since, not the
    whole history. In memory: only the unfinished ones (a scheduled delivery is added,
    its final attempt removes it).
    """

    def __init__(
        self, nc: NATS, *, window: timedelta = nt.GIVE_UP_AFTER + timedelta(hours=1)
    ) -> None:
        self.nc = nc
        self.window = window
        self.cursor = 0  # the last stream sequence read
        self.open: dict[str, tuple[str, str, str]] = {}  # by subject: (org, config, delivery)

    async def refresh(self, *, timeout: float = 60.0) -> list[tuple[str, str, str]]:
        """(org, config id, delivery id) of every delivery not finished, as of now."""
        js = self.nc.jetstream()
        if self.cursor:
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.cursor + 1
            )
        else:
            since = datetime.now(UTC) - self.window
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since
            )
        sub = await js.subscribe(PENDING_FILTER, ordered_consumer=True, config=config)
        try:
            info = await sub.consumer_info()
            # Pushed already, or still to push: a push consumer's num_pending counts only
            # the second, so what it delivered so far counts too.
            delivered = info.delivered.consumer_seq if info.delivered else 0
            want = (info.num_pending or 0) + (delivered or 0)
            deadline = time.monotonic() + timeout
            while want > 0 and time.monotonic() < deadline:
                msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
                self._note(msg.subject, msg.data)
                self.cursor = max(self.cursor, msg.metadata.sequence.stream)
                want = msg.metadata.num_pending or 0
        finally:
            await sub.unsubscribe()
        return list(self.open.values())

    def _note(self, subject: str, data: bytes) -> None:
        event = decode(data)
        if isinstance(event, nt.DeliveryScheduled):
            _, _, org, _, config_id, _, did = subject.split(".")
            self.open[subject] = (org, config_id, did)
        elif isinstance(event, nt.DeliveryAttempted) and event.outcome in nt.FINAL:
            self.open.pop(subject, None)
