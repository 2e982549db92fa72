"""Every stream, consumer, bucket and subject runplane uses, declared idempotently in one place."""

from __future__ import annotations

import json
from typing import Any

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from services.infra.kv import declare_buckets

EVENTS = "RP_EVENTS"
DISPATCH = "RP_DISPATCH"
HEARTBEATS = "RP_HEARTBEATS"
LOGS = "RP_LOGS"

PLANS_BUCKET = "rp-plans"
LOGS_BUCKET = "rp-logs"
STATE_BUCKET = "rp-state"

SCHEDULER_CONSUMER = "rp-scheduler"
SCHEDULER_ACK_WAIT = 6  # seconds; the scheduler marks what it holds in progress every 2 s
DUPLICATE_WINDOW_S = 120


def dispatch_subject(pool: str) -> str:
    return f"rp.dispatch.{pool}"


def executor_consumer(pool: str) -> str:
    return f"rp-exec-{pool}"


async def _ensure_stream(nc: NATS, js: JetStreamContext, config: dict[str, Any]) -> None:
    """Create or update a stream from raw config (nats-py lacks some newer fields)."""
    name = config["name"]
    try:
        await js.stream_info(name)
        api = f"$JS.API.STREAM.UPDATE.{name}"
    except nats.js.errors.NotFoundError:
        api = f"$JS.API.STREAM.CREATE.{name}"
    resp = await nc.request(api, json.dumps(config).encode(), timeout=10)
    body = json.loads(resp.data)
    if "error" in body:
        raise RuntimeError(f"declaring stream {name}: {body['error'].get('description')}")


async def declare(nc: NATS, js: JetStreamContext, *, replicas: int = 1) -> None:
    """Declare streams and buckets. Safe to call from every process at every start."""
    window = DUPLICATE_WINDOW_S * 1_000_000_000
    await _ensure_stream(
        nc,
        js,
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
    )
    await _ensure_stream(
        nc,
        js,
        {
            "name": DISPATCH,
            "subjects": ["rp.dispatch.>"],
            "storage": "file",
            "retention": "workqueue",
            "num_replicas": replicas,
            "duplicate_window": window,
        },
    )
    await _ensure_stream(
        nc,
        js,
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
    )
    await _ensure_stream(
        nc,
        js,
        {
            "name": LOGS,
            "subjects": ["rp.log.>"],
            "storage": "file",
            "retention": "limits",
            "max_age": 6 * 3600 * 1_000_000_000,
            "num_replicas": replicas,
            "allow_direct": True,
        },
    )
    for bucket in (PLANS_BUCKET, LOGS_BUCKET, STATE_BUCKET):
        try:
            await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            from nats.js.api import ObjectStoreConfig

            await js.create_object_store(
                bucket, config=ObjectStoreConfig(storage=StorageType.FILE, replicas=replicas)
            )
    await declare_buckets(js, replicas=replicas)


async def ensure_executor_consumer(js: JetStreamContext, pool: str) -> None:
    """The shared pull consumer of a pool: executors take steps from it in FIFO order."""
    await js.add_consumer(
        DISPATCH,
        ConsumerConfig(
            durable_name=executor_consumer(pool),
            filter_subject=dispatch_subject(pool),
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
            # marks what it holds in progress (services/scheduler/scheduler.py).
            ack_wait=SCHEDULER_ACK_WAIT,
            max_deliver=-1,
            max_ack_pending=20_000,
        ),
    )


__all__ = [
    "RetentionPolicy",
    "StreamConfig",
    "declare",
    "ensure_executor_consumer",
    "ensure_scheduler_consumer",
]
