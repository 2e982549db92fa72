"""Every stream, consumer, bucket and subject runplane uses, declared idempotently in one place."""

from __future__ import annotations

import json
from typing import Any

import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from infra import replicas as rep
from infra.kv import declare_buckets

log = structlog.get_logger(__name__)

# A checked append refused: "wrong last sequence" (10071), and the same in its constant
# form (10164, no sequence in the text), which a clustered stream answers while another
# write to the subject is in flight (nats-py's KV takes both). Every checked append here
# (event store, board, state store, notifications' outbox) tells a conflict by these.
WRONG_LAST_SEQUENCES = frozenset({10071, 10164})

EVENTS = "RP_EVENTS"
DISPATCH = "RP_DISPATCH"
HEARTBEATS = "RP_HEARTBEATS"
LOGS = "RP_LOGS"
AUDIT = "RP_AUDIT"  # the organizations' audit chains (infra/auditlog.py): `audit.<org>`

PLANS_BUCKET = "rp-plans"
LOGS_BUCKET = "rp-logs"
STATE_BUCKET = "rp-state"
SNAPSHOTS_BUCKET = "rp-snapshots"  # read-model snapshots (projections/snapshots.py)
OBJECT_BUCKETS = (PLANS_BUCKET, LOGS_BUCKET, STATE_BUCKET, SNAPSHOTS_BUCKET)

SCHEDULER_CONSUMER = "rp-scheduler"
SCHEDULER_ACK_WAIT = 6  # seconds; the scheduler marks what it holds in progress every 2 s
SUBSCRIBER_ACK_WAIT = 10  # seconds; a subscriber marks what it holds in progress every 2 s
DUPLICATE_WINDOW_S = 120


DISPATCHES = "rp.dispatch.>"
NO_MESSAGE = 10057  # JetStream's error code: no message at that sequence


def dispatch_subject(pool: str, org: str = "") -> str:
    """Where a phase of an organization waits for its pool's executors; without `org`,
    the pool's own subject (dispatches of versions before organizations took turns)."""
    return f"rp.dispatch.{pool}.{org}" if org else f"rp.dispatch.{pool}"


async def delete_dispatch(nc: NATS, seq: int, *, timeout: float = 5.0) -> bool:
    """Delete a dispatch message once its claim is decided; False if it was gone already
    (another executor decided it first). Without the secure erase `delete_msg` asks
    for: a dispatch is a hint of no secret, and an erase is a write on every replica."""
    body = json.dumps({"seq": seq, "no_erase": True}).encode()
    reply = await nc.request(f"$JS.API.STREAM.MSG.DELETE.{DISPATCH}", body, timeout=timeout)
    answer = json.loads(reply.data)
    error = answer.get("error")
    if not error:
        return True
    if error.get("err_code") == NO_MESSAGE:
        return False
    raise nats.js.errors.APIError.from_error(error)


def pool_subjects(pool: str) -> str:
    """Every organization's dispatch subject of a pool."""
    return f"rp.dispatch.{pool}.>"


def executor_consumer(pool: str) -> str:
    return f"rp-exec-{pool}"


def subscriber_consumer(name: str) -> str:
    """The durable consumer of a subscription (infra/consumer.py)."""
    return f"rp-sub-{name}"


# Processes that start together on a fresh cluster race to declare the same streams,
# and JetStream leaves a request about a stream whose assignment is still in flight
# unanswered (6 processes at once: 2 to 5 of them got no answer within 10 s). Every step
# of a declaration is idempotent, so it is tried again from the start.
DECLARE_TRIES = 4


async def _ensure_stream(nc: NATS, config: dict[str, Any]) -> None:
    """Create or update a stream from raw config (nats-py lacks some newer fields),
    keeping the replicas it has if it has more than `config` asks for; a stream that
    already has every setting of `config` is left alone (no update at each start)."""
    name = config["name"]
    existing = await rep.stream_config(nc, name)
    config["num_replicas"] = rep.kept(existing, config["num_replicas"])
    if existing is not None and all(existing.get(k) == v for k, v in config.items()):
        return
    verb = "CREATE" if existing is None else "UPDATE"
    body = await rep.api(nc, f"$JS.API.STREAM.{verb}.{name}", config)
    if "error" in body:
        raise rep.ReplicationError(
            f"declaring stream {name} ({config['num_replicas']} replicas): "
            f"{body['error'].get('description')}"
        )


async def declare(nc: NATS, js: JetStreamContext, *, replicas: int = 0) -> None:
    """Declare streams and buckets. Safe to call from every process at every start.

    `replicas` is the setting (0: the default for this server, `replicas.wanted`); what
    exists with more replicas keeps them. A request left unanswered (see
    `DECLARE_TRIES`) starts the declaration again.
    """
    for attempt in range(1, DECLARE_TRIES + 1):
        try:
            await _declare(nc, js, rep.wanted(nc, replicas))
            return
        except nats.errors.TimeoutError:
            if attempt == DECLARE_TRIES:
                raise rep.ReplicationError(
                    f"declaring streams and buckets: no answer from JetStream {attempt} times"
                ) from None
            log.warning("declare_unanswered", attempt=attempt)


async def _declare(nc: NATS, js: JetStreamContext, replicas: int) -> None:
    for config in _streams(replicas):
        await _ensure_stream(nc, config)
    await _declare_object_stores(nc, js, replicas)
    await declare_buckets(nc, js, replicas=replicas)


def _streams(replicas: int) -> list[dict[str, Any]]:
    """The streams' configurations, in the order they are declared."""
    window = DUPLICATE_WINDOW_S * 1_000_000_000
    return [
        {
            "name": EVENTS,
            "subjects": ["rp.run.>", "rp.ws.>", "rp.org.>"],
            "storage": "file",
            "retention": "limits",
            "num_replicas": replicas,
            "deny_delete": True,
            "deny_purge": True,
            "allow_direct": True,
            "allow_atomic": True,
            "duplicate_window": window,
        },
        {
            # Append-only by use: runplane never deletes nor purges a record, so
            # `runplane audit verify` names any gap as tampering. Not `deny_delete` /
            # `deny_purge`: a stream update can never lift them (retention of whole
            # records, later, will delete ranges it records first), and someone with NATS
            # access can remove the whole stream anyway: the chain, not a flag, is the proof.
            "name": AUDIT,
            "subjects": ["audit.>"],
            "storage": "file",
            "retention": "limits",
            "num_replicas": replicas,
            "allow_direct": True,
            "duplicate_window": window,
        },
        {
            "name": DISPATCH,
            "subjects": ["rp.dispatch.>"],
            "storage": "file",
            "retention": "workqueue",
            "num_replicas": replicas,
            "duplicate_window": window,
        },
        {
            "name": HEARTBEATS,
            "subjects": ["rp.hb.>"],
            "storage": "file",
            "retention": "limits",
            "max_msgs_per_subject": 1,
            "max_age": 24 * 3600 * 1_000_000_000,
            "num_replicas": replicas,
            "allow_direct": True,
        },
        {
            "name": LOGS,
            "subjects": ["rp.log.>"],
            "storage": "file",
            "retention": "limits",
            "max_age": 6 * 3600 * 1_000_000_000,
            "num_replicas": replicas,
            "allow_direct": True,
        },
    ]


async def _declare_object_stores(nc: NATS, js: JetStreamContext, replicas: int) -> None:
    for bucket in OBJECT_BUCKETS:
        try:
            await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            await js.create_object_store(
                bucket, config=ObjectStoreConfig(storage=StorageType.FILE, replicas=replicas)
            )
        else:
            await rep.raise_stream(nc, f"OBJ_{bucket}", replicas)


# The durable consumers below leave `num_replicas` unset: they have as many replicas as
# their stream, and follow it when the stream is raised (`replicas.raise_stream`).


async def ensure_executor_consumer(js: JetStreamContext, pool: str) -> None:
    """A pull consumer of a pool's dispatches, first in, first out: how executors took
    them before organizations took turns (executor/intake.py reads the stream itself
    now); tests read what was dispatched through it."""
    await js.add_consumer(
        DISPATCH,
        ConsumerConfig(
            durable_name=executor_consumer(pool),
            filter_subjects=[dispatch_subject(pool), pool_subjects(pool)],
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=60,
            max_deliver=-1,
            max_ack_pending=10_000,
        ),
    )


async def ensure_scheduler_consumer(js: JetStreamContext) -> None:
    """The scheduler's durable consumer over the event log (shared by its replicas)."""
    await js.add_consumer(
        EVENTS,
        ConsumerConfig(
            durable_name=SCHEDULER_CONSUMER,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            # Short, so a killed scheduler's messages come back within seconds; a live one
            # marks what it holds in progress (services/processes/scheduler/scheduler.py).
            ack_wait=SCHEDULER_ACK_WAIT,
            max_deliver=-1,
            max_ack_pending=20_000,
        ),
    )


async def ensure_subscriber_consumer(
    js: JetStreamContext,
    name: str,
    subjects: tuple[str, ...],
    *,
    start: str = "new",
) -> None:
    """A subscription's durable consumer over the event log, shared by its replicas; a
    new one starts at the next event (`new`) or at the first (`all`). Its own, apart from
    the scheduler's: a subscriber that falls behind holds nothing of admission's."""
    await js.add_consumer(
        EVENTS,
        ConsumerConfig(
            durable_name=subscriber_consumer(name),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL if start == "all" else DeliverPolicy.NEW,
            filter_subjects=list(subjects),
            # Short, so a killed subscriber's messages come back within seconds; a live
            # one marks what it holds in progress (infra/consumer.py).
            ack_wait=SUBSCRIBER_ACK_WAIT,
            max_deliver=-1,
            max_ack_pending=10_000,
        ),
    )


__all__ = [
    "RetentionPolicy",
    "StreamConfig",
    "declare",
    "ensure_executor_consumer",
    "ensure_scheduler_consumer",
    "ensure_subscriber_consumer",
]
