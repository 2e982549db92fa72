"""What an organization's configuration versions may hold of the shared object store, and
the sweep that deletes the ones no run needs (services/surfaces/tfe/quota.py, sweep.py),
through runplane's real API on real NATS. Time is the sweep's argument, never a sleep."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from yarl import URL

from executor.objects import PLANS_BUCKET, Objects
from infra.natsserver import EmbeddedNats
from services.surfaces.tfe import configs, quota, sweep
from services.surfaces.tfe.configs import ConfigStore
from services.surfaces.tfe.quota import QUOTA_TITLE, Ledger, Limits, Quota
from services.surfaces.tfe.sweep import SWEEPER, Sweeper
from tests.helpers import eventually
from tests.tfe_support import Tfe, archive, new_config, new_run, put, tfe_fixture
from tests.tfe_support import replica as support_replica

__all__ = ["tfe_fixture"]

PER_WS = 3
BUDGET = 256 * 1024
KIB = 1024


@pytest.fixture(autouse=True)
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deployment's settings, read when the API is built (after this fixture)."""
    monkeypatch.setenv(quota.PENDING_PER_WORKSPACE_ENV, str(PER_WS))
    monkeypatch.setenv(quota.VERSIONS_PER_ORG_ENV, "8")
    monkeypatch.setenv(quota.MB_PER_ORG_ENV, str(BUDGET / (1024 * 1024)))


async def stored(tfe: Tfe) -> list[str]:
    """The configuration objects in rp-plans, deleted ones left out."""
    store = await tfe.api.app.store.nc.jetstream().object_store(PLANS_BUCKET)
    try:
        infos = await store.list(ignore_deletes=True)
    except nats.js.errors.NotFoundError:
        return []
    return sorted(i.name for i in infos if i.name.startswith(configs.PREFIX + "/"))


async def create(tfe: Tfe, ws_id: str) -> Any:
    return await tfe.tfe(
        "POST",
        f"/api/v2/workspaces/{ws_id}/configuration-versions",
        json={"data": {"type": "configuration-versions", "attributes": {"speculative": True}}},
    )


async def upload(tfe: Tfe, ws_id: str, body: bytes | None = None) -> str:
    cv = await new_config(tfe, ws_id, speculative=True)
    status, answer = await put(tfe, cv["attributes"]["upload-url"], body or archive())
    assert status == 200, answer
    return str(cv["id"])


async def status_of(tfe: Tfe, cv: str) -> int | str:
    got = await tfe.tfe("GET", f"/api/v2/configuration-versions/{cv}")
    return got.body["data"]["attributes"]["status"] if got.status == 200 else got.status


def sweeper_of(tfe: Tfe) -> Sweeper:
    s = tfe.client.app[SWEEPER]
    assert s is not None
    return s


def later(**delta: float) -> datetime:
    return datetime.now().astimezone() + timedelta(**delta)


async def test_the_limits_are_the_deployments_settings_and_bad_ones_refused() -> None:
    assert Limits.from_env({}) == Limits()
    assert Limits() == Limits(
        pending_per_workspace=20,
        versions_per_org=500,
        bytes_per_org=1024 * 1024 * 1024,
        unused_ttl_s=86400.0,
        pending_ttl_s=3600.0,
    )
    got = Limits.from_env({quota.PENDING_PER_WORKSPACE_ENV: "5", quota.MB_PER_ORG_ENV: "64"})
    assert (got.pending_per_workspace, got.bytes_per_org) == (5, 64 * 1024 * 1024)
    for bad in ("0", "-1", "lots", "inf", "nan"):
        with pytest.raises(ValueError, match=quota.UNUSED_TTL_ENV):
            Limits.from_env({quota.UNUSED_TTL_ENV: bad})
    for bad in ("0.5", "2.5", "2001"):  # a count, and a ledger that fits one KV value
        with pytest.raises(ValueError, match=quota.VERSIONS_PER_ORG_ENV):
            Limits.from_env({quota.VERSIONS_PER_ORG_ENV: bad})


async def test_the_version_past_a_workspaces_unused_limit_is_refused_and_nothing_written(
    tfe: Tfe,
) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    made = [await create(tfe, ws_id) for _ in range(PER_WS)]
    assert [a.status for a in made] == [201] * PER_WS
    before = await stored(tfe)
    refused = await create(tfe, ws_id)
    assert refused.status == 422, refused.body
    error = refused.body["errors"][0]
    assert error["title"] == QUOTA_TITLE
    assert f"workspace net has {PER_WS} configuration versions no run has used" in error["detail"]
    assert "start a run of one" in error["detail"]
    assert await stored(tfe) == before
    ledger = await sweeper_of(tfe).quota.ledger("acme")
    assert len(ledger.versions) == PER_WS
    # another workspace of the organization has slots of its own
    other = await tfe.cli_workspace("acme", "dns")
    assert (await create(tfe, other)).status == 201


async def test_an_organization_has_at_most_its_versions_in_the_store(tfe: Tfe) -> None:
    await tfe.org("acme")
    spaces = [await tfe.cli_workspace("acme", name) for name in ("a", "b", "c")]
    for ws_id in spaces:
        for _ in range(PER_WS if ws_id != spaces[-1] else 2):
            assert (await create(tfe, ws_id)).status == 201
    before = await stored(tfe)
    refused = await create(tfe, spaces[-1])  # its workspace has a slot; the org has none
    assert refused.status == 422
    detail = refused.body["errors"][0]["detail"]
    assert "organization acme has 8 configuration versions in the store (the limit is 8)" in (
        detail
    )
    assert await stored(tfe) == before


async def test_an_upload_past_the_organizations_budget_is_refused_before_its_body(
    tfe: Tfe,
) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    other_ws = await tfe.cli_workspace("acme", "dns")
    first = await upload(tfe, ws_id, bytes(200 * KIB))
    cv = await new_config(tfe, other_ws, speculative=True)
    before = await stored(tfe)
    status, body = await put(tfe, cv["attributes"]["upload-url"], bytes(100 * KIB))
    assert status == 422, body
    error = body["errors"][0]
    assert error["title"] == QUOTA_TITLE
    assert (
        "organization acme's configuration versions hold 0.2 MiB of its 0.2 MiB"
        in (error["detail"])
    )
    assert "this upload: 0.1 MiB" in error["detail"]
    assert await stored(tfe) == before
    assert await status_of(tfe, cv["id"]) == "pending"
    ledger = await sweeper_of(tfe).quota.ledger("acme")
    assert ledger.held() == 200 * KIB and ledger.versions[cv["id"]].state == "pending"

    # an upload that announces no length reserves the cap (32 MiB): refused unread
    async def chunked() -> AsyncIterator[bytes]:
        yield archive()

    async with tfe.client.put(URL(cv["attributes"]["upload-url"]).path, data=chunked()) as resp:
        answer = await resp.json(content_type=None)
    assert resp.status == 422 and "without a Content-Length" in answer["errors"][0]["detail"]
    # what fits is taken: the version refused may still be uploaded smaller
    assert (await put(tfe, cv["attributes"]["upload-url"], bytes(50 * KIB)))[0] == 200
    assert await status_of(tfe, cv["id"]) == "uploaded" and await status_of(tfe, first) == (
        "uploaded"
    )


async def test_an_upload_cut_short_gives_its_reservation_back(
    tfe: Tfe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body that runs past the cap after its reservation was taken (no Content-Length:
    the cap reserved): 422, nothing stored, the bytes free again, the version pending."""
    monkeypatch.setattr(configs, "MAX_UPLOAD", 64 * KIB)
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv = await new_config(tfe, ws_id, speculative=True)
    before = await stored(tfe)

    async def too_long() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield bytes(16 * KIB)

    async with tfe.client.put(URL(cv["attributes"]["upload-url"]).path, data=too_long()) as resp:
        answer = await resp.json(content_type=None)
    assert resp.status == 422 and answer["errors"][0]["title"] == "configuration too large"
    assert await stored(tfe) == before
    entry = (await sweeper_of(tfe).quota.ledger("acme")).versions[cv["id"]]
    assert (entry.state, entry.size) == ("pending", 0)
    assert (await put(tfe, cv["attributes"]["upload-url"], archive()))[0] == 200


async def test_attack_one_organization_filling_its_quota_refuses_no_other(tfe: Tfe) -> None:
    """Org A fills its workspace's slots and its byte budget; org B creates and uploads
    as if A were not there. Without a quota A's fourth version was taken (this fails)."""
    await tfe.org("org-a")
    await tfe.org("org-b")
    a_ws = await tfe.cli_workspace("org-a", "net")
    b_ws = await tfe.cli_workspace("org-b", "net")
    await upload(tfe, a_ws, bytes(BUDGET - 10 * KIB))
    for _ in range(PER_WS - 1):
        assert (await create(tfe, a_ws)).status == 201
    refused = await create(tfe, a_ws)
    assert refused.status == 422 and refused.body["errors"][0]["title"] == QUOTA_TITLE
    a_other = await tfe.cli_workspace("org-a", "dns")
    cv = await new_config(tfe, a_other, speculative=True)
    assert (await put(tfe, cv["attributes"]["upload-url"], bytes(20 * KIB)))[0] == 422
    # org B: all its slots and all its budget
    for _ in range(PER_WS - 1):
        assert (await create(tfe, b_ws)).status == 201
    assert await status_of(tfe, await upload(tfe, b_ws, bytes(BUDGET - 10 * KIB))) == "uploaded"


async def test_a_run_made_of_a_version_frees_its_slot(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    versions = [await upload(tfe, ws_id) for _ in range(PER_WS)]
    assert (await create(tfe, ws_id)).status == 422
    run = await new_run(tfe, ws_id, versions[0])
    assert run.status == 201, run.body
    assert (await create(tfe, ws_id)).status == 201
    entry = (await sweeper_of(tfe).quota.ledger("acme")).versions[versions[0]]
    assert entry.state == "consumed" and len(entry.runs) == 1
    assert run.body["data"]["id"].endswith(entry.runs[0])


async def test_a_refused_run_gives_its_claim_back(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv = await upload(tfe, ws_id)
    bad = await new_run(tfe, ws_id, cv, **{"refresh-only": "yes"})
    assert bad.status == 422
    entry = (await sweeper_of(tfe).quota.ledger("acme")).versions[cv]
    assert (entry.state, entry.runs) == ("uploaded", ())


async def test_expiry_deletes_unused_versions_and_keeps_one_a_live_run_reads(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    unused = await upload(tfe, ws_id)
    never = (await create(tfe, ws_id)).body["data"]["id"]
    used = await upload(tfe, ws_id)
    run = await new_run(tfe, ws_id, used)
    assert run.status == 201, run.body
    sweeper = sweeper_of(tfe)

    assert await sweeper.sweep(later(minutes=30)) == 0
    assert await sweeper.sweep(later(hours=2)) == 1  # never uploaded: 1 h
    assert await status_of(tfe, never) == 404
    assert await status_of(tfe, unused) == "uploaded"
    assert await sweeper.sweep(later(hours=25)) == 1  # uploaded, no run: 24 h
    assert await status_of(tfe, unused) == 404
    assert await sweeper.sweep(later(days=30)) == 0  # its run is not over
    assert await status_of(tfe, used) == "uploaded"
    names = await stored(tfe)
    assert names == sorted(ConfigStore.names("acme", "net", used))
    assert set((await sweeper.quota.ledger("acme")).versions) == {used}
    # a swept version answers no upload and makes no run
    assert (await new_run(tfe, ws_id, unused)).status == 404

    # the run ends (canceled): its version goes with the next sweep
    canceled = await tfe.tfe("POST", f"/api/v2/runs/{run.body['data']['id']}/actions/cancel")
    assert canceled.status in (200, 202), canceled.body
    assert await sweeper.sweep(later(seconds=1)) == 1
    assert await stored(tfe) == []
    assert (await sweeper.quota.ledger("acme")).versions == {}


async def test_the_sweep_lists_every_organization_every_time(tfe: Tfe) -> None:
    """The sweep's list of ledgers is the stream leader's, read whole each time: with
    nats-py's `kv.keys()` about 1 listing in 300 came back empty (its watcher ended
    before its first message), and that sweep swept nothing (CI failed on it)."""
    q = sweeper_of(tfe).quota
    assert await q.orgs() == []  # the bucket empty: no ledger yet
    for org in ("acme", "globex", "initech"):
        await q.change(org, lambda led: Ledger(versions=dict(led.versions)))
    listings = [await q.orgs() for _ in range(400)]
    assert all(got == ["acme", "globex", "initech"] for got in listings)


async def test_a_claim_whose_run_never_landed_holds_its_version_an_hour(tfe: Tfe) -> None:
    """The api died between claiming a version for a run and recording the run: the
    version counts as unused after CLAIM_GRACE_S, and goes when unused ones go; beside a
    live run, a ghost run holds nothing past the grace."""
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    ghost_only = await upload(tfe, ws_id)
    shared = await upload(tfe, ws_id)
    q = sweeper_of(tfe).quota
    await q.claim("acme", ghost_only, "01ghostrun0000000000000000", later())
    run = await new_run(tfe, ws_id, shared)
    assert run.status == 201, run.body
    await q.claim("acme", shared, "01ghostrun0000000000000001", later())
    sweeper = sweeper_of(tfe)
    assert await sweeper.sweep(later(hours=2)) == 0  # both a day from their upload
    assert await sweeper.sweep(later(hours=25)) == 1  # the ghost's: unused for a day
    assert await status_of(tfe, ghost_only) == 404
    assert await status_of(tfe, shared) == "uploaded"  # its real run is not over
    canceled = await tfe.tfe("POST", f"/api/v2/runs/{run.body['data']['id']}/actions/cancel")
    assert canceled.status in (200, 202)
    assert await sweeper.sweep(later(hours=2)) == 1
    assert await stored(tfe) == []


async def test_an_upload_a_sweep_took_meanwhile_leaves_nothing_behind(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv = await new_config(tfe, ws_id, speculative=True)
    store = tfe.client.app[configs.CONFIGS]
    assert store is not None
    # the PUT's reservation is taken, then a sweep (the version too old) takes it
    await store.quota.begin_upload("acme", cv["id"], 1024, announced=True)
    assert await sweeper_of(tfe).sweep(later(hours=2)) == 1
    assert await store.quota.end_upload("acme", cv["id"], 1024, later()) is False
    assert (await put(tfe, cv["attributes"]["upload-url"], archive()))[0] == 404
    assert await stored(tfe) == []


async def test_two_sweepers_at_once_delete_each_version_once_and_keep_the_rest(
    tfe: Tfe, nats_server: EmbeddedNats
) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    dns = await tfe.cli_workspace("acme", "dns")
    old = [await upload(tfe, ws_id) for _ in range(PER_WS)]
    old += [(await create(tfe, dns)).body["data"]["id"] for _ in range(2)]
    kept = await upload(tfe, dns)
    ledger = await sweeper_of(tfe).quota.ledger("acme")
    fresh = ledger.versions[kept].uploaded_at
    assert fresh is not None
    # every old one is past its TTL at `when`; `kept` has just been uploaded
    for cv in old:
        await _age(tfe, cv)
    when = fresh + timedelta(minutes=1)
    second: NATS = await nats_server.connect()
    try:
        first = sweeper_of(tfe)
        other = Sweeper(Quota(second.jetstream(), first.quota.limits), first.run_over, first.names)
        results = await asyncio.gather(first.sweep(when), other.sweep(when), first.sweep(when))
    finally:
        await second.close()
    assert sum(results) == len(old)  # each marked by one of them
    assert set((await first.quota.ledger("acme")).versions) == {kept}
    assert await stored(tfe) == sorted(ConfigStore.names("acme", "dns", kept))
    assert all([await status_of(tfe, cv) == 404 for cv in old])


async def _age(tfe: Tfe, cv: str) -> None:
    """Move a version's times two days back in its ledger (as if made then)."""
    q = sweeper_of(tfe).quota
    two_days = timedelta(days=2)

    def edit(led: quota.Ledger) -> quota.Ledger:
        e = led.versions[cv]
        aged = msgspec.structs.replace(
            e,
            created_at=e.created_at - two_days,
            uploaded_at=e.uploaded_at - two_days if e.uploaded_at else None,
        )
        return quota.Ledger(versions={**led.versions, cv: aged})

    await q.change("acme", edit)


async def test_a_run_racing_the_sweep_either_has_its_version_or_is_refused(tfe: Tfe) -> None:
    """Runs made of expired versions while sweeps delete them: each run made keeps its
    archive (the executor reads it); each version deleted made no run."""
    await tfe.org("acme")
    spaces = [await tfe.cli_workspace("acme", n) for n in ("a", "b", "c")]
    versions = {await upload(tfe, ws_id): ws_id for ws_id in spaces for _ in range(2)}
    for cv in versions:
        await _age(tfe, cv)
    sweeper = sweeper_of(tfe)
    now = later()
    runs = [new_run(tfe, ws_id, cv) for cv, ws_id in versions.items()]
    answers = await asyncio.gather(*runs, sweeper.sweep(now), sweeper.sweep(now))
    names = set(await stored(tfe))
    ledger = await sweeper.quota.ledger("acme")
    for (cv, _), answer in zip(versions.items(), answers, strict=False):
        ws = cv.split(".")[1]
        if answer.status == 201:
            assert set(ConfigStore.names("acme", ws, cv)) <= names
            assert ledger.versions[cv].state == "consumed"
        else:
            assert answer.status == 404, answer.body
            assert not set(ConfigStore.names("acme", ws, cv)) & names
            assert cv not in ledger.versions


@dataclass(frozen=True)
class Interleaved(Quota):
    """A Quota whose next compare-and-set first lets `before` run: a claim landing
    between a sweep's read of the ledger and its marking."""

    before: list[Callable[[], Awaitable[object]]] = field(default_factory=list)

    async def change(self, org: str, edit: Callable[[Ledger], Ledger | None]) -> Ledger:
        while self.before:
            await self.before.pop()()
        return await super().change(org, edit)


async def test_a_run_made_while_a_sweep_decides_keeps_its_version(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv = await upload(tfe, ws_id)
    await _age(tfe, cv)
    first = sweeper_of(tfe)
    made: list[Any] = []

    async def run_it() -> None:
        made.append(await new_run(tfe, ws_id, cv))

    racing = Interleaved(first.quota.js, first.quota.limits, [run_it])
    sweeper = Sweeper(racing, first.run_over, first.names)
    assert await sweeper.sweep(later()) == 0  # it read `uploaded`, then the claim landed
    assert made[0].status == 201, made[0].body
    assert await stored(tfe) == sorted(ConfigStore.names("acme", "net", cv))
    assert (await first.quota.ledger("acme")).versions[cv].state == "consumed"


async def test_objects_no_ledger_names_are_deleted_once_old(tfe: Tfe, tmp_path: Path) -> None:
    """An archive and a record left by a version made before the ledger (or by an api
    that died mid-upload): deleted once older than the pending TTL; a version the
    ledger names, and anything not a configuration (a plan), never."""
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    kept = await upload(tfe, ws_id)
    js = tfe.api.app.store.nc.jetstream()
    blob = tmp_path / "blob"
    blob.write_bytes(b"left behind")
    orphan = "cv-acme.net.01orphan000000000000000000"
    objects = Objects(js)
    for name in (*ConfigStore.names("acme", "net", orphan), "01somerun.tfplan"):
        await objects.upload(PLANS_BUCKET, name, blob)
    sweeper = sweeper_of(tfe)
    assert await sweeper.sweep_orphans(later(minutes=10)) == 0  # too young: maybe mid-write
    assert await sweeper.sweep_orphans(later(hours=2)) == 2
    assert await stored(tfe) == sorted(ConfigStore.names("acme", "net", kept))
    plans = await js.object_store(PLANS_BUCKET)
    assert (await plans.get_info("01somerun.tfplan")).size == len(b"left behind")


@pytest.fixture
def fast_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every api's sweep every 50 ms, a version never uploaded expiring after 0.2 s."""
    monkeypatch.setattr(sweep, "SWEEP_EVERY_S", 0.05)
    monkeypatch.setenv(quota.PENDING_TTL_ENV, "0.2")


async def test_the_api_sweeps_by_itself(fast_sweep: None, tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv = (await create(tfe, ws_id)).body["data"]["id"]
    uploaded = await upload(tfe, ws_id)

    async def gone() -> bool:
        return await status_of(tfe, cv) == 404

    await eventually(gone, timeout=10, what="the never-uploaded version swept")
    assert await status_of(tfe, uploaded) == "uploaded"  # unused for 24 h only


@contextlib.asynccontextmanager
async def replica(tfe: Tfe, server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[Tfe]:
    """A second api process's application: its own NATS connection, App, read model;
    the deployment's key ring."""
    conn = await server.connect()
    try:
        async with support_replica(conn, tfe.keyring, tmp_path / "replica.sqlite") as other:
            assert await other.api.projector.wait_for(await tfe.api.app.store.last_seq())
            yield other
    finally:
        await conn.close()


async def test_two_api_replicas_share_one_quota_and_race_for_its_last_slot(
    tfe: Tfe, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    async with replica(tfe, nats_server, tmp_path) as other:
        assert (await create(tfe, ws_id)).status == 201
        assert (await create(other, ws_id)).status == 201
        # one slot left, asked of both at once, several times each
        answers = await asyncio.gather(*[create(t, ws_id) for t in (tfe, other) * 3])
        assert sorted(a.status for a in answers) == [201] + [422] * 5
        assert (await create(other, ws_id)).status == 422
        ledger = await sweeper_of(other).quota.ledger("acme")
        assert len(ledger.versions) == PER_WS
        # a version made on one replica is uploaded through the other's URL, and run there
        cv = await new_config(tfe, await tfe.cli_workspace("acme", "dns"), speculative=True)
        assert (await put(other, cv["attributes"]["upload-url"], archive()))[0] == 200
        assert (await sweeper_of(tfe).quota.ledger("acme")).versions[cv["id"]].state == ("uploaded")
