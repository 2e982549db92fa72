"""`runplane up`'s terminal: short lines for a person (run transitions and warnings), JSON
for machines; and the run watch that logs each transition, on a real nats-server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import structlog
from nats.aio.client import Client as NATS

from events.run import CancelRun, Workspace
from infra import logs
from services.app.commands import App
from services.processes.runwatch import RunWatch
from tests.helpers import eventually


@pytest.fixture
def restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # as the suite runs: structlog's defaults


def test_auto_means_people_for_up_on_a_terminal_and_json_elsewhere() -> None:
    assert logs.choose("auto", for_people=True, tty=True) == "people"
    assert logs.choose("auto", for_people=False, tty=True) == "console"
    assert logs.choose("auto", for_people=True, tty=False) == "json"
    assert logs.choose("json", for_people=True, tty=True) == "json"


def test_people_see_transitions_and_warnings_on_one_short_line_each(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    assert logs.configure("people") == "people"
    log = structlog.get_logger("t")
    log.info("request", method="GET", path="/api/v1/orgs/demo/runs", status=200)
    log.info("projected", seq=4)
    log.info(logs.TRANSITION, org="demo", workspace="hello", run_id="01abc", status="planning")
    log.info(
        logs.TRANSITION,
        org="demo",
        workspace="hello",
        run_id="01abc",
        status="failed",
        reason="step_failed",
        error="custom step 50 (lint) exited with code 1\nmain.tf:3: TODO",
    )
    log.warning("projection_lagging", seq=9, projected=3)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3, lines  # no request line, no debug chatter
    assert lines[0].endswith("  run 01abc demo/hello  planning")
    assert lines[1].split("  ", 1)[1] == (
        "run 01abc demo/hello  failed  error=custom step 50 (lint) exited with code 1 "
        "main.tf:3: TODO reason=step_failed"
    )
    assert lines[2].split("  ", 1)[1] == "warning  projection_lagging  projected=3 seq=9"
    assert all(len(line) < 200 for line in lines)


def test_machines_get_every_line_as_json(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    logs.configure("json")
    structlog.get_logger("t").info("request", status=200)
    assert json.loads(capsys.readouterr().err)["event"] == "request"


async def test_the_run_watch_logs_each_status_a_run_takes(nc: NATS, app: App) -> None:
    """From the stream's end: a run created and canceled shows pending, then canceled
    with its reason; a run created before the watch started is not replayed."""
    await app.create_org("acme", "alice")
    await app.create_workspace("acme", "net", Workspace(repository="/repo"), "alice")
    before = await app.create_run("acme", "net", "plan", "alice", "")
    with structlog.testing.capture_logs() as seen:
        async with RunWatch(nc) as watch:
            created = await app.create_run("acme", "net", "apply", "alice", "")
            run_id = created.state.run_id
            await app.run_command("acme", None, run_id, CancelRun(actor="bob", reason="nope"))

            def moved() -> list[tuple[str, str]]:
                return [
                    (e["run_id"], e["status"])
                    for e in seen
                    if e["event"] == logs.TRANSITION and e["org"] == "acme"
                ]

            async def both() -> bool:
                return len(moved()) >= 2

            await eventually(both, timeout=10, what="two transitions")
    assert moved() == [(run_id, "pending"), (run_id, "canceled")]
    assert before.state.run_id not in {r for r, _ in moved()}
    canceled = next(e for e in seen if e.get("status") == "canceled")
    assert (canceled["org"], canceled["workspace"], canceled["reason"]) == ("acme", "net", "nope")
    assert run_id not in watch.runs  # an ended run is forgotten


def test_a_tenants_text_reaches_the_terminal_without_its_control_characters() -> None:
    """A run's error is its Terraform's output, a tenant's: an escape sequence in it
    (a title change, an OSC 52 clipboard write, a cursor move) is shown escaped, never
    written raw to the operator's terminal; a newline is a space, as before."""
    hostile = "Error: boom\x1b]52;c;ZXZpbA==\x07\x1b[2J\nnext\u202eline"
    line = logs.people_line(
        None,
        "info",
        {
            "event": "run_transition",
            "run_id": "r1",
            "org": "o",
            "workspace": "w",
            "status": "failed",
            "error": hostile,
        },
    )
    assert "\x1b" not in line and "\x07" not in line and "\u202e" not in line
    assert "\n" not in line and "boom" in line and "next" in line
    assert "\\x1b]52;c;ZXZpbA==\\x07" in line
