"""Run triggers' graph: the pure rules (given / when / then), its API, the serialized
cycle check under a race, and one organization's admin against another's workspaces."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given as given_h
from hypothesis import settings
from hypothesis import strategies as st

from events import run as R
from events import run_triggers as rt
from events.errors import AlreadyExists, Conflict, NotFound
from events.react import Follow
from events.values import Cause, ResourceChange, Snapshot, Workspace
from infra.eventstore import Append, Envelope, EventStore
from infra.ids import derived_id
from services.app.commands import App
from services.processes.triggers import graph
from services.processes.triggers.subscriber import Triggers
from tests.api_support import Http, http_fixture  # noqa: F401 - the `http` fixture
from tests.bootstrap_support import Process
from tests.builders import organization, workspaces
from tests.gwt import NOW, Aggregate, given

RT = Aggregate(initial=rt.INITIAL, decide=rt.decide, evolve=rt.evolve)


def added(source: str, target: str) -> rt.RunTriggerAdded:
    return rt.RunTriggerAdded(at=NOW, actor="alice", source=source, target=target)


def add(source: str, target: str) -> rt.AddRunTrigger:
    return rt.AddRunTrigger(actor="alice", source=source, target=target)


# ---------------------------------------------------------------- the pure rules


def test_a_workspace_follows_another_and_the_graph_knows_both_directions() -> None:
    g = given(RT).when(add("a", "b")).then(added("a", "b"))
    assert g.sources_of("b") == ["a"] and g.followers_of("a") == ["b"]


def test_a_trigger_closing_a_cycle_is_refused_naming_the_cycle_in_flow_order() -> None:
    """a -> b -> c exists (b follows a, c follows b); a following c closes it."""
    e = given(RT, added("a", "b"), added("b", "c")).when(add("c", "a")).then_error(rt.TriggerCycle)
    assert e.cycle == ["a", "b", "c", "a"]
    assert "a -> b -> c -> a" in str(e) and e.code == "run-trigger-cycle"


def test_a_cycle_anywhere_in_the_graph_is_found_not_only_between_the_two() -> None:
    history = [added("x", "y"), added("a", "b"), added("b", "c"), added("c", "d")]
    e = given(RT, *history).when(add("d", "b")).then_error(rt.TriggerCycle)
    assert e.cycle == ["b", "c", "d", "b"]


def test_a_workspace_cannot_follow_itself() -> None:
    assert given(RT).when(add("a", "a")).then_error(rt.TriggerCycle).cycle == ["a", "a"]


def test_a_diamond_is_no_cycle() -> None:
    history = [added("a", "b"), added("a", "c"), added("b", "d")]
    given(RT, *history).when(add("c", "d")).then(added("c", "d"))


def test_an_edge_is_added_once_and_removed_only_if_there() -> None:
    given(RT, added("a", "b")).when(add("a", "b")).then_error(AlreadyExists)
    remove = rt.RemoveRunTrigger(actor="alice", source="a", target="b")
    given(RT).when(remove).then_error(NotFound)
    g = (
        given(RT, added("a", "b"))
        .when(remove)
        .then(rt.RunTriggerRemoved(at=NOW, actor="alice", source="a", target="b"))
    )
    assert g.sources == {}
    # removed, it no longer closes the cycle it did
    removed = rt.RunTriggerRemoved(at=NOW, actor="x", source="a", target="b")
    given(RT, added("a", "b"), removed).when(add("b", "a")).then(added("b", "a"))


def test_a_workspace_follows_at_most_max_sources_and_is_followed_by_at_most_max_followers() -> None:
    many = [added(f"s{i}", "t") for i in range(rt.MAX_SOURCES)]
    given(RT, *many).when(add("one-more", "t")).then_error(rt.TooManyTriggers)
    fans = [added("hub", f"f{i}") for i in range(rt.MAX_FOLLOWERS)]
    given(RT, *fans).when(add("hub", "one-more")).then_error(rt.TooManyTriggers)


def _acyclic(g: rt.TriggerGraph) -> bool:
    return all(rt.path_between(g, t, s) is None for t, srcs in g.sources.items() for s in srcs)


_NAMES = st.sampled_from(["a", "b", "c", "d", "e", "f"])


@settings(max_examples=300, deadline=None)
@given_h(st.lists(st.tuples(_NAMES, _NAMES, st.booleans()), max_size=40))
def test_whatever_is_added_and_removed_the_graph_never_has_a_cycle(
    steps: list[tuple[str, str, bool]],
) -> None:
    """Every sequence of additions and removals leaves an acyclic graph, and every
    refusal names a cycle the edge would really close (each hop a trigger, plus it)."""
    g = rt.INITIAL
    for source, target, removing in steps:
        cmd: rt.RunTriggerCommand = (
            rt.RemoveRunTrigger(actor="u", source=source, target=target)
            if removing
            else add(source, target)
        )
        try:
            g = rt.fold(rt.decide(g, cmd, now=NOW, new_id=lambda: "x"), g)
        except rt.TriggerCycle as e:
            hops = list(zip(e.cycle, e.cycle[1:], strict=False))
            assert e.cycle[0] == e.cycle[-1] == target and (source, target) in hops
            assert all(g.has(a, b) or (a, b) == (source, target) for a, b in hops)
        except (AlreadyExists, NotFound):
            pass
        assert _acyclic(g)


# ---------------------------------------------------------------- the race


class _Gate(EventStore):
    """An event store whose first read of the trigger graph in each of `parties` tasks
    waits for the others' (so each decides on the same graph), once."""

    def __init__(self, nc: Any, parties: int) -> None:
        super().__init__(nc)
        self.barrier = asyncio.Barrier(parties)
        self.waited: set[int] = set()

    async def read(self, subject: str, after: int = 0, *, min_seq: int = 0) -> list[Envelope]:
        envs = await super().read(subject, after, min_seq=min_seq)
        task = id(asyncio.current_task())
        if subject.endswith(".run_triggers") and task not in self.waited:
            self.waited.add(task)
            await asyncio.wait_for(self.barrier.wait(), 10)
        return envs


async def _workspaces(app: App, org: str, *names: str) -> None:
    await organization(app, org, actor="test")
    await workspaces(app, *names, org=org, actor="t", repository="https://e.com/r.git")


async def test_two_concurrent_additions_that_together_close_a_cycle_do_not_both_land(
    nc: Any, app: App, process: Process
) -> None:
    """a follows b and b follows a, decided at once on the same (empty) graph: the
    second append finds the subject moved, is decided again on the graph with the first
    in it, and is refused naming the cycle. Without the expected sequence both land."""
    await _workspaces(app, "race", "a", "b")
    gated = process(store=_Gate(nc, 2)).app
    results = await asyncio.gather(
        graph.add(gated, "race", "a", "b", "u1"),
        graph.add(gated, "race", "b", "a", "u2"),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, rt.TriggerCycle)]
    landed = [r for r in results if isinstance(r, graph.Graph)]
    assert len(refused) == 1 and len(landed) == 1, results
    assert refused[0].cycle in (["a", "b", "a"], ["b", "a", "b"])
    final = (await graph.load(app, "race")).state
    assert sum(len(s) for s in final.sources.values()) == 1
    assert len(gated.store.waited) == 2  # type: ignore[attr-defined]  # the race was real


async def test_a_graph_decided_on_a_stale_read_is_refused_by_the_append(app: App) -> None:
    """The check the race rests on: an append at an expected sequence the subject has
    moved past is a conflict."""
    await _workspaces(app, "stale", "a", "b", "c")
    before = await graph.load(app, "stale")
    await graph.add(app, "stale", "b", "a", "u")
    event = added("c", "a")
    with pytest.raises(Conflict):
        await app.store.append(
            [Append(subject=rt.subject("stale"), event=event, expected=before.seq, msg_id="m1")]
        )


# ---------------------------------------------------------------- the API


def _path(org: str, ws: str) -> str:
    return f"/api/v1/orgs/{org}/workspaces/{ws}/run-triggers"


async def test_the_api_adds_lists_and_removes_triggers_and_refuses_a_cycle(http: Http) -> None:
    tokens = await http.org("acme")
    for ws in ("a", "b", "c"):
        await http.workspace("acme", ws)
    admin = tokens["admin"]
    a = await http.post(_path("acme", "b"), json={"source": "a"}, token=admin)
    assert a.status == 201, a.body
    assert a.headers["Location"] == _path("acme", "b") + "/a"
    assert a.body == {"workspace": "b", "sources": [{"workspace": "a"}], "followers": []}
    assert (await http.post(_path("acme", "c"), json={"source": "b"}, token=admin)).status == 201
    cyc = await http.post(_path("acme", "a"), json={"source": "c"}, token=admin)
    body = cyc.problem("run-trigger-cycle", 422)
    assert body["cycle"] == ["a", "b", "c", "a"] and "a -> b -> c -> a" in body["detail"]
    got = await http.get(_path("acme", "b"), token=tokens["viewer"])
    assert got.status == 200
    assert got.body["sources"] == [{"workspace": "a"}]
    assert got.body["followers"] == [{"workspace": "c"}]
    again = await http.post(_path("acme", "b"), json={"source": "a"}, token=admin)
    again.problem("already-exists", 409)
    gone = await http.call("DELETE", _path("acme", "b") + "/a", token=admin)
    assert gone.status == 204
    (await http.call("DELETE", _path("acme", "b") + "/a", token=admin)).problem("not-found", 404)
    # with b no longer following a, a may follow c
    assert (await http.post(_path("acme", "a"), json={"source": "c"}, token=admin)).status == 201


async def test_bad_input_is_a_clear_problem(http: Http) -> None:
    tokens = await http.org("acme")
    await http.workspace("acme", "a")
    admin = tokens["admin"]
    (await http.post(_path("acme", "a"), json={"source": "nope"}, token=admin)).problem(
        "not-found", 404
    )
    (await http.post(_path("acme", "nope"), json={"source": "a"}, token=admin)).problem(
        "not-found", 404
    )
    (await http.post(_path("acme", "a"), json={"source": "a.b"}, token=admin)).problem(
        "invalid-id", 422
    )
    (await http.post(_path("acme", "a"), json={"source": "a", "x": 1}, token=admin)).problem(
        "invalid-body", 400
    )
    (await http.post(_path("acme", "a"), json={"source": "a"}, token=admin)).problem(
        "run-trigger-cycle", 422
    )
    (await http.get(_path("acme", "nope"), token=admin)).problem("not-found", 404)


async def test_only_an_admin_writes_triggers(http: Http) -> None:
    tokens = await http.org("acme")
    await http.workspace("acme", "a")
    await http.workspace("acme", "b")
    for role in ("viewer", "operator", "approver"):
        a = await http.post(_path("acme", "b"), json={"source": "a"}, token=tokens[role])
        a.problem("forbidden", 403)
    ok = await http.post(_path("acme", "b"), json={"source": "a"}, token=tokens["admin"])
    assert ok.status == 201
    d = await http.call("DELETE", _path("acme", "b") + "/a", token=tokens["operator"])
    d.problem("forbidden", 403)


async def test_org_a_s_admin_cannot_follow_read_or_unfollow_org_b_s_workspaces(
    http: Http,
) -> None:
    """Attack: a workspace of another organization is not found from this one (the
    graph's subjects are the organization's own), and the other's paths are refused."""
    a_tokens = await http.org("orga")
    b_tokens = await http.org("orgb")
    await http.workspace("orga", "mine")
    await http.workspace("orgb", "theirs")
    await http.workspace("orgb", "other")
    attacker = a_tokens["admin"]
    # follow B's workspace from A's
    (await http.post(_path("orga", "mine"), json={"source": "theirs"}, token=attacker)).problem(
        "not-found", 404
    )
    # write into B's graph, read it, delete from it
    assert (
        await http.post(_path("orgb", "theirs"), json={"source": "other"}, token=b_tokens["admin"])
    ).status == 201
    (await http.post(_path("orgb", "other"), json={"source": "mine"}, token=attacker)).problem(
        "not-found", 404
    )
    (await http.get(_path("orgb", "theirs"), token=attacker)).problem("not-found", 404)
    (await http.call("DELETE", _path("orgb", "theirs") + "/other", token=attacker)).problem(
        "not-found", 404
    )
    # B's graph is as B left it; A's has nothing
    assert (await graph.load(http.app, "orgb")).state.sources == {"theirs": ["other"]}
    assert (await graph.load(http.app, "orga")).state.sources == {}


# ---------------------------------------------------------------- the approval hold

RUN = Aggregate(initial=R.INITIAL, decide=R.decide, evolve=R.evolve)
LEASE = "lease-1"
DELETES = [ResourceChange(address="null_resource.x", type="null_resource", action="replace")]
CREATES = [ResourceChange(address="null_resource.y", type="null_resource", action="create")]


def _planning(cause: Cause | None, **settings: Any) -> list[Any]:
    """A run (caused by `cause`) admitted with `settings`, its plan running."""
    snap = Snapshot(settings={k: {"value": v, "origin": "workspace"} for k, v in settings.items()})
    created = R.RunCreated(
        at=NOW, actor="run-trigger", run_id="r1", org="acme", workspace="b", run_type="apply",
        config=Workspace(repository="https://e.com/r.git"), cause=cause,
    )  # fmt: skip
    queued = R.decide(R.fold([created]), R.AdmitRun(actor="s", snapshot=snap), now=NOW,
                      new_id=lambda: "x")  # fmt: skip
    started = R.PhaseStarted(at=NOW, actor="e", phase="plan", lease_id=LEASE, executor_id="e")
    return [created, *queued, started]


def _plan(changes: list[ResourceChange], require_approval: bool = True) -> R.FinishPlan:
    return R.FinishPlan(
        actor="e", lease_id=LEASE, commit="c", has_changes=True, summary=R.PlanSummary(add=1),
        require_approval=require_approval, changes=changes,
    )  # fmt: skip


TRIGGERED = Cause(kind="run_trigger", source_workspace="a", source_run="ra")


def _finished(history: list[Any], command: R.FinishPlan) -> R.PlanFinished:
    events = given(RUN, *history).when(command).events
    assert events is not None and isinstance(events[0], R.PlanFinished)
    return events[0]


def test_a_triggered_run_of_a_workspace_with_auto_apply_does_not_wait_and_says_why() -> None:
    history = _planning(TRIGGERED, auto_apply_run_triggers=True)
    finished = _finished(history, _plan(CREATES))
    assert finished.status == R.Status.APPLY_QUEUED
    assert (finished.require_approval, finished.approval_skipped) == (
        False,
        "auto_apply_run_triggers",
    )
    assert not R.fold([*history, finished]).needs_approval


@pytest.mark.parametrize(
    ("cause", "settings"),
    [
        (TRIGGERED, {}),  # the setting off (its default)
        (Cause(kind="api", user="alice"), {"auto_apply_run_triggers": True}),  # not triggered
        (None, {"auto_apply_run_triggers": True}),  # recorded before causes were
        (Cause(kind="rerun", rerun_of="ra"), {"auto_apply_run_triggers": True}),
    ],
)
def test_any_other_run_waits_for_the_approval_its_settings_ask_for(
    cause: Cause | None, settings: dict[str, Any]
) -> None:
    finished = _finished(_planning(cause, **settings), _plan(CREATES))
    assert finished.status == R.Status.AWAITING_APPROVAL
    assert (finished.require_approval, finished.approval_skipped) == (True, "")


def test_a_run_trigger_never_acknowledges_a_destroy_under_confirm_destructive() -> None:
    history = _planning(TRIGGERED, auto_apply_run_triggers=True, confirm_destructive=True)
    assert _finished(history, _plan(DELETES)).status == R.Status.AWAITING_APPROVAL
    # nothing to delete or replace: confirm_destructive asks nothing, and it goes on
    assert _finished(history, _plan(CREATES)).status == R.Status.APPLY_QUEUED


def test_a_workspace_that_asks_no_approval_records_nothing_skipped() -> None:
    history = _planning(TRIGGERED, auto_apply_run_triggers=True)
    finished = _finished(history, _plan(CREATES, require_approval=False))
    assert (finished.status, finished.approval_skipped) == (R.Status.APPLY_QUEUED, "")


# ---------------------------------------------------------------- the subscriber's follow


async def test_follow_starts_each_follower_of_the_graph_as_of_the_event_once(app: App) -> None:
    """b followed a when a's run ended (stream sequence `at`); c followed after, d left
    after: b and d get a run each, linked to a's, c none; the same event handled again
    finds both runs (their ids derived from a's run and the follower) and makes none."""
    await _workspaces(app, "acme", "a", "b", "c", "d")
    await graph.add(app, "acme", "b", "a", "t")
    await graph.add(app, "acme", "d", "a", "t")
    at = await app.store.last_seq()  # a's run ends here
    await graph.add(app, "acme", "c", "a", "t")
    await graph.remove(app, "acme", "d", "a", "t")
    triggers = Triggers(app)
    action = Follow(org="acme", ws="a", run_id="ra")
    first = await triggers.follow(action, at=at)
    assert first == [derived_id("run-trigger", "ra", "b"), derived_id("run-trigger", "ra", "d")]
    for ws, run_id in zip(("b", "d"), first, strict=True):
        state = (await app.load_run("acme", ws, run_id)).state
        assert (state.run_type, state.created_by) == ("apply", "run-trigger")
        assert state.cause == Cause(kind="run_trigger", source_workspace="a", source_run="ra")
    assert await triggers.follow(action, at=at) == first
    assert triggers.started == 2
    assert not await app.store.read("rp.run.acme.c.*")
    # as the graph is now (at=0): b and c
    assert await triggers.follow(action) == [first[0], derived_id("run-trigger", "ra", "c")]
