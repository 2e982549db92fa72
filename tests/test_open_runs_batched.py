"""The open-runs ledger's writes are shared by the callers that wait for them
(services/app/openruns.py): a burst of creates, or of releases, costs a few writes of the
organization's ledger, not one each, and the quota holds as before (tests/test_open_runs.py).
Real NATS."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events.errors import QuotaExceeded
from infra.kv import OPEN_RUNS_BUCKET
from services.root.bootstrap import Plane
from tests import builders
from tests.bootstrap_support import built, options_for

WORKSPACES = [f"w{i}" for i in range(10)]


@pytest.fixture
async def system(nc: NATS, tmp_path: Path) -> AsyncIterator[Plane]:
    """An organization allowed 25 open runs, a workspace 3 (overrides conftest's)."""
    opts = options_for(tmp_path, org_max_open_runs=25, workspace_max_open_runs=3)
    async with AsyncExitStack() as stack:
        plane = built(nc, stack, tmp_path, opts=opts)
        await plane.app.create_org("acme", "test")
        for ws in WORKSPACES:
            await builders.workspace(plane.app, ws, org="acme", actor="alice")
        yield plane


async def _writes(nc: NATS) -> int:
    """The ledger writes so far (the bucket's stream sequence)."""
    info = await nc.jetstream().stream_info(f"KV_{OPEN_RUNS_BUCKET}")
    return info.state.last_seq


async def test_a_flood_of_creates_shares_a_few_ledger_writes_and_never_passes_the_quota(
    system: Plane, nc: NATS
) -> None:
    """Attack: an organization floods 60 creates at once over 10 workspaces (each may
    have 3 open, the organization 25). Exactly 25 get in, none of a workspace past 3, in
    a handful of writes (main wrote the whole ledger once per create: 25 writes, each
    of up to 25 runs)."""
    app = system.app
    before = await _writes(nc)

    async def create(i: int) -> str:
        try:
            made = await app.create_run("acme", WORKSPACES[i % 10], "plan", "alice")
        except QuotaExceeded:
            return ""
        return made.state.workspace

    made = [ws for ws in await asyncio.gather(*(create(i) for i in range(60))) if ws]
    assert len(made) == 25
    assert max(made.count(ws) for ws in WORKSPACES) == 3
    writes = await _writes(nc) - before
    assert writes <= 8, writes
    assert app.open_runs is not None
    ledger, _ = await app.open_runs._read("acme", leader=True)
    assert len(ledger.runs) == 25


async def test_releases_ending_together_share_writes_and_free_their_places(
    system: Plane, nc: NATS
) -> None:
    """The scheduler's releases of runs that end together go in a few writes; each place
    is free again after."""
    app = system.app
    runs = [
        (await app.create_run("acme", ws, "plan", "alice")).state.run_id
        for ws in WORKSPACES
        for _ in range(2)
    ]
    assert app.open_runs is not None
    before = await _writes(nc)
    await asyncio.gather(*(app.open_runs.release("acme", r) for r in runs))
    assert await _writes(nc) - before <= 4
    ledger, _ = await app.open_runs._read("acme", leader=True)
    assert ledger.runs == []
