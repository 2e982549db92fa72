"""Queue invariants replayed from the event history alone (the whole RP_EVENTS stream, in
stream order): per-workspace FIFO admission and at most one active run per workspace at
every instant. Used by the concurrency and stateful tests; holds no tests itself."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from events import run as R
from events import workspace as W
from infra.eventstore import EventStore

# Past `pending` and not terminal: the run holds its workspace.
ACTIVE = frozenset(R.Status) - R.TERMINAL - {R.Status.PENDING}


@dataclass
class Replay:
    """What the replay saw, per workspace (`<org>.<ws>`)."""

    enqueued: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    admitted: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    status: dict[str, R.Status] = field(default_factory=dict)  # run -> last status
    events: int = 0
    max_active: int = 0


def _ws_key(subject: str) -> str:
    parts = subject.split(".")  # rp.run.<org>.<ws>.<run> / rp.ws.<org>.<ws>
    return f"{parts[2]}.{parts[3]}"


def replay(envs: Iterable[Any]) -> Replay:
    """Replay envelopes in stream order; raise AssertionError at the first violation.

    Two independent views are checked at every event:
    - the runs' own events (folded with the core's `evolve`): never two runs of a
      workspace past `pending` and non-terminal at once; a run reaches `queued` only as
      the oldest of its workspace's still-waiting runs, and never while it is locked;
    - the workspace's queue events: `ws.run_admitted` names the head of the waiting runs
      (enqueued, neither admitted nor released), and no run is admitted while another is.
    """
    out = Replay()
    runs: dict[str, R.RunState] = {}
    active: dict[str, set[str]] = defaultdict(set)  # from run events
    ws_active: dict[str, str] = {}  # from workspace events
    gone: set[str] = set()  # released (terminal) runs
    locked: dict[str, bool] = defaultdict(bool)
    for env in envs:
        out.events += 1
        subject, ev = env.subject, env.event
        if subject.startswith("rp.org."):
            continue
        key = _ws_key(subject)
        if subject.startswith("rp.ws."):
            if isinstance(ev, W.RunEnqueued):
                assert ev.run_id not in out.enqueued[key], f"{ev.run_id} enqueued twice"
                out.enqueued[key].append(ev.run_id)
            elif isinstance(ev, W.RunAdmitted):
                assert not ws_active.get(key), (
                    f"seq {env.seq}: {ev.run_id} admitted while {ws_active[key]} active in {key}"
                )
                assert not locked[key], f"seq {env.seq}: {ev.run_id} admitted while {key} locked"
                waiting = [
                    r for r in out.enqueued[key] if r not in gone and r not in out.admitted[key]
                ]
                assert waiting and waiting[0] == ev.run_id, (
                    f"seq {env.seq}: {ev.run_id} admitted in {key} before {waiting[:1]}"
                )
                out.admitted[key].append(ev.run_id)
                ws_active[key] = ev.run_id
            elif isinstance(ev, W.RunReleased):
                gone.add(ev.run_id)
                if ws_active.get(key) == ev.run_id:
                    ws_active[key] = ""
            elif isinstance(ev, W.WorkspaceLocked):
                locked[key] = True
            elif isinstance(ev, W.WorkspaceUnlocked):
                locked[key] = False
            continue
        run_id = subject.split(".")[4]
        before = runs.get(run_id, R.INITIAL)
        after = R.evolve(before, ev)
        runs[run_id] = after
        assert after.status is not None
        out.status[run_id] = after.status
        if after.speculative:
            continue  # a speculative plan neither waits for its workspace nor holds it
        if before.status == R.Status.PENDING and after.status == R.Status.QUEUED:
            # admitted: its workspace admitted it just before (`ws.run_admitted`, then this)
            assert out.admitted[key] and out.admitted[key][-1] == run_id, (
                f"seq {env.seq}: {run_id} queued without being admitted on {key}"
            )
        if after.status in ACTIVE:
            active[key].add(run_id)
        else:
            active[key].discard(run_id)
        assert len(active[key]) <= 1, f"seq {env.seq}: {sorted(active[key])} active in {key}"
        out.max_active = max(out.max_active, len(active[key]))
    for key, admitted in out.admitted.items():
        order = [r for r in out.enqueued[key] if r in set(admitted)]
        assert admitted == order, f"{key}: admission order differs from enqueue order"
    return out


async def replay_stream(store: EventStore) -> Replay:
    """Read the whole RP_EVENTS stream, in order, and replay it."""
    return replay(await store.read("rp.>"))
