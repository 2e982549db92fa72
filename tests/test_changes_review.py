"""The change review without I/O: `terraform show -json` in, masked changes and review
groups out. Records have the shapes Terraform 1.0.3 printed for the fake provider."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from events.values import SENSITIVE, AttributeChange, ResourceChange
from executor import changes
from executor import terraform as tf
from executor.changes import UNKNOWN, action_of, mask, plan_changes, render_path, with_unknown
from projections.changes import review

CANARY = "canary-6f1d2b"


def rc(address: str, actions: list[str], **change: Any) -> dict[str, Any]:
    """A `resource_changes` entry of `terraform show -json`."""
    kind, name = address.split(".")[-2:]
    return {
        "address": address,
        "type": kind,
        "name": name,
        "change": {"actions": actions, **change},
    }


# ---------------------------------------------------------------- change review


@pytest.mark.parametrize(
    ("actions", "word"),
    [
        (["create"], "create"),
        (["update"], "update"),
        (["delete"], "delete"),
        (["delete", "create"], "replace"),
        (["create", "delete"], "replace"),
        (["read"], "read"),
        (["no-op"], "no-op"),
        (["forget"], "forget"),
    ],
)
def test_terraform_actions_map_to_one_word(actions: list[str], word: str) -> None:
    assert action_of(actions) == word


def test_a_replacement_names_what_forces_it_and_unknowns_say_so() -> None:
    """replace_paths become text; the forcing attribute is flagged; a computed id reads
    `(known after apply)`; unchanged attributes are left out."""
    item = rc(
        "fake_thing.rep",
        ["delete", "create"],
        before={"id": "rep1", "name": "rep1", "value": "x", "tags": None},
        after={"name": "rep2", "value": "x", "tags": None},
        after_unknown={"id": True},
        replace_paths=[["name"]],
    )
    (change,) = plan_changes({"resource_changes": [item]})
    assert change == ResourceChange(
        address="fake_thing.rep",
        type="fake_thing",
        name="rep",
        action="replace",
        replace_paths=["name"],
        attributes=[
            AttributeChange(name="id", before="rep1", after=UNKNOWN),
            AttributeChange(name="name", before="rep1", after="rep2", forces_replacement=True),
        ],
    )


def test_no_op_changes_are_left_out_and_modules_kept() -> None:
    items = [
        rc("fake_thing.same", ["no-op"], before={"a": 1}, after={"a": 1}),
        {
            **rc("module.m.fake_thing.x", ["create"], before=None, after={"a": 1}),
            "module_address": "module.m",
        },
    ]
    (change,) = plan_changes({"resource_changes": items})
    assert (change.address, change.module, change.action) == (
        "module.m.fake_thing.x",
        "module.m",
        "create",
    )
    assert change.attributes == [AttributeChange(name="a", before=None, after=1)]


def test_sensitive_values_are_masked_whole_and_nested() -> None:
    """Marked values, top-level or inside a map, are `(sensitive)` before and after; the
    clear value appears nowhere in the encoded change."""
    item = rc(
        "fake_thing.s",
        ["update"],
        before={"secret": CANARY + "-old", "tags": {"k": CANARY, "env": "dev"}},
        after={"secret": CANARY, "tags": {"k": CANARY + "2", "env": "prod"}},
        before_sensitive={"secret": True, "tags": {"k": True}},
        after_sensitive={"secret": True, "tags": {"k": True}},
    )
    (change,) = plan_changes({"resource_changes": [item]})
    assert change.attributes == [
        AttributeChange(name="secret", before=SENSITIVE, after=SENSITIVE),
        AttributeChange(
            name="tags",
            before={"k": SENSITIVE, "env": "dev"},
            after={"k": SENSITIVE, "env": "prod"},
        ),
    ]
    assert CANARY.encode() not in msgspec.json.encode(change)


def test_a_wholly_sensitive_object_and_lists_are_masked() -> None:
    assert mask({"a": 1}, True) == SENSITIVE
    assert mask([1, CANARY, {"x": CANARY}], [False, True, {"x": True}]) == [
        1,
        SENSITIVE,
        {"x": SENSITIVE},
    ]
    assert mask("plain", None) == "plain"


def test_unknown_parts_are_marked_inside_maps_and_lists() -> None:
    assert with_unknown({"a": 1}, {"b": True}) == {"a": 1, "b": UNKNOWN}
    assert with_unknown(None, [False, True]) == [None, UNKNOWN]
    assert with_unknown("x", {}) == "x"


def test_an_unknown_sensitive_value_stays_sensitive() -> None:
    item = rc(
        "fake_thing.s",
        ["create"],
        before=None,
        after={},
        after_unknown={"secret": True},
        after_sensitive={"secret": True},
    )
    (change,) = plan_changes({"resource_changes": [item]})
    assert change.attributes == [AttributeChange(name="secret", before=None, after=SENSITIVE)]


def test_large_values_and_plans_are_bounded_for_the_event() -> None:
    """A huge value is replaced by its size; a plan too large for one event keeps its
    addresses, actions and replace_paths but loses its attributes."""
    big = "x" * (changes.VALUE_LIMIT + 1)
    (one,) = plan_changes(
        {"resource_changes": [rc("t.big", ["create"], before=None, after={"v": big})]}
    )
    assert one.attributes[0].after == f"({changes.VALUE_LIMIT + 3} bytes, too large to show)"
    many = [
        rc(
            f"t.r{i}",
            ["delete", "create"],
            before={"v": "a" * 4000},
            after={"v": "b"},
            replace_paths=[["v"]],
        )
        for i in range(300)
    ]
    got = plan_changes({"resource_changes": many})
    assert len(got) == 300 and all(c.attributes == [] and c.replace_paths == ["v"] for c in got)


@pytest.mark.parametrize(
    ("path", "text"),
    [
        (["ami"], "ami"),
        (["tags", "name"], "tags.name"),
        (["ingress", 0, "cidr"], "ingress[0].cidr"),
    ],
)
def test_replace_paths_render_as_text(path: list[Any], text: str) -> None:
    assert render_path(path) == text


def test_a_drift_run_lists_resource_drift() -> None:
    show = {
        "resource_changes": [],
        "resource_drift": [
            rc("fake_thing.d", ["update"], before={"value": "a"}, after={"value": "b"})
        ],
    }
    assert plan_changes(show) == []
    (change,) = plan_changes(show, drift=True)
    assert (change.action, change.attributes[0].after) == ("update", "b")


def test_review_groups_in_reading_order_and_counts_replacements_apart() -> None:
    actions = ["create", "update", "replace", "delete", "create", "update", "read"]
    items = [{"address": f"t.r{i}", "action": a} for i, a in enumerate(actions)]
    got = review(items)
    assert got["summary"] == {"delete": 1, "replace": 1, "update": 2, "create": 2}
    assert got["summary_text"] == "1 delete · 1 replace · 2 update · 2 create"
    assert [(g["action"], g["title"], g["count"]) for g in got["groups"]] == [
        ("delete", "will be deleted", 1),
        ("replace", "will be replaced", 1),
        ("update", "will be updated", 2),
        ("create", "will be created", 2),
    ]
    assert [i["address"] for i in got["groups"][3]["items"]] == ["t.r0", "t.r4"]
    assert review([])["summary_text"] == "no changes" and review([])["groups"] == []


# ---------------------------------------------------------------- provider mirrors


def test_providers_of_other_hosts_in_a_mirror_are_never_fetched_directly(tmp_path: Path) -> None:
    """Terraform would query `runplane.test` and fail offline if `direct` could take it."""
    (tmp_path / "m" / "runplane.test" / "test" / "fake" / "1.0.0").mkdir(parents=True)
    (tmp_path / "m" / "registry.terraform.io" / "hashicorp" / "null").mkdir(parents=True)
    text = tf.cli_config_text([tmp_path / "m"])
    patterns = json.dumps(["registry.terraform.io/*/*", "runplane.test/test/fake"])
    assert f"include = {patterns}" in text
    assert f"exclude = {patterns}" in text
