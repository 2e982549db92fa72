"""Folders and inherited settings in the pure core, given / when / then: folders nest
under existing parents only, names are unique per organization, settings patches are
validated with every reason named, and resolution names the nearest level as origin."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from events import inherit, org
from events import workspace as ws_agg
from events.errors import AlreadyExists, Invalid, NotFound
from events.folder import (
    MAX_DEPTH,
    CreateFolder,
    FolderCreated,
    FolderSettingsSet,
    OrgSettingsSet,
    SetFolderSettings,
    SetOrgSettings,
    path,
)
from events.org import OrgCreated
from events.run import INITIAL as RUN_INITIAL
from events.run import RunCreated, RunQueued, Snapshot, Workspace
from events.run import evolve as run_evolve
from events.values import pinned_config
from tests.gwt import NOW, Aggregate, given

ORG = Aggregate(initial=org.INITIAL, decide=org.decide, evolve=org.evolve)
WS = Aggregate(initial=ws_agg.INITIAL, decide=ws_agg.decide, evolve=ws_agg.evolve)
BEFORE = NOW - timedelta(days=1)
CREATED = OrgCreated(at=BEFORE, actor="alice", name="acme")
PLATFORM = FolderCreated(at=BEFORE, actor="alice", name="platform")
NETWORK = FolderCreated(at=BEFORE, actor="alice", name="network", parent="platform")
CONFIG = Workspace(repository="https://example.com/infra.git")


def folder(name: str, parent: str = "") -> CreateFolder:
    return CreateFolder(actor="alice", name=name, parent=parent)


def test_a_folder_is_created_at_the_top_and_another_nested_in_it() -> None:
    state = (
        given(ORG, CREATED)
        .when(folder("platform"))
        .then(FolderCreated(at=NOW, actor="alice", name="platform"))
    )
    state = (
        given(ORG, CREATED, PLATFORM)
        .when(folder("network", "platform"))
        .then(FolderCreated(at=NOW, actor="alice", name="network", parent="platform"))
    )
    assert path(state.folders, "network") == ["platform", "network"]
    assert list(state.folders) == ["platform", "network"]


def test_a_folder_name_is_unique_in_its_organization_whatever_the_parent() -> None:
    given(ORG, CREATED, PLATFORM, NETWORK).when(folder("network")).then_error(AlreadyExists)
    given(ORG, CREATED, PLATFORM).when(folder("platform", "platform")).then_error(AlreadyExists)


def test_a_parent_must_exist_first_so_no_cycle_can_form() -> None:
    given(ORG, CREATED).when(folder("network", "platform")).then_error(NotFound)


def test_folders_nest_at_most_max_depth_deep() -> None:
    chain = [FolderCreated(at=BEFORE, actor="a", name="f1")]
    for i in range(2, MAX_DEPTH + 1):
        chain.append(FolderCreated(at=BEFORE, actor="a", name=f"f{i}", parent=f"f{i - 1}"))
    deepest = given(ORG, CREATED, *chain)
    assert len(path(deepest.state.folders, f"f{MAX_DEPTH}")) == MAX_DEPTH
    deepest.when(folder("too-deep", f"f{MAX_DEPTH}")).then_error(Invalid)
    deepest.when(folder("fine", f"f{MAX_DEPTH - 1}")).then(
        FolderCreated(at=NOW, actor="alice", name="fine", parent=f"f{MAX_DEPTH - 1}")
    )


def test_folders_and_settings_need_the_organization() -> None:
    given(ORG).when(folder("platform")).then_error(NotFound)
    given(ORG).when(SetOrgSettings(actor="a", changes={"four_eyes": True})).then_error(NotFound)


def test_org_settings_are_recorded_as_a_patch_and_null_unsets_one() -> None:
    state = (
        given(ORG, CREATED)
        .when(SetOrgSettings(actor="alice", changes={"confirm_destructive": True}))
        .then(OrgSettingsSet(at=NOW, actor="alice", changes={"confirm_destructive": True}))
    )
    assert state.settings == {"confirm_destructive": True}
    unset = OrgSettingsSet(at=NOW, actor="bob", changes={"confirm_destructive": None})
    assert ORG.fold([unset], state).settings == {}


def test_a_bad_patch_is_refused_naming_every_reason() -> None:
    bad = {"nope": 1, "run_timeout": -5, "four_eyes": "yes"}
    error = given(ORG, CREATED).when(SetOrgSettings(actor="a", changes=bad)).then_error(Invalid)
    assert "unknown setting 'nope'" in str(error)
    assert "run_timeout" in str(error) and "four_eyes" in str(error)
    given(ORG, CREATED).when(SetOrgSettings(actor="a", changes={})).then_error(Invalid)


def test_folder_settings_need_an_existing_folder() -> None:
    cmd = SetFolderSettings(actor="a", folder="platform", changes={"run_timeout": 60})
    given(ORG, CREATED).when(cmd).then_error(NotFound)
    state = (
        given(ORG, CREATED, PLATFORM)
        .when(cmd)
        .then(FolderSettingsSet(at=NOW, actor="a", folder="platform", changes={"run_timeout": 60}))
    )
    assert state.folders["platform"].settings == {"run_timeout": 60}


def test_a_workspace_records_its_folder_and_its_own_settings() -> None:
    create = ws_agg.CreateWorkspace(
        actor="a", org="acme", name="net", config=CONFIG, folder="network"
    )
    created = ws_agg.WorkspaceCreated(
        at=NOW, actor="a", org="acme", name="net", config=CONFIG, folder="network"
    )
    state = given(WS).when(create).then(created)
    assert state.folder == "network"
    set_ = ws_agg.SetSettings(actor="a", changes={"require_approval": False})
    state = (
        given(WS, created)
        .when(set_)
        .then(ws_agg.SettingsSet(at=NOW, actor="a", changes={"require_approval": False}))
    )
    assert state.settings == {"require_approval": False}
    given(WS).when(set_).then_error(NotFound)
    given(WS, created).when(ws_agg.SetSettings(actor="a", changes={"x": 1})).then_error(Invalid)


def _three_levels() -> tuple[org.OrgState, ws_agg.WorkspaceState]:
    o = ORG.fold(
        [
            CREATED,
            PLATFORM,
            NETWORK,
            OrgSettingsSet(at=NOW, actor="a", changes={"confirm_destructive": True}),
            FolderSettingsSet(at=NOW, actor="a", folder="platform", changes={"run_timeout": 3600}),
            FolderSettingsSet(at=NOW, actor="a", folder="network", changes={"run_timeout": 900}),
        ]
    )
    w = WS.fold(
        [
            ws_agg.WorkspaceCreated(
                at=NOW, actor="a", org="acme", name="net", config=CONFIG, folder="network"
            ),
            ws_agg.SettingsSet(at=NOW, actor="a", changes={"require_approval": False}),
        ]
    )
    return o, w


def test_each_effective_value_comes_from_the_nearest_level_that_sets_it() -> None:
    o, w = _three_levels()
    got = inherit.for_workspace(o, w)
    assert got["confirm_destructive"] == {"value": True, "origin": "org"}
    assert got["run_timeout"] == {"value": 900, "origin": "folder:network"}
    assert got["require_approval"] == {"value": False, "origin": "workspace"}
    assert got["four_eyes"] == {"value": False, "origin": "default"}
    assert inherit.for_folder(o, "platform")["run_timeout"] == {
        "value": 3600,
        "origin": "folder:platform",
    }


def test_a_workspace_configs_own_timeouts_count_as_its_settings_and_settings_win() -> None:
    o = ORG.fold([CREATED, OrgSettingsSet(at=NOW, actor="a", changes={"heartbeat_timeout": 90})])
    cfg = Workspace(repository="r", dispatch_timeout=30)
    w = WS.fold([ws_agg.WorkspaceCreated(at=NOW, actor="a", org="acme", name="n", config=cfg)])
    got = inherit.for_workspace(o, w)
    assert got["heartbeat_timeout"] == {"value": 90, "origin": "org"}  # config at default
    assert got["dispatch_timeout"] == {"value": 30, "origin": "workspace"}
    w = WS.fold([ws_agg.SettingsSet(at=NOW, actor="a", changes={"dispatch_timeout": 5})], w)
    assert inherit.for_workspace(o, w)["dispatch_timeout"] == {"value": 5, "origin": "workspace"}


@pytest.mark.parametrize(
    "settings",
    [
        {"heartbeat_timeout": {"value": 7, "origin": "org"}, "dispatch_timeout": {"value": 3}},
        {"heartbeat_timeout": 7, "dispatch_timeout": 3},  # snapshots from before origins
    ],
)
def test_admission_pins_the_effective_timeouts_into_the_runs_config(
    settings: dict[str, Any],
) -> None:
    """run.queued's snapshot settings decide the timeouts the executor and reaper use."""
    created = RunCreated(
        at=NOW, actor="a", run_id="r", org="acme", workspace="n", run_type="plan", config=CONFIG
    )
    queued = RunQueued(at=NOW, actor="s", snapshot=Snapshot(commit="c", settings=settings))
    state = run_evolve(run_evolve(RUN_INITIAL, created), queued)
    assert state.config is not None
    assert (state.config.heartbeat_timeout, state.config.dispatch_timeout) == (7, 3)
    assert pinned_config(CONFIG, None) is CONFIG
    assert pinned_config(CONFIG, Snapshot(settings={})) is CONFIG
