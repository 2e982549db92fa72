"""`GET .../runs/{run}/logs`, whole and followed (SSE), with a real executor and Terraform.

The API graph of tests/api_support.py (real nats-server, App, projector, aiohttp server)
beside a real executor; runs are driven like the scheduler would (tests.executor_support).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from nats.aio.client import Client as NATS

from events.run import FailRun
from executor import Executor
from infra.steplogs import LogLine, decode_records, read_live
from infra.streams import LOGS
from services.surfaces.api.runlog import StepCursor
from services.surfaces.client.logs import sse_events
from tests.api_support import ADMIN_TOKEN, Http, http_fixture  # noqa: F401  # fixture
from tests.executor_support import Harness
from tests.helpers import eventually
from tests.logs_support import (  # noqa: F401  # registers the fixtures
    harness_fixture,
    talking_run,
)

pytestmark = pytest.mark.terraform

V1 = "/api/v1"
Event = tuple[str, Any]


def logs_path(run_id: str, org: str = "acme", **query: str) -> str:
    return f"{V1}/orgs/{org}/runs/{run_id}/logs" + (f"?{urlencode(query)}" if query else "")


async def follow(http: Http, run_id: str, into: list[Event], **params: str) -> None:
    """Collect the server-sent events of a followed log until the server closes."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    query = {"follow": "1", **params}
    async with http.client.get(logs_path(run_id), params=query, headers=headers) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        async for event in sse_events(resp):
            into.append(event)


async def stored_lines(h: Harness, run_id: str, phase: str, step: str) -> list[dict[str, Any]]:
    raw = await h.get("rp-logs", f"{run_id}/{phase}/{step}.log")
    return [
        {"phase": phase, "step": step, "stream": r.stream, "line": r.line, "text": r.text}
        for r in decode_records(raw.splitlines())
    ]


async def all_stored(h: Harness, run_id: str, steps: list[tuple[str, str]]) -> list[Any]:
    return [line for p, s in steps for line in await stored_lines(h, run_id, p, s)]


async def steps_ended(http: Http, run_id: str, count: int) -> list[dict[str, Any]]:
    async def probe() -> list[dict[str, Any]]:
        a = await http.get(f"{V1}/orgs/acme/runs/{run_id}/steps")
        done = [s for s in a.body["items"] if s["status"] != "running"]
        assert len(done) == count, a.body
        return done

    return await eventually(probe, what=f"{count} steps projected as ended")


PLAN_STEPS = [("plan", "checkout"), ("plan", "init"), ("plan", "plan")]
ALL_STEPS = [*PLAN_STEPS, ("apply", "warm"), ("apply", "apply")]  # a warm apply (one executor)


def lines_of(events: list[Event]) -> list[Any]:
    return [data for name, data in events if name == "line"]


def has_line(events: list[Event], step: str, needle: str) -> bool:
    return any(d["step"] == step and needle in d["text"] for d in lines_of(events))


async def test_follow_sends_existing_lines_then_live_ones_then_end(
    http: Http, h: Harness, repo: Path, executor: Executor, tmp_path: Path
) -> None:
    """A follower gets the planned steps' lines, then the apply's as they are written
    (while the provisioner waits on the gate), each line once in order, then `end`."""
    gate = tmp_path / "gate"
    run_id = await talking_run(h, repo, gate)
    events: list[Event] = []
    task = asyncio.create_task(follow(http, run_id, events))

    async def planned_lines() -> bool:
        return has_line(events, "plan", "[runplane] plan stored")

    await eventually(planned_lines, what="the plan's existing lines")
    await h.approve("net", run_id)

    async def started() -> bool:
        return has_line(events, "apply", "begin-42")

    await eventually(started, what="the apply's first line, live")
    assert not has_line(events, "apply", "end-42") and events[-1][0] != "end"
    gate.touch()
    await asyncio.wait_for(task, 60)

    assert events[-1] == ("end", {"status": "applied", "reason": None})
    assert lines_of(events) == await all_stored(h, run_id, ALL_STEPS)
    steps = [(d["phase"], d["step"], d["status"]) for n, d in events if n == "step"]
    assert steps == [(p, s, st) for p, s in ALL_STEPS for st in ("running", "ok")]
    ended = [d for n, d in events if n == "step" and d["status"] == "ok"]
    assert ended[-1]["step"] == "apply" and ended[-1]["metrics"]["add"] == 1


async def test_a_run_failed_under_a_running_step_ends_the_follow(
    http: Http, h: Harness, repo: Path, executor: Executor, tmp_path: Path
) -> None:
    """The reaper fails the run while the apply step runs: the follower sends that step's
    lines, marks it failed with the run's reason, and ends."""
    run_id = await talking_run(h, repo, tmp_path / "gate")
    events: list[Event] = []
    task = asyncio.create_task(follow(http, run_id, events, phase="apply"))
    await h.approve("net", run_id)

    async def started() -> bool:
        return has_line(events, "apply", "begin-42")

    await eventually(started, what="the apply's first line, live")
    reap = FailRun(actor="scheduler", reason="executor_unavailable", message="no heartbeat")
    await h.app.run_command("acme", "net", run_id, reap)
    await asyncio.wait_for(task, 30)

    assert events[-2:] == [
        (
            "step",
            {
                "phase": "apply",
                "step": "apply",
                "status": "failed",
                "error": "run failed: executor_unavailable",
            },
        ),
        ("end", {"status": "failed", "reason": "executor_unavailable"}),
    ]
    numbers = [d["line"] for d in lines_of(events) if d["step"] == "apply"]
    assert numbers == list(range(1, len(numbers) + 1))
    assert {d["phase"] for d in lines_of(events)} == {"apply"}


async def test_logs_read_running_steps_live_and_finished_ones_from_the_store(
    http: Http, h: Harness, repo: Path, executor: Executor, tmp_path: Path
) -> None:
    """Without follow: a running step's lines come from RP_LOGS, finished ones from their
    objects; once the run ended every line of every step is there, in step order."""
    gate = tmp_path / "gate"
    run_id = await talking_run(h, repo, gate)
    await h.approve("net", run_id)

    async def running_apply() -> list[Any]:
        items = (await http.get(logs_path(run_id, phase="apply"))).body["items"]
        assert any(i["step"] == "apply" and "begin-42" in i["text"] for i in items)
        return list(items)

    items = await eventually(running_apply, what="the running apply's lines")
    assert not any("end-42" in i["text"] for i in items if i["step"] == "apply")
    assert {i["phase"] for i in items} == {"apply"}
    gate.touch()
    await h.reaches("net", run_id, "applied")
    await steps_ended(http, run_id, len(ALL_STEPS))

    a = await http.get(logs_path(run_id))
    assert a.status == 200 and a.body["items"] == await all_stored(h, run_id, ALL_STEPS)
    only = await http.get(logs_path(run_id, phase="plan", step="init"))
    assert only.body["items"] == await stored_lines(h, run_id, "plan", "init")


async def test_logs_stay_readable_after_the_live_stream_aged_out(
    http: Http, h: Harness, repo: Path, nc: NATS, executor: Executor, tmp_path: Path
) -> None:
    """Purge the run's RP_LOGS messages (as max_age would): the whole log and a follow
    still answer every line, from the object store."""
    gate = tmp_path / "gate"
    gate.touch()
    run_id = await talking_run(h, repo, gate)
    await h.approve("net", run_id)
    await h.reaches("net", run_id, "applied")
    await steps_ended(http, run_id, len(ALL_STEPS))
    before = (await http.get(logs_path(run_id))).body["items"]

    await nc.jetstream().purge_stream(LOGS, subject=f"rp.log.{run_id}.>")
    assert await read_live(nc, f"rp.log.{run_id}.>") == []
    after = await http.get(logs_path(run_id))
    assert after.body["items"] == before == await all_stored(h, run_id, ALL_STEPS)

    events: list[Event] = []
    await asyncio.wait_for(follow(http, run_id, events), 30)
    assert lines_of(events) == before and events[-1][0] == "end"


async def test_steps_carry_the_executors_metrics(
    http: Http, h: Harness, repo: Path, executor: Executor, tmp_path: Path
) -> None:
    """GET .../steps has each step's metrics: duration, lines per stream, counts."""
    gate = tmp_path / "gate"
    gate.touch()
    run_id = await talking_run(h, repo, gate)
    steps = {s["step"]: s for s in await steps_ended(http, run_id, 3)}
    for step in steps.values():
        assert step["metrics"]["duration_ms"] >= 0 and step["metrics"]["stdout_lines"] > 0
    plan = steps["plan"]["metrics"]
    assert (plan["add"], plan["change"], plan["destroy"]) == (1, 0, 0)
    assert steps["checkout"]["metrics"]["stderr_lines"] >= 1


async def test_another_orgs_run_is_not_found_and_bad_queries_are_refused(http: Http) -> None:
    """A run of acme is a 404 problem for beta's token, followed or not; unknown or bad
    query parameters are problems too."""
    await http.org("acme")
    beta = await http.org("beta")
    await http.workspace("acme", "net")
    run_id = (await http.run("acme", "net"))["id"]
    for query in ({}, {"follow": "1"}):
        a = await http.get(logs_path(run_id, **query), token=beta["admin"])
        a.problem("not-found", 404)
    for query, slug, status in (
        ({"follow": "yes"}, "invalid-query", 400),
        ({"phase": "deploy"}, "invalid-query", 400),
        ({"tail": "10"}, "invalid-query", 400),
        ({"step": "Init"}, "invalid-id", 422),
    ):
        (await http.get(logs_path(run_id, **query))).problem(slug, status)
    a = await http.get(logs_path(run_id))
    assert (a.status, a.body) == (200, {"items": []})


# ---------------------------------------------------------------- the cursor, pure


def _line(n: int) -> LogLine:
    return LogLine("plan", "init", "stdout", n, f"line {n}")


def test_a_cursor_sends_each_line_once_and_in_order() -> None:
    """Duplicates are dropped; a line past a gap waits until the gap is filled."""
    c = StepCursor()
    c.start()
    assert c.offer(_line(1)) == [_line(1)]
    assert c.offer(_line(1)) == []
    assert c.offer(_line(3)) == []
    assert c.offer(_line(2)) == [_line(2), _line(3)]


def test_lines_wait_for_their_steps_start() -> None:
    """Live lines that arrive before the step's start event go out right after it."""
    c = StepCursor()
    assert c.offer(_line(1)) == [] and c.offer(_line(2)) == []
    assert c.start() == [_line(1), _line(2)]


def test_a_completed_cursor_takes_the_rest_from_the_whole_log_and_then_nothing() -> None:
    """At the step's end the complete log fills what is owed; live lines after are old."""
    c = StepCursor()
    c.start()
    c.offer(_line(1))
    c.offer(_line(4))
    assert c.complete([_line(n) for n in range(1, 6)]) == [_line(n) for n in (2, 3, 4, 5)]
    assert c.offer(_line(6)) == [] and c.done


def test_a_complete_log_is_owed_whole_past_any_gap() -> None:
    """Lines 1-2 aged out of the live stream: a running step still shows all it has."""
    assert StepCursor().complete([_line(5), _line(3), _line(4), _line(3)]) == [
        _line(3),
        _line(4),
        _line(5),
    ]
