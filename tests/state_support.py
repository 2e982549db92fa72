"""Reading managed state and sealed plans in tests, the way an executor does. No tests here."""

from __future__ import annotations

import io
import json
from typing import Any

from nats.aio.client import Client as NATS

from executor.statestore import StateStore
from infra.crypto import KeyRing
from infra.streams import PLANS_BUCKET


async def current_state(nc: NATS, keyring: KeyRing, org: str, ws: str) -> dict[str, Any] | None:
    """The workspace's current state (opened and digest-checked), or None if it has none."""
    store = StateStore(nc.jetstream(), keyring)
    head, _ = await store.head(org, ws)
    if head is None:
        return None
    return json.loads(await store.read(head))  # type: ignore[no-any-return]  # a JSON object


async def sealed_object(nc: NATS, bucket: str, name: str) -> bytes:
    buf = io.BytesIO()
    store = await nc.jetstream().object_store(bucket)
    await store.get(name, writeinto=buf)
    return buf.getvalue()


async def opened_plan(nc: NATS, keyring: KeyRing, name: str) -> bytes:
    """A stored plan file, opened."""
    return keyring.open(await sealed_object(nc, PLANS_BUCKET, name), f"{PLANS_BUCKET}/{name}")
