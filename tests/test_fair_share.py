"""Fair share of the executors (issue 23, attack F3): a pool serves organizations in
turn, so one organization's flood of phases does not starve another's.

The attack: 60 speculative plans from org A made org B's next plan take 167 s instead
of 1.2 s, because a pool's executors took dispatches first in, first out across every
organization. Now each organization's phases wait on a subject of their own and an
executor with room serves the organizations in weighted round robin
(executor/intake.py, executor/turns.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from executor.turns import ACTIVE_FOR, Slots, Turns, Waiting, parse_weights
from infra.options import ConfigError, Options
from infra.streams import dispatch_subject
from services.root.cli import options, parser
from tests import bootstrap_support
from tests.builders import api_workspace
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

TWO = """
resource "null_resource" "a" {}
resource "null_resource" "b" {}
"""

# ---------------------------------------------------------------- whose turn (pure)


def _serve(turns: Turns, waiting: dict[str, int], n: int) -> list[str]:
    """Which organization `n` successive free slots serve while `waiting` waits."""
    served = []
    for _ in range(n):
        org = turns.order([o for o, left in waiting.items() if left])[0]
        turns.served(org)
        waiting[org] -= 1
        served.append(org)
    return served


def test_two_organizations_alternate_however_long_either_queue() -> None:
    assert _serve(Turns(), {"a": 60, "b": 3}, 8) == ["a", "b", "a", "b", "a", "b", "a", "a"]


def test_a_weight_is_turns_per_round() -> None:
    served = _serve(Turns({"a": 2}), {"a": 60, "b": 60, "c": 60}, 12)
    assert {o: served.count(o) for o in "abc"} == {"a": 6, "b": 3, "c": 3}


def test_an_organization_that_was_idle_saves_up_no_turns() -> None:
    turns = Turns()
    _serve(turns, {"a": 50}, 50)  # b waited for nothing meanwhile
    assert _serve(turns, {"a": 10, "b": 10}, 6) == ["a", "b", "a", "b", "a", "b"]


def test_waiting_is_counted_by_each_organizations_subject_of_the_pool() -> None:
    subjects = {
        dispatch_subject("default", "acme"): 3,
        dispatch_subject("default", "beta"): 1,
        dispatch_subject("default"): 2,  # before organizations took turns
        dispatch_subject("gpu", "acme"): 9,  # another pool's
    }
    counts = Waiting.of(subjects, dispatch_subject("default")).counts
    assert counts == {"acme": 3, "beta": 1, "": 2}


@pytest.mark.parametrize("text", ["acme", "acme=", "acme=0", "acme=x", "=2", "a=1001"])
def test_a_weight_that_is_not_one_refuses_to_start(text: str) -> None:
    with pytest.raises(ValueError):
        parse_weights(text)
    assert parse_weights(" acme=3, beta=1 ") == {"acme": 3, "beta": 1}


def test_the_fair_share_settings_are_checked_before_anything_starts() -> None:
    def opts(*argv: str) -> Options:
        o = options(parser().parse_args(["executor", *argv]))
        o.check()
        return o

    o = opts("--concurrency", "4", "--org-weights", "acme=3", "--org-max-phases", "2")
    assert (o.concurrency, o.org_weights, o.org_max_phases) == (4, "acme=3", 2)
    for argv, said in [
        (["--org-weights", "acme"], "--org-weights: 'acme' is not org=weight"),
        (["--concurrency", "0"], "--concurrency wants 1 to 256"),
        (["--org-max-phases", "3", "--concurrency", "2"], "--org-max-phases wants 0"),
    ]:
        with pytest.raises(ConfigError, match=said):
            opts(*argv)


def test_an_executor_keeps_a_slot_for_the_next_organization_only_while_one_is_active() -> None:
    slots = Slots(concurrency=3)
    slots.saw(["acme"], now=0)
    for _ in range(3):
        assert slots.room("acme", now=1)
        slots.took("acme")
    assert not slots.room("acme", now=1)  # every slot taken: a single tenant uses them all
    slots.gave_back("acme")
    slots.saw(["acme", "beta"], now=2)
    assert not slots.room("acme", now=3)  # beta is active: acme keeps to 2 of 3
    assert slots.room("beta", now=3)
    assert slots.room("acme", now=2 + ACTIVE_FOR + 1)  # beta long gone
    fixed = Slots(concurrency=3, max_phases=1)
    fixed.took("acme")
    assert not fixed.room("acme", now=0) and fixed.room("beta", now=0)


# ---------------------------------------------------------------- the flood


async def _planned_in(plane: Plane, ws: str, org: str) -> float:
    started = time.monotonic()
    run_id = await plane.start(ws, "plan", org=org)
    done = await plane.reaches(ws, run_id, "planned", "failed", org=org)
    assert done.status == "planned", done.error_message
    envs = await plane.app.store.read(f"rp.run.{org}.{ws}.{run_id}")
    t0 = envs[0].time
    print(
        [
            (type(e.event).__name__, round((e.time - t0).total_seconds(), 2))
            for e in envs
            if e.time and t0
        ]
    )
    return time.monotonic() - started


@pytest.mark.terraform
async def test_one_organizations_flood_leaves_anothers_plan_within_twice_its_quiet_time(
    plane: Plane, repo: Path
) -> None:
    """Org A queues 40 speculative plans on a pool of two slots; org B's next plan takes
    at most twice what it takes on a quiet pool, and overtakes most of A's backlog."""
    commit(repo, {"main.tf": TWO})
    assert (await plane.http.post("/api/v1/orgs", json={"name": "beta"})).status == 201
    await api_workspace(plane.http, repo, settings={"speculative_plans": True})
    await api_workspace(plane.http, repo, org="beta")
    ex = bootstrap_support.executor(
        plane.system, work_dir=plane.root / "e1", executor_id="e1", concurrency=2
    )
    await plane.stack.enter_async_context(ex)
    await _planned_in(plane, "net", "beta")  # providers installed, caches warm
    quiet = min([await _planned_in(plane, "net", "beta") for _ in range(2)])

    flood = [await plane.start("net", "plan", org="acme") for _ in range(40)]
    for run_id in flood[:2]:  # both slots taken by A
        await plane.reaches("net", run_id, "planning", "planned", org="acme")
    loaded = await _planned_in(plane, "net", "beta")

    states = [await plane.run("net", run_id, org="acme") for run_id in flood]
    behind = [s for s in states if not s.terminal]
    assert loaded <= 2 * quiet, f"quiet {quiet:.2f}s, under A's flood {loaded:.2f}s"
    assert len(behind) >= 30, f"B overtook only {40 - len(behind)} of A's plans"
    print(f"org B's plan: quiet {quiet:.2f}s, under a 40-plan flood {loaded:.2f}s")
