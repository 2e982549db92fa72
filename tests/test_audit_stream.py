"""Streaming the audit log to a SIEM (issue 25, item 1): an organization admin's
destinations get the organization's records in chain order, each with its stable
delivery id, signed as notifications are (or in Splunk HEC's shape), at least once,
across a restart, retried with backoff, and a failing destination delays no other
organization's. Real NATS, real HTTP receivers on loopback."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from nats.aio.client import Client as NATS

from events.audit import Facts
from infra.auditlog import AuditLog
from infra.natsserver import EmbeddedNats
from infra.options import ConfigError
from services.processes.notifications import signing
from services.root import cli
from services.root.bootstrap import Plane
from tests.api_support import Http
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


async def _activity(http: Http, org: str, workspaces: int, prefix: str = "ws") -> None:
    for i in range(workspaces):
        await http.workspace(org, f"{prefix}{i}")


async def _chain(nc: NATS, org: str, at_least: int) -> list[int]:
    async def probe() -> list[int] | None:
        found = [r["n"] for _, r in await records(nc, org)]
        return found if len(found) >= at_least else None

    return await eventually(probe, timeout=20, what=f"{at_least} records of {org}")


async def _got_all(receiver: Sink, org: str, nc: NATS, timeout: float = 20) -> list[int]:
    """What the receiver took, once it holds the chain's last record (and, from its
    first record on, every one)."""

    async def probe() -> list[int] | None:
        chain = [r["n"] for _, r in await records(nc, org)]
        got = places(receiver, org)
        return got if got and sorted(set(got)) == chain[chain.index(got[0]) :] else None

    return await eventually(probe, timeout=timeout, what=f"every record of {org} delivered")


async def test_records_arrive_in_chain_order_signed_as_notifications_are(
    shttp: Http, system: Plane, nc: NATS
) -> None:
    """Each record as the audit API answers it, with `delivery_id` org.n, as JSON lines in
    chain order; every request carries RP-Delivery (its first and last place) and both
    notification signatures, which verify with the destination's secret."""
    await system.start_auditor(checkpoint_s=0.2)
    await shttp.org("a")
    async with Sink(token=SECRET) as rx:
        await destination(shttp, "a", rx.url)
        await _activity(shttp, "a", 5)
        await _chain(nc, "a", 7)
        async with streaming(system, batch=3):
            got = await _got_all(rx, "a", nc)
    assert got == list(range(1, len(got) + 1)), "in chain order, none missing or doubled"
    assert len(rx.got) >= 3, "batches of at most 3"
    for g in rx.got:
        assert g.rp_ok and g.tfe_ok, "signed with the destination's secret"
        assert g.headers["Content-Type"] == "application/x-ndjson"
        first, last = g.body.splitlines()[0], g.body.splitlines()[-1]
        ns = (json.loads(first)["n"], json.loads(last)["n"])
        assert g.delivery == f"a.{ns[0]}-{ns[1]}"
    page = await shttp.get(f"{V1}/a/audit?limit=1000")
    answered = {i["n"]: i for i in page.body["items"]}
    for line in lines(rx):
        assert line.pop("delivery_id") == f"a.{line['n']}"
        assert line == answered[line["n"]], "the record as GET .../audit answers it"
    assert any(line["action"] == "org.audit_destination_saved" for line in lines(rx))


async def test_splunk_hec_shape_with_its_token(shttp: Http, system: Plane, nc: NATS) -> None:
    """`splunk-hec`: `Authorization: Splunk <token>`, and a body of HEC event objects
    (time, host, source runplane:<org>, sourcetype, index, event: the record)."""
    await system.start_auditor(checkpoint_s=0.2)
    await shttp.org("a")
    async with Sink() as rx:
        hec = rx.url + "/services/collector/event"
        await destination(shttp, "a", hec, format="splunk-hec", index="audit")
        await _activity(shttp, "a", 2)
        await _chain(nc, "a", 4)
        async with streaming(system):
            await _got_all(rx, "a", nc)
    assert {g.headers["Authorization"] for g in rx.got} == {f"Splunk {SECRET}"}
    assert all(signing.TFE_HEADER not in g.headers for g in rx.got), "HEC: the token, no HMAC"
    for line in lines(rx):
        assert set(line) == {"time", "host", "source", "sourcetype", "index", "event"}
        assert line["host"] == "runplane.test" and line["source"] == "runplane:a"
        assert line["sourcetype"] == "runplane:audit" and line["index"] == "audit"
        event = line["event"]
        assert event["delivery_id"] == f"a.{event['n']}" and len(event["hash"]) == 64
        assert abs(line["time"] - time.time()) < 300


async def test_a_restarted_streamer_resumes_from_its_cursor_without_loss_or_resend(
    shttp: Http, system: Plane, nc: NATS
) -> None:
    """A streamer stopped once everything so far was delivered, records appended while
    none runs, another streamer started: it sends exactly what followed (the cursor is
    in NATS), nothing twice, nothing skipped; the destination's GET shows the progress."""
    await system.start_auditor(checkpoint_s=0.2)
    await shttp.org("a")
    async with Sink(token=SECRET) as rx:
        made = await destination(shttp, "a", rx.url)
        await _activity(shttp, "a", 3)
        await _chain(nc, "a", 5)
        async with streaming(system):
            before = await _got_all(rx, "a", nc)

            async def saved() -> bool:
                a = await shttp.get(f"{V1}/a/audit/destinations/{made['id']}")
                return bool(a.body["delivered"]["n"] == before[-1])

            await eventually(saved, what="the cursor saved")
        await _activity(shttp, "a", 4, prefix="later")
        await _chain(nc, "a", len(before) + 4)
        async with streaming(system):
            after = await _got_all(rx, "a", nc)
    assert after == list(range(1, len(after) + 1)), "nothing skipped, nothing sent twice"
    assert len(after) > len(before)
    a = await shttp.get(f"{V1}/a/audit/destinations/{made['id']}")
    assert a.body["delivered"]["error"] is None and a.body["delivered"]["at"]


async def test_a_failing_destination_is_retried_and_delays_no_other_org(
    shttp: Http, system: Plane, nc: NATS
) -> None:
    """Org a's receiver answers 500 three times, then hangs past the timeout once, then
    takes: its records come in order after the retries, each retry the same RP-Delivery,
    and the failure is on its GET meanwhile. Org b's destination gets each of its records
    meanwhile, within a second of the streamer seeing it."""
    await system.start_auditor(checkpoint_s=60)
    await shttp.org("a")
    await shttp.org("b")
    async with Sink(token=SECRET, answers=[500, 500, 500, 0]) as ra, Sink(token=SECRET) as rb:
        da = await destination(shttp, "a", ra.url)
        await destination(shttp, "b", rb.url)
        await _activity(shttp, "a", 2)
        await _chain(nc, "a", 3)
        async with streaming(system, timeout=1.0, retry=(0.3,)):
            await eventually(lambda: _true(len(ra.got) >= 2), what="a's first failures")
            failing = await shttp.get(f"{V1}/a/audit/destinations/{da['id']}")
            assert "HTTP 500" in failing.body["delivered"]["error"]
            assert failing.body["delivered"]["failures"] >= 1
            started = time.monotonic()
            await _activity(shttp, "b", 1)
            await _got_all(rb, "b", nc)
            assert time.monotonic() - started < 3.0, "b's records waited for a's receiver"
            assert places(ra, "a") == [], "a still failing meanwhile"
            got = await _got_all(ra, "a", nc, timeout=30)
    tries = [g.delivery for g in ra.got]
    assert tries[0] == tries[1] == tries[2] == tries[3] == tries[4], "the same batch again"
    assert places(ra, "a")[-len(got) :] == list(range(1, len(got) + 1))
    assert sorted(set(places(rb, "b"))) == places(rb, "b"), "b's in order, once each"


async def _true(value: bool) -> bool:
    return value


async def test_two_streamers_send_each_record_once(shttp: Http, system: Plane, nc: NATS) -> None:
    """Two replicas of the subscribers: the cursor's lease lets one send at a time, so
    the receiver gets each record once, in order."""
    await system.start_auditor(checkpoint_s=0.2)
    await shttp.org("a")
    async with Sink(token=SECRET) as rx:
        await destination(shttp, "a", rx.url)
        async with streaming(system, batch=2), streaming(system, batch=2):
            for i in range(4):
                await shttp.workspace("a", f"x{i}")
                await asyncio.sleep(0.1)
            await _chain(nc, "a", 6)
            got = await _got_all(rx, "a", nc)
    assert got == list(range(1, len(got) + 1))


async def test_start_now_sends_only_what_follows_and_a_disabled_destination_nothing(
    shttp: Http, system: Plane, nc: NATS
) -> None:
    """`start: now` begins after the chain's head at the create (its own record of the
    create is the first sent); a destination disabled gets nothing more, and enabled
    again goes on from where it stopped."""
    await system.start_auditor(checkpoint_s=60)
    await shttp.org("a")
    await _activity(shttp, "a", 3)
    before = await _chain(nc, "a", 4)
    async with Sink(token=SECRET) as rx:
        made = await destination(shttp, "a", rx.url, start="now")
        one = f"{V1}/a/audit/destinations/{made['id']}"
        async with streaming(system):
            await eventually(lambda: _true(bool(places(rx, "a"))), what="the first record")
            assert places(rx, "a")[0] == before[-1] + 1
            off = await shttp.call("PATCH", one, json={"enabled": False})
            assert off.status == 200 and off.body["enabled"] is False
            await asyncio.sleep(0.5)  # the change reaches the streamer: its lane stops
            sent = len(rx.got)
            await _activity(shttp, "a", 2, prefix="quiet")
            await _chain(nc, "a", before[-1] + 4)
            await asyncio.sleep(1.0)  # five of the lane's polls, were it still running
            assert len(rx.got) == sent, "a disabled destination is sent nothing"
            assert (await shttp.call("PATCH", one, json={"enabled": True})).status == 200
            got = await _got_all(rx, "a", nc)
    assert got == list(range(before[-1] + 1, got[-1] + 1)), "from where it stopped, in order"


@pytest.mark.slow
async def test_throughput_of_one_destination(shttp: Http, system: Plane, nc: NATS) -> None:
    """A figure for the README: 5,000 records of one organization streamed to a local
    receiver, batches of 100 (`pytest tests/test_audit_stream.py -m slow -s`)."""
    await shttp.org("a")
    audit = AuditLog(nc)
    for i in range(5000):
        facts = Facts(
            org="a", at=datetime.now(UTC), actor=f"u{i}", actor_kind="user", via="api",
            action="refused GET /x", thing="organization a", outcome="refused", status=403,
        )  # fmt: skip
        await audit.append(facts)
    async with Sink(token=SECRET) as rx:
        await destination(shttp, "a", rx.url)
        started = time.monotonic()
        async with streaming(system, batch=100):

            async def last_taken() -> bool:  # cheap: the figure is the streamer's
                if not rx.taken:
                    return False
                body = rx.got[max(rx.taken)].body
                return bool(json.loads(body.splitlines()[-1])["n"] == 5000)

            await eventually(last_taken, timeout=120, interval=0.01, what="record 5000")
        took = time.monotonic() - started
        got = places(rx, "a")
    assert got == list(range(1, len(got) + 1))
    print(f"\naudit stream: {len(got)} records in {took:.2f} s, {len(got) / took:.0f}/s")


def test_the_settings_come_from_flags_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--audit-stream-*` flags, or RUNPLANE_AUDIT_STREAM_* when a flag is not given, become
    the options; out of range is one ConfigError naming the flag."""
    monkeypatch.setenv("RUNPLANE_AUDIT_STREAM_BATCH", "7")
    monkeypatch.setenv("RUNPLANE_AUDIT_STREAM_ALLOW_HTTP", "1")
    args = ["subscribers", "--nats-url", "nats://127.0.0.1:4222", "--audit-stream-retry", "1,5"]
    opts = cli.options(cli.parser().parse_args([*args, "--audit-stream-timeout", "3"]))
    assert opts.audit_stream_retry == (1.0, 5.0) and opts.audit_stream_timeout == 3.0
    assert opts.audit_stream_batch == 7 and opts.audit_stream_allow_http is True
    opts.check()
    for name, value, flag in (
        ("audit_stream_batch", 0, "--audit-stream-batch"),
        ("audit_stream_timeout", 0.0, "--audit-stream-timeout"),
        ("audit_stream_retry", (), "--audit-stream-retry"),
    ):
        bad = replace(opts)
        setattr(bad, name, value)
        with pytest.raises(ConfigError, match=flag):
            bad.check()
    monkeypatch.delenv("RUNPLANE_AUDIT_STREAM_ALLOW_HTTP")
    plain = cli.options(cli.parser().parse_args(args))
    assert plain.audit_stream_allow_http is False and plain.audit_stream_batch == 7


async def test_a_streamer_killed_mid_send_is_taken_over_and_its_batch_sent_again(
    shttp: Http, system: Plane, nc: NATS, nats_server: EmbeddedNats
) -> None:
    """A streamer whose connection dies while its receiver holds a batch unanswered (a
    kill: no lease given back): another streamer waits for the lease to run out, then
    sends its records again (their same delivery ids: at least once) and all after,
    in order, nothing skipped."""
    await system.start_auditor(checkpoint_s=60)
    await shttp.org("a")
    await _activity(shttp, "a", 2)
    chain = await _chain(nc, "a", 3)
    async with Sink(token=SECRET, answers=[0]) as rx:
        await destination(shttp, "a", rx.url)
        doomed = await nats_server.connect()
        async with streaming(system, doomed, lease_s=2.0, timeout=30.0):
            await eventually(lambda: _true(len(rx.got) == 1), what="the batch in flight")
            await doomed.close()  # the process dies: its lease stays, its batch unanswered
        await _activity(shttp, "a", 2, prefix="meanwhile")
        started = time.monotonic()
        async with streaming(system, lease_s=2.0):
            got = await _got_all(rx, "a", nc)
        waited = time.monotonic() - started
    again, first = rx.got[1].delivery, rx.got[0].delivery  # a.1-8, then a.1-10 (2 since)
    assert again.split("-")[0] == first.split("-")[0] == "a.1", "the unanswered ones again"
    assert got == list(range(1, len(got) + 1)) and len(got) >= len(chain) + 2
    assert 0.5 < waited < 10, "taken over once the dead one's lease ran out"
