"""Traces (infra/tracing.py): one trace from an HTTP create through the events'
NATS headers, the scheduler's dispatch and the executor's phase and steps, over real NATS
and real Terraform; what a caller's headers may put in the stream; and the OTLP/HTTP
exporter, configured by the environment of a real process, against a local collector."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from nats.aio.client import Client as NATS
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from events.run import Workspace
from infra import tracing
from infra.consumer import Consumer, Received, Subscription
from infra.streams import EVENTS, pool_subjects
from services.app.commands import App
from tests.api_support import Http, http_fixture  # noqa: F401  # registers the fixture
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)


class Recorder(InMemorySpanExporter):
    """Keeps finished spans only while a test of this module asks (the provider is the
    process's, for the rest of the session)."""

    on = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return super().export(spans) if self.on else SpanExportResult.SUCCESS


RECORDER = Recorder()


@pytest.fixture
def spans() -> Iterator[Recorder]:
    tracing.setup("runplane-test", processors=[SimpleSpanProcessor(RECORDER)])
    RECORDER.clear()
    RECORDER.on = True
    yield RECORDER
    RECORDER.on = False
    RECORDER.clear()


def traceparent() -> tuple[str, str, str]:
    """A caller's `traceparent` (sampled), with its trace and span ids."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def ids(header: str) -> tuple[str, str]:
    """(trace id, parent span id) of a `traceparent`."""
    version, trace_id, span_id, _flags = header.split("-")
    assert version == "00"
    return trace_id, span_id


async def headers_of(nc: NATS, store: Any, subject: str) -> list[tuple[str, dict[str, str]]]:
    """(event type, NATS headers) of every event on `subject`, as stored."""
    js = nc.jetstream()
    out = []
    for env in await store.read(subject):
        raw = await js.get_msg(EVENTS, env.seq)
        hdrs = dict(raw.headers or {})
        out.append((hdrs.get("Rp-Type", ""), hdrs))
    return out


def hexed(span: ReadableSpan) -> tuple[str, str, str]:
    """(trace id, span id, parent span id or "") of a finished span."""
    ctx = span.get_span_context()
    assert ctx is not None
    parent = format(span.parent.span_id, "016x") if span.parent else ""
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"), parent


ONE = 'resource "null_resource" "a" {}\n'


@pytest.mark.terraform
async def test_one_trace_from_the_http_create_to_the_executors_steps(
    plane: Plane, repo: Path, spans: Recorder
) -> None:
    """A create with a caller's `traceparent`: its request span is that span's child;
    every event of the run (the api's, the scheduler's, the executor's) and of its
    workspace's enqueue carries the same trace id in its NATS headers; the dispatch message
    carries it; the executor's `phase plan` span is the child of the dispatch it took, and
    each step's span the phase's child; a subscriber's deliveries of the run's events
    (the notifications' path) are spans of the same trace."""
    commit(repo, {"main.tf": ONE})
    body = {"name": "net", "repository": str(repo)}
    assert (await plane.http.post("/api/v1/orgs/acme/workspaces", json=body)).status == 201
    dispatched = await plane.nc.subscribe(pool_subjects("default"))  # sees JetStream's
    delivered: dict[str, str] = {}  # a subscriber's view: event type -> its trace id

    async def handle(r: Received) -> None:
        delivered[r.type] = tracing.trace_id()

    subscriber = Consumer(
        plane.nc, Subscription(name="t-e2e", handle=handle), states=plane.app.states
    )
    await (await plane.stack.enter_async_context(subscriber)).ready.wait()
    await plane.executor("e1")
    header, trace_id, caller_span = traceparent()
    a = await plane.http.post(
        "/api/v1/orgs/acme/workspaces/net/runs",
        json={"type": "plan"},
        headers={"traceparent": header},
    )
    assert a.status == 201, a.body
    run_id = str(a.body["id"])
    await plane.reaches("net", run_id, "planned")

    msg = await dispatched.next_msg(timeout=30)
    assert msg.headers is not None and run_id.encode() in msg.data
    dispatch_trace, dispatch_span = ids(msg.headers["traceparent"])
    assert dispatch_trace == trace_id

    run_events = await headers_of(plane.nc, plane.app.store, f"rp.run.acme.net.{run_id}")
    types = [t for t, _ in run_events]
    for must in ("run.created", "run.queued", "run.phase_started", "run.plan_finished"):
        assert must in types, types
    for kind, hdrs in run_events:
        assert ids(hdrs["traceparent"])[0] == trace_id, (kind, hdrs)
    ws_events = await headers_of(plane.nc, plane.app.store, "rp.ws.acme.net")
    enqueued = [h for t, h in ws_events if t == "ws.run_enqueued"]
    assert enqueued and ids(enqueued[-1]["traceparent"])[0] == trace_id

    async def finished() -> dict[str, list[ReadableSpan]]:
        mine = [s for s in spans.get_finished_spans() if hexed(s)[0] == trace_id]
        by_name: dict[str, list[ReadableSpan]] = {}
        for s in mine:
            by_name.setdefault(s.name, []).append(s)
        assert "phase plan" in by_name and "step plan" in by_name, sorted(by_name)
        # a delivery's span ends after its handler returns: wait for the span, not the handler
        deliveries = [s for s in by_name.get("deliver rp-sub-t-e2e", []) if s.attributes]
        seen = {s.attributes["runplane.event"] for s in deliveries if s.attributes}
        assert seen >= {"run.created", "run.plan_finished"}, seen
        return by_name

    await eventually(lambda: _has(delivered, "run.plan_finished"), what="the subscriber's delivery")
    by_name = await eventually(finished, what="the phase's and the deliveries' spans")
    assert delivered["run.created"] == delivered["run.plan_finished"] == trace_id
    (request,) = by_name["POST /api/v1/orgs/{org}/workspaces/{ws}/runs"]
    assert hexed(request)[2] == caller_span, "the caller's span is the request's parent"
    assert request.attributes is not None
    assert request.attributes["http.response.status_code"] == 201
    (create,) = by_name["command create_run"]
    assert hexed(create)[2] == hexed(request)[1]
    assert create.attributes is not None
    assert (create.attributes["runplane.org"], create.attributes["runplane.workspace"]) == (
        "acme",
        "net",
    )
    (dispatch,) = by_name["dispatch"]
    assert hexed(dispatch)[1] == dispatch_span, "the message carries the dispatch span"
    (phase,) = by_name["phase plan"]
    assert hexed(phase)[2] == dispatch_span, "the phase is the dispatch's child"
    assert phase.attributes is not None and phase.attributes["runplane.run_id"] == run_id
    steps = {n: s for n, (s, *_) in by_name.items() if n.startswith("step ")}
    assert {"step checkout", "step init", "step plan"} <= set(steps)
    for s in steps.values():
        assert hexed(s)[2] == hexed(phase)[1], f"{s.name} is the phase's child"
    # The phase's own events name a span of the phase (its claim's, its steps' commands).
    phase_spans = {hexed(s)[1] for s in spans.get_finished_spans() if _under(s, phase, spans)}
    started = next(h for t, h in run_events if t == "run.phase_started")
    assert ids(started["traceparent"])[1] in phase_spans


@pytest.mark.terraform
async def test_one_trace_from_the_http_create_to_its_notification(
    plane: Plane, repo: Path, spans: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same trace from a caller's create to the receiver of the run's notifications:
    `run:created` (the api's event) and `run:completed` (the executor's `plan_finished`)
    are each delivered by the notifications subscriber in a `notify <trigger>` span of
    the caller's trace, whose `traceparent` the receiver gets in the delivery's headers;
    the scheduled delivery's event carries it too."""
    from services.processes.notifications.delivery import Policy
    from services.processes.notifications.subscriber import serving
    from tests.notify_support import Receiver

    monkeypatch.setenv("RUNPLANE_NOTIFY_ALLOW", "loopback")
    commit(repo, {"main.tf": ONE})
    body = {"name": "net", "repository": str(repo)}
    assert (await plane.http.post("/api/v1/orgs/acme/workspaces", json=body)).status == 201
    await plane.executor("e1")
    async with Receiver() as r:
        made = await plane.http.post(
            "/api/v1/orgs/acme/notifications",
            json={
                "name": "ops",
                "destination": "generic",
                "url": r.url,
                "triggers": ["run:created", "run:completed"],
            },
        )
        assert made.status == 201, made.body
        policy = Policy(allow=frozenset({"loopback"}), schedule=(0.1,))
        async with serving(plane.nc, plane.app, plane.keyring, policy=policy):
            header, trace_id, _ = traceparent()
            a = await plane.http.post(
                "/api/v1/orgs/acme/workspaces/net/runs",
                json={"type": "plan"},
                headers={"traceparent": header},
            )
            assert a.status == 201, a.body
            run_id = str(a.body["id"])

            async def both() -> list[str]:
                triggers = [g.json["notifications"][0]["trigger"] for g in r.got]
                assert {"run:created", "run:completed"} <= set(triggers), triggers
                return triggers

            await eventually(both, what="both notifications", timeout=60)
    for got in r.got:
        assert got.json["run_id"] == run_id
        assert ids(got.headers["traceparent"])[0] == trace_id, "the receiver sees the trace"

    async def notified() -> list[ReadableSpan]:
        mine = [
            s
            for s in spans.get_finished_spans()
            if hexed(s)[0] == trace_id and s.name.startswith("notify ")
        ]
        assert {s.name for s in mine} >= {"notify run:created", "notify run:completed"}
        return mine

    for s in await eventually(notified, what="the delivery spans"):
        assert s.attributes is not None and s.attributes["runplane.outcome"] == "delivered"
        receiver_parent = next(
            ids(g.headers["traceparent"])[1]
            for g in r.got
            if f"notify {g.json['notifications'][0]['trigger']}" == s.name
        )
        assert receiver_parent == hexed(s)[1], "the request is the delivery span's"


async def _has(seen: dict[str, str], key: str) -> bool:
    return key in seen


def _under(span: ReadableSpan, ancestor: ReadableSpan, spans: Recorder) -> bool:
    """Whether `span` is `ancestor` or one of its descendants."""
    by_id = {hexed(s)[1]: s for s in spans.get_finished_spans()}
    target = hexed(ancestor)[1]
    current: ReadableSpan | None = span
    while current is not None:
        if hexed(current)[1] == target:
            return True
        current = by_id.get(hexed(current)[2])
    return False


async def _created_headers(http: Http, headers: dict[str, str]) -> dict[str, str]:
    """The NATS headers of the `run.created` of a run created with these HTTP headers."""
    a = await http.post(
        "/api/v1/orgs/acme/workspaces/net/runs", json={"type": "plan"}, headers=headers
    )
    assert a.status == 201, a.body
    events = await headers_of(http.app.store.nc, http.app.store, f"rp.run.acme.net.{a.body['id']}")
    return next(h for t, h in events if t == "run.created")


async def test_what_a_callers_trace_headers_may_put_in_the_stream(
    http: Http, spans: Recorder
) -> None:
    """A request without `traceparent` starts a trace of its own (one per request); a
    malformed one is ignored, never an error; a short `tracestate` travels with it, one
    longer than 512 characters (a hostile caller's, stored in every event) does not."""
    await http.org("acme")
    await http.workspace("acme", "net")
    plain = [ids((await _created_headers(http, {}))["traceparent"])[0] for _ in range(2)]
    assert plain[0] != plain[1], "a trace per request"

    for bad in ("00-zz-11-01", "ff-" + "0" * 32 + "-" + "1" * 16 + "-01", "x" * 4000):
        hdrs = await _created_headers(http, {"traceparent": bad})
        assert ids(hdrs["traceparent"])[0] not in bad, "a malformed parent is not taken"

    header, trace_id, _ = traceparent()
    kept = await _created_headers(http, {"traceparent": header, "tracestate": "vendor=abc"})
    assert ids(kept["traceparent"])[0] == trace_id and kept["tracestate"] == "vendor=abc"
    long_state = ",".join(f"k{i}={'v' * 200}" for i in range(3))  # valid, 610 characters
    dropped = await _created_headers(http, {"traceparent": header, "tracestate": long_state})
    assert ids(dropped["traceparent"])[0] == trace_id and "tracestate" not in dropped


COLLECTOR_PROBE = """
from infra import tracing
tracing.setup("probe-service")
with tracing.span("probe-span", run_id="r1"):
    pass
tracing.shutdown()
"""


@pytest.fixture
async def collector() -> AsyncIterator[tuple[str, list[ExportTraceServiceRequest]]]:
    """A local OTLP/HTTP collector: its base URL and the export requests it received."""
    got: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        got.append(ExportTraceServiceRequest.FromString(await request.read()))
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", got
    finally:
        await runner.cleanup()


def _exported(got: list[ExportTraceServiceRequest]) -> list[tuple[str, str]]:
    """(service.name, span name) of every span exported."""
    out = []
    for req in got:
        for rs in req.resource_spans:
            service = next(
                a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
            )
            out += [(service, s.name) for ss in rs.scope_spans for s in ss.spans]
    return out


@pytest.mark.parametrize("variable", ["RUNPLANE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"])
async def test_a_process_exports_its_spans_to_the_configured_collector(
    collector: tuple[str, list[ExportTraceServiceRequest]], variable: str
) -> None:
    """A process whose environment names a collector (runplane's variable or the standard
    one) sends it its spans, with its service name; one that names none sends nothing."""
    url, got = collector
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RUNPLANE_OTLP"))}
    await _probe({**env, variable: url})
    assert ("probe-service", "probe-span") in _exported(got)
    got.clear()
    await _probe(env)
    assert got == [], "no exporter unless configured"


async def _probe(env: dict[str, str], script: str = COLLECTOR_PROBE) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


QUIET_PROBE = """
import json, sys
from infra import tracing
tracing.setup("quiet")
out = {}
with tracing.span_from_headers("root", {}) as root:
    out["recording"] = root.is_recording()
    out["root"] = tracing.inject({})["traceparent"]
    with tracing.span("child"):
        out["child"] = tracing.inject({})["traceparent"]
for flags in ("00", "01"):
    parent = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-" + flags}
    with tracing.span_from_headers("from", parent) as s:
        out[flags] = [tracing.inject({})["traceparent"], s.is_recording()]
print(json.dumps(out))
"""


async def test_without_an_exporter_nothing_is_recorded_but_the_trace_id_travels(
    tmp_path: Path,
) -> None:
    """A process with no collector configured records no span of its own, yet each root
    span has a fresh trace id its children keep (flags 00, so a downstream process with
    an exporter does not record it either); a caller's parent keeps its trace id, and a
    sampled one is honoured (recorded, flags 01)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RUNPLANE_OTLP"))}
    out = json.loads((await _probe(env, QUIET_PROBE)).strip().splitlines()[-1])
    assert out["recording"] is False
    root, child = ids(out["root"]), ids(out["child"])
    assert root[0] == child[0] and root[1] != child[1]
    assert out["root"].endswith("-00") and out["child"].endswith("-00")
    unsampled, recorded = out["00"]
    assert ids(unsampled)[0] == "a" * 32 and unsampled.endswith("-00") and not recorded
    sampled, recorded = out["01"]
    assert ids(sampled)[0] == "a" * 32 and sampled.endswith("-01") and recorded


async def test_a_subscribers_delivery_is_a_span_of_the_events_trace(
    nc: NATS, app: App, spans: Recorder
) -> None:
    """The consumer loop (infra/consumer.py) hands each message to its handler
    inside a `deliver rp-sub-<name>` span, the child of the span that appended the event:
    the handler runs in the writer's trace, and what it appends carries it on."""
    seen: dict[str, str] = {}

    async def handle(r: Received) -> None:
        if r.type == "run.created":
            seen["trace"] = tracing.trace_id()
            seen["header"] = r.headers["traceparent"]

    async with Consumer(nc, Subscription(name="t-trace", handle=handle), states=app.states) as c:
        await c.ready.wait()
        await app.create_org("acme", "admin")
        await app.create_workspace("acme", "net", Workspace(repository="/nowhere"), "admin")
        with tracing.span("writer") as writer:
            await app.create_run("acme", "net", "plan", "alice")
        writer_trace = format(writer.get_span_context().trace_id, "032x")

        async def delivered() -> ReadableSpan:
            assert seen, "not delivered yet"
            (d,) = [
                s
                for s in spans.get_finished_spans()
                if s.name == "deliver rp-sub-t-trace" and hexed(s)[0] == writer_trace
            ]
            return d

        delivery = await eventually(delivered, what="the delivery's span")
    assert seen["trace"] == writer_trace == ids(seen["header"])[0]
    assert hexed(delivery)[2] == ids(seen["header"])[1], "the event's writer is its parent"
    assert delivery.attributes is not None
    assert delivery.attributes["runplane.event"] == "run.created"
