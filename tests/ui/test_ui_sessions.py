"""Browser sessions behind several api replicas: two api apps on one NATS (each with its
own projector, as two replicas have), one browser going through both; what the bucket
holds; and, on a 3-node cluster, a replica reading through a follower that is behind."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import nats.js.errors
import pytest
from aiohttp.test_utils import BaseTestServer, TestClient, TestServer
from nats.aio.client import Client as NATS

from infra import kv, streams
from services.app.commands import App
from services.surfaces.api.context import API
from services.surfaces.ui.sessions import Sessions, _key
from tests.api_support import Http, web_app_of
from tests.bootstrap_support import Process
from tests.cluster_support import NatsCluster
from tests.helpers import eventually, kv_keys
from tests.stale_reads_support import PAYLOAD, Lagging, trials
from tests.ui.support import Browser, Page


class Replicas:
    """Two api replicas over one NATS."""

    def __init__(self, one: BaseTestServer, two: BaseTestServer) -> None:
        self.one = one
        self.two = two


@pytest.fixture
async def replicas(
    app: App, process: Process, tmp_path: Path
) -> AsyncIterator[tuple[Http, Replicas]]:
    async with AsyncExitStack() as stack:
        clients = []
        http = None
        for name in ("one", "two"):
            replica = process()  # a replica's own graph: its own command side
            projector = await stack.enter_async_context(
                replica.projector(tmp_path / f"{name}.sqlite")
            )
            started = await app.create_org(f"ui-replica-{name}", "test")
            assert await projector.wait_for(started.seq)  # see tests/api_support.py
            web_app = web_app_of(replica, projector, secret_store=None)
            client = await stack.enter_async_context(TestClient(TestServer(web_app)))
            clients.append(client)
            http = http or Http(client, web_app[API], replica.app)
        assert http is not None
        yield http, Replicas(clients[0].server, clients[1].server)


async def _bucket_dump(nc: NATS) -> list[bytes]:
    """Every key and value the sessions bucket holds now."""
    bucket = await nc.jetstream().key_value(kv.UI_SESSIONS_BUCKET)
    out: list[bytes] = []
    for key in await kv_keys(nc, kv.UI_SESSIONS_BUCKET):
        entry = await bucket.get(key)
        out += [key.encode(), entry.value or b""]
    return out


async def test_a_session_started_on_one_replica_is_used_and_ended_on_the_other(
    replicas: tuple[Http, Replicas],
) -> None:
    """Sign in on one, use on the other, sign out on the other: refused on the first."""
    http, r = replicas
    acme = await http.org("acme")
    on_one, on_two = Browser(r.one), Browser(r.two)
    try:
        signed = await on_one.signin(acme["operator"])
        assert signed.status == 200 and "Organization acme" in signed.text
        cookie = on_one.cookie("rp_session")
        assert cookie
        on_two.plant("rp_session", cookie)  # the same browser, routed to the other replica
        page = await on_two.get("/orgs/acme", allow_redirects=False)
        assert page.status == 200 and "Organization acme" in page.text
        out = await on_two.post("/signout", {}, follow=False)
        assert out.status == 303 and out.headers["Location"] == "/"
        refused = await on_one.get("/orgs/acme", allow_redirects=False)
        assert refused.status == 303 and refused.headers["Location"] == "/"
    finally:
        await on_one.close()
        await on_two.close()


async def test_a_token_revoked_on_one_replica_ends_its_sessions_on_the_other(
    replicas: tuple[Http, Replicas], nc: NATS
) -> None:
    """Its every session goes from the bucket, not only the one that noticed."""
    http, r = replicas
    acme = await http.org("acme")
    first, second = Browser(r.one), Browser(r.two)
    try:
        await first.signin(acme["viewer"])
        await second.signin(acme["viewer"])
        tokens = (await http.get("/api/v1/orgs/acme/tokens")).body["items"]
        viewer = next(t for t in tokens if t["role"] == "viewer")
        gone = await http.call("DELETE", f"/api/v1/orgs/acme/tokens/{viewer['token_id']}")
        assert gone.status in (200, 204), gone.body
        stolen = first.cookie("rp_session")
        assert stolen
        page = await eventually_refused(second)
        assert page.headers["Location"] == "/"
        bucket = await nc.jetstream().key_value(kv.UI_SESSIONS_BUCKET)
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await bucket.get(_key(stolen))  # the first browser's, never used since
    finally:
        await first.close()
        await second.close()


async def eventually_refused(b: Browser) -> Page:
    """The page once the replica's projection has the revocation (it may lag)."""

    async def refused() -> Page:
        page = await b.get("/orgs/acme", allow_redirects=False)
        assert page.status == 303, page.status
        return page

    return await eventually(refused, timeout=10, what="the revoked session refused")


async def test_the_bucket_holds_neither_the_cookie_nor_the_token(
    replicas: tuple[Http, Replicas], nc: NATS
) -> None:
    http, r = replicas
    acme = await http.org("acme")
    b = Browser(r.one)
    try:
        await b.signin(acme["admin"])
        cookie = b.cookie("rp_session")
        assert cookie
        page = await b.get("/orgs/acme")
        dump = b"\n".join(await _bucket_dump(nc))
        assert dump  # the session is there
        for secret in (cookie, acme["admin"], page.csrf):
            assert secret.encode() not in dump
    finally:
        await b.close()


@pytest.mark.slow
async def test_a_replica_reading_through_a_follower_behind_sees_sessions_fresh(
    tmp_path: Path,
) -> None:
    """A session started through the leader is found, and one ended there is gone, when
    read through a follower that is behind (a direct get there misses or keeps them)."""
    async with NatsCluster(tmp_path / "cluster") as cluster:
        nc = await cluster.connect()
        await streams.declare(nc, nc.jetstream(), replicas=3)
        await nc.close()
        async with Lagging(cluster, f"KV_{kv.UI_SESSIONS_BUCKET}") as lag:
            writer, reader = Sessions(lag.writer), Sessions(lag.reader, timeout=2.0)
            bucket = await lag.writer.jetstream().key_value(kv.UI_SESSIONS_BUCKET)
            started: dict[int, str] = {}

            async def burst(j: int) -> object:
                return await bucket.put(f"burst.w{j}", PAYLOAD)

            async def write(i: int) -> int:
                if i % 2 == 0:
                    started[i], _ = await writer.start(f"token-{i}", "acme")
                else:
                    await writer.end(started[i - 1])
                return 0

            async def old(i: int) -> bool:
                """A direct get (what a follower answers): found iff the trial expects."""
                js = lag.reader.jetstream(timeout=2.0)
                subject = f"$KV.{kv.UI_SESSIONS_BUCKET}.{_key(started[i - i % 2])}"
                try:
                    raw = await js.get_msg(
                        f"KV_{kv.UI_SESSIONS_BUCKET}", subject=subject, direct=True
                    )
                    live = bool(raw.data)
                except nats.js.errors.NotFoundError:
                    live = False
                return live == (i % 2 == 0)

            async def new(i: int, _: int) -> bool:
                found = await reader.get(started[i - i % 2])
                return (found is not None) == (i % 2 == 0)

            tally = await trials(lag, burst, write, old, {"Sessions.get": new})
    print(tally.line("sessions"))
    assert tally.old_stale > 0, f"the follower never lagged, nothing proven: {tally}"
    assert not any(tally.new_stale.values()), tally.line("sessions")
