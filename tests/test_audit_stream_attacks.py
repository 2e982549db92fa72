"""The audit stream against a hostile organization admin (issue 25, item 1): an org only
ever streams its own records, whatever it writes in its destination and whatever
someone with NATS access slips into its chain; it cannot reach another org's
destinations; the URL passes the notifications' address guard and must be https; the
secret is never in clear in the log, the read model or an answer; an endless answer
holds a lane no longer than its first bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
from aiohttp import web
from nats.aio.client import Client as NATS

from infra.kv import AUDIT_BUCKET, SECRETS_BUCKET
from infra.streams import AUDIT, EVENTS
from services.processes.audit_stream import DestinationSecrets
from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from tests.api_support import Http, served
from tests.audit_stream_support import (
    SECRET,
    V1,
    Sink,
    destination,
    lines,
    places,
    shttp_fixture,  # noqa: F401  # `shttp`
    streaming,
)
from tests.audit_support import records
from tests.helpers import eventually

B_NAMED = {"name": "b", "sourcetype": "b", "index": "b"}


async def test_org_a_never_receives_org_bs_records_even_naming_b_everywhere(
    shttp: Http, system: Plane, nc: NATS
) -> None:
    """A's destination says "b" in every field it has (name, HEC sourcetype and index,
    the URL's path and query) while b is busy: A's receiver gets records of a alone,
    each `source` runplane:a, and b's own receiver gets b's."""
    await system.start_auditor(checkpoint_s=0.2)
    await shttp.org("a")
    await shttp.org("b")
    async with Sink() as ra, Sink(token=SECRET) as rb:
        url = ra.url + "/b/services/collector?org=b&source=runplane:b"
        await destination(shttp, "a", url, format="splunk-hec", **B_NAMED)
        await destination(shttp, "b", rb.url)
        for i in range(4):
            await shttp.workspace("b", f"w{i}")
        await shttp.workspace("a", "only")
        async with streaming(system):

            async def both() -> bool:
                b_chain = [r["n"] for _, r in await records(nc, "b")]
                a_chain = [r["n"] for _, r in await records(nc, "a")]
                return places(rb, "b") == b_chain and places(ra, "a") == a_chain

            await eventually(both, timeout=20, what="both orgs' records delivered")
    assert {line["source"] for line in lines(ra)} == {"runplane:a"}
    assert {line["event"]["org"] for line in lines(ra, taken=False)} == {"a"}
    assert all(b'"org":"b"' not in g.body for g in ra.got)


async def test_a_foreign_message_in_org_as_chain_is_never_sent(
    shttp: Http, system: Plane, nc: NATS
) -> None:
    """Someone with NATS access publishes b's record (and garbage) on a's subject: a's
    destination never gets them, and the records around them still arrive in order."""
    await system.start_auditor(checkpoint_s=60)
    await shttp.org("a")
    await shttp.org("b")
    await shttp.workspace("b", "secret-project")
    (_, b_record), *_ = [x for x in await records(nc, "b") if x[1]["action"] == "ws.created"]
    forged = msgspec.json.encode({**b_record})
    await nc.jetstream().publish("audit.a", forged, stream=AUDIT)
    await nc.jetstream().publish("audit.a", b"not a record", stream=AUDIT)
    async with Sink(token=SECRET) as ra:
        await destination(shttp, "a", ra.url)
        await shttp.workspace("a", "after")
        async with streaming(system):

            async def arrived() -> bool:
                return any(line["action"] == "ws.created" for line in lines(ra))

            await eventually(arrived, timeout=20, what="a's record after the foreign ones")
    sent = lines(ra, taken=False)
    assert {line["org"] for line in sent} == {"a"}
    assert all("secret-project" not in line["thing"] for line in sent)


async def test_another_orgs_destinations_are_not_found_and_below_admin_forbidden(
    shttp: Http, system: Plane
) -> None:
    """A's admin token: b's destinations are 404 to read, change or delete, and making
    one under b is refused; a's operator may not make or list a's (403)."""
    a = await shttp.org("a")
    await shttp.org("b")
    made = await destination(shttp, "b", "http://127.0.0.1:9/hook")
    one = f"{V1}/b/audit/destinations/{made['id']}"
    admin = a["admin"]
    assert (await shttp.get(one, token=admin)).status == 404
    assert (
        await shttp.call("PATCH", one, json={"url": "http://127.0.0.1:1/x"}, token=admin)
    ).status == 404
    assert (await shttp.call("DELETE", one, token=admin)).status == 404
    body = {"name": "x", "url": "http://127.0.0.1:9/hook", "secret": "s"}
    assert (await shttp.post(f"{V1}/b/audit/destinations", json=body, token=admin)).status == 404
    assert (await shttp.get(f"{V1}/b/audit/destinations", token=admin)).status == 404
    mine = await shttp.get(f"{V1}/a/audit/destinations/{made['id']}", token=admin)
    mine.problem("not-found", 404)
    op = a["operator"]
    (await shttp.post(f"{V1}/a/audit/destinations", json=body, token=op)).problem("forbidden", 403)
    (await shttp.get(f"{V1}/a/audit/destinations", token=op)).problem("forbidden", 403)
    still = await shttp.get(one)
    assert still.status == 200 and still.body["url"] == "http://127.0.0.1:9/hook"


async def test_the_address_guard_and_https_hold_when_saved(
    shttp: Http, system: Plane, tmp_path: Path
) -> None:
    """The metadata service, private and (not allowed here) other addresses are 422
    destination-refused with nothing written; http:// too on a deployment that does not
    allow it; a destination without its secret is 422."""
    await shttp.org("a")
    root = f"{V1}/a/audit/destinations"
    for url in (
        "https://169.254.169.254/latest/meta-data",
        "https://10.0.0.7/hec",
        "https://[fd00::1]/hec",
        "https://0.0.0.0/hec",
    ):
        a = await shttp.post(root, json={"name": "x", "url": url, "secret": "s"})
        a.problem("destination-refused", 422)
    no_secret = await shttp.post(root, json={"name": "x", "url": "https://siem.example"})
    no_secret.problem("invalid-command", 422)
    assert (await shttp.get(root)).body["items"] == []
    strict = served(system, tmp_path / "strict.sqlite", "strict", audit_stream_allow_http=False)
    async with strict as (web_app, client):
        http = Http(client, web_app[API], system.app)
        body = {"name": "x", "url": "http://127.0.0.1:9/", "secret": "s"}
        (await http.post(root, json=body)).problem("destination-refused", 422)


async def test_http_is_not_sent_to_unless_the_deployment_allows_it(
    shttp: Http, system: Plane, nc: NATS
) -> None:
    """A destination saved while http was allowed is not sent to by a streamer that does
    not allow it: its GET says why, and the receiver gets nothing."""
    await system.start_auditor(checkpoint_s=60)
    await shttp.org("a")
    async with Sink(token=SECRET) as rx:
        made = await destination(shttp, "a", rx.url)
        async with streaming(system, allow_http=False):

            async def refused() -> str:
                a = await shttp.get(f"{V1}/a/audit/destinations/{made['id']}")
                return str(a.body["delivered"]["error"] or "")

            assert "https" in await eventually(refused, what="the refusal on record")
        assert rx.got == []


async def test_the_secret_is_never_in_clear_in_the_log_the_read_model_or_an_answer(
    shttp: Http, system: Plane, nc: NATS, tmp_path: Path
) -> None:
    """After a create and a change of secret: no event, no audit record, no key of the
    progress bucket, no byte of the read model and no answer holds either secret; the
    secrets bucket holds them sealed only."""
    await system.start_auditor(checkpoint_s=0.1)
    await shttp.org("a")
    made = await destination(shttp, "a", "http://127.0.0.1:9/hook", format="splunk-hec")
    other = "second-hec-token-77c0ffee"
    one = f"{V1}/a/audit/destinations/{made['id']}"
    changed = await shttp.call("PATCH", one, json={"secret": other})
    assert changed.status == 200 and changed.body["has_secret"] is True
    answers = [
        made,
        changed.body,
        (await shttp.get(one)).body,
        (await shttp.get(f"{V1}/a/audit")).body,
    ]
    stored = b"".join(
        [await _all(nc, EVENTS), await _all(nc, AUDIT), await _all(nc, f"KV_{AUDIT_BUCKET}")]
    )
    sealed = await _all(nc, f"KV_{SECRETS_BUCKET}")
    model = b"".join(p.read_bytes() for p in tmp_path.glob("rm.sqlite*"))
    for secret in (SECRET, other):
        assert secret.encode() not in stored and secret.encode() not in sealed
        assert secret.encode() not in model
        assert all(secret not in msgspec.json.encode(a).decode() for a in answers)
    assert b"_auditdest." in sealed, "the sealed secret is there"


async def _all(nc: NATS, stream: str) -> bytes:
    js = nc.jetstream()
    info = await js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await js.get_msg(stream, seq)
        except Exception:  # noqa: BLE001 - a deleted sequence
            continue
        out.append((msg.subject or "").encode() + (msg.data or b""))
    return b"\n".join(out)


@asynccontextmanager
async def _endless() -> AsyncIterator[tuple[str, list[int]]]:
    """A receiver that answers 200 and then streams bytes for ever."""
    seen: list[int] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(len(await request.read()))
        resp = web.StreamResponse(status=200)
        await resp.prepare(request)
        chunk = b"x" * 65536
        while True:
            await resp.write(chunk)
            await asyncio.sleep(0)

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/hec", seen
    finally:
        await runner.cleanup()


async def test_an_endless_answer_holds_the_lane_no_longer_than_its_first_bytes(
    shttp: Http, system: Plane, nc: NATS
) -> None:
    """A receiver that answers 200 and never ends its body: each batch is taken as
    delivered once its status and first bytes are read, and the next goes at once (the
    answer is never read whole: a few KiB at most)."""
    await system.start_auditor(checkpoint_s=60)
    await shttp.org("a")
    async with _endless() as (url, seen):
        await destination(shttp, "a", url)
        for i in range(3):
            await shttp.workspace("a", f"w{i}")
        async with streaming(system, batch=1, timeout=30.0):

            async def all_sent() -> bool:
                return len(seen) >= len(await records(nc, "a"))

            await eventually(all_sent, timeout=10, what="every batch sent, one by one")


async def test_removing_the_secret_of_an_enabled_destination_is_refused_and_keeps_it(
    shttp: Http, system: Plane
) -> None:
    """`"secret": ""` on an enabled destination is 422 and the sealed secret stays (it
    was removed before the refusal, once); disabled with it, both go."""
    await shttp.org("a")
    made = await destination(shttp, "a", "http://127.0.0.1:9/hook")
    one = f"{V1}/a/audit/destinations/{made['id']}"
    (await shttp.call("PATCH", one, json={"secret": ""})).problem("invalid-command", 422)
    assert await DestinationSecrets(system.nc, system.keyring).get("a", made["id"]) == SECRET
    off = await shttp.call("PATCH", one, json={"secret": "", "enabled": False})
    assert off.status == 200 and off.body["has_secret"] is False
    assert await DestinationSecrets(system.nc, system.keyring).get("a", made["id"]) == ""
