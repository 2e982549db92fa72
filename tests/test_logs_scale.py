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
from collections.abc import Awaitable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client as NATS

from events.run import ClaimPhase, FinishPlan, FinishStep, PlanSummary, StartStep
from executor.objects import LOGS_BUCKET, Objects, log_object
from infra.steplogs import encode_record, live_headers, log_subject
from services.surfaces.client.logs import sse_events
from tests.api_support import ADMIN_TOKEN, Http, http_fixture  # noqa: F401  # fixture
from tests.helpers import eventually
from tests.procs import ROOT, RUNPLANE

V1 = "/api/v1"
LEASE = "lease-1"
PLAN_STEP = {"number": 100, "kind": "plan"}
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
T = TypeVar("T")


def text_of(step: str, n: int) -> str:
    """A line of about 85 characters (200,000 of them make a 26 MB object)."""
    return f"{step} line {n:06d} " + "x" * 70


def expected_items(steps: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return list(iter_items(steps))


def iter_items(steps: list[tuple[str, int]]) -> Iterator[dict[str, Any]]:
    return (
        {
            "phase": "plan",
            "step": step,
            "stream": "stderr" if n % 7 == 0 else "stdout",
            "line": n,
            "text": text_of(step, n),
        }
        for step, count in steps
        for n in range(1, count + 1)
    )


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


def expected_digest(steps: list[tuple[str, int]]) -> str:
    """sha256 of the whole answer `{"items": [...]}`, made without holding it."""
    h = hashlib.sha256(b'{"items":[')
    sep = b""
    for item in iter_items(steps):
        h.update(sep + msgspec.json.encode(item))
        sep = b","
    h.update(b"]}")
    return h.hexdigest()


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def peak_growth(work: Awaitable[T]) -> tuple[T, int]:
    """What `work` returns, and how far this process's resident memory rose above where
    it was when `work` started (KiB, sampled every 10 ms)."""
    base = peak = rss_kib()
    task = asyncio.ensure_future(work)
    while not task.done():
        peak = max(peak, rss_kib())
        await asyncio.wait({task}, timeout=0.01)
    return task.result(), peak - base


async def read_hashed(http: Http, path: str) -> tuple[int, str, int]:
    """(status, sha256 of the body, body size), the body read in pieces and not kept."""
    h = hashlib.sha256()
    size = 0
    async with http.client.get(path, headers=AUTH) as resp:
        async for piece in resp.content.iter_chunked(1 << 16):
            h.update(piece)
            size += len(piece)
        return resp.status, h.hexdigest(), size


@pytest.mark.slow
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
    del body
    readers = asyncio.gather(*(read_hashed(http, path) for _ in range(300)))
    answers, grown = await peak_growth(readers)
    statuses = sorted({a[0] for a in answers})
    print(f"300 readers of 20,050 lines: peak +{grown // 300} KiB per reader")
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


@pytest.mark.slow
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
    with log_path.open("wb") as out:
        for n in range(1, total + 1):
            out.write(encode_record("stdout", n, text_of("plan", n)))
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
    _, grown = await peak_growth(asyncio.wait_for(asyncio.gather(*tasks), 120))
    await session.close()
    print(f"300 followers of {total} lines: peak +{grown // 300} KiB per follower")
    ended = sum(1 for f in followers if f.end is not None)
    assert ended == 300
    for f in followers:
        assert f.status == 200 and f.lines == {"plan": list(range(1, total + 1))}
        assert f.end == {"status": "no_changes", "reason": None}


# ---------------------------------------------------------------- pages


async def page_of(http: Http, run_id: str, **query: Any) -> dict[str, Any]:
    a = await http.get(f"{V1}/orgs/acme/runs/{run_id}/logs?{urlencode(query)}")
    assert a.status == 200, a.body
    assert set(a.body) == {"items", "next_offset"}
    return a.body  # type: ignore[no-any-return]  # JSON object


async def all_pages(http: Http, run_id: str, limit: int, **query: str) -> list[Any]:
    """Every page from offset 0 on, following next_offset until it is null."""
    items: list[Any] = []
    offset: int | None = 0
    while offset is not None:
        page = await page_of(http, run_id, offset=offset, limit=limit, **query)
        assert len(page["items"]) <= limit
        items += page["items"]
        assert page["next_offset"] is None or page["next_offset"] == offset + limit
        offset = page["next_offset"]
    return items


async def test_pages_cover_a_finished_log_exactly_once(
    http: Http, nc: NATS, tmp_path: Path
) -> None:
    """Pages of any size, across steps and chunks, add up to the whole answer; past the
    end a page is empty with next_offset null; phase and step filters page too."""
    steps = [("checkout", 7), ("init", 1), ("plan", 3_001)]
    run_id = await finished_run(http, nc, tmp_path, steps)
    whole = expected_items(steps)
    for limit in (1_000, 1_500, 3_009, 10_000):
        assert await all_pages(http, run_id, limit) == whole, limit
    edges = {
        (0, 7): (whole[:7], 7),
        (7, 1): (whole[7:8], 8),
        (6, 3): (whole[6:9], 9),
        (3_000, 9): (whole[3_000:], None),
        (3_008, 1): (whole[3_008:], None),
        (3_009, 5): ([], None),
        (99_999, 5): ([], None),
    }
    for (offset, limit), (items, following) in edges.items():
        page = await page_of(http, run_id, offset=offset, limit=limit)
        assert (page["items"], page["next_offset"]) == (items, following), (offset, limit)
    only = await page_of(http, run_id, step="init", offset=0)
    assert (only["items"], only["next_offset"]) == (whole[7:8], None)
    first = await page_of(http, run_id, limit=2)
    assert (first["items"], first["next_offset"]) == (whole[:2], 2)


async def test_a_page_of_a_running_run_always_has_a_next_offset(http: Http, nc: NATS) -> None:
    """While the run goes on, the last page points past itself: more lines may come."""
    run_id = await running_run(http)
    await publish_lines(nc, run_id, 1, 5)
    page = await page_of(http, run_id, offset=3, limit=100)
    assert [i["line"] for i in page["items"]] == [4, 5] and page["next_offset"] == 5
    page = await page_of(http, run_id, offset=5)
    assert (page["items"], page["next_offset"]) == ([], 5)


async def test_bad_pages_are_refused_and_another_orgs_log_is_not_found(
    http: Http, nc: NATS, tmp_path: Path
) -> None:
    """offset and limit out of range or not numbers are 400 problems (invalid-query), as
    is paging a followed log; beta's token reads nothing of acme's run, however asked."""
    run_id = await finished_run(http, nc, tmp_path, [("plan", 3)])
    path = f"{V1}/orgs/acme/runs/{run_id}/logs"
    for query in (
        "offset=-1",
        "offset=x",
        "offset=1.5",
        "offset=",
        "limit=0",
        "limit=10001",
        "limit=-3",
        "limit=ten",
        "follow=1&offset=0",
    ):
        (await http.get(f"{path}?{query}")).problem("invalid-query", 400)
    beta = await http.org("beta")
    for query in ("", "?offset=0&limit=10", "?follow=1"):
        (await http.get(path + query, token=beta["admin"])).problem("not-found", 404)
    beta_path = f"{V1}/orgs/beta/runs/{run_id}/logs"
    (await http.get(beta_path, token=beta["admin"])).problem("not-found", 404)
    for query in ("", "?follow=1"):
        (await http.get(path + query, token=beta["viewer"])).problem("not-found", 404)


# ---------------------------------------------------------------- memory


async def concurrent_large_reads(http: Http, nc: NATS, tmp_path: Path, readers: int) -> int:
    """`readers` at once of a 200,000-line (26 MB) log; the growth of this process's peak
    memory per reader, in KiB (server and clients are this process; clients keep none)."""
    steps = [("plan", 200_000)]
    run_id = await finished_run(http, nc, tmp_path, steps)
    path = f"{V1}/orgs/acme/runs/{run_id}/logs"
    work = asyncio.gather(*(read_hashed(http, path) for _ in range(readers)))
    answers, grown = await peak_growth(work)
    per_reader = grown // readers
    want = expected_digest(steps)
    print(f"{readers} readers of 200,000 lines: peak +{per_reader} KiB per reader")
    assert {a[:2] for a in answers} == {(200, want)}
    assert answers[0][2] > 25_000_000
    return per_reader


@pytest.mark.slow
async def test_readers_of_a_26_mb_log_cost_the_server_a_bounded_amount_each(
    http: Http, nc: NATS, tmp_path: Path
) -> None:
    """20 readers at once of a 26 MB log: each gets it whole, and the process's peak grows
    by far less than the log per reader (was ~34 MB each: the object, then the list,
    then the body, all whole)."""
    assert await concurrent_large_reads(http, nc, tmp_path, 20) < 3 * 1024


@pytest.mark.slow
async def test_300_readers_of_a_26_mb_log(http: Http, nc: NATS, tmp_path: Path) -> None:
    """The issue's case: 300 readers at once of a 200,000-line log, all complete."""
    assert await concurrent_large_reads(http, nc, tmp_path, 300) < 3 * 1024


# ---------------------------------------------------------------- the CLI


async def test_runplane_logs_prints_a_custom_steps_log(
    http: Http, nc: NATS, tmp_path: Path
) -> None:
    """`runplane logs RUN --phase custom-50` prints that step's lines (read a page at a
    time); a phase that is none is one `runplane:` line and exit 2."""
    await http.org("acme")
    await http.workspace("acme", "net")
    steps = [{"number": 50, "kind": "custom", "name": "lint", "command": "true"}]
    put = await http.call(
        "PUT", f"{V1}/orgs/acme/templates/lint", json={"steps": [*steps, PLAN_STEP]}
    )
    assert put.status in (200, 201), put.body
    a = await http.post(
        f"{V1}/orgs/acme/workspaces/net/runs", json={"type": "plan", "template": "lint"}
    )
    assert a.status == 201, a.body
    run_id = str(a.body["id"])
    app = http.app
    assert await app.admit_next("acme", "net") == run_id
    claim = ClaimPhase(actor="executor", phase="custom-50", lease_id=LEASE, executor_id="x")
    await app.run_command("acme", "net", run_id, claim)
    await app.run_command(
        "acme", "net", run_id, StartStep(actor="executor", lease_id=LEASE, step="run")
    )
    path = tmp_path / "run.log"
    write_log(path, "run", 12_345)
    name = log_object(run_id, "custom-50", "run")
    await Objects(nc.jetstream()).upload(LOGS_BUCKET, name, path, fresh=True)
    finish = FinishStep(
        actor="executor",
        lease_id=LEASE,
        step="run",
        ok=True,
        started_at=datetime.now(UTC),
        log_object=name,
    )
    await app.run_command("acme", "net", run_id, finish)

    async def projected() -> bool:
        a = await http.get(f"{V1}/orgs/acme/runs/{run_id}/steps")
        return [(s["phase"], s["status"]) for s in a.body["items"]] == [("custom-50", "ok")]

    await eventually(projected, what="the custom step projected as finished")
    url = str(http.client.make_url("/"))
    cli = await _cli(run_id, "--org", "acme", "--phase", "custom-50", "--url", url)
    out, err, code = cli
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "==> custom-50/run <==" and len(lines) == 1 + 12_345 - 12_345 // 7
    assert lines[1] == text_of("run", 1) and lines[-1] == text_of("run", 12_345)
    assert err.splitlines() == [text_of("run", n) for n in range(7, 12_346, 7)]
    out, err, code = await _cli(run_id, "--org", "acme", "--phase", "custom-x", "--url", url)
    assert code == 2 and err.startswith("runplane: ") and len(err.splitlines()) == 1


async def _cli(*args: str) -> tuple[str, str, int]:
    proc = await asyncio.create_subprocess_exec(
        *RUNPLANE,
        "logs",
        *args,
        "--token",
        ADMIN_TOKEN,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=str(ROOT),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return out.decode(), err.decode(), await proc.wait()
