"""`GET /metrics` (projections/metrics.py, services/surfaces/api/metrics.py): runs by status,
queue depth, consumer lag and notification attempts read from the real read model and
the real JetStream consumers; and who may read them: the admin token or the metrics
token, never an organization's token (its admin's included), and no label that names a
tenant's things."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig
from prometheus_client.parser import text_string_to_metric_families

from infra import streams
from projections.metrics import Metrics
from services.surfaces.api.app import build_app
from services.surfaces.api.context import API
from services.surfaces.api.metrics import METRICS
from tests.api_support import ADMIN_TOKEN, Http, http_fixture  # noqa: F401  # fixture

METRICS_TOKEN = "rp_metrics_test_token_0123456789"


def parsed(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def scrape(http: Http, token: str | None = ADMIN_TOKEN) -> tuple[int, str, str]:
    hdrs = {"Authorization": f"Bearer {token}"} if token else {}
    async with http.client.get("/metrics", headers=hdrs) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


@pytest.fixture
async def plane(http: Http) -> AsyncIterator[Http]:
    """Two organizations with runs waiting (no scheduler: they stay pending, queued on
    their workspaces); the metrics read fresh at every scrape."""
    http.client.app[METRICS].cache_s = 0
    for org, ws, runs in (("alpha-secret", "ws-alpha-name", 3), ("beta-hidden", "ws-beta", 1)):
        await http.org(org)
        await http.workspace(org, ws)
        made = [await http.run(org, ws, "plan") for _ in range(runs)]
    first = (await http.run("alpha-secret", "ws-alpha-name", "plan"))["id"]
    assert (await http.post(f"/api/v1/orgs/alpha-secret/runs/{first}/cancel")).status == 200
    assert made
    await _projected(http)
    yield http


async def _projected(http: Http) -> None:
    assert await http.api.reached(await http.app.store.last_seq(), 5)


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_runs_by_status_queue_depth_and_consumer_lag(plane: Http, nc: NATS) -> None:
    """The figures are the read model's and JetStream's own: 4 pending runs and 1
    canceled, 4 waiting in 2 queues (3 deep at most); the scheduler's durable and a
    subscriber's `rp-sub-*` with their pending and unacked counts as the server has them,
    another durable left out; no notification attempts yet: every outcome at 0."""
    js = nc.jetstream()
    await streams.ensure_scheduler_consumer(js)
    await js.add_consumer(
        streams.EVENTS, ConsumerConfig(durable_name="rp-sub-test", ack_policy=AckPolicy.EXPLICIT)
    )
    await js.add_consumer(
        streams.EVENTS, ConsumerConfig(durable_name="someone-else", ack_policy=AckPolicy.EXPLICIT)
    )
    sub = await js.pull_subscribe_bind(durable="rp-sub-test", stream=streams.EVENTS)
    held = await sub.fetch(2, timeout=5)  # delivered, not acked
    assert len(held) == 2
    for org, n in (("acme", 2), ("beta", 1)):  # phases no executor has claimed yet
        for i in range(n):
            await js.publish(streams.dispatch_subject("default", org), f"{org}{i}".encode())

    status, content_type, text = await scrape(plane)
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    samples = parsed(text)
    assert _value(samples, "runplane_runs", status="pending") == 4
    assert _value(samples, "runplane_runs", status="canceled") == 1
    assert _value(samples, "runplane_runs", status="applied") == 0, "every status listed"
    assert _value(samples, "runplane_queue_depth") == 4
    assert _value(samples, "runplane_queue_depth_max") == 3
    assert _value(samples, "runplane_queues") == 2
    for durable in (streams.SCHEDULER_CONSUMER, "rp-sub-test"):
        info = await js.consumer_info(streams.EVENTS, durable)
        labels = {"stream": streams.EVENTS, "consumer": durable}
        assert _value(samples, "runplane_consumer_pending", **labels) == info.num_pending
        assert _value(samples, "runplane_consumer_ack_pending", **labels) == info.num_ack_pending
    sub_labels = {"stream": streams.EVENTS, "consumer": "rp-sub-test"}
    assert _value(samples, "runplane_consumer_ack_pending", **sub_labels) == 2
    assert "someone-else" not in text
    assert _value(samples, "runplane_dispatch_waiting") == 3
    for outcome in ("delivered", "retry", "failed", "gave_up", "other"):
        assert _value(samples, "runplane_notification_attempts_total", outcome=outcome) == 0
    for part in ("runs", "queue", "consumers", "dispatch", "notifications"):
        assert _value(samples, "runplane_metrics_ok", part=part) == 1


async def test_notification_attempts_are_counted_by_outcome_when_the_table_exists(
    plane: Http,
) -> None:
    """The read model's `notify_attempts` (services/processes/notifications' attempts) are counted
    by outcome; an outcome runplane does not know is `other`, never a label of its own
    (a value in the table cannot add series)."""
    db = sqlite3.connect(plane.api.projector.db_path)
    rows = ["delivered"] * 3 + ["retry", "gave_up", 'x"} 1\nrunplane_runs{status="evil']
    db.executemany(
        "INSERT INTO notify_attempts (config_id, seq, outcome) VALUES ('c', ?, ?)",
        list(enumerate(rows)),
    )
    db.commit()
    db.close()
    samples = parsed((await scrape(plane))[2])
    name = "runplane_notification_attempts_total"
    assert _value(samples, name, outcome="delivered") == 3
    assert _value(samples, name, outcome="retry") == 1
    assert _value(samples, name, outcome="gave_up") == 1
    assert _value(samples, name, outcome="failed") == 0
    assert _value(samples, name, outcome="other") == 1
    assert ("runplane_runs", (("status", "evil"),)) not in samples


async def test_only_the_admin_or_the_metrics_token_reads_the_metrics(
    plane: Http, tmp_path: Path
) -> None:
    """Attack: org alpha's admin and org beta's viewer get 403 problem details and no
    figure; no token, another scheme, a wrong token: 401. The admin token reads them, and
    what it reads names no organization, workspace or run. The metrics token reads them
    and opens nothing else."""
    alpha = await plane.org("alpha-two")
    beta = await plane.org("beta-two")
    await _projected(plane)
    for token in (alpha["admin"], beta["viewer"]):
        a = await plane.get("/metrics", token=token)
        a.problem("forbidden", 403)
        assert "runplane_" not in str(a.body)
    for hdrs in ({}, {"Authorization": "Basic YTpi"}, {"Authorization": "Bearer rp_nope"}):
        a = await plane.call("GET", "/metrics", token=None, headers=hdrs)
        a.problem("unauthorized", 401)
    (await plane.post("/metrics")).problem("method-not-allowed", 405)

    status, _, text = await scrape(plane)
    assert status == 200
    runs = await plane.get("/api/v1/orgs/alpha-secret/runs")
    names = {"alpha-secret", "beta-hidden", "ws-alpha-name", "ws-beta", "alpha-two", "beta-two"}
    names |= {r["id"] for r in runs.body["items"]}
    for secret in names:
        assert secret not in text, f"{secret} is in the metrics"

    web_app = build_app(
        app=plane.app,
        projector=plane.api.projector,
        admin_token=ADMIN_TOKEN,
        metrics_token=METRICS_TOKEN,
    )
    async with TestClient(TestServer(web_app)) as client:
        scraper = Http(client, web_app[API], plane.app)
        assert (await scrape(scraper, METRICS_TOKEN))[0] == 200
        assert (await scrape(scraper, ADMIN_TOKEN))[0] == 200
        assert (await scrape(scraper, alpha["admin"]))[0] == 403
        a = await scraper.get("/api/v1/orgs/alpha-secret", token=METRICS_TOKEN)
        a.problem("unauthorized", 401)


async def test_a_part_that_cannot_be_read_is_reported_and_the_rest_answered(
    nc: NATS, tmp_path: Path
) -> None:
    """A read model without the tables (a bad path): its parts are 0 in
    `runplane_metrics_ok`, the consumers' still read; no error escapes."""
    metrics = Metrics(nc, tmp_path / "empty.sqlite", cache_s=0)
    try:
        samples = parsed((await metrics.render()).decode())
    finally:
        await metrics.close()
    assert _value(samples, "runplane_metrics_ok", part="runs") == 0
    assert _value(samples, "runplane_metrics_ok", part="queue") == 0
    assert _value(samples, "runplane_metrics_ok", part="consumers") == 1
    assert not any(name == "runplane_runs" for name, _ in samples)
