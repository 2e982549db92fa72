"""A CLI push cut short between its event and its head move is what the next run plans on.

The TFE API records `ws.state_pushed` before it moves the state head
(services/surfaces/tfe/state_push.py). If the api dies in between, the workspace is unlocked
later and a runplane run is the next reader: its executor's state backend promotes the
pending version because its event names the head it replaced, so the run plans on the
state the user pushed, not the one before it. Real nats-server, real Terraform.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from events.run import Workspace
from executor.statestore import StateStore
from services.surfaces.tfe.state_push import push_command
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.state_support import current_state

pytestmark = pytest.mark.terraform

TWO = {"main.tf": 'resource "null_resource" "hello" {\n  count = 2\n}\n'}


async def test_a_run_plans_on_a_cli_push_whose_head_move_a_crash_cut_short(
    plane: Plane, repo: Path
) -> None:
    commit(repo, TWO)
    await plane.app.create_workspace("acme", "net", Workspace(repository=str(repo)), "admin")
    await plane.executor("ex1")
    run1 = await plane.start("net")
    await plane.reaches("net", run1, "awaiting_approval")
    await plane.approve(run1)
    await plane.reaches("net", run1, "applied")
    states = StateStore(plane.nc.jetstream(), plane.keyring)
    head, _ = await states.head("acme", "net")
    state = await current_state(plane.nc, plane.keyring, "acme", "net")
    assert head is not None and state is not None

    # alice's CLI pushes a state with one of the two instances gone (`terraform state
    # rm`): sealed, pending, recorded; the api dies before the head moves
    state["serial"] += 1
    state["resources"][0]["instances"] = state["resources"][0]["instances"][:1]
    await plane.app.lock_workspace("acme", "net", "Locked by Terraform", "alice")
    version = await states.put_version("acme", "net", json.dumps(state).encode())
    await states.mark_pending("acme", "net", version)
    push = push_command(version, "alice", head.object)
    await plane.app.record_state_push("acme", "net", push)
    await plane.app.unlock_workspace("acme", "net", "alice", admin=True)

    # the next run's plan reads the pushed state: one instance to create again
    run2 = await plane.start("net")
    planned = await plane.reaches("net", run2, "awaiting_approval", "no_changes", "failed")
    assert planned.status == "awaiting_approval", planned
    assert planned.plan_summary is not None and planned.plan_summary.add == 1
    moved, _ = await states.head("acme", "net")
    assert moved is not None and moved.object == version.object
