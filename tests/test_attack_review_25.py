"""An attacker's review of issue 25's new surfaces (audit streaming, TFE refusals on the
record, whole-record retention, point-in-time answers) as they landed on main at f7b23a1:
each finding is a test that failed there.

The attacker is the admin of organization `evil` (its own token, its own organization's
endpoints only); the victim is organization `acme`. The review's table (every attempt,
those refused already included) is in the branch's report.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client as NATS

from events import folder as fo
from events.run import RemoveRun
from infra.ids import utcnow
from infra.streams import EVENTS
from projections.asof import Bounds
from services.processes.retention import Retention
from services.root.bootstrap import Plane
from services.surfaces.api.asof import PAST
from services.surfaces.api.context import API
from services.surfaces.tfe import logs as tfe_logs
from services.surfaces.tfe.jsonapi import TfeError
from tests.api_support import Http, http_fixture, served
from tests.lograce_support import READERS, finished_run, items, read_once

__all__ = ["http_fixture"]

V1 = "/api/v1/orgs"


async def _last_seq(http: Http) -> int:
    return (await http.app.store.nc.jetstream().stream_info(EVENTS)).state.last_seq


async def test_as_of_cache_org_a_cannot_evict_org_b_s_model_to_starve_it(
    system: Plane, tmp_path: Path
) -> None:
    """Attack: acme's history is longer than one request's fold cap, so its answer takes
    a few requests, each going on from the model the last one kept. Between acme's
    requests evil asks its own runs as of ever earlier sequences: each is a new scratch
    model (a model never goes back), cheap for evil (its organization has few events),
    and the cache's least recently used model, acme's, was the one closed for it. acme
    started over from sequence 1 every time and never got an answer: 503 for ever, at
    the price of one cheap request of evil's per request of acme's. Now the cache takes
    back from the organization holding the most of it."""
    async with served(system, tmp_path / "rm.sqlite", "acme", as_of=Bounds(models=2, events=4)) as (
        web,
        client,
    ):
        http = Http(client, web[API], system.app)
        assert (await http.post(V1, json={"name": "pad"})).status == 201
        for i in range(30):  # sequences for evil to ask as of
            await http.workspace("pad", f"w{i}")
        await http.workspace("acme", "net")
        runs = [(await http.run("acme", "net"))["id"] for _ in range(4)]
        evil = (await http.org("evil"))["admin"]
        seq = await _last_seq(http)
        low = seq  # evil's models: as of ever earlier sequences
        answered = None
        for _ in range(12):
            got = await http.get(f"{V1}/acme/runs/{runs[-1]}?as_of={seq}")
            if got.status == 200:
                answered = got
                break
            got.problem("as-of-too-costly", 503)
            for _ in range(2):  # as many models as the cache holds
                low -= 1
                mine = await http.get(f"{V1}/evil/runs?as_of={low}", token=evil)
                assert mine.status in (200, 404), mine.body
        assert answered is not None, "acme's as_of never answered: evil evicted its model"
        assert answered.body["id"] == runs[-1]
        assert len(web[PAST]._models) <= 2


async def test_as_of_times_at_the_calendar_s_edges_are_a_422_never_a_500(
    system: Plane, tmp_path: Path
) -> None:
    """Attack: an `as_of` time whose offset takes it past datetime's range (year 1 at
    +01:00, year 9999 at -01:00) raised OverflowError, and year 1 in UTC reached the
    stream's leader as `1-01-01T...` (strftime does not pad the year): a 500
    internal-error, where every refusal is a problem with its own type."""
    async with served(system, tmp_path / "rm.sqlite", "acme") as (web, client):
        http = Http(client, web[API], system.app)
        for when in (
            "0001-01-01T00:00:00%2B01:00",
            "9999-12-31T23:59:59-01:00",
            "0001-01-01T00:00:00Z",
            "0099-06-01T00:00:00Z",
        ):
            got = await http.get(f"{V1}/acme/runs?as_of={when}")
            got.problem("invalid-as-of", 422)
        ok = await http.get(f"{V1}/acme/runs?as_of=2999-01-01T00:00:00Z")
        ok.problem("invalid-as-of", 422)  # in the future: refused as before


async def test_log_reads_racing_a_whole_record_removal_never_answer_a_partial_200(
    http: Http, nc: NATS, tmp_path: Path
) -> None:
    """Attack: the log-prune race fix asks the event log whether retention removed a
    run's logs when a stored object is found gone (`log_removed_at`), but a whole-record
    removal (`run.removed`) sets `removed_at` only: a read that found the object gone
    (its row still in the read model: a replica's projector behind, or a pass without
    grace as here) went on to RP_LOGS's remains and answered 200 with an empty log,
    passing for whole. Now either removal is a 410, as a read after it answers."""
    run_id = await finished_run(http, nc, tmp_path)
    want = hashlib.sha256(msgspec.json.encode({"items": items()})).hexdigest()
    await http.app.org_command(
        "acme", fo.SetOrgSettings(actor="admin", changes={"record_retention_days": 1})
    )
    http.app.clock = lambda: utcnow() + timedelta(days=2)  # type: ignore[method-assign]
    deleted = asyncio.Event()

    async def remove() -> None:
        await asyncio.sleep(0.3)
        await Retention(nc, http.app, grace=0).pass_once()
        deleted.set()

    url = str(http.client.make_url(f"{V1}/acme/runs/{run_id}/logs"))
    seen: Counter[tuple[str, str]] = Counter()

    async def reader(session: aiohttp.ClientSession) -> None:
        while True:
            answer = await asyncio.wait_for(read_once(session, url), 20)
            seen[answer] += 1
            if deleted.is_set() and answer[0] == "410":
                return

    async def readers() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(reader(session) for _ in range(READERS)))

    await asyncio.gather(readers(), remove())
    allowed = {("whole", want), ("410", "log-removed"), ("410", "run-removed")}
    assert {k for k in seen if k[0] != "cut"} <= allowed, seen


async def test_a_tfe_log_read_racing_a_whole_record_removal_is_never_an_empty_whole_log(
    http: Http, nc: NATS, tmp_path: Path
) -> None:
    """The same race on the TFE API's log (what `terraform` prints): its read checked
    `removed_at` when it began, then read the steps from the read model; once the
    projection dropped them it answered an empty log, which the CLI takes for the whole
    one. Deterministic here: the run as the read loaded it, the removal projected, then
    the read of its text. Now a 503 (the client's next try is the 410)."""
    run_id = await finished_run(http, nc, tmp_path)
    before = (await http.app.load_run("acme", "net", run_id)).state
    removal = RemoveRun(
        actor="retention", objects=[], ended_before=utcnow() + timedelta(seconds=1), days=0
    )
    removed = await http.app.run_command("acme", "net", run_id, removal)
    assert await http.api.projector.wait_for(removed.seq, timeout=5)
    with pytest.raises(TfeError) as refused:
        await tfe_logs._text(http.api, before, "plan", ended=True)
    assert refused.value.status == 503


async def test_as_of_one_tenant_cannot_keep_the_api_folding_without_end(
    system: Plane, tmp_path: Path
) -> None:
    """Attack (the fold cap as a DoS): each request as of an earlier sequence than every
    cached model builds a new one from sequence 1 and folds all of evil's history up to
    it (a dozen events here; 20,000, about 2 s of the api's event loop, by default). 12
    such requests started over 12 times, none refused. Now an organization's requests
    fold at most `per_minute` events a minute: past it 503 as-of-too-costly, nothing
    folded, other organizations answered."""
    async with served(
        system, tmp_path / "rm.sqlite", "acme", as_of=Bounds(events=20, per_minute=30)
    ) as (
        web,
        client,
    ):
        http = Http(client, web[API], system.app)
        evil = (await http.org("evil"))["admin"]
        for i in range(6):
            await http.workspace("evil", f"w{i}")
        seq = await _last_seq(http)
        refused = 0
        for i in range(12):
            got = await http.get(
                f"{V1}/evil/workspaces/w0/state-versions?as_of={seq - i}", token=evil
            )
            if got.status == 503:
                refused += 1
            else:
                assert got.status in (200, 404), got.body
        assert refused > 0, "12 requests folded 12 times the cap, none refused"
        assert web[PAST].built < 12  # the refused ones started nothing
        other = await http.get(f"{V1}/acme/runs?as_of={seq}")  # another org: answered
        assert other.status == 200, other.body


def test_the_as_of_budget_is_a_flag_and_an_environment_variable(monkeypatch: Any) -> None:
    from services.root.cli import options, parser

    opts = options(parser().parse_args(["api", "--as-of-events-per-minute", "5"]))
    assert opts.as_of_events_per_minute == 5
    monkeypatch.setenv("RUNPLANE_AS_OF_EVENTS_PER_MINUTE", "0")
    assert options(parser().parse_args(["up"])).as_of_events_per_minute == 0
    assert options(parser().parse_args(["up"])).as_of_max_events == 20_000
