"""Stack runs, the pure core (given / when / then): dependency order, destroy reversed,
targets with and without their dependencies, the failure policies, resume, and the
idempotence the crash-safe process rests on (a start or an end recorded twice, an end
before its start). Plus a golden history replayed to the state it had."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given as given_h
from hypothesis import settings
from hypothesis import strategies as st

from events import stack_runs as sr
from events import stacks as sk
from events.codec import decode, encode
from events.errors import IllegalTransition
from events.stack_run_events import (
    StackNodeEnded,
    StackNodesSkipped,
    StackNodeStarted,
    StackRunAborting,
    StackRunEnded,
    StackRunPaused,
    StackRunResumed,
    StackRunState,
    child_run_id,
    evolve,
)
from tests.gwt import NOW, Aggregate, given

SR = Aggregate(initial=sr.INITIAL, decide=sr.decide, evolve=evolve)
ID = "01jstackrun"
GOLDEN = Path(__file__).parent / "golden" / "stacks" / "stack-run-paused-resumed-completed.jsonl"

# A; B and C depend on A; D on B and C.
DIAMOND = sk.Definition(
    workspaces=["a", "b", "c", "d"],
    edges=[
        sk.Edge(source=s, target=t) for s, t in (("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"))
    ],
)


def created(run_type: str = "apply", policy: str = "pause", **kw: Any) -> Any:
    cmd = sr.CreateStackRun(
        actor="alice", stack_run_id=ID, org="acme", stack="prod", run_type=run_type,
        definition=DIAMOND, failure_policy=policy, **kw,
    )  # fmt: skip
    events = sr.decide(sr.INITIAL, cmd, now=NOW, new_id=lambda: "x")
    return events[0]


def rid(node: str, attempt: int = 1) -> str:
    return child_run_id(ID, node, attempt)


def start(node: str, attempt: int = 1, ended: str = "") -> sr.RecordStarted:
    return sr.RecordStarted(actor="p", node=node, run_id=rid(node, attempt), attempt=attempt,
                            ended_status=ended)  # fmt: skip


def end(node: str, status: str, attempt: int = 1) -> sr.RecordEnded:
    return sr.RecordEnded(actor="p", node=node, run_id=rid(node, attempt), run_status=status)


def run(history: list[Any], *commands: Any) -> list[Any]:
    """`history` and what each command decided, in order."""
    out = list(history)
    for c in commands:
        state = SR.fold(out)
        out += sr.decide(state, c, now=NOW, new_id=lambda: "x")
    return out


def ready(history: list[Any]) -> list[str]:
    return [n for n, _, _ in sr.ready(SR.fold(history))]


# ---------------------------------------------------------------- dependency order


def test_nodes_start_by_level_and_a_dependent_waits_for_every_prerequisite() -> None:
    h = [created()]
    assert ready(h) == ["a"]
    h = run(h, start("a"))
    assert ready(h) == []  # a runs
    h = run(h, end("a", "applied"))
    assert ready(h) == ["b", "c"]  # at once
    h = run(h, start("b"), start("c"), end("b", "applied"))
    assert ready(h) == []  # d waits for c too
    h = run(h, end("c", "no_changes"))
    assert ready(h) == ["d"]
    h = run(h, start("d"), end("d", "applied"))
    assert h[-1] == StackRunEnded(at=NOW, actor="p", status="completed")
    assert SR.fold(h).status == "completed"


def test_a_plan_only_stack_run_goes_on_after_planned_and_no_changes() -> None:
    h = run([created("plan")], start("a"), end("a", "planned"))
    assert ready(h) == ["b", "c"]
    h = run([created("apply")], start("a"), end("a", "planned"))  # an apply that only planned
    assert ready(h) == [] and SR.fold(h).status == "paused"


def test_a_destroy_goes_in_reverse_order() -> None:
    h = [created("destroy")]
    assert ready(h) == ["d"]
    h = run(h, start("d"), end("d", "applied"))
    assert ready(h) == ["b", "c"]
    h = run(h, start("b"), start("c"), end("b", "applied"), end("c", "applied"))
    assert ready(h) == ["a"]


def test_targets_bring_their_dependencies_unless_skip_dependencies() -> None:
    assert created(targets=["d"]).selected == ["a", "b", "c", "d"]
    assert created(targets=["b"]).selected == ["a", "b"]
    only = created(targets=["d"], skip_dependencies=True)
    assert only.selected == ["d"] and ready([only]) == ["d"]  # its prerequisites are not run
    # a destroy of a target takes what depends on it first
    assert created("destroy", targets=["b"]).selected == ["b", "d"]
    assert ready([created("destroy", targets=["b"])]) == ["d"]
    with pytest.raises(sk.InvalidStack):
        created(targets=["zz"])


# ---------------------------------------------------------------- failure policies


def _failed_c(policy: str) -> list[Any]:
    h = run([created(policy=policy)], start("a"), end("a", "applied"), start("b"), start("c"))
    return run(h, end("c", "failed"))


def test_pause_starts_nothing_new_lets_running_children_finish_and_stays_resumable() -> None:
    h = _failed_c("pause")
    assert StackRunPaused(at=NOW, actor="p", node="c") in h
    h = run(h, end("b", "applied"))
    s = SR.fold(h)
    assert s.status == "paused" and ready(h) == [] and s.nodes["d"].status == "waiting"


def test_abort_cancels_the_running_children_and_ends_aborted_once_none_runs() -> None:
    h = _failed_c("abort")
    assert StackRunAborting(at=NOW, actor="p", node="c", cancel=[rid("b")]) in h
    assert ready(h) == []
    h = run(h, end("b", "canceled"))
    assert h[-1] == StackRunEnded(at=NOW, actor="p", status="aborted")
    assert SR.fold(h).nodes["b"].status == "canceled"


def test_continue_skips_the_dependents_of_the_failed_node_and_the_rest_goes_on() -> None:
    d2 = sk.Definition(workspaces=[*DIAMOND.workspaces, "x"], edges=DIAMOND.edges)
    cmd = sr.CreateStackRun(actor="a", stack_run_id=ID, org="acme", stack="p", run_type="apply",
                            definition=d2, failure_policy="continue")  # fmt: skip
    h = sr.decide(sr.INITIAL, cmd, now=NOW, new_id=lambda: "x")
    assert ready(list(h)) == ["a", "x"]
    h = run(list(h), start("a"), start("x"), end("a", "failed"))
    assert StackNodesSkipped(at=NOW, actor="p", nodes=["b", "c", "d"], because_of="a") in h
    assert SR.fold(h).status == "running"  # x still runs
    h = run(h, end("x", "applied"))
    assert h[-1] == StackRunEnded(at=NOW, actor="p", status="failed")


# ---------------------------------------------------------------- resume


def test_resume_repeats_only_what_did_not_end_well_at_a_new_attempt() -> None:
    h = run(_failed_c("pause"), end("b", "applied"))
    h = run(h, sr.ResumeStackRun(actor="bob"))
    assert h[-1] == StackRunResumed(at=NOW, actor="bob", nodes=["c"])
    s = SR.fold(h)
    assert s.status == "running" and s.nodes["c"].attempt == 2 and s.resumes == 1
    assert sr.ready(s) == [("c", 2, rid("c", 2))]  # a new, linked run; a, b not repeated
    h = run(h, start("c", 2), end("c", "applied", 2))
    assert ready(h) == ["d"]
    h = run(h, start("d"), end("d", "applied"))
    s = SR.fold(h)
    assert s.status == "completed" and s.nodes["c"].runs == [rid("c"), rid("c", 2)]


def test_resuming_twice_starts_nothing_twice() -> None:
    h = run(_failed_c("pause"), end("b", "applied"), sr.ResumeStackRun(actor="bob"))
    given(SR, *h).when(sr.ResumeStackRun(actor="eve")).then_error(IllegalTransition)


def test_a_running_or_completed_stack_run_is_not_resumed() -> None:
    given(SR, created()).when(sr.ResumeStackRun(actor="bob")).then_error(IllegalTransition)
    given(SR).when(sr.ResumeStackRun(actor="bob")).then_error(IllegalTransition)


def test_an_aborted_and_a_failed_stack_run_can_be_resumed() -> None:
    aborted = run(_failed_c("abort"), end("b", "canceled"), sr.ResumeStackRun(actor="bob"))
    assert aborted[-1] == StackRunResumed(at=NOW, actor="bob", nodes=["b", "c"])
    assert ready(aborted) == ["b", "c"]


# ---------------------------------------------------------------- idempotence


def test_a_start_or_an_end_recorded_twice_decides_nothing_the_second_time() -> None:
    h = run([created()], start("a"))
    given(SR, *h).when(start("a")).then_nothing()
    h = run(h, end("a", "applied"))
    given(SR, *h).when(end("a", "applied")).then_nothing()
    # another attempt's run, or a run that is not the node's, decides nothing
    given(SR, *h).when(end("b", "failed", attempt=2)).then_nothing()
    bogus = sr.RecordStarted(actor="p", node="b", run_id="forged", attempt=1)
    given(SR, *h).when(bogus).then_nothing()


def test_an_end_delivered_before_its_start_was_recorded_records_both() -> None:
    h = [created()]
    got = sr.decide(SR.fold(h), end("a", "applied"), now=NOW, new_id=lambda: "x")
    assert [type(e) for e in got] == [StackNodeStarted, StackNodeEnded]
    assert ready([*h, *got]) == ["b", "c"]
    # and a start found ended by its creation records its end at once
    got = sr.decide(SR.fold(h), start("a", ended="failed"), now=NOW, new_id=lambda: "x")
    assert [type(e) for e in got] == [StackNodeStarted, StackNodeEnded, StackRunPaused]


def test_a_node_whose_run_cannot_be_made_fails_and_the_policy_applies() -> None:
    cant = sr.RecordEnded(actor="p", node="a", run_id="", reason="workspace a not found")
    h = run([created()], cant)
    s = SR.fold(h)
    assert s.nodes["a"].status == "failed" and s.status == "paused"


@settings(max_examples=200, deadline=None)
@given_h(st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from(
    ["start", "applied", "failed", "canceled", "resume"])), max_size=40))  # fmt: skip
def test_whatever_arrives_a_node_has_at_most_one_run_per_attempt_and_waits_for_its_own(
    steps: list[tuple[str, str]],
) -> None:
    """Any order of starts, ends (duplicated, early, of stale attempts) and resumes: a
    node never runs before its prerequisites succeeded, and each of its runs is its own
    attempt's."""
    h: list[Any] = [created()]
    for node, what in steps:
        s = SR.fold(h)
        attempt = s.nodes[node].attempt
        cmd: Any = end(node, what, attempt)
        if what in ("resume", "start"):
            cmd = sr.ResumeStackRun(actor="r") if what == "resume" else start(node, attempt)
        if what == "start" and node not in [n for n, _, _ in sr.ready(s)]:
            continue  # the process starts only what is ready
        try:
            h += sr.decide(s, cmd, now=NOW, new_id=lambda: "x")
        except IllegalTransition:
            pass
        s = SR.fold(h)
        for n, v in s.nodes.items():
            assert len(v.runs) == len(set(v.runs))
            assert set(v.runs) <= {rid(n, k) for k in range(1, 50)}
    _assert_order(h)


def _assert_order(h: list[Any]) -> None:
    """Every start came after each prerequisite's latest good end."""
    good: set[str] = set()
    pre = sk.prerequisites(DIAMOND)
    for e in h:
        if isinstance(e, StackNodeEnded):
            (good.add if e.outcome == "succeeded" else good.discard)(e.node)
        if isinstance(e, StackRunResumed):
            for n in e.nodes:
                good.discard(n)
        if isinstance(e, StackNodeStarted):
            assert set(pre[e.node]) <= good, (e.node, good)


# ---------------------------------------------------------------- golden history


def _golden_history() -> list[Any]:
    h = run(_failed_c("pause"), end("b", "applied"), sr.ResumeStackRun(actor="bob"))
    return run(h, start("c", 2), end("c", "applied", 2), start("d"), end("d", "applied"))


def test_a_recorded_stack_run_replays_to_the_state_it_had() -> None:
    """The stored bytes of a stack run that paused, was resumed and completed decode and
    fold to the very state recorded beside them (events change only by adding)."""
    lines = GOLDEN.read_bytes().splitlines()
    events = [decode(line) for line in lines]
    expected = json.loads(GOLDEN.with_suffix(".expected.json").read_text())
    state = sr.fold(events)  # type: ignore[arg-type]  # the file holds only stack run events
    assert json.loads(msgspec.json.encode(state)) == expected
    assert state.status == "completed" and state.resumes == 1
    # today's core decides the same history
    assert [encode(e) for e in _golden_history()] == lines


def write_golden() -> None:  # pragma: no cover - run by hand to record the golden file
    h = _golden_history()
    GOLDEN.write_bytes(b"\n".join(encode(e) for e in h) + b"\n")
    state: StackRunState = sr.fold(h)
    GOLDEN.with_suffix(".expected.json").write_text(
        json.dumps(json.loads(msgspec.json.encode(state)), indent=1, sort_keys=True) + "\n"
    )
