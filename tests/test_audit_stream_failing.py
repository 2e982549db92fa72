"""A destination that keeps failing (issue 25's loose ends, item 4): the audit stream
tries it again for ever (no record is ever skipped), and says so where an operator and
the organization look: the destination's `last_failure` (status, error, time) and
`failing_since`, a warning at most once a minute per destination, and the `/metrics`
gauge `runplane_audit_destinations_failing` (a count: no organization named). On main
a 400 was retried for ever and said so only in `delivered.error`, with a warning at
every try (a tenant's dead SIEM flooding the control plane's log)."""

from __future__ import annotations

from typing import Any

import structlog
from nats.aio.client import Client as NATS

from services.root.bootstrap import Plane
from services.surfaces.api.metrics import METRICS
from tests.api_support import ADMIN_TOKEN, Http
from tests.audit_stream_support import (
    SECRET,
    V1,
    Sink,
    destination,
    places,
    shttp_fixture,  # noqa: F401  # `shttp`
    streaming,
)
from tests.helpers import eventually

GAUGE = "runplane_audit_destinations_failing"


async def _gauge(http: Http) -> list[str]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with http.client.get("/metrics", headers=headers) as resp:
        assert resp.status == 200
        text = await resp.text()
    return [line for line in text.splitlines() if line.startswith(GAUGE)]


async def test_a_destination_answering_400_is_tried_for_ever_and_shown_failing(
    shttp: Http, system: Plane, nc: NATS
) -> None:
    """Org evil's SIEM answers 400 to every try: the stream keeps trying (a dozen tries
    here) with one warning line, the destination answers `failing_since` and
    `last_failure` {status 400, at}, the gauge is 1 with no label; once the receiver
    takes, every record arrives from the first, in order, `failing_since` is null again,
    `last_failure` stays, the gauge is 0."""
    shttp.client.app[METRICS].cache_s = 0
    await system.start_auditor(checkpoint_s=60)
    await shttp.org("evil")
    assert await _gauge(shttp) == [f"{GAUGE} 0.0"]
    async with Sink(token=SECRET, then=400) as rx:
        made = await destination(shttp, "evil", rx.url)
        one = f"{V1}/evil/audit/destinations/{made['id']}"
        with structlog.testing.capture_logs() as seen:
            async with streaming(system, retry=(0.05,)):

                async def failing() -> dict[str, Any]:
                    a = await shttp.get(one)
                    assert len(rx.got) >= 12 and a.body["failing_since"], a.body
                    return a.body  # type: ignore[no-any-return]  # JSON object

                body = await eventually(failing, timeout=20, what="a dozen failed tries")
        warned = [e for e in seen if e["event"] == "audit_stream_failing"]
        assert [e["log_level"] for e in warned].count("warning") == 1, warned
        assert body["last_failure"]["status"] == 400 and body["last_failure"]["at"]
        assert "HTTP 400" in body["last_failure"]["error"]
        assert body["failing_since"] <= body["last_failure"]["at"]
        assert await _gauge(shttp) == [f"{GAUGE} 1.0"]
        assert places(rx, "evil") == []
        rx.then = 200
        async with streaming(system, retry=(0.05,)):

            async def delivered() -> dict[str, Any]:
                a = await shttp.get(one)
                assert a.body["failing_since"] is None and places(rx, "evil"), a.body
                return a.body  # type: ignore[no-any-return]  # JSON object

            after = await eventually(delivered, timeout=20, what="the records taken")
    got = places(rx, "evil")
    assert got == list(range(1, len(got) + 1)), "from the first record, in order"
    assert after["last_failure"]["status"] == 400
    assert await _gauge(shttp) == [f"{GAUGE} 0.0"]


async def test_a_disabled_destination_no_longer_counts_as_failing(
    shttp: Http, system: Plane, nc: NATS
) -> None:
    """Disabling a failing destination stops its tries: it leaves the gauge (its last
    failure stays on its answer)."""
    shttp.client.app[METRICS].cache_s = 0
    await system.start_auditor(checkpoint_s=60)
    await shttp.org("evil")
    async with Sink(token=SECRET, then=503) as rx:
        made = await destination(shttp, "evil", rx.url)
        one = f"{V1}/evil/audit/destinations/{made['id']}"
        async with streaming(system, retry=(0.05,)):

            async def failing() -> bool:
                return bool((await shttp.get(one)).body["failing_since"])

            await eventually(failing, timeout=20, what="the destination failing")
            assert await _gauge(shttp) == [f"{GAUGE} 1.0"]
            off = await shttp.call("PATCH", one, json={"enabled": False})
            assert off.status == 200 and off.body["failing_since"] is None, off.body
            assert off.body["last_failure"]["status"] == 503
            assert await _gauge(shttp) == [f"{GAUGE} 0.0"]
