"""A finished run whose logs are stored as the executor stores them (several chunks a
step, so that reads take long enough to overlap a deletion), and one read of its log: for
the tests of log reads racing retention (test_retention_race, test_attack_review_25)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import msgspec
from nats.aio.client import Client as NATS

from events.run import ClaimPhase, FinishPlan, FinishStep, PlanSummary, StartStep
from executor.objects import LOGS_BUCKET, Objects, log_object
from infra.steplogs import encode_record
from tests.api_support import ADMIN_TOKEN, Http
from tests.helpers import eventually

V1 = "/api/v1/orgs/acme"
LEASE = "lease-1"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# Four steps of 3,000 lines (about 260 KB, 3 chunks each): a read takes some milliseconds.
STEPS = [(name, 3000) for name in ("checkout", "init", "plan", "show")]
READERS = 24


def text_of(step: str, n: int) -> str:
    return f"{step} line {n:06d} " + "x" * 70


def items() -> list[dict[str, object]]:
    return [
        {"phase": "plan", "step": step, "stream": "stdout", "line": n, "text": text_of(step, n)}
        for step, count in STEPS
        for n in range(1, count + 1)
    ]


async def finished_run(http: Http, nc: NATS, tmp_path: Path) -> str:
    """A plan run of acme whose STEPS finished with their logs stored, then the run."""
    await http.org("acme")
    await http.workspace("acme", "net")
    app = http.app
    run_id = str((await http.run("acme", "net", "plan"))["id"])
    assert await app.admit_next("acme", "net") == run_id
    claim = ClaimPhase(actor="executor", phase="plan", lease_id=LEASE, executor_id="x")
    await app.run_command("acme", "net", run_id, claim)
    objects = Objects(nc.jetstream())
    for step, count in STEPS:
        await app.run_command(
            "acme", "net", run_id, StartStep(actor="executor", lease_id=LEASE, step=step)
        )
        path = tmp_path / f"{step}.log"
        path.write_bytes(
            b"".join(encode_record("stdout", n, text_of(step, n)) for n in range(1, count + 1))
        )
        name = log_object(run_id, "plan", step)
        await objects.upload(LOGS_BUCKET, name, path, fresh=True)
        finish = FinishStep(
            actor="executor", lease_id=LEASE, step=step, ok=True,
            started_at=datetime.now(UTC), log_object=name,
        )  # fmt: skip
        await app.run_command("acme", "net", run_id, finish)
    done = FinishPlan(
        actor="executor", lease_id=LEASE, commit="abc", has_changes=False, summary=PlanSummary()
    )
    await app.run_command("acme", "net", run_id, done)

    async def projected() -> bool:
        a = await http.get(f"{V1}/runs/{run_id}")
        return a.body is not None and a.body["status"] == "no_changes"

    await eventually(projected, what="the run projected as ended")
    return run_id


async def read_once(session: aiohttp.ClientSession, url: str) -> tuple[str, str]:
    """One GET of the log: ("whole", digest), ("410", type), ("cut", error) when the
    connection broke mid-body, or (status, body) for anything else."""
    try:
        async with session.get(url, headers=AUTH) as resp:
            body = await resp.read()
    except aiohttp.ClientPayloadError as e:
        return "cut", repr(e)
    if resp.status == 410:
        return "410", msgspec.json.decode(body)["type"].rsplit("/", 1)[-1]
    if resp.status == 200:
        return "whole", hashlib.sha256(body).hexdigest()
    return str(resp.status), body.decode(errors="replace")[:200]
