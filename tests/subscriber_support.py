"""A test-only subscription for `runplane subscribers` (RUNPLANE_SUBSCRIBER_MODULES).

It writes one line per delivery of a `run.created` to `RP_TEST_SUB_LOG`: `<phase> <seq>
<num_delivered> <pid>`, "got" as it starts and "done" as it returns; with
`RP_TEST_SUB_HANG=1` it never returns (a process to kill mid-handling).
"""

from __future__ import annotations

import asyncio
import os

from infra.consumer import Received, Subscription
from services.processes.subscribers.context import SubscriberContext


def _note(phase: str, r: Received) -> None:
    with open(os.environ["RP_TEST_SUB_LOG"], "a") as f:
        f.write(f"{phase} {r.seq} {r.num_delivered} {os.getpid()}\n")


async def handle(r: Received) -> None:
    if r.type != "run.created":
        return
    _note("got", r)
    if os.environ.get("RP_TEST_SUB_HANG") == "1":
        await asyncio.Event().wait()
    _note("done", r)


def subscriptions(ctx: SubscriberContext) -> list[Subscription]:
    return [Subscription(name="test-probe", handle=handle, with_state=True)]
