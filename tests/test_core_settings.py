"""Inherited settings: nearest level wins, every value records its origin."""

from __future__ import annotations

import pytest

from events.errors import Invalid
from events.settings import SPECS, effective, merge, validate, values


def test_every_setting_has_its_default_and_origin_default_when_nothing_is_set() -> None:
    resolved = effective([])
    assert set(resolved) == set(SPECS)
    assert resolved["require_approval"] == {"value": True, "origin": "default"}
    assert resolved["confirm_destructive"] == {"value": False, "origin": "default"}
    assert resolved["heartbeat_timeout"] == {"value": 600, "origin": "default"}


def test_the_nearest_level_wins_and_names_its_origin() -> None:
    resolved = effective(
        [
            ("org", {"confirm_destructive": True, "run_timeout": 3600, "four_eyes": True}),
            ("folder:platform", {"run_timeout": 1800}),
            ("folder:platform/network", {"four_eyes": False}),
            ("workspace", {"require_approval": False}),
        ]
    )
    assert resolved["confirm_destructive"] == {"value": True, "origin": "org"}
    assert resolved["run_timeout"] == {"value": 1800, "origin": "folder:platform"}
    assert resolved["four_eyes"] == {"value": False, "origin": "folder:platform/network"}
    assert resolved["require_approval"] == {"value": False, "origin": "workspace"}
    assert values(resolved)["executor_pool"] == "default"


def test_unsetting_a_value_falls_back_to_the_outer_level() -> None:
    ws = merge({"run_timeout": 60}, validate({"run_timeout": None}))
    assert ws == {}
    assert effective([("org", {"run_timeout": 90}), ("workspace", ws)])["run_timeout"] == {
        "value": 90,
        "origin": "org",
    }


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"nope": 1}, "unknown setting 'nope'"),
        ({"require_approval": "yes"}, "require_approval must be true or false"),
        ({"heartbeat_timeout": 0}, "heartbeat_timeout must be at least 1 second"),
        ({"run_timeout": -5}, "run_timeout must be a whole number"),
        ({"run_timeout": True}, "run_timeout must be a whole number"),
        ({"approvers": ["alice", "group:Ops"]}, "approvers has an invalid entry 'group:Ops'"),
        ({"approvers": "alice"}, "approvers must be a list"),
        ({"executor_pool": "GPU pool"}, "executor_pool must be a lowercase name"),
    ],
)
def test_bad_settings_are_refused_with_every_reason(patch: dict[str, object], needle: str) -> None:
    with pytest.raises(Invalid, match=needle):
        validate(patch)


def test_good_settings_pass_validation_unchanged() -> None:
    patch = {"approvers": ["alice", "group:ops"], "executor_pool": "gpu-1", "four_eyes": True}
    assert validate(patch) == patch
