"""Log reads racing retention (issue 25, item 4): many GETs of a finished run's log while a
pass records and deletes it answer the whole log or 410 `log-removed`; never a 500, a
partial 200 or a hang. On main, a read that found an object gone halfway answered a 500
problem appended to its 200 (the client hung reading it as more chunks), and one that
found it gone before its first byte answered 200 with RP_LOGS's remains (nothing).

Real nats-server, the API over a real projector, logs stored as the executor stores them
(several chunks each, so that reads take long enough to overlap the deletion)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from pathlib import Path

import aiohttp
import msgspec
from nats.aio.client import Client as NATS

from events import folder as fo
from services.processes.retention import Retention, stored_logs
from tests.api_support import Http, http_fixture  # noqa: F401  # `http`
from tests.lograce_support import READERS, STEPS, V1, finished_run, items, read_once


async def race(http: Http, run_id: str, until: asyncio.Event) -> Counter[tuple[str, str]]:
    """READERS readers, each reading again and again until `until` is set and it has
    had a 410; every answer counted. A read longer than 20 s is a hang (AssertionError)."""
    url = str(http.client.make_url(f"{V1}/runs/{run_id}/logs"))
    seen: Counter[tuple[str, str]] = Counter()

    async def reader(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                answer = await asyncio.wait_for(read_once(session, url), 20)
            except TimeoutError:
                raise AssertionError("a log read hung for 20 s") from None
            seen[answer] += 1
            if until.is_set() and answer == ("410", "log-removed"):
                return

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(reader(session) for _ in range(READERS)))
    return seen


async def set_days(http: Http, days: int) -> None:
    changes = {"log_retention_days": days}
    await http.app.org_command("acme", fo.SetOrgSettings(actor="admin", changes=changes))


async def test_reads_racing_a_pass_and_its_deletion_answer_the_whole_log_or_410(
    http: Http, nc: NATS, tmp_path: Path
) -> None:
    """24 readers read the log over and over while a pass records the removal and, its
    grace over (1 s here, READ_DEADLINE_S + 300 s by default), a later pass deletes the
    objects: every answer is the whole log or 410 `log-removed`, and the readers end."""
    run_id = await finished_run(http, nc, tmp_path)
    want = hashlib.sha256(msgspec.json.encode({"items": items()})).hexdigest()
    await set_days(http, 0)
    retention = Retention(nc, http.app, grace=1.0)
    deleted = asyncio.Event()

    async def passes() -> None:
        await asyncio.sleep(0.3)  # readers under way
        first = await retention.pass_once()
        assert first.pruned == [run_id] and first.deleted == 0 and first.waiting == 1
        started = time.monotonic()
        while not (await stored_logs(nc)) == {}:
            await retention.pass_once()
            await asyncio.sleep(0.05)
        assert time.monotonic() - started >= 0.9  # (the objects waited out the grace)
        deleted.set()

    seen, _ = await asyncio.gather(race(http, run_id, deleted), passes())
    print(f"\nanswers: {dict(seen)}")
    assert set(seen) <= {("whole", want), ("410", "log-removed")}, seen
    assert seen[("whole", want)] >= READERS and seen[("410", "log-removed")] >= READERS


async def test_reads_under_a_deletion_without_grace_never_answer_500_a_partial_200_or_hang(
    http: Http, nc: NATS, tmp_path: Path
) -> None:
    """The old race itself: a pass that deletes the objects at once (grace 0, as main's
    did) under 24 readers. A read answers the whole log, 410 `log-removed` (gone before
    its first byte: checked on the event log), or is cut (its connection closed mid-
    body: never a 200 that passes for whole); never a 500, a partial 200 or a hang. On
    main: 500s appended to 200s (readers hung) and 200s with an empty log."""
    run_id = await finished_run(http, nc, tmp_path)
    want = hashlib.sha256(msgspec.json.encode({"items": items()})).hexdigest()
    await set_days(http, 0)
    deleted = asyncio.Event()

    async def prune() -> None:
        await asyncio.sleep(0.3)
        report = await Retention(nc, http.app, grace=0).pass_once()
        assert report.pruned == [run_id] and report.deleted == len(STEPS)
        deleted.set()

    seen, _ = await asyncio.gather(race(http, run_id, deleted), prune())
    print(f"\nanswers: {dict(seen)}")
    assert {k for k in seen if k[0] != "cut"} <= {("whole", want), ("410", "log-removed")}, seen
    assert seen[("whole", want)] >= READERS and seen[("410", "log-removed")] >= READERS
