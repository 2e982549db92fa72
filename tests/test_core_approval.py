"""The approval rule and organization groups, pure: who may approve or discard, what an
approval must acknowledge, and groups given / when / then."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from events import approval, org
from events.approval import Caller
from events.errors import AlreadyExists, Forbidden, Invalid, NotFound
from events.groups import CreateGroup, GroupSet, SetGroupMembers
from events.org import OrgCreated
from events.values import ResourceChange, Snapshot
from tests.gwt import NOW, Aggregate, given

ORG = Aggregate(initial=org.INITIAL, decide=org.decide, evolve=org.evolve)
CREATED = OrgCreated(at=NOW - timedelta(days=1), actor="admin", name="acme")
GROUPS = {"ops": ("bob",)}


def snap(**values: Any) -> Snapshot:
    return Snapshot(settings={k: {"value": v, "origin": "workspace"} for k, v in values.items()})


def check(caller: Caller, snapshot: Snapshot | None, action: Any = "approve") -> None:
    approval.check(action, caller, creator="carol", snapshot=snapshot, groups=GROUPS)


@pytest.mark.parametrize("role", ["operator", "approver", "admin"])
def test_with_no_approvers_set_any_operator_or_above_may_approve(role: str) -> None:
    check(Caller(user="zed", role=role), None)
    check(Caller(user="zed", role=role), snap(approvers=[]), "discard")


def test_with_no_approvers_set_a_viewer_is_refused_with_the_role_it_needs() -> None:
    with pytest.raises(Forbidden, match=r"role viewer may not discard.*needs operator"):
        check(Caller(user="zed", role="viewer"), None, "discard")


@pytest.mark.parametrize("user", ["alice", "bob"])
def test_listed_people_and_group_members_may_approve_whatever_their_role(user: str) -> None:
    check(Caller(user=user, role="operator"), snap(approvers=["alice", "group:ops"]))


def test_an_unlisted_user_is_refused_even_with_the_admin_role() -> None:
    with pytest.raises(Forbidden, match="zed is not among the workspace's approvers"):
        check(Caller(user="zed", role="admin"), snap(approvers=["alice", "group:ops"]))


def test_the_admin_token_bypasses_approvers_but_not_four_eyes() -> None:
    admin = Caller(user="admin", role="admin", superuser=True)
    check(admin, snap(approvers=["alice"]))
    with pytest.raises(Forbidden, match="four_eyes"):
        approval.check("approve", admin, creator="admin", snapshot=snap(four_eyes=True), groups={})


def test_four_eyes_refuses_the_creators_approval_not_their_discard() -> None:
    carol = Caller(user="carol", role="approver")
    with pytest.raises(Forbidden, match="carol created this run"):
        check(carol, snap(four_eyes=True))
    check(carol, snap(four_eyes=True), "discard")
    check(carol, snap(four_eyes=False))


CHANGES = [
    ResourceChange(address="a.x", type="a", action="create"),
    ResourceChange(address="a.y", type="a", action="delete"),
    ResourceChange(address="a.z", type="a", action="replace"),
    ResourceChange(address="a.w", type="a", action="update"),
]


def test_confirm_destructive_lists_unacknowledged_deletions_and_replacements() -> None:
    on = snap(confirm_destructive=True)
    assert approval.missing(on, CHANGES, []) == ["a.y", "a.z"]
    assert approval.missing(on, CHANGES, ["a.z", "a.x"]) == ["a.y"]
    assert approval.missing(on, CHANGES, ["a.y", "a.z"]) == []
    assert approval.missing(None, CHANGES, []) == []  # off by default


def test_a_setting_falls_back_to_its_default_and_reads_bare_old_values() -> None:
    assert approval.setting(None, "require_approval") is True
    assert (
        approval.setting(Snapshot(settings={"require_approval": False}), "require_approval")
        is False
    )
    assert approval.setting(snap(require_approval=False), "require_approval") is False


def test_a_group_is_created_then_its_members_replaced() -> None:
    state = (
        given(ORG, CREATED)
        .when(CreateGroup(actor="admin", name="ops", members=["bob", "amy", "bob"]))
        .then(GroupSet(at=NOW, actor="admin", name="ops", members=["bob", "amy"]))
    )
    assert state.groups == {"ops": ("bob", "amy")}
    replaced = (
        given(ORG, CREATED, GroupSet(at=NOW, actor="admin", name="ops", members=["bob"]))
        .when(SetGroupMembers(actor="admin", name="ops", members=["cy"]))
        .then(GroupSet(at=NOW, actor="admin", name="ops", members=["cy"]))
    )
    assert replaced.groups == {"ops": ("cy",)}


def test_group_refusals_name_the_problem() -> None:
    ops = GroupSet(at=NOW, actor="admin", name="ops", members=[])
    given(ORG, CREATED, ops).when(CreateGroup(actor="a", name="ops")).then_error(AlreadyExists)
    given(ORG, CREATED).when(SetGroupMembers(actor="a", name="x", members=[])).then_error(NotFound)
    given(ORG, CREATED).when(CreateGroup(actor="a", name="Ops")).then_error(Invalid)
    given(ORG).when(CreateGroup(actor="a", name="ops")).then_error(NotFound)
