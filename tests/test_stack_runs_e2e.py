"""Stack runs end to end: real Terraform (null provider), the real subscribers (the
stack-run process on its own durable consumer, children's ends through the run-triggers
subscription) and a real executor. A stack of four workspaces (A; B and C on A; D on B
and C): A first, B and C at once, then D; C failing under `pause` stops D; C fixed and
the stack run resumed runs only C and D again; a destroy goes D, then B and C, then A;
a target with and without `skip_dependencies`."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from events.stack_run_events import StackNodeEnded, StackNodeStarted, subject
from infra.consumer import Consumer
from services.processes.stacks.subscriber import StackRuns
from services.processes.stacks.subscriber import subscription as stack_subscription
from services.processes.triggers.subscriber import Triggers, subscription
from tests.executor_support import git
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

pytestmark = [pytest.mark.terraform, pytest.mark.slow]

V1 = "/api/v1/orgs/acme"
TF = 'resource "null_resource" "x" {\n  triggers = { v = "%s" }\n}\n'
BROKEN = 'resource "null_resource" "x" {\n  nope = \n}\n'
EDGES = [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")]


async def _setup(plane: Plane, tmp_path: Path) -> dict[str, Path]:
    repos = {}
    for ws in "abcd":
        path = tmp_path / f"repo-{ws}"
        path.mkdir()
        git(path, "init", "-q", "-b", "main")
        commit(path, {"main.tf": TF % "1"})
        repos[ws] = path
        made = await plane.http.post(f"{V1}/workspaces", json={"name": ws, "repository": str(path)})
        assert made.status == 201, made.body
        s = await plane.http.call("PATCH", f"{V1}/workspaces/{ws}/settings",
                                  json={"require_approval": False})  # fmt: skip
        assert s.status == 200, s.body
    body = {"name": "prod", "workspaces": list("abcd"),
            "edges": [{"source": s, "target": t} for s, t in EDGES]}  # fmt: skip
    assert (await plane.http.post(f"{V1}/stacks", json=body)).status == 201
    await plane.executor("e1")
    await plane.executor("e2")
    return repos


async def _run(plane: Plane, **body: Any) -> str:
    a = await plane.http.post(f"{V1}/stacks/prod/runs", json=body)
    assert a.status == 201, a.body
    return str(a.body["id"])


async def _ends(plane: Plane, sid: str, *status: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any]:
        a = await plane.http.get(f"{V1}/stack-runs/{sid}")
        assert a.body["status"] in status, a.body
        return a.body  # type: ignore[no-any-return]  # JSON object

    return await eventually(probe, timeout=240, what=f"stack run {sid} {status}")


async def _order(plane: Plane, sid: str) -> list[str]:
    """`+a`, `-a`, ...: each node's starts and ends, in the order recorded."""
    out = []
    for e in await plane.app.store.read(subject("acme", sid)):
        if isinstance(e.event, StackNodeStarted):
            out.append(f"+{e.event.node}")
        elif isinstance(e.event, StackNodeEnded):
            out.append(f"-{e.event.node}")
    return out


def _before(order: list[str], first: str, then: str) -> bool:
    return order.index(first) < order.index(then)


async def test_a_stack_applies_in_order_pauses_on_failure_resumes_and_destroys_in_reverse(
    plane: Plane, tmp_path: Path
) -> None:
    repos = await _setup(plane, tmp_path)
    async with AsyncExitStack() as subs:
        runs = StackRuns(plane.app)
        for sub in (stack_subscription(runs), subscription(Triggers(plane.app))):
            await subs.enter_async_context(Consumer(plane.nc, sub, states=plane.app.states))
        await _applies_in_order(plane)
        await _pauses_and_resumes(plane, repos)
        await _targets_and_destroy(plane)
        assert runs.started == 4 + 3 + 2 + 1 + 2 + 4


async def _applies_in_order(plane: Plane) -> None:
    """A first, B and C at once, then D; each child caused by the stack run."""
    sid = await _run(plane, type="apply")
    done = await _ends(plane, sid, "completed", "failed", "paused")
    assert done["status"] == "completed", done
    order = await _order(plane, sid)
    assert _before(order, "-a", "+b") and _before(order, "-a", "+c")
    assert _before(order, "+b", "-c") and _before(order, "+c", "-b")  # b and c at once
    assert _before(order, "-b", "+d") and _before(order, "-c", "+d")
    child = await plane.run("d", done["nodes"]["d"]["run_id"])
    assert child.cause is not None and child.cause.stack_run == sid
    assert str(child.status) == "applied"


async def _pauses_and_resumes(plane: Plane, repos: dict[str, Path]) -> None:
    """C fails under `pause`: D does not start; C fixed, the resume runs C and D only."""
    commit(repos["c"], {"main.tf": BROKEN})
    commit(repos["b"], {"main.tf": TF % "2"})
    sid = await _run(plane, type="apply")
    paused = await _ends(plane, sid, "paused", "completed")
    assert paused["status"] == "paused", paused
    await eventually(_settled(plane, sid), timeout=120, what="b finished")
    paused = (await plane.http.get(f"{V1}/stack-runs/{sid}")).body
    assert paused["nodes"]["c"]["status"] == "failed"
    assert paused["nodes"]["d"] == {"status": "waiting", "attempt": 1, "run_id": None,
                                    "run_status": None, "runs": []}  # fmt: skip
    commit(repos["c"], {"main.tf": TF % "2"})
    resumed = await plane.http.post(f"{V1}/stack-runs/{sid}/resume")
    assert resumed.status == 200, resumed.body
    done = await _ends(plane, sid, "completed", "failed", "paused")
    assert done["status"] == "completed", done
    assert {n: len(v["runs"]) for n, v in done["nodes"].items()} == {
        "a": 1, "b": 1, "c": 2, "d": 1,
    }  # fmt: skip
    c_again = await plane.run("c", done["nodes"]["c"]["runs"][1])
    assert c_again.cause is not None and c_again.cause.attempt == 2


async def _targets_and_destroy(plane: Plane) -> None:
    """D alone, B with what it needs (plans); then a destroy: D, then B and C, then A."""
    alone = await _run(plane, type="plan", targets=["d"], skip_dependencies=True)
    assert list((await _ends(plane, alone, "completed"))["nodes"]) == ["d"]
    with_deps = await _run(plane, type="plan", targets=["b"])
    assert sorted((await _ends(plane, with_deps, "completed"))["nodes"]) == ["a", "b"]
    sid = await _run(plane, type="destroy")
    done = await _ends(plane, sid, "completed", "failed", "paused")
    assert done["status"] == "completed", done
    order = await _order(plane, sid)
    assert order[:2] == ["+d", "-d"] and order[-2:] == ["+a", "-a"]


def _settled(plane: Plane, sid: str) -> Any:
    async def probe() -> bool:
        a = await plane.http.get(f"{V1}/stack-runs/{sid}")
        return all(v["status"] != "running" for v in a.body["nodes"].values())

    return probe
