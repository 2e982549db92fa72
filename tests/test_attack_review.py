"""Attacks on issue 12's change (notifications, chat-ops, traces, the consumer loop), each
played for real (nats-server, HTTP receivers, signed Slack requests): a hostile webhook
receiver, a Slack user with too small a role, a forged or crafted request."""

from __future__ import annotations

from typing import Any

from tests.helpers import eventually
from tests.notify_support import Receiver
from tests.test_notifications_delivery import (  # noqa: F401  # the fixtures
    TOKEN,
    Rig,
    policy,
    rig,
)

# ---------------------------------------------------------------- a hostile receiver


async def test_a_receiver_asking_to_retry_in_a_billion_years_is_given_up_not_hammered(
    rig: Rig,  # noqa: F811  # the fixture
) -> None:
    """`Retry-After: 999...9` made `next_retry` overflow (timedelta / datetime): the
    attempt was never recorded and the lane put the job back as a first attempt every
    schedule[0] seconds, forever (a first attempt never asks whether the configuration
    still exists, so even deleting it did not stop it). Now: one attempt, given up."""
    async with Receiver(token=TOKEN, then=429, retry_after="9" * 30) as r:
        cfg = await rig.config(r.url)
        await rig.notify_created()
        await eventually(lambda: _got(r, 1), what="the first attempt")
        did = r.got[0].delivery
        rows = await eventually(lambda: _final(rig, cfg, did), what="the attempt recorded")
        assert [(a.status_code, a.outcome) for a in rows] == [(429, "gave_up")]
        assert rig.dispatcher.busy() == 0
        assert len(r.got) == 1  # not hammered


async def _got(r: Receiver, n: int) -> bool:
    return len(r.got) >= n


async def _final(r: Rig, cfg: Any, did: str) -> list[Any]:
    rows = await r.attempts(cfg, did)
    return rows if rows and rows[-1].outcome in ("delivered", "failed", "gave_up") else []
