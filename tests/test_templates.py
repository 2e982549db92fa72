"""Run templates through the HTTP API: saved, listed, refused with the reason, picked by
a run or by the workspace's `templates` setting; custom command steps run by a real
executor around a real Terraform plan and apply, each with its own log and status."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from events import run as R
from tests.builders import api_workspace
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

pytestmark = pytest.mark.terraform

V1 = "/api/v1/orgs/acme"
MAIN_TF = """
variable "out" {}
resource "null_resource" "a" {}
"""
PLAN = {"number": 100, "kind": "plan"}
NOOP = {"steps": [{"number": 100, "kind": "custom", "name": "noop", "command": "true"}]}


async def _workspace(plane: Plane, repo: Path, out: Path) -> None:
    commit(repo, {"main.tf": MAIN_TF})
    await api_workspace(plane.http, repo, variables={"out": str(out)})


async def _put(plane: Plane, name: str, body: Any, **kw: Any) -> Any:
    return await plane.http.call("PUT", f"{V1}/templates/{name}", json=body, **kw)


async def _read(plane: Plane, path: str) -> Any:
    """GET once the projection holds everything written so far."""
    seq = await plane.app.store.last_seq()
    answer = await plane.http.get(path, headers={"RP-Min-Seq": str(seq)})
    assert answer.status == 200, answer.body
    return answer.body


async def _start(plane: Plane, run_type: str = "apply", template: str | None = None) -> str:
    body = {"type": run_type} | ({"template": template} if template is not None else {})
    a = await plane.http.post(f"{V1}/workspaces/net/runs", json=body)
    assert a.status == 201, a.body
    return str(a.body["id"])


def _steps(run: dict[str, Any]) -> list[tuple[str, str]]:
    return [(s["name"], s["status"]) for s in run["steps"]]


async def test_templates_are_listed_saved_and_refused_with_the_reason(plane: Plane) -> None:
    """Built-ins are listed and cannot be changed or deleted; a template breaking a rule
    is 422 with the reason; only an admin saves one; PUT creates (201) then replaces."""
    listed = (await plane.http.get(f"{V1}/templates")).body["items"]
    assert [(t["name"], t["builtin"]) for t in listed] == [
        ("plan", True),
        ("apply", True),
        ("destroy", True),
        ("drift", True),
    ]
    assert [s["kind"] for s in listed[1]["steps"]] == ["plan", "policy", "approval", "apply"]
    for body, why in [
        ({"steps": []}, "non-empty"),
        ({"steps": [{"number": 100, "kind": "lint"}]}, "kind must be one of"),
        ({"steps": [PLAN, {"number": 100, "kind": "policy"}]}, "100 is used twice"),
        ({"steps": [PLAN, {"number": 200, "kind": "apply"}]}, "needs an approval step"),
        ({"steps": [{"number": 50, "kind": "approval"}, PLAN]}, "must come after a plan"),
        ({"steps": [{"number": 100, "kind": "custom", "name": "x"}]}, "needs a command"),
        ({"steps": [{"number": 100, "kind": "plan", "command": "ls"}]}, "only custom steps"),
    ]:  # fmt: skip
        a = await _put(plane, "broken", body)
        assert why in a.problem("invalid-command", 422)["detail"], (why, a.body)
    a = await _put(plane, "apply", NOOP)
    assert "built-in" in a.problem("invalid-command", 422)["detail"]
    (await _put(plane, "Bad", NOOP)).problem("invalid-id", 422)
    (await plane.http.call("PUT", f"{V1}/templates/x", json={"stepz": []})).problem(
        "invalid-body", 400
    )
    operator = await plane.http.post(f"{V1}/tokens", json={"user": "op", "role": "operator"})
    (await _put(plane, "noop", NOOP, token=operator.body["token"])).problem("forbidden", 403)

    a = await _put(plane, "noop", NOOP)
    assert a.status == 201, a.body
    assert a.headers["Location"] == f"{V1}/templates/noop" and a.seq > 0
    assert a.body == {
        "name": "noop",
        "builtin": False,
        "steps": [
            {"number": 100, "kind": "custom", "name": "noop", "command": "true", "always": False}
        ],
    }
    assert (await _put(plane, "noop", NOOP)).status == 200  # the same again: no change
    linted = {"steps": [PLAN, {"number": 50, "kind": "custom", "command": "tflint"}]}
    a = await _put(plane, "noop", linted)
    assert a.status == 200 and [s["number"] for s in a.body["steps"]] == [50, 100]
    assert a.body["steps"][0]["name"] == "custom"  # the kind, when unnamed
    got = (await plane.http.get(f"{V1}/templates/noop")).body
    assert got == a.body
    assert (await plane.http.get(f"{V1}/templates/apply")).body["builtin"] is True
    names = [t["name"] for t in (await plane.http.get(f"{V1}/templates")).body["items"]]
    assert names[-1] == "noop"

    (await plane.http.call("DELETE", f"{V1}/templates/plan")).problem("invalid-command", 422)
    assert (await plane.http.call("DELETE", f"{V1}/templates/noop")).status == 204
    (await plane.http.get(f"{V1}/templates/noop")).problem("not-found", 404)
    (await plane.http.call("DELETE", f"{V1}/templates/noop")).problem("not-found", 404)


async def test_custom_steps_run_before_the_plan_and_after_the_apply_with_their_logs(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """A custom step before the plan and one after the apply run in the checkout with
    the run's variables; each has its own log (`?phase=custom-<n>`) and status, and the
    run shows every step's status as it goes."""
    out = tmp_path / "out.txt"
    out.touch(mode=0o666)  # each phase runs as a uid of its own: both steps append to it
    out.chmod(0o666)  # (umask aside)
    await _workspace(plane, repo, out)
    body = {
        "steps": [
            {
                "number": 50,
                "kind": "custom",
                "name": "lint",
                "command": 'test -f main.tf && echo "lint $RUNPLANE_STEP of $RUNPLANE_RUN_ID" '
                '&& echo "lint $TF_VAR_out" >> "$TF_VAR_out"',
            },
            {"number": 100, "kind": "plan"},
            {"number": 150, "kind": "approval"},
            {"number": 200, "kind": "apply"},
            {
                "number": 300,
                "kind": "custom",
                "name": "notify",
                "command": 'echo notified "$RUNPLANE_APPLIED" >> "$TF_VAR_out"',
            },
        ]
    }
    assert (await _put(plane, "checked", body)).status == 201
    await plane.executor("e1")
    run_id = await _start(plane, template="checked")
    await plane.reaches("net", run_id, "awaiting_approval")
    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert shown["template"] == "checked"
    assert _steps(shown) == [
        ("lint", "done"),
        ("plan", "done"),
        ("policy (implied)", "done"),
        ("approval", "current"),
        ("apply", "pending"),
        ("notify", "pending"),
    ]
    assert shown["current_step"]["kind"] == "approval"
    assert [s["phase"] for s in shown["steps"]] == [
        "custom-50",
        "plan",
        None,
        None,
        "apply",
        "custom-300",
    ]
    assert out.read_text() == f"lint {out}\n"
    await plane.approve(run_id)
    done = await plane.reaches("net", run_id, "applied", "failed")
    assert done.status == "applied", done.error_message
    assert out.read_text() == f"lint {out}\nnotified true\n"

    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert [st for _, st in _steps(shown)] == ["done"] * 6
    assert shown["current_step"] is None and shown["status"] == "applied"
    logs = await _read(plane, f"{V1}/runs/{run_id}/logs?phase=custom-50")
    texts = [(i["step"], i["text"]) for i in logs["items"]]
    assert ("lint", f"lint 50 of {run_id}") in texts
    assert {i["phase"] for i in logs["items"]} == {"custom-50"}
    steps = (await _read(plane, f"{V1}/runs/{run_id}/steps"))["items"]
    ran = [(s["phase"], s["step"], s["status"]) for s in steps]
    assert ran[:2] == [("custom-50", "checkout", "ok"), ("custom-50", "lint", "ok")]
    assert ran[-1] == ("custom-300", "notify", "ok")
    history = (await _read(plane, f"{V1}/runs/{run_id}/events"))["items"]
    finished = [e for e in history if e["type"] == "run.custom_finished"]
    assert [(e["data"]["number"], e["actor"]) for e in finished] == [
        (50, "executor:e1"),
        (300, "executor:e1"),
    ]


async def test_the_workspace_default_comes_from_the_templates_setting(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """`templates` set on the organization is the workspace's default (origin org): an
    apply run of the one-step custom template `true` ends `applied`; a run naming the
    built-in still gets it."""
    await _workspace(plane, repo, tmp_path / "out")
    assert (await _put(plane, "noop", NOOP)).status == 201
    a = await plane.http.call("PATCH", f"{V1}/settings", json={"templates": {"apply": "noop"}})
    assert a.status == 200, a.body
    settings = (await plane.http.get(f"{V1}/workspaces/net/settings")).body
    assert settings["effective"]["templates"] == {"value": {"apply": "noop"}, "origin": "org"}
    await plane.executor("e1")
    run_id = await _start(plane)
    done = await plane.reaches("net", run_id, "applied", "failed")
    assert done.status == "applied", done.error_message
    assert done.plan_summary is None  # no plan ran
    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert (shown["template"], _steps(shown)) == ("noop", [("noop", "done")])
    assert shown["snapshot"]["settings"]["templates"]["origin"] == "org"

    builtin = await _start(plane, template="apply")
    await plane.reaches("net", builtin, "awaiting_approval")
    assert (await _read(plane, f"{V1}/runs/{builtin}"))["template"] == "apply"
    a = await plane.http.call("PATCH", f"{V1}/settings", json={"templates": {"apply": "gone"}})
    assert "'gone'" in a.problem("invalid-command", 422)["detail"], "named, it must exist"
    assert (await _put(plane, "gone", NOOP)).status == 201
    a = await plane.http.call("PATCH", f"{V1}/settings", json={"templates": {"apply": "gone"}})
    assert a.status == 200, a.body
    assert (await plane.http.call("DELETE", f"{V1}/templates/gone")).status == 204
    a = await plane.http.post(f"{V1}/workspaces/net/runs", json={"type": "apply"})
    assert "'gone'" in a.problem("invalid-command", 422)["detail"]


async def test_a_failing_custom_step_fails_the_run_with_its_exit_code(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    await _workspace(plane, repo, tmp_path / "out")
    command = "echo checking; echo 'tflint: 2 issues' >&2; exit 3"
    body = {
        "steps": [
            {"number": 50, "kind": "custom", "name": "lint", "command": command},
            {"number": 100, "kind": "plan"},
        ]
    }
    assert (await _put(plane, "strict", body)).status == 201
    await plane.executor("e1")
    run_id = await _start(plane, "plan", template="strict")
    failed = await plane.reaches("net", run_id, "failed")
    assert failed.reason == "step_failed"
    assert "custom step 50 (lint) exited with code 3" in failed.error_message
    assert "tflint: 2 issues" in failed.error_message
    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert _steps(shown) == [
        ("lint", "failed"),
        ("plan", "skipped"),
        ("policy (implied)", "skipped"),
    ]
    steps = (await _read(plane, f"{V1}/runs/{run_id}/steps"))["items"]
    [lint] = [s for s in steps if s["step"] == "lint"]
    assert lint["status"] == "failed" and "exited with code 3" in lint["error"]
    logs = await _read(plane, f"{V1}/runs/{run_id}/logs?phase=custom-50&step=lint")
    assert [(i["stream"], i["text"]) for i in logs["items"] if "[runplane]" not in i["text"]] == [
        ("stdout", "checking"),
        ("stderr", "tflint: 2 issues"),
    ]


async def test_a_run_keeps_the_steps_it_was_created_with(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """Changing, then deleting, the organization's template changes no run created
    before: it shows and executes the steps it recorded."""
    out = tmp_path / "out"
    await _workspace(plane, repo, out)
    append = 'echo first >> "$TF_VAR_out"'
    first = {"steps": [{"number": 10, "kind": "custom", "name": "first", "command": append}]}
    second = {"steps": [{"number": 20, "kind": "custom", "name": "second", "command": "exit 9"}]}
    assert (await _put(plane, "evolving", first)).status == 201
    run_id = await _start(plane, template="evolving")  # no executor yet: it waits
    await plane.reaches("net", run_id, "queued")
    assert (await _put(plane, "evolving", second)).status == 200
    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert (_steps(shown), shown["current_step"]["phase"]) == ([("first", "current")], "custom-10")
    assert (await plane.http.call("DELETE", f"{V1}/templates/evolving")).status == 204
    await plane.executor("e1")
    done = await plane.reaches("net", run_id, "applied", "failed")
    assert done.status == "applied", done.error_message
    assert out.read_text() == "first\n"
    [created] = [e for e in await plane.events("net", run_id) if isinstance(e, R.RunCreated)]
    assert created.template is not None and created.template.steps[0].name == "first"


async def test_cancel_of_a_queued_custom_step_and_stop_of_a_running_one(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """A custom step waiting for an executor is canceled at once; a running one is
    stopped: its command is interrupted and the run ends `canceled`."""
    started = tmp_path / "started"
    await _workspace(plane, repo, started)
    slow = f"touch {started}; echo waiting; sleep 120"
    body = {"steps": [{"number": 100, "kind": "custom", "name": "wait", "command": slow}]}
    assert (await _put(plane, "slow", body)).status == 201
    queued = await _start(plane, "plan", template="slow")
    await plane.reaches("net", queued, "queued")
    a = await plane.http.post(f"{V1}/runs/{queued}/cancel", json={"reason": "not now"})
    assert (a.status, a.body["status"]) == (200, "canceled"), a.body
    assert _steps(await _read(plane, f"{V1}/runs/{queued}")) == [("wait", "canceled")]

    await plane.executor("e1")
    running = await _start(plane, "plan", template="slow")
    await plane.reaches("net", running, "running")
    await eventually(lambda: _exists(started), timeout=30, what="the command started")
    a = await plane.http.post(f"{V1}/runs/{running}/cancel", json={"reason": "enough"})
    assert a.status == 200, a.body
    stopped = await plane.reaches("net", running, "canceled")
    assert stopped.reason == "enough"
    events = await plane.events("net", running)
    [step] = [e for e in events if isinstance(e, R.StepFinished) and e.step == "wait"]
    assert (step.ok, step.error) == (False, "interrupted (stop_requested)")
    assert _steps(await _read(plane, f"{V1}/runs/{running}")) == [("wait", "canceled")]


async def _exists(path: Path) -> bool:
    await asyncio.sleep(0)
    return path.exists()


async def test_an_unknown_or_unsuitable_template_is_refused_422(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    await _workspace(plane, repo, tmp_path / "out")
    applying = {
        "steps": [
            {"number": 100, "kind": "plan"},
            {"number": 150, "kind": "approval"},
            {"number": 200, "kind": "apply"},
        ]
    }
    assert (await _put(plane, "applying", applying)).status == 201
    for run_type, template, why in [
        ("plan", "applying", "a plan run changes nothing"),
        ("plan", "apply", "a plan run changes nothing"),
        ("destroy", "applying", "a destroy run's changes step is destroy"),
        ("drift", "nowhere", "template 'nowhere' (named by the run) does not exist"),
    ]:
        body = {"type": run_type, "template": template}
        a = await plane.http.post(f"{V1}/workspaces/net/runs", json=body)
        assert why in a.problem("invalid-command", 422)["detail"], (why, a.body)
    runs = (await _read(plane, f"{V1}/workspaces/net/runs"))["items"]
    assert runs == []
