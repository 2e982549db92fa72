"""Logs scale with readers: hundreds of concurrent readers and followers of one run.

No Terraform: a run is driven the way an executor reports it (claim, start and finish
steps), its log written as the executor writes it: lines on RP_LOGS while the step runs,
the whole log as JSON lines in `rp-logs` when it ends (executor/objects.py `upload`).
Readers hash what they receive instead of keeping it, so the test's own memory stays
small and the figure measured is the server's.
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from nats.aio.client import Client as NATS

from events.run import ClaimPhase, FinishPlan, FinishStep, PlanSummary, StartStep
from executor.objects import LOGS_BUCKET, Objects, log_object
from services.infra.steplogs import encode_record, live_headers, log_subject
from services.logs_cli import sse_events
from tests.helpers import eventually
from tests.test_api_support import ADMIN_TOKEN, Http, http_fixture  # noqa: F401  # fixture

V1 = "/api/v1"
LEASE = "lease-1"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def text_of(step: str, n: int) -> str:
    """A line of about 85 characters (200,000 of them make a 26 MB object)."""
    return f"{step} line {n:06d} " + "x" * 70


def expected_items(steps: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [
        {
            "phase": "plan",
            "step": step,
            "stream": "stderr" if n % 7 == 0 else "stdout",
            "line": n,
            "text": text_of(step, n),
        }
        for step, count in steps
        for n in range(1, count + 1)
    ]


def write_log(path: Path, step: str, count: int) -> None:
    with path.open("wb") as f:
        for n in range(1, count + 1):
            f.write(encode_record("stderr" if n % 7 == 0 else "stdout", n, text_of(step, n)))


async def finished_run(
    http: Http, nc: NATS, tmp_path: Path, steps: list[tuple[str, int]], org: str = "acme"
) -> str:
    """A plan run of `org` whose steps (name, lines) finished with their logs stored."""
    await http.org(org)
    await http.workspace(org, "net")
    run_id = str((await http.run(org, "net", "plan"))["id"])
    app = http.app
    assert await app.admit_next(org, "net") == run_id
    claim = ClaimPhase(actor="executor", phase="plan", lease_id=LEASE, executor_id="x")
    await app.run_command(org, "net", run_id, claim)
    objects = Objects(nc.jetstream())
    for step, count in steps:
        start = StartStep(actor="executor", lease_id=LEASE, step=step)
        await app.run_command(org, "net", run_id, start)
        path = tmp_path / f"{step}.log"
        write_log(path, step, count)
        name = log_object(run_id, "plan", step)
        await objects.upload(LOGS_BUCKET, name, path, fresh=True)
        path.unlink()
        finish = FinishStep(
            actor="executor",
            lease_id=LEASE,
            step=step,
            ok=True,
            started_at=datetime.now(UTC),
            log_object=name,
        )
        await app.run_command(org, "net", run_id, finish)
    done = FinishPlan(
        actor="executor", lease_id=LEASE, commit="abc", has_changes=False, summary=PlanSummary()
    )
    await app.run_command(org, "net", run_id, done)

    async def projected() -> bool:
        a = await http.get(f"{V1}/orgs/{org}/runs/{run_id}/steps")
        return a.body is not None and [s["status"] for s in a.body["items"]] == ["ok"] * len(steps)

    await eventually(projected, what="the steps projected as finished")
    return run_id


def vm_hwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


async def read_hashed(http: Http, path: str) -> tuple[int, str, int]:
    """(status, sha256 of the body, body size), the body read in pieces and not kept."""
    h = hashlib.sha256()
    size = 0
    async with http.client.get(path, headers=AUTH) as resp:
        async for piece in resp.content.iter_chunked(1 << 16):
            h.update(piece)
            size += len(piece)
        return resp.status, h.hexdigest(), size


async def test_300_concurrent_readers_of_a_finished_run_get_the_whole_identical_log(
    http: Http, nc: NATS, tmp_path: Path
) -> None:
    """300 readers at once of a finished run's log: all 200, all the same bytes, every line."""
    steps = [("checkout", 50), ("plan", 20_000)]
    run_id = await finished_run(http, nc, tmp_path, steps)
    path = f"{V1}/orgs/acme/runs/{run_id}/logs"
    body = await http.get(path)
    assert body.status == 200 and body.body == {"items": expected_items(steps)}
    want = hashlib.sha256(msgspec.json.encode(body.body)).hexdigest()
    before = vm_hwm_kb()
    answers = await asyncio.gather(*(read_hashed(http, path) for _ in range(300)))
    grown = vm_hwm_kb() - before
    statuses = sorted({a[0] for a in answers})
    print(f"grown {grown} KB, {grown / 300:.0f} KB per reader, statuses {statuses}")
    assert [a[0] for a in answers].count(200) == 300, statuses
    assert {a[1] for a in answers} == {want}


class Followed:
    """One `?follow=1` reader: the lines it got (numbers per step) and how it ended."""

    def __init__(self) -> None:
        self.lines: dict[str, list[int]] = {}
        self.end: Any = None
        self.status = 0
        self.other: list[tuple[str, Any]] = []

    async def run(self, session: aiohttp.ClientSession, url: Any) -> None:
        async with session.get(url, params={"follow": "1"}, headers=AUTH) as resp:
            self.status = resp.status
            async for name, data in sse_events(resp):
                if name == "line":
                    self.lines.setdefault(data["step"], []).append(data["line"])
                elif name == "end":
                    self.end = data
                else:
                    self.other.append((name, data))


async def running_run(http: Http, org: str = "acme") -> str:
    """A plan run of `org` whose step `plan` has started (no line yet)."""
    await http.org(org)
    await http.workspace(org, "net")
    run_id = str((await http.run(org, "net", "plan"))["id"])
    app = http.app
    assert await app.admit_next(org, "net") == run_id
    claim = ClaimPhase(actor="executor", phase="plan", lease_id=LEASE, executor_id="x")
    await app.run_command(org, "net", run_id, claim)
    await app.run_command(
        org, "net", run_id, StartStep(actor="executor", lease_id=LEASE, step="plan")
    )
    return run_id


async def publish_lines(nc: NATS, run_id: str, first: int, last: int) -> None:
    js = nc.jetstream()
    subject = log_subject(run_id, "plan", "plan")
    acks = [
        js.publish(subject, text_of("plan", n).encode(), headers=live_headers("stdout", n))
        for n in range(first, last + 1)
    ]
    await asyncio.gather(*acks)


async def test_300_followers_of_a_live_run_get_every_line_and_their_end(
    http: Http, nc: NATS, tmp_path: Path
) -> None:
    """300 followers of one running step: each gets every line once, in order, then `end`."""
    run_id = await running_run(http)
    path = f"{V1}/orgs/acme/runs/{run_id}/logs"
    followers = [Followed() for _ in range(300)]
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    tasks = [asyncio.create_task(f.run(session, http.client.make_url(path))) for f in followers]
    await publish_lines(nc, run_id, 1, 1)

    async def all_following() -> bool:
        missing = sum(1 for f in followers if not f.lines.get("plan"))
        assert missing == 0, f"{missing} followers without the first line"
        return True

    await eventually(all_following, timeout=60, what="300 followers on the first line")
    total = 2_000
    await publish_lines(nc, run_id, 2, total)
    objects = Objects(nc.jetstream())
    log_path = tmp_path / "plan.log"
    with log_path.open("wb") as f:
        for n in range(1, total + 1):
            f.write(encode_record("stdout", n, text_of("plan", n)))
    name = log_object(run_id, "plan", "plan")
    await objects.upload(LOGS_BUCKET, name, log_path, fresh=True)
    app = http.app
    finish = FinishStep(
        actor="executor",
        lease_id=LEASE,
        step="plan",
        ok=True,
        started_at=datetime.now(UTC),
        log_object=name,
    )
    await app.run_command("acme", "net", run_id, finish)
    done = FinishPlan(
        actor="executor", lease_id=LEASE, commit="abc", has_changes=False, summary=PlanSummary()
    )
    await app.run_command("acme", "net", run_id, done)
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    await session.close()
    ended = sum(1 for f in followers if f.end is not None)
    assert ended == 300
    for f in followers:
        assert f.status == 200 and f.lines == {"plan": list(range(1, total + 1))}
        assert f.end == {"status": "no_changes", "reason": None}
