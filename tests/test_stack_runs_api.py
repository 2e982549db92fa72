"""Stack runs without Terraform: the API and its problems, who may start and resume one
(and org A's admin against org B's), and the process's crash safety on real NATS (two
replicas advancing one stack run at once, a replica killed between creating a child run
and recording it, a child's end delivered before its start was recorded)."""

from __future__ import annotations

import asyncio
from typing import Any

from events import run as R
from events import stack_runs as sr
from events import stacks as sk
from events.react import StackChild
from events.stack_run_events import RUNNING, child_run_id
from services.app import stack_runs as runs_app
from services.app import stacks as stacks_app
from services.app.commands import App
from services.processes.stacks.subscriber import StackRuns, child_ended
from tests.access_support import person
from tests.api_support import Http, http_fixture  # noqa: F401 - the `http` fixture
from tests.bootstrap_support import Process
from tests.builders import organization, workspaces
from tests.stacks_support import Gate, diamond_stack


def _p(org: str) -> str:
    return f"/api/v1/orgs/{org}"


async def test_the_api_starts_shows_and_refuses_to_resume_a_running_stack_run(
    http: Http,
) -> None:
    tokens = await diamond_stack(http, "acme")
    op = tokens["operator"]
    a = await http.post(f"{_p('acme')}/stacks/prod/runs", json={"type": "apply"}, token=op)
    assert a.status == 201, a.body
    assert a.headers["Location"] == f"{_p('acme')}/stack-runs/{a.body['id']}"
    assert a.body["status"] == "running" and a.body["levels"] == [["a"], ["b", "c"], ["d"]]
    assert a.body["nodes"]["a"]["status"] == "waiting"
    got = await http.get(a.headers["Location"], token=tokens["viewer"])
    assert got.status == 200 and got.body["id"] == a.body["id"]
    (await http.post(a.headers["Location"] + "/resume", token=op)).problem("conflict", 409)
    d = await http.post(f"{_p('acme')}/stacks/prod/runs",
                        json={"type": "destroy", "targets": ["b"]}, token=op)  # fmt: skip
    assert d.status == 201 and d.body["levels"] == [["d"], ["b"]]
    one = await http.post(f"{_p('acme')}/stacks/prod/runs",
                          json={"type": "plan", "targets": ["d"], "skip_dependencies": True},
                          token=op)  # fmt: skip
    assert one.body["levels"] == [["d"]] and list(one.body["nodes"]) == ["d"]


async def test_bad_stack_run_input_is_a_problem_with_a_stable_type(http: Http) -> None:
    tokens = await diamond_stack(http, "acme")
    op = tokens["operator"]
    runs = f"{_p('acme')}/stacks/prod/runs"
    (await http.post(runs, json={"type": "drift"}, token=op)).problem("invalid-stack", 422)
    (await http.post(runs, json={"type": "apply", "targets": ["zz"]}, token=op)).problem(
        "invalid-stack", 422
    )
    (await http.post(runs, json={"type": "apply", "failure_policy": "x"}, token=op)).problem(
        "invalid-stack", 422
    )
    (await http.post(runs, json={"type": "apply", "x": 1}, token=op)).problem("invalid-body", 400)
    (await http.post(f"{_p('acme')}/stacks/nope/runs", json={"type": "apply"}, token=op)).problem(
        "not-found", 404
    )
    (await http.get(f"{_p('acme')}/stack-runs/nope", token=op)).problem("not-found", 404)


async def test_a_viewer_may_read_but_neither_start_nor_resume_a_stack_run(http: Http) -> None:
    """The children are the caller's runs: starting (or resuming) needs the run type's
    level on every workspace covered, not only a read of the organization. A version
    that checked only the organization let a viewer apply four workspaces."""
    tokens = await diamond_stack(http, "acme")
    runs = f"{_p('acme')}/stacks/prod/runs"
    for kind in ("plan", "apply", "destroy"):
        (await http.post(runs, json={"type": kind}, token=tokens["viewer"])).problem(
            "forbidden", 403
        )
    a = await http.post(runs, json={"type": "apply"}, token=tokens["operator"])
    resume = await http.post(f"{_p('acme')}/stack-runs/{a.body['id']}/resume",
                             token=tokens["viewer"])  # fmt: skip
    resume.problem("forbidden", 403)
    assert (await http.get(f"{_p('acme')}/stack-runs/{a.body['id']}",
                           token=tokens["viewer"])).status == 200  # fmt: skip


async def test_attack_org_a_s_admin_cannot_start_read_or_resume_org_b_s_stack_runs(
    http: Http,
) -> None:
    """Org B's stack and stack run are not found from org A's admin (their subjects are
    B's own; the paths' organization is checked before anything is read)."""
    a_tokens = await http.org("orga")
    b_tokens = await diamond_stack(http, "orgb")
    attacker = a_tokens["admin"]
    b_run = await http.post(f"{_p('orgb')}/stacks/prod/runs", json={"type": "plan"},
                            token=b_tokens["operator"])  # fmt: skip
    assert b_run.status == 201
    one = f"{_p('orgb')}/stack-runs/{b_run.body['id']}"
    (await http.post(f"{_p('orgb')}/stacks/prod/runs", json={"type": "apply"},
                     token=attacker)).problem("not-found", 404)  # fmt: skip
    (await http.get(one, token=attacker)).problem("not-found", 404)
    (await http.post(one + "/resume", token=attacker)).problem("not-found", 404)
    # nor through its own organization's paths: the stack run's id is B's subject only
    (await http.get(f"{_p('orga')}/stack-runs/{b_run.body['id']}", token=attacker)).problem(
        "not-found", 404
    )
    (await http.post(f"{_p('orga')}/stack-runs/{b_run.body['id']}/resume",
                     token=attacker)).problem("not-found", 404)  # fmt: skip
    s = (await runs_app.load(http.app, "orgb", b_run.body["id"])).state
    assert s.resumes == 0 and s.created_by == "operator-user"


async def test_attack_a_person_with_one_workspace_cannot_run_the_others_through_a_stack(
    http: Http,
) -> None:
    """Granted write on `a` alone, a person may apply `a` (a target without its
    dependencies) but not the stack, nor `d` with what it needs, nor resume a run
    covering the others: each is refused as starting that run directly would be (404
    for a workspace they may not read). A version that checked only the organization
    let them apply b, c and d as themselves. What they read hides the others."""
    tokens = await diamond_stack(http, "acme")
    pat = await person(http, "acme", "pat@example.com", "only-a", **{"workspaces/a": "write"})
    runs = f"{_p('acme')}/stacks/prod/runs"
    (await http.post(runs, json={"type": "apply"}, token=pat)).problem("not-found", 404)
    # a target she may not read is answered as one not in the stack (tells her nothing)
    (await http.post(runs, json={"type": "plan", "targets": ["d"]}, token=pat)).problem(
        "invalid-stack", 422
    )
    own = await http.post(runs, json={"type": "apply", "targets": ["a"]}, token=pat)
    assert own.status == 201, own.body
    theirs = await http.post(runs, json={"type": "apply"}, token=tokens["operator"])
    shown = await http.get(f"{_p('acme')}/stack-runs/{theirs.body['id']}", token=pat)
    assert shown.status == 200 and list(shown.body["nodes"]) == ["a"]
    assert shown.body["levels"] == [["a"], ["(hidden)", "(hidden)"], ["(hidden)"]]
    sid = theirs.body["id"]
    # paused by a node that could not start: resumable, but not by her
    cant = sr.RecordEnded(actor="p", node="a", run_id="", reason="gone")
    await runs_app.execute(http.app, "acme", sid, cant)
    (await http.post(f"{_p('acme')}/stack-runs/{sid}/resume", token=pat)).problem("not-found", 404)
    again = await http.post(f"{_p('acme')}/stack-runs/{sid}/resume", token=tokens["operator"])
    assert again.status == 200, again.body
    assert (await runs_app.load(http.app, "acme", sid)).state.resumes == 1


# ---------------------------------------------------------------- crash safety


async def _started(app: App, org: str) -> str:
    """A stack of x, y, z (independent) and w (after x), and an apply stack run of it."""
    await organization(app, org, actor="test")
    await workspaces(app, "x", "y", "z", "w", org=org, actor="t", repository="https://e.com/r.git")
    d = sk.Definition(workspaces=["w", "x", "y", "z"], edges=[sk.Edge(source="x", target="w")])
    await stacks_app.create(app, org, "s", d, "alice")
    run = await runs_app.start(app, org, "s", runs_app.Start(run_type="apply"), "alice")
    return run.state.stack_run_id


async def _runs_of(app: App, org: str, ws: str) -> list[str]:
    return sorted({e.subject.split(".")[-1] for e in await app.store.read(f"rp.run.{org}.{ws}.*")})


async def test_two_replicas_advancing_one_stack_run_at_once_start_each_node_once(
    app: App, process: Process
) -> None:
    sid = await _started(app, "twice")
    replicas = [StackRuns(process().app) for _ in range(3)]
    await asyncio.gather(*(r.advance("twice", sid) for r in replicas))
    await asyncio.gather(*(r.advance("twice", sid) for r in replicas))  # a redelivery
    for ws in ("x", "y", "z"):
        assert await _runs_of(app, "twice", ws) == [child_run_id(sid, ws, 1)]
    assert await _runs_of(app, "twice", "w") == []  # w waits for x
    s = (await runs_app.load(app, "twice", sid)).state
    assert {n: v.status for n, v in s.nodes.items()} == {
        "w": "waiting", "x": RUNNING, "y": RUNNING, "z": RUNNING,
    }  # fmt: skip
    assert sum(r.started for r in replicas) == 3
    run = (await app.load_run("twice", "x", child_run_id(sid, "x", 1))).state
    assert run.cause is not None and (run.cause.kind, run.cause.stack_run) == ("stack_run", sid)
    assert run.created_by == "alice" and run.cause.attempt == 1


class _DiesAfterCreating(StackRuns):
    """A replica that created every ready node's child run, then was killed before it
    recorded any start."""

    async def _record(self, s: Any, node: str, attempt: int, run_id: str, made: Any) -> None:
        pass  # killed before any start was recorded

    async def advance(self, org: str, stack_run_id: str, *, min_seq: int = 0) -> None:
        await super().advance(org, stack_run_id, min_seq=min_seq)
        raise RuntimeError("killed")


async def test_a_replica_killed_between_creating_and_recording_forgets_nothing(
    app: App, process: Process
) -> None:
    """The next delivery finds the same nodes ready, their runs existing, and records
    each once; a child that ended meanwhile (its end delivered before its start was
    recorded, and found nothing to end) is recorded started and ended."""
    sid = await _started(app, "crash")
    dying = _DiesAfterCreating(process().app)
    try:
        await dying.advance("crash", sid)
    except RuntimeError:
        pass
    x_run = child_run_id(sid, "x", 1)
    assert await _runs_of(app, "crash", "x") == [x_run]
    # x's run ends (canceled) before anyone recorded its start; its end is delivered
    ended = await app.run_command("crash", "x", x_run, R.CancelRun(actor="bob"))
    action = StackChild(org="crash", ws="x", run_id=x_run, stack_run=sid)
    await child_ended(app, action, str(ended.state.status))
    s = (await runs_app.load(app, "crash", sid)).state
    assert s.nodes["x"].status == "canceled" and s.nodes["x"].runs == [x_run]
    assert s.status == "paused"  # the default policy
    again = StackRuns(process().app)
    await again.advance("crash", sid)  # paused: nothing new
    for ws in ("x", "y", "z", "w"):
        assert len(await _runs_of(app, "crash", ws)) == (0 if ws == "w" else 1), ws
    s = (await runs_app.load(app, "crash", sid)).state
    assert s.nodes["y"].status == "waiting"  # made by the dead replica, not recorded yet
    # a resume: y and z's existing runs are recorded (not made twice), x gets attempt 2
    await runs_app.resume(app, "crash", sid, "bob")
    await again.advance("crash", sid)
    s = (await runs_app.load(app, "crash", sid)).state
    assert s.nodes["x"].runs == [x_run, child_run_id(sid, "x", 2)]
    assert s.nodes["y"].runs == [child_run_id(sid, "y", 1)]
    for ws in ("y", "z"):
        assert len(await _runs_of(app, "crash", ws)) == 1, ws


async def test_two_resumes_decided_at_once_land_once(nc: Any, app: App, process: Process) -> None:
    """Both decided on the same paused run: the second append finds the subject moved, is
    decided again on the resumed run and refused, so no node gets two new attempts.
    Without the expected sequence both would land (x at attempt 3, two new runs)."""
    sid = await _started(app, "resume2")
    cant = sr.RecordEnded(actor="p", node="x", run_id="", reason="gone")
    await runs_app.execute(app, "resume2", sid, cant)  # x failed: paused
    gated = process(store=Gate(nc, 2, ".stack_run.")).app
    results = await asyncio.gather(
        runs_app.resume(gated, "resume2", sid, "u1"),
        runs_app.resume(gated, "resume2", sid, "u2"),
        return_exceptions=True,
    )
    assert sorted(type(r).__name__ for r in results) == ["IllegalTransition", "StackRun"]
    s = (await runs_app.load(app, "resume2", sid)).state
    assert s.resumes == 1 and s.nodes["x"].attempt == 2
    assert len(gated.store.waited) == 2  # type: ignore[attr-defined]  # the race was real


async def test_abort_cancels_the_running_children_and_the_run_ends_aborted(
    app: App, process: Process
) -> None:
    """Policy `abort` on real NATS: x's failure makes the run aborting; the process
    cancels y's and z's runs (still waiting for an executor here), their ends close the
    run `aborted`, and w (after x) never starts."""
    await organization(app, "ab", actor="test")
    await workspaces(app, "x", "y", "z", "w", org="ab", actor="t", repository="https://e.com/r.git")
    d = sk.Definition(workspaces=["w", "x", "y", "z"], edges=[sk.Edge(source="x", target="w")])
    await stacks_app.create(app, "ab", "s", d, "alice")
    ask = runs_app.Start(run_type="apply", failure_policy="abort")
    sid = (await runs_app.start(app, "ab", "s", ask, "alice")).state.stack_run_id
    runs = StackRuns(process().app)
    await runs.advance("ab", sid)
    x_run = child_run_id(sid, "x", 1)
    await child_ended(app, StackChild(org="ab", ws="x", run_id=x_run, stack_run=sid), "failed")
    s = (await runs_app.load(app, "ab", sid)).state
    assert s.aborting and s.nodes["x"].status == "failed"
    await runs.advance("ab", sid)  # cancels what runs
    for ws in ("y", "z"):
        run_id = child_run_id(sid, ws, 1)
        child = (await app.load_run("ab", ws, run_id)).state
        assert str(child.status) == "canceled", ws
        await child_ended(
            app, StackChild(org="ab", ws=ws, run_id=run_id, stack_run=sid), "canceled"
        )
    s = (await runs_app.load(app, "ab", sid)).state
    assert s.status == "aborted" and not s.aborting
    assert {n: v.status for n, v in s.nodes.items()} == {
        "w": "waiting", "x": "failed", "y": "canceled", "z": "canceled",
    }  # fmt: skip
    assert await _runs_of(app, "ab", "w") == []
