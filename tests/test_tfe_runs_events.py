"""A CLI run's source and options in `run.created`: encoded, folded, validated, and turned
into Terraform's arguments (events/values.py, executor/terraform.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from events import access
from events.codec import decode, encode
from events.errors import Invalid
from events.run import (
    INITIAL,
    Cause,
    ConfigSource,
    CreateRun,
    RunCreated,
    RunOptions,
    RunState,
    Snapshot,
    Status,
    Workspace,
    decide,
    fold,
)
from executor import terraform as tf
from services.app.commands import App
from services.surfaces.api.auth import Principal
from services.surfaces.tfe import logs
from services.surfaces.tfe.run_view import render_run

AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SOURCE = ConfigSource(id="cv-acme.net.01jz", object="config/acme/net/cv.tgz", digest="ab" * 32)
OPTIONS = RunOptions(
    refresh=False,
    targets=['module.m["k"].null_resource.a[0]'],
    replaces=["null_resource.b"],
    variables={"region": '"eu-west-1"'},
)


def _create(**kw: object) -> CreateRun:
    fields: dict[str, object] = {
        "actor": "alice",
        "run_id": "r1",
        "org": "acme",
        "workspace": "net",
        "run_type": "apply",
        "config": Workspace(repository="runplane-cli://configuration-upload"),
        "cause": Cause(kind="cli", user="alice"),
    }
    return CreateRun(**{**fields, **kw})  # type: ignore[arg-type]


def test_source_and_options_round_trip_and_fold() -> None:
    events = decide(INITIAL, _create(source=SOURCE, options=OPTIONS), now=AT, new_id=lambda: "x")
    (created,) = events
    assert isinstance(created, RunCreated)
    again = decode(encode(created))
    assert again == created
    state = fold([again])
    assert (state.source, state.options) == (SOURCE, OPTIONS)


def test_an_older_run_created_decodes_without_them() -> None:
    stored = (
        b'{"type":"run.created","at":"2025-01-02T03:04:05Z","actor":"alice","run_id":"r",'
        b'"org":"acme","workspace":"net","run_type":"plan","config":{"repository":"r"}}'
    )
    event = decode(stored)
    assert isinstance(event, RunCreated)
    assert (event.source, event.options) == (None, None)


@pytest.mark.parametrize(
    "options",
    [
        RunOptions(targets=["-destroy"]),
        RunOptions(targets=["null_resource.a -lock=false"]),
        RunOptions(replaces=["a.b\n-auto-approve"]),
        RunOptions(targets=['a.b["x\\"]']),
        RunOptions(targets=["a.b"] * 101),
        RunOptions(refresh_only=True, replaces=["a.b"]),
        RunOptions(refresh_only=True, refresh=False),
        RunOptions(variables={"-var": "1"}),
        RunOptions(variables={"a b": "1"}),
    ],
)
def test_options_that_are_not_addresses_or_names_are_refused(options: RunOptions) -> None:
    with pytest.raises(Invalid):
        decide(INITIAL, _create(options=options), now=AT, new_id=lambda: "x")
    with pytest.raises(ValueError):  # and again before argv, whatever the event says
        tf.plan_args("apply", options=options)


def test_options_become_separate_arguments() -> None:
    args = tf.plan_args("apply", options=OPTIONS)
    assert args[-4:] == [
        "-refresh=false",
        '-target=module.m["k"].null_resource.a[0]',
        "-replace=null_resource.b",
        f"-var-file={tf.RUN_VARS_FILE}",
    ]
    assert "-refresh-only" in tf.plan_args("plan", options=RunOptions(refresh_only=True))
    assert tf.plan_args("drift", options=RunOptions(refresh_only=True)).count("-refresh-only") == 1
    assert tf.plan_args("destroy", options=None) == tf.plan_args("destroy")


def test_run_variables_file_is_one_assignment_a_line() -> None:
    text = tf.run_variables_file({"b": "2", "a": '"x"'}).decode()
    assert text == 'a = "x"\nb = 2\n'


# ---------------------------------------------------------------- the CLI's "yes"


def _waiting(**settings: object) -> RunState:
    snapshot = Snapshot(
        settings={k: {"value": v, "origin": "workspace"} for k, v in settings.items()}
    )
    return RunState(
        run_id="r1",
        org="acme",
        workspace="net",
        run_type="apply",
        status=Status.AWAITING_APPROVAL,
        created_by="alice",
        snapshot=snapshot,
        planned=True,
        has_changes=True,
        destructive=["null_resource.a"],
    )


@pytest.mark.parametrize(
    ("settings", "who", "confirmable", "note"),
    [
        ({}, "alice", True, ""),
        ({"four_eyes": True}, "alice", False, "four_eyes is on"),
        ({"four_eyes": True}, "bob", True, "four_eyes is on"),
        ({"confirm_destructive": True}, "alice", False, "confirm_destructive is on"),
        ({"approvers": ["carol"]}, "alice", False, ""),
    ],
)
async def test_the_cli_may_confirm_only_what_runplanes_rule_would_take(
    app: App, settings: dict[str, object], who: str, confirmable: bool, note: str
) -> None:
    """`is-confirmable` (the CLI asks "yes" only then) is the approval rule applied to
    the caller; a plan the CLI cannot approve ends its log saying why."""
    await app.create_org("acme", "test")
    s = _waiting(**settings)
    caller = Principal(
        user=who, role="admin", org="acme", access=access.for_role("acme", who, "admin")
    )
    doc = await render_run(app, s, caller, level=access.ADMIN)
    assert doc["attributes"]["actions"]["is-confirmable"] is confirmable
    assert doc["attributes"]["permissions"]["can-apply"] is confirmable
    assert doc["attributes"]["status"] == "planned"
    text = logs._waiting_note(s).decode()
    assert (note in text) if note else text == "", text
