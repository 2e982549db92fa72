"""Attacks on stack runs (issue 27): a resume that would let its resumer approve the runs
it started (four-eyes), and a refusal that named a workspace the caller may not read."""

from __future__ import annotations

from typing import Any

from events import stack_runs as sr
from events import stacks as sk
from events.stack_run_events import child_run_id
from services.app import stack_runs as runs_app
from services.app import stacks as stacks_app
from services.app.commands import App
from services.processes.stacks.subscriber import StackRuns
from tests.access_support import person
from tests.api_support import Http, http_fixture  # noqa: F401 - the `http` fixture
from tests.bootstrap_support import Process
from tests.builders import organization, workspaces
from tests.stacks_support import diamond_stack


async def test_attack_a_resumer_is_the_creator_of_the_runs_a_resume_starts(
    app: App, process: Process
) -> None:
    """Alice starts a stack run; x fails and it pauses (bob can make that happen: he may
    cancel x's run). Bob resumes it: x's new run and w's (after x) are bob's doing. Were
    they created as alice, four-eyes (the run's creator may not approve it) would let bob
    approve the runs he started himself, on code he may have just pushed: they were."""
    await organization(app, "fe", actor="test")
    await workspaces(app, "x", "w", org="fe", actor="t", repository="https://e.com/r.git")
    d = sk.Definition(workspaces=["w", "x"], edges=[sk.Edge(source="x", target="w")])
    await stacks_app.create(app, "fe", "s", d, "alice")
    sid = (await runs_app.start(app, "fe", "s", runs_app.Start(run_type="apply"), "alice")).state
    sid_ = sid.stack_run_id
    runs = StackRuns(process().app)
    await runs.advance("fe", sid_)
    first = (await app.load_run("fe", "x", child_run_id(sid_, "x", 1))).state
    assert first.created_by == "alice"
    end = sr.RecordEnded(actor="p", node="x", run_id=child_run_id(sid_, "x", 1),
                         run_status="canceled")  # fmt: skip
    await runs_app.execute(app, "fe", sid_, end)
    assert (await runs_app.load(app, "fe", sid_)).state.status == "paused"
    await runs_app.resume(app, "fe", sid_, "bob")
    await runs.advance("fe", sid_)
    again = (await app.load_run("fe", "x", child_run_id(sid_, "x", 2))).state
    assert again.created_by == "bob", again.created_by
    assert again.cause is not None and again.cause.user == "bob"


async def test_attack_a_stack_run_refused_names_no_workspace_the_caller_may_not_read(
    http: Http,
) -> None:
    """Pat may write `a` only; the stack's other workspaces are `(hidden)` to her. Starting
    the whole stack is refused 404, without naming `b` (its name
    was in the refusal: `workspace b not found`)."""
    await diamond_stack(http, "acme")
    pat = await person(http, "acme", "pat@example.com", "only-a", **{"workspaces/a": "write"})
    runs = "/api/v1/orgs/acme/stacks/prod/runs"
    for body in ({"type": "apply"}, {"type": "plan"}):
        got = await http.post(runs, json=body, token=pat)
        got.problem("not-found", 404)
        text = str(got.body)
        for hidden in ("workspace b", "workspace c", "workspace d"):
            assert hidden not in text, text


async def test_attack_a_stack_changed_between_the_check_and_the_start_runs_only_what_was_checked(
    http: Http, monkeypatch: Any
) -> None:
    """Pat may write `a`, the only workspace of stack `one`. She starts it as the admin
    makes `one` the diamond: the run is of the definition her access was checked on. The
    start read the stack again, and ran b, c and d as her."""
    tokens = await http.org("acme")
    for ws in ("a", "b", "c", "d"):
        await http.workspace("acme", ws)
    alone = {"name": "one", "workspaces": ["a"]}
    made = await http.post("/api/v1/orgs/acme/stacks", json=alone, token=tokens["admin"])
    assert made.status == 201, made.body
    pat = await person(http, "acme", "pat@example.com", "only-a", **{"workspaces/a": "write"})
    load = stacks_app.load
    calls = 0

    async def racing(app: Any, org: str, name: str, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # after her access was checked: the admin's change lands
            d = sk.Definition(workspaces=["a", "b", "c", "d"], edges=[
                sk.Edge(source="a", target=t) for t in ("b", "c", "d")])  # fmt: skip
            await stacks_app.change(app, org, name, d, "admin")
        return await load(app, org, name, **kw)

    monkeypatch.setattr(stacks_app, "load", racing)
    got = await http.post("/api/v1/orgs/acme/stacks/one/runs", json={"type": "apply"}, token=pat)
    monkeypatch.setattr(stacks_app, "load", load)
    assert got.status in (201, 404), got.body
    if got.status == 201:
        s = (await runs_app.load(http.app, "acme", got.body["id"])).state
        assert s.selected == ["a"], s.selected


async def test_attack_a_stack_run_starts_nothing_more_for_someone_whose_access_is_gone(
    http: Http, process: Process
) -> None:
    """Pat (write on a and b, b after a) starts the stack; a's run is made. Then she is
    taken out of her team (or suspended, or leaves): b's run must not be made in her
    name. It was: the process made every later level's runs as the starter, asking
    nobody whether she still may."""
    tokens = await http.org("acme")
    for ws in ("a", "b"):
        await http.workspace("acme", ws)
    stack = {"name": "ab", "workspaces": ["a", "b"], "edges": [{"source": "a", "target": "b"}]}
    made = await http.post("/api/v1/orgs/acme/stacks", json=stack, token=tokens["admin"])
    assert made.status == 201, made.body
    pat = await person(http, "acme", "pat@example.com", "ab-team",
                       **{"workspaces/a": "write", "workspaces/b": "write"})  # fmt: skip
    got = await http.post("/api/v1/orgs/acme/stacks/ab/runs", json={"type": "apply"}, token=pat)
    assert got.status == 201, got.body
    sid = got.body["id"]
    runs = StackRuns(process().app)
    await runs.advance("acme", sid)
    a_run = child_run_id(sid, "a", 1)
    assert (await http.app.load_run("acme", "a", a_run)).state.created_by == "pat@example.com"
    out = await http.call("PUT", "/api/v1/orgs/acme/teams/ab-team/members", json={"members": []})
    assert out.status == 200, out.body
    await runs_app.execute(http.app, "acme", sid,
                           sr.RecordEnded(actor="t", node="a", run_id=a_run,
                                          run_status="applied"))  # fmt: skip
    await runs.advance("acme", sid)
    s = (await runs_app.load(http.app, "acme", sid)).state
    assert s.nodes["b"].status == "failed" and s.nodes["b"].runs == [], s.nodes["b"]
    assert not (await http.app.load_run("acme", "b", child_run_id(sid, "b", 1))).state.exists


async def test_attack_targets_tell_nobody_which_hidden_workspaces_are_in_a_stack(
    http: Http,
) -> None:
    """Pat may read `a` only. Asking for a target she may not read answers as for a name
    not in the stack at all: otherwise trying names tells her which hidden workspaces
    the stack holds (422 `targets not in the stack` for one, 404 for the other)."""
    await diamond_stack(http, "acme")
    pat = await person(http, "acme", "pat@example.com", "only-a", **{"workspaces/a": "write"})
    runs = "/api/v1/orgs/acme/stacks/prod/runs"
    answers = []
    for target in ("b", "zz"):
        body = {"type": "plan", "targets": [target], "skip_dependencies": True}
        got = await http.post(runs, json=body, token=pat)
        answers.append((got.status, got.body.get("type"),
                        got.body.get("detail", "").replace(target, "X")))  # fmt: skip
    assert answers[0] == answers[1], answers


async def test_attack_an_organization_s_stacks_are_bounded(http: Http, monkeypatch: Any) -> None:
    """Each listing computes every stack's levels, unpaginated: an admin who made stacks
    without end made every listing of the shared API cost without end. Past MAX_STACKS
    a new one is refused (422 invalid-stack); a change of one is not."""
    monkeypatch.setattr(sk, "MAX_STACKS", 2, raising=False)
    tokens = await http.org("acme")
    await http.workspace("acme", "a")
    for i in range(2):
        body = {"name": f"s{i}", "workspaces": ["a"]}
        made = await http.post("/api/v1/orgs/acme/stacks", json=body, token=tokens["admin"])
        assert made.status == 201, made.body
    body = {"name": "s2", "workspaces": ["a"]}
    (await http.post("/api/v1/orgs/acme/stacks", json=body, token=tokens["admin"])).problem(
        "invalid-stack", 422
    )
    put = await http.call("PUT", "/api/v1/orgs/acme/stacks/s1",
                          json={"workspaces": ["a"], "failure_policy": "abort"})  # fmt: skip
    assert put.status == 200, put.body
