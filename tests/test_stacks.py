"""Stacks: the pure rules (given / when / then), the serialized cycle check under a race,
the API and its problems, the projection and its replay, and one organization's admin
against another's workspaces and stacks."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events import stacks as sk
from events.errors import AlreadyExists, Conflict, NotFound
from infra.eventstore import Append, EventStore
from projections import replay
from projections.readmodel import ReadModel
from services.app import stacks as stacks_app
from services.app.commands import App
from services.root.bootstrap import Plane
from tests.access_support import person
from tests.api_support import Http, http_fixture  # noqa: F401 - the `http` fixture
from tests.bootstrap_support import Process
from tests.builders import organization, workspaces
from tests.gwt import NOW, Aggregate, given
from tests.projection_support import settle
from tests.stacks_support import DIAMOND, Gate

STACK = Aggregate(initial=sk.INITIAL, decide=sk.decide, evolve=sk.evolve)


def d(nodes: str, *edges: str, policy: str = "pause") -> sk.Definition:
    """`d("a b c", "a:b")`: nodes a, b, c, and b depends on a."""
    pairs = [e.split(":") for e in edges]
    return sk.Definition(
        workspaces=nodes.split(),
        edges=[sk.Edge(source=s, target=t) for s, t in pairs],
        failure_policy=policy,
    )


def created(name: str, definition: sk.Definition) -> sk.StackCreated:
    return sk.StackCreated(at=NOW, actor="alice", name=name, definition=definition)


def create(name: str, definition: sk.Definition) -> sk.CreateStack:
    return sk.CreateStack(actor="alice", name=name, definition=definition)


# ---------------------------------------------------------------- the pure rules


def test_a_stack_is_created_with_its_definition_sorted_and_its_levels_known() -> None:
    s = (
        given(STACK)
        .when(create("prod", d("d c b a", "c:d", "a:c", "a:b", "b:d")))
        .then(created("prod", d("a b c d", "a:b", "a:c", "b:d", "c:d")))
    )
    assert s.exists and sk.levels(s.definition) == [["a"], ["b", "c"], ["d"]]
    assert sk.prerequisites(s.definition)["d"] == ["b", "c"]
    assert sk.with_dependencies(s.definition, ["d"]) == ["a", "b", "c", "d"]
    assert sk.with_dependencies(s.definition, ["b"]) == ["a", "b"]


def test_an_edge_closing_a_cycle_is_refused_naming_the_cycle() -> None:
    e = given(STACK).when(create("s", d("a b c", "a:b", "b:c", "c:a"))).then_error(sk.StackCycle)
    assert e.cycle == ["a", "b", "c", "a"] and e.code == "stack-cycle"
    e2 = given(STACK).when(create("s", d("a", "a:a"))).then_error(sk.StackCycle)
    assert e2.cycle == ["a", "a"]


def test_a_diamond_and_disjoint_branches_are_no_cycle() -> None:
    diamond = d("a b c d x y", "a:b", "a:c", "b:d", "c:d", "x:y")
    s = given(STACK).when(create("s", diamond)).then(created("s", diamond))
    assert sk.levels(s.definition) == [["a", "x"], ["b", "c", "y"], ["d"]]


@pytest.mark.parametrize(
    "definition",
    [
        d("a a"),  # a node twice
        d(""),  # no node
        d("a b", "a:c"),  # an edge to a workspace not in the stack
        d("a b", "a:b", "a:b"),  # an edge twice
        d("a b", policy="explode"),
        sk.Definition(workspaces=[f"w{i}" for i in range(sk.MAX_NODES + 1)]),
    ],
)
def test_a_definition_breaking_a_rule_is_refused(definition: sk.Definition) -> None:
    given(STACK).when(create("s", definition)).then_error(sk.InvalidStack)


def test_a_change_replaces_the_definition_and_is_checked_alike() -> None:
    base = created("s", d("a b", "a:b"))
    change = sk.ChangeStack(actor="bob", name="s", definition=d("a b c", "b:c", "a:b"))
    s = (
        given(STACK, base)
        .when(change)
        .then(sk.StackChanged(at=NOW, actor="bob", name="s", definition=d("a b c", "a:b", "b:c")))
    )
    assert sk.levels(s.definition) == [["a"], ["b"], ["c"]] and s.changed_by == "bob"
    cyc = sk.ChangeStack(actor="bob", name="s", definition=d("a b", "a:b", "b:a"))
    given(STACK, base).when(cyc).then_error(sk.StackCycle)


def test_a_name_is_created_once_and_changed_or_deleted_only_while_it_exists() -> None:
    base = created("s", d("a"))
    given(STACK, base).when(create("s", d("a"))).then_error(AlreadyExists)
    given(STACK).when(sk.ChangeStack(actor="a", name="s", definition=d("a"))).then_error(NotFound)
    given(STACK).when(sk.DeleteStack(actor="a", name="s")).then_error(NotFound)
    gone = sk.StackDeleted(at=NOW, actor="alice", name="s")
    assert not given(STACK, base, gone).state.exists
    # a deleted name may be taken again
    given(STACK, base, gone).when(create("s", d("b"))).then(created("s", d("b")))


# ---------------------------------------------------------------- the race


async def _workspaces(app: App, org: str, *names: str) -> None:
    await organization(app, org, actor="test")
    await workspaces(app, *names, org=org, actor="t", repository="https://e.com/r.git")


async def test_two_concurrent_creations_of_one_name_do_not_both_land(
    nc: Any, app: App, process: Process
) -> None:
    """Both are decided on the same (empty) stack at once: the second append finds the
    subject moved, is decided again on the stack the first made, and is refused. Without
    the expected sequence both would land, the second silently replacing the first."""
    await _workspaces(app, "race", "a", "b", "c")
    gated = process(store=Gate(nc, 2, ".stack.")).app
    results = await asyncio.gather(
        stacks_app.create(gated, "race", "s", d("a b", "a:b"), "u1"),
        stacks_app.create(gated, "race", "s", d("b c", "c:b"), "u2"),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, AlreadyExists)]
    landed = [r for r in results if isinstance(r, stacks_app.Stack)]
    assert len(refused) == 1 and len(landed) == 1, results
    history = await app.store.read(sk.subject("race", "s"))
    assert [type(e.event) for e in history] == [sk.StackCreated]
    first = history[0].event
    assert isinstance(first, sk.StackCreated) and first.definition == landed[0].state.definition
    assert len(gated.store.waited) == 2  # type: ignore[attr-defined]  # the race was real


async def test_a_change_decided_on_a_stale_read_is_refused_by_the_append(app: App) -> None:
    await _workspaces(app, "stale", "a", "b")
    await stacks_app.create(app, "stale", "s", d("a b"), "u")
    before = await stacks_app.load(app, "stale", "s")
    await stacks_app.change(app, "stale", "s", d("a b", "a:b"), "u")
    event = sk.StackChanged(at=NOW, actor="x", name="s", definition=d("a b", "b:a"))
    with pytest.raises(Conflict):
        await app.store.append(
            [Append(subject=sk.subject("stale", "s"), event=event, expected=before.seq, msg_id="m")]
        )


# ---------------------------------------------------------------- the API


def _p(org: str, name: str = "") -> str:
    return f"/api/v1/orgs/{org}/stacks" + (f"/{name}" if name else "")


BODY = DIAMOND


async def test_the_api_creates_shows_lists_changes_and_deletes_a_stack(http: Http) -> None:
    tokens = await http.org("acme")
    for ws in ("a", "b", "c", "d"):
        await http.workspace("acme", ws)
    admin = tokens["admin"]
    a = await http.post(_p("acme"), json=BODY, token=admin)
    assert a.status == 201, a.body
    assert a.headers["Location"] == _p("acme", "prod")
    assert a.body["levels"] == [["a"], ["b", "c"], ["d"]]
    assert a.body["failure_policy"] == "pause"
    got = await http.get(_p("acme", "prod"), token=tokens["viewer"])
    assert got.status == 200 and got.body["edges"] == BODY["edges"]
    # the list is the read model's, at least as new as the write
    seq = {"RP-Min-Seq": str(a.seq)}
    ls = await http.get(_p("acme"), token=tokens["viewer"], headers=seq)
    assert [s["name"] for s in ls.body["items"]] == ["prod"]
    assert ls.body["items"][0]["levels"] == [["a"], ["b", "c"], ["d"]]
    # a workspace in several stacks
    other = {"name": "apps", "workspaces": ["b", "d"], "edges": [{"source": "d", "target": "b"}]}
    assert (await http.post(_p("acme"), json=other, token=admin)).status == 201
    put = await http.call(
        "PUT",
        _p("acme", "prod"),
        json={"workspaces": ["a", "b"], "edges": [], "failure_policy": "continue"},
        token=admin,
    )
    assert put.status == 200 and put.body["levels"] == [["a", "b"]]
    ls = await http.get(_p("acme"), token=admin, headers={"RP-Min-Seq": str(put.seq)})
    assert [(s["name"], s["failure_policy"]) for s in ls.body["items"]] == [
        ("apps", "pause"),
        ("prod", "continue"),
    ]
    gone = await http.call("DELETE", _p("acme", "prod"), token=admin)
    assert gone.status == 204
    (await http.get(_p("acme", "prod"), token=admin)).problem("not-found", 404)
    ls = await http.get(_p("acme"), token=admin, headers={"RP-Min-Seq": gone.headers["RP-Seq"]})
    assert [s["name"] for s in ls.body["items"]] == ["apps"]
    (await http.call("DELETE", _p("acme", "prod"), token=admin)).problem("not-found", 404)


async def test_bad_input_is_a_problem_with_a_stable_type(http: Http) -> None:
    tokens = await http.org("acme")
    for ws in ("a", "b"):
        await http.workspace("acme", ws)
    admin = tokens["admin"]

    async def post(body: dict[str, Any]) -> Any:
        return await http.post(_p("acme"), json=body, token=admin)

    cyc = (
        await post(
            {
                "name": "s",
                "workspaces": ["a", "b"],
                "edges": [{"source": "a", "target": "b"}, {"source": "b", "target": "a"}],
            }
        )
    ).problem("stack-cycle", 422)
    assert cyc["cycle"] == ["a", "b", "a"]
    (await post({"name": "s", "workspaces": ["a", "a"]})).problem("invalid-stack", 422)
    (
        await post({"name": "s", "workspaces": ["a"], "edges": [{"source": "a", "target": "b"}]})
    ).problem("invalid-stack", 422)
    (await post({"name": "s", "workspaces": ["a"], "failure_policy": "x"})).problem(
        "invalid-stack", 422
    )
    (await post({"name": "s", "workspaces": ["a", "nope"]})).problem("not-found", 404)
    (await post({"name": "S!", "workspaces": ["a"]})).problem("invalid-id", 422)
    (await post({"name": "s", "workspaces": ["a.b"]})).problem("invalid-id", 422)
    (await post({"name": "s", "workspaces": ["a"], "x": 1})).problem("invalid-body", 400)
    (
        await post(
            {
                "name": "s",
                "workspaces": ["a"],
                "edges": [{"source": "a", "target": "a", "outputs": 1}],
            }
        )
    ).problem("invalid-body", 400)
    assert (await post({"name": "s", "workspaces": ["a"]})).status == 201
    (await post({"name": "s", "workspaces": ["b"]})).problem("already-exists", 409)
    put = await http.call("PUT", _p("acme", "nope"), json={"workspaces": ["a"]}, token=admin)
    put.problem("not-found", 404)


async def test_only_an_admin_writes_stacks_and_a_viewer_reads_them(http: Http) -> None:
    tokens = await http.org("acme")
    await http.workspace("acme", "a")
    body = {"name": "s", "workspaces": ["a"]}
    for role in ("viewer", "operator", "approver"):
        (await http.post(_p("acme"), json=body, token=tokens[role])).problem("forbidden", 403)
        put = await http.call(
            "PUT", _p("acme", "s"), json={"workspaces": ["a"]}, token=tokens[role]
        )
        put.problem("forbidden", 403)
        (await http.call("DELETE", _p("acme", "s"), token=tokens[role])).problem("forbidden", 403)
    assert (await http.post(_p("acme"), json=body, token=tokens["admin"])).status == 201
    assert (await http.get(_p("acme", "s"), token=tokens["viewer"])).status == 200


async def test_attack_org_a_s_admin_cannot_stack_read_change_or_delete_org_b_s(
    http: Http,
) -> None:
    """Attack: org B's workspaces are not found from org A (a stack's nodes are checked
    on A's own subjects), and B's stack paths refuse A's admin. A version that took the
    names unchecked (or checked them in any organization) would let A's stack name B's
    workspaces, and a stack run would then start runs in them."""
    a_tokens = await http.org("orga")
    b_tokens = await http.org("orgb")
    await http.workspace("orga", "mine")
    await http.workspace("orgb", "theirs")
    attacker = a_tokens["admin"]
    bad = {
        "name": "grab",
        "workspaces": ["mine", "theirs"],
        "edges": [{"source": "mine", "target": "theirs"}],
    }
    (await http.post(_p("orga"), json=bad, token=attacker)).problem("not-found", 404)
    theirs = {"name": "b-stack", "workspaces": ["theirs"]}
    assert (await http.post(_p("orgb"), json=theirs, token=b_tokens["admin"])).status == 201
    (
        await http.post(_p("orgb"), json={"name": "x", "workspaces": ["theirs"]}, token=attacker)
    ).problem("not-found", 404)
    (await http.get(_p("orgb"), token=attacker)).problem("not-found", 404)
    (await http.get(_p("orgb", "b-stack"), token=attacker)).problem("not-found", 404)
    put = await http.call(
        "PUT", _p("orgb", "b-stack"), json={"workspaces": ["theirs"]}, token=attacker
    )
    put.problem("not-found", 404)
    (await http.call("DELETE", _p("orgb", "b-stack"), token=attacker)).problem("not-found", 404)
    # A's own stack of the same name knows nothing of B's
    (await http.get(_p("orga", "b-stack"), token=attacker)).problem("not-found", 404)
    b = await stacks_app.load(http.app, "orgb", "b-stack")
    assert b.state.exists and b.state.definition.workspaces == ["theirs"]
    assert b.state.version == 1
    assert not (await stacks_app.load(http.app, "orga", "grab")).state.exists


# ---------------------------------------------------------------- projection and replay


async def test_the_stacks_table_is_a_fold_a_replay_rebuilds_identically(
    system: Plane, nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    app = system.app
    await _workspaces(app, "rep", "a", "b", "c")
    async with system.projector(tmp_path / "live.db") as live:
        await stacks_app.create(app, "rep", "one", d("a b", "a:b"), "u")
        await stacks_app.create(app, "rep", "two", d("a b c", "a:c", "b:c"), "u")
        await stacks_app.change(app, "rep", "one", d("a b c", "b:a", "a:c"), "v")
        await stacks_app.create(app, "rep", "gone", d("a"), "u")
        await stacks_app.delete(app, "rep", "gone", "u")
        await settle(live, store)
        live_dump = await live.read.dump()
    rows = live_dump["stacks"]
    assert [(r[0], r[1]) for r in rows] == [("rep", "one"), ("rep", "two")]
    assert '"source":"b","target":"a"' in str(rows[0][2])
    await replay(nc, tmp_path / "replayed.db")
    async with await ReadModel.open(tmp_path / "replayed.db") as read:
        assert await read.dump() == live_dump


async def test_attack_a_person_sees_a_stack_without_the_workspaces_they_may_not_read(
    http: Http,
) -> None:
    """A stack names workspaces; a person granted only `a` reads it with the others
    named `(hidden)` (nodes, edges and levels alike), in the one and in the list. A
    version that showed the stack as stored told them every workspace's name."""
    tokens = await http.org("acme")
    for ws in ("a", "secret-b", "secret-c"):
        await http.workspace("acme", ws)
    body = {"name": "s", "workspaces": ["a", "secret-b", "secret-c"],
            "edges": [{"source": "a", "target": "secret-b"},
                      {"source": "secret-b", "target": "secret-c"}]}  # fmt: skip
    made = await http.post(_p("acme"), json=body, token=tokens["admin"])
    assert made.status == 201
    token = await person(http, "acme", "pat@example.com", "only-a", **{"workspaces/a": "write"})
    got = await http.get(_p("acme", "s"), token=token)
    assert got.status == 200, got.body
    assert got.body["workspaces"] == ["a", "(hidden)", "(hidden)"]
    assert got.body["levels"] == [["a"], ["(hidden)"], ["(hidden)"]]
    assert got.body["edges"] == [{"source": "a", "target": "(hidden)"},
                                 {"source": "(hidden)", "target": "(hidden)"}]  # fmt: skip
    assert "secret" not in str(got.body)
    ls = await http.get(_p("acme"), token=token, headers={"RP-Min-Seq": str(made.seq)})
    assert ls.status == 200 and "secret" not in str(ls.body)
    assert ls.body["items"][0]["workspaces"] == ["a", "(hidden)", "(hidden)"]
