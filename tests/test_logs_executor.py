"""Step logs from the executor: live lines on RP_LOGS, the stored log, per-step metrics.

A real nats-server and real Terraform. The talking provisioner waits for a gate file that
the test creates only after it has seen the first line live: proof that lines arrive while
the step runs, without sleeping and hoping.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events.run import StepFinished
from executor import Executor, process
from executor.logstream import LivePublisher, LiveStepLog
from executor.output import Masker
from infra.steplogs import (
    LINE_HEADER,
    LogLine,
    Record,
    decode_records,
    log_subject,
    read_live,
)
from tests.executor_support import Harness, step_results
from tests.helpers import eventually
from tests.logs_support import (  # noqa: F401  # registers the fixtures
    SECRET,
    Collected,
    harness_fixture,
    talking_run,
)

pytestmark = pytest.mark.terraform


async def test_lines_arrive_live_while_the_step_runs_and_match_the_stored_log(
    h: Harness, repo: Path, nc: NATS, executor: Executor, tmp_path: Path
) -> None:
    """The apply step's first lines are on RP_LOGS while it still waits (the gate); the
    stored log has the same numbered lines, and the live stream has no gap."""
    gate = tmp_path / "gate"
    run_id = await talking_run(h, repo, gate)
    live = Collected()
    await live.subscribe(nc, log_subject(run_id, "apply", "apply"))
    await h.approve("net", run_id)

    await eventually(live.seen("begin-42"), what="the first line, live")
    assert str((await h.run("net", run_id)).status) == "applying"
    assert not live.has("end-42") and "apply" not in step_results(await h.events("net", run_id))
    gate.touch()
    await h.reaches("net", run_id, "applied")

    stored = await _stored(h, run_id, "apply")
    assert [r.line for r in stored] == list(range(1, len(stored) + 1))
    assert any("end-42" in r.text for r in stored)
    kept = await read_live(nc, log_subject(run_id, "apply", "apply"))
    assert [(x.stream, x.line, x.text) for x in kept] == [
        (r.stream, r.line, r.text) for r in stored
    ]
    numbers = [int(m.headers[LINE_HEADER]) for m in live.msgs if m.headers]
    assert numbers == list(range(1, len(stored) + 1)), "each line once, in order"


async def test_stdout_and_stderr_stay_apart_live_and_stored(
    h: Harness, repo: Path, nc: NATS, executor: Executor, tmp_path: Path
) -> None:
    """git writes what it fetched (`From <repository>`) on stderr, runplane's notes are
    stdout: both the live headers and the stored records say which stream each line came
    from."""
    gate = tmp_path / "gate"
    gate.touch()
    run_id = await talking_run(h, repo, gate)
    stored = await _stored(h, run_id, "checkout")
    streams = {r.stream for r in stored if r.text.startswith("From ")}
    assert streams == {"stderr"}
    assert any(r.stream == "stdout" and r.text.startswith("[runplane] checked out") for r in stored)
    kept = await read_live(nc, log_subject(run_id, "plan", "checkout"))
    assert {x.stream for x in kept if x.text.startswith("From ")} == {"stderr"}
    metrics = step_results(await h.events("net", run_id))["checkout"].metrics
    assert metrics["stderr_lines"] >= 1 and metrics["stdout_lines"] >= 1


async def test_a_secret_is_masked_live_and_in_the_stored_log(
    h: Harness, repo: Path, nc: NATS, executor: Executor, tmp_path: Path
) -> None:
    """A credential in a URL the step prints never reaches RP_LOGS nor the stored log."""
    gate = tmp_path / "gate"
    gate.touch()
    run_id = await talking_run(h, repo, gate)
    live = Collected()
    await live.subscribe(nc, f"rp.log.{run_id}.>")
    await h.approve("net", run_id)
    await h.reaches("net", run_id, "applied")

    assert live.has("https://***@example.com/x.git") and not live.has(SECRET)
    kept = await read_live(nc, f"rp.log.{run_id}.>")
    assert kept and not any(SECRET in x.text for x in kept)
    for phase, step in (("plan", "plan"), ("apply", "apply")):
        raw = await h.get("rp-logs", f"{run_id}/{phase}/{step}.log")
        assert SECRET.encode() not in raw
    assert b"***@example.com" in await h.get("rp-logs", f"{run_id}/apply/apply.log")


async def test_plan_and_apply_steps_report_metrics(
    h: Harness, repo: Path, executor: Executor, tmp_path: Path
) -> None:
    """Every step reports its duration and lines per stream; plan and apply add the
    resource counts of Terraform's change summary."""
    gate = tmp_path / "gate"
    gate.touch()
    run_id = await talking_run(h, repo, gate)
    await h.approve("net", run_id)
    await h.reaches("net", run_id, "applied")
    finished = [e for e in await h.events("net", run_id) if isinstance(e, StepFinished)]
    # the apply is warm (one executor): its checkout and init are the plan's, kept
    assert [e.step for e in finished] == ["checkout", "init", "plan", "warm", "apply"]
    for e in finished:
        assert e.metrics["duration_ms"] >= 0 and e.metrics["stdout_lines"] > 0, e
        assert "stderr_lines" in e.metrics
    counts = {e.step: e.metrics for e in finished if e.step in ("plan", "apply")}
    for step in ("plan", "apply"):
        m = counts[step]
        assert (m["add"], m["change"], m["destroy"]) == (1, 0, 0), (step, m)


# ---------------------------------------------------------------- the pieces, on real NATS


async def test_a_listed_secret_is_masked_before_it_is_published(nc: NATS, tmp_path: Path) -> None:
    """A secret the masker knows is `***` on both streams, live and in the file."""
    subject = log_subject("01run", "plan", "init")
    log = LiveStepLog(tmp_path / "init.log", Masker(["hunter2"]), LivePublisher(nc, subject))
    script = "echo pw=hunter2; echo hunter2 failed >&2"
    code = await process.run(["sh", "-c", script], cwd=tmp_path, env={}, step_log=log)
    await log.finish()
    assert code == 0
    stored = list(decode_records((tmp_path / "init.log").read_bytes().splitlines()))
    assert sorted((r.stream, r.text) for r in stored) == [
        ("stderr", "*** failed"),
        ("stdout", "pw=***"),
    ]
    kept = await read_live(nc, subject)
    assert sorted((x.stream, x.text) for x in kept) == [
        ("stderr", "*** failed"),
        ("stdout", "pw=***"),
    ]
    assert log.metrics()["stdout_lines"] == log.metrics()["stderr_lines"] == 1


async def test_many_lines_are_published_in_order_without_an_ack_per_line(nc: NATS) -> None:
    """20,000 lines offered at once all land, in order, each once; offering never waits."""
    subject = log_subject("01run", "apply", "apply")
    publisher = LivePublisher(nc, subject, max_lines=50_000)
    started = time.perf_counter()
    for n in range(1, 20_001):
        publisher.offer("stderr" if n % 7 == 0 else "stdout", n, f"line {n}")
    offered = time.perf_counter() - started
    await publisher.close(timeout=30)
    assert offered < 1.0 and publisher.dropped == 0 and publisher.sent == 20_000
    kept = await read_live(nc, subject)
    assert [x.line for x in kept] == list(range(1, 20_001))
    assert kept[6] == LogLine("apply", "apply", "stderr", 7, "line 7")


async def test_a_burst_faster_than_the_stream_is_paced_not_dropped(
    nc: NATS, tmp_path: Path
) -> None:
    """A step printing far more lines than the buffer holds, at once: with NATS up, the
    step waits for room rather than losing live lines; every line is live, in order."""
    subject = log_subject("01run", "plan", "plan")
    live = LivePublisher(nc, subject, max_lines=2_000)
    log = LiveStepLog(tmp_path / "plan.log", Masker(), live)
    code = await process.run(["seq", "1", "30000"], cwd=tmp_path, env={}, step_log=log)
    await log.finish(timeout=10)
    assert code == 0 and live.dropped == 0 and "live_dropped" not in log.metrics()
    kept = await read_live(nc, subject)
    assert [x.text for x in kept] == [str(n) for n in range(1, 30_001)]


async def test_without_a_stream_lines_are_dropped_not_buffered_forever(nc: NATS) -> None:
    """When nothing acknowledges (here: no stream captures the subject), the buffer stays
    within its bound, neither offering nor waiting for room blocks the step, and close
    gives up after its timeout."""
    publisher = LivePublisher(nc, "nowhere.log.x", max_lines=5, ack_timeout=0.2)
    for n in range(1, 11):
        publisher.offer("stdout", n, f"line {n}")
    assert publisher.dropped == 5
    await asyncio.wait_for(publisher.room(), 5)
    started = time.perf_counter()
    await publisher.close(timeout=0.5)
    assert time.perf_counter() - started < 2
    assert publisher.dropped == 10 and publisher.sent == 0


def test_a_log_stored_before_json_lines_reads_as_stdout() -> None:
    """An old plain-text log object still reads: one stdout record per line."""
    records = list(
        decode_records([b"Initializing...\n", b'{"stream":"stderr","line":2,"text":"x"}'])
    )
    assert records == [Record("stdout", 1, "Initializing..."), Record("stderr", 2, "x")]


async def _stored(h: Harness, run_id: str, step: str) -> list[Record]:
    phase = "apply" if step == "apply" else "plan"
    raw = await h.get("rp-logs", f"{run_id}/{phase}/{step}.log")
    return list(decode_records(raw.splitlines()))
