"""The event codec: every event round-trips, past JSON still decodes, stored events tolerate
fields they do not know, and ids are subject-safe tokens."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any, get_args

import msgspec
import pytest

from events import audit_stream as ads
from events import chat as ch
from events import codec, sso, vcs
from events import members as mb
from events import notification as nt
from events import run_triggers as rt
from events import schedule as sc
from events import stack_run_events as srv
from events import stacks as sk
from events import teams as tm
from events import vcs_report as vr
from events.codec import AnyEvent, decode, encode, tag_of, valid_id
from events.folder import FolderCreated, FolderSettingsSet, OrgSettingsSet
from events.groups import GroupSet
from events.org import OrgCreated, OrgEvent, TokenIssued, TokenRevoked, TokenUsed
from events.policies import PolicyDeleted, PolicySaved, PolicySet
from events.run import (
    ApplyFinished,
    CustomStepFinished,
    LogPruned,
    PhaseReleased,
    PhaseStarted,
    PlanFinished,
    PlanSummary,
    PrunedObject,
    ResourceStateChanged,
    RunApproved,
    RunCanceled,
    RunCreated,
    RunDiscarded,
    RunEvent,
    RunFailed,
    RunLimitExceeded,
    RunPinned,
    RunQueued,
    RunRemoved,
    RunStopRequested,
    Snapshot,
    StateVersionCreated,
    Status,
    StepFinished,
    StepStarted,
    Workspace,
)
from events.templates import Template, TemplateDeleted, TemplateSaved, TemplateStep
from events.workspace import (
    ConfigChanged,
    RunAdmitted,
    RunEnqueued,
    RunReleased,
    SettingsSet,
    StatePushed,
    VariablesSet,
    WorkspaceCreated,
    WorkspaceDeleted,
    WorkspaceEvent,
    WorkspaceLocked,
    WorkspacePurged,
    WorkspaceUnlocked,
)

AT = datetime(2025, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
CONFIG = Workspace(
    repository="https://git.example.com/acme/infra.git",
    branch="prod",
    directory="network",
    variables={"region": "eu-west-1"},
)
SUMMARY = PlanSummary(add=1, change=2, destroy=3)

SAMPLES: list[Any] = [
    RunCreated(
        at=AT,
        actor="alice",
        run_id="01jh0000000000000000000000",
        org="acme",
        workspace="network",
        run_type="apply",
        config=CONFIG,
        message="bump vpc",
    ),
    RunQueued(at=AT, actor="scheduler", phase="plan", pinning=True),
    RunPinned(at=AT, actor="scheduler", snapshot=Snapshot(commit="c0ffee")),
    PhaseStarted(at=AT, actor="exec-a", phase="plan", lease_id="lease-1", executor_id="exec-a"),
    PhaseReleased(
        at=AT,
        actor="executor:exec-a",
        phase="plan",
        lease_id="lease-1",
        executor_id="exec-a",
        attempt=1,
        status=Status.QUEUED,
        step_at=0,
    ),
    StepStarted(at=AT, actor="exec-a", lease_id="lease-1", step="init"),
    StepFinished(
        at=AT,
        actor="exec-a",
        lease_id="lease-1",
        step="init",
        ok=False,
        started_at=AT - timedelta(seconds=30),
        log_object="logs/run/init",
        error="exit 1",
    ),
    PlanFinished(
        at=AT,
        actor="exec-a",
        lease_id="lease-1",
        commit="c0ffee",
        has_changes=True,
        summary=SUMMARY,
        plan_object="plans/run",
        plan_digest="sha256:abc",
        require_approval=False,
    ),
    RunApproved(at=AT, actor="bob", acknowledged=["aws_instance.web", "aws_vpc.main"]),
    ApplyFinished(at=AT, actor="exec-b", lease_id="lease-2", summary=SUMMARY),
    ResourceStateChanged(
        at=AT,
        actor="exec-b",
        lease_id="lease-2",
        address="null_resource.a",
        action="create",
        state="failed",
        error="boom",
    ),
    StateVersionCreated(
        at=AT,
        actor="exec-b",
        lease_id="lease-2",
        serial=3,
        lineage="l-1",
        digest="ab" * 32,
        object="acme/network/3",
        size=1234,
    ),
    RunDiscarded(at=AT, actor="bob", reason="wrong region"),
    RunCanceled(at=AT, actor="alice", reason="not today"),
    RunStopRequested(at=AT, actor="alice", reason="wrong branch"),
    RunLimitExceeded(at=AT, actor="reaper", limit="run_timeout", message="open 60s"),
    RunFailed(
        at=AT, actor="exec-b", reason="step_failed", message="apply: exit 1", lease_id="lease-2"
    ),
    WorkspaceCreated(at=AT, actor="alice", org="acme", name="network", config=CONFIG),
    VariablesSet(at=AT, actor="alice", variables={"region": "eu-west-1"}),
    RunEnqueued(at=AT, actor="alice", run_id="run-1"),
    RunAdmitted(at=AT, actor="scheduler", run_id="run-1"),
    RunReleased(at=AT, actor="scheduler", run_id="run-1", status="applied"),
    WorkspaceLocked(at=AT, actor="alice", reason="provider upgrade"),
    WorkspaceUnlocked(at=AT, actor="bob", holder="alice", reason="provider upgrade"),
    ConfigChanged(at=AT, actor="alice", changes={"branch": "prod", "trigger_paths": ["net/**"]}),
    WorkspaceDeleted(at=AT, actor="alice"),
    WorkspacePurged(at=AT, actor="alice"),
    StatePushed(
        at=AT,
        actor="alice",
        serial=4,
        lineage="8e5b8f54-0000-4000-8000-000000000001",
        digest="ab" * 32,
        object="acme/net/4-abababababababab",
        size=181,
        previous="acme/net/3-0123456789abcdef",
        forced=True,
    ),
    OrgCreated(at=AT, actor="alice", name="acme"),
    FolderCreated(at=AT, actor="alice", name="network", parent="platform"),
    OrgSettingsSet(at=AT, actor="alice", changes={"confirm_destructive": True}),
    FolderSettingsSet(at=AT, actor="alice", folder="network", changes={"run_timeout": None}),
    SettingsSet(at=AT, actor="alice", changes={"approvers": ["bob", "group:sre"]}),
    TokenIssued(
        at=AT,
        actor="alice",
        token_id="tok-1",
        token_hash="sha256:feed",
        user="bob",
        role="admin",
        expires_at=AT,
    ),
    TokenRevoked(at=AT, actor="alice", token_id="tok-1"),
    TokenUsed(at=AT, actor="bob", token_id="tok-1"),
    GroupSet(at=AT, actor="alice", name="sre", members=["bob", "carol"]),
    mb.UserAdded(at=AT, actor="alice", user_id="u-1", email="bob@acme.io", name="Bob"),
    mb.UserSuspended(at=AT, actor="alice", user_id="u-1", reason="left"),
    mb.UserReactivated(at=AT, actor="alice", user_id="u-1"),
    mb.UserLinked(at=AT, actor="sso", user_id="u-1", issuer="https://idp", subject="42"),
    tm.TeamSet(at=AT, actor="alice", name="net", rights=["manage-vcs"], idp_groups=["g"]),
    tm.TeamDeleted(at=AT, actor="alice", name="net"),
    tm.TeamMembersSet(at=AT, actor="alice", name="net", members=["u-1"]),
    tm.UserTeamsSynced(at=AT, actor="sso", user_id="u-1", teams=["net"]),
    tm.AccessGranted(at=AT, actor="alice", team="net", target="folder:prod", level="write"),
    tm.AccessRevoked(at=AT, actor="alice", team="net", target="folder:prod"),
    CustomStepFinished(at=AT, actor="exec-a", lease_id="lease-1", number=300),
    LogPruned(
        at=AT,
        actor="retention",
        objects=[PrunedObject(name="run-1/plan/init.log", sha256="ab" * 32, size=12)],
        days=90,
    ),
    RunRemoved(
        at=AT,
        actor="retention",
        objects=[PrunedObject(name="run-1.tfplan", sha256="cd" * 32, size=9, bucket="rp-plans")],
        rows=["runs", "steps", "changes", "resource_states"],
        days=400,
    ),
    TemplateSaved(
        at=AT,
        actor="alice",
        template=Template(
            name="lint",
            steps=[
                TemplateStep(number=50, kind="custom", name="tflint", command="tflint"),
                TemplateStep(number=100, kind="plan"),
            ],
        ),
    ),
    TemplateDeleted(at=AT, actor="alice", name="lint"),
    PolicySaved(
        at=AT,
        actor="alice",
        policy=PolicySet(
            name="no-deletes",
            enforcement="hard-mandatory",
            source="package p\ndeny contains m if { false; m := 1 }",
            scope="folder:platform",
        ),
    ),
    PolicyDeleted(at=AT, actor="alice", name="no-deletes"),
    nt.ConfigSaved(
        at=AT,
        actor="alice",
        config=nt.NotificationConfig(
            id="01jnotify",
            org="acme",
            workspace="net",
            name="ops",
            destination="slack",
            url="https://hooks.example.com/x",
            triggers=["run:errored"],
            has_token=True,
            created_at=AT,
            created_by="alice",
        ),
    ),
    nt.ConfigDeleted(at=AT, actor="alice", config_id="01jnotify"),
    nt.DeliveryScheduled(
        at=AT,
        actor="notifications",
        delivery_id="d0123",
        config_id="01jnotify",
        org="acme",
        workspace="net",
        run_id="01jrun",
        trigger="run:errored",
        event_seq=42,
        body="{}",
    ),
    nt.DeliveryAttempted(
        at=AT,
        actor="notifications",
        delivery_id="d0123",
        config_id="01jnotify",
        attempt=1,
        trigger="run:errored",
        run_id="01jrun",
        status_code=503,
        excerpt="busy",
        outcome="retry",
        next_retry_at=AT + timedelta(seconds=10),
    ),
    ch.SlackConfigured(at=AT, actor="alice", team_id="T0123", bot_token=True),
    ch.SlackRemoved(at=AT, actor="alice"),
    ch.SlackUserMapped(at=AT, actor="alice", slack_id="U0123", user="bob"),
    ch.SlackUserUnmapped(at=AT, actor="alice", slack_id="U0123"),
    ch.SlackRequestReceived(
        at=AT,
        actor="U0123",
        request_id="0f" * 16,
        kind="interaction",
        team_id="T0123",
        slack_user="U0123",
        channel="C0123",
        message_ts="1700000000.000100",
        action_id="runplane_approve",
        value="acme/net/01jh0000000000000000000000",
        response_url="c2VhbGVk",
    ),
    ch.SlackRequestDone(at=AT, actor="bob", request_id="0f" * 16, outcome="ok", user="bob"),
    ch.SlackMessageLinked(
        at=AT,
        actor="U0123",
        run_id="01jh0000000000000000000000",
        request_id="0f" * 16,
        response_url="c2VhbGVk",
        channel="C0123",
    ),
    vcs.ConnectionSaved(
        at=AT,
        actor="alice",
        connection=vcs.VcsConnection(
            id="01jvcs",
            org="acme",
            name="github",
            provider="github",
            api_url="https://api.github.com",
            has_secret=True,
            created_at=AT,
            created_by="alice",
        ),
    ),
    vcs.ConnectionDeleted(at=AT, actor="alice", connection_id="01jvcs"),
    vcs.DeliveryAccepted(
        at=AT,
        actor="vcs:01jvcs",
        connection_id="01jvcs",
        delivery="72d3162e-cc78-11e3-81ab-4c9367dc0958",
        event="push",
        repository="acme/net",
        ref="refs/heads/main",
        commit="6113728f27ae82c7b1a177c8d03f9e96e0adf246",
        runs=["net/01jh0000000000000000000000"],
    ),
    vcs.PushClaimed(
        at=AT,
        actor="vcs:01jvcs",
        connection_id="01jvcs",
        ref="refs/heads/main",
        commit="6113728f27ae82c7b1a177c8d03f9e96e0adf246",
        delivery="72d3162e-cc78-11e3-81ab-4c9367dc0958",
    ),
    vr.RowSet(
        at=AT,
        actor="vcs",
        connection="01jh0000000000000000000001",
        repository="acme/net",
        pull_request=42,
        row=vr.PrRow(
            workspace="net",
            run_id="01jh0000000000000000000000",
            commit="abcdef0",
            status="planned",
            add=2,
            change=1,
            destroy=0,
            created_at=AT,
            event_seq=9,
        ),
    ),
    vr.CommentClaimed(at=AT, actor="vcs", claim="0f" * 16),
    vr.CommentLinked(at=AT, actor="vcs", claim="0f" * 16, comment_id=2**40),
    sc.ScheduleSaved(
        at=AT,
        actor="alice",
        schedule=sc.Schedule(
            id="01jsched",
            org="acme",
            workspace="net",
            cron="0 3 * * 1-5",
            timezone="Europe/Paris",
            run_type="drift",
            missed="skip",
            since=AT,
            created_at=AT,
            created_by="alice",
            updated_at=AT,
        ),
    ),
    sc.ScheduleDeleted(at=AT, actor="alice", schedule_id="01jsched"),
    sc.ScheduleFired(
        at=AT, actor="schedule", schedule_id="01jsched", fire_time=AT, run_id="01jrun", missed=2
    ),
    sc.ScheduleSkipped(
        at=AT,
        actor="schedule",
        schedule_id="01jsched",
        fire_time=AT,
        reason="waiting",
        waiting_run="01jrun",
        last_run="01jrun",
    ),
]

SAMPLES += [
    rt.RunTriggerAdded(at=AT, actor="alice", source="net", target="app"),
    rt.RunTriggerRemoved(at=AT, actor="alice", source="net", target="app"),
]

SAMPLES += [
    sso.SsoConfigured(
        at=AT,
        actor="alice",
        issuer="https://idp.example.com",
        client_id="runplane",
        display_name="Example",
        allowed_domains=["example.com"],
        groups_claim="groups",
        group_rules=[sso.GroupRule(group="net-admins", team="network")],
        secret_changed=True,
    ),
    sso.SsoRemoved(at=AT, actor="alice"),
    ads.DestinationSaved(
        at=AT,
        actor="alice",
        destination_id="01jsiem",
        destination=ads.AuditDestination(
            id="01jsiem",
            org="acme",
            name="splunk",
            format="splunk-hec",
            url="https://splunk.example.com:8088/services/collector/event",
            has_secret=True,
            index="audit",
            created_at=AT,
            created_by="alice",
        ),
    ),
    ads.DestinationDeleted(at=AT, actor="alice", destination_id="01jsiem"),
]

SAMPLES += [
    sk.StackCreated(
        at=AT,
        actor="alice",
        name="prod",
        definition=sk.Definition(
            workspaces=["app", "net"], edges=[sk.Edge(source="net", target="app")]
        ),
    ),
    sk.StackChanged(
        at=AT, actor="alice", name="prod", definition=sk.Definition(workspaces=["net"])
    ),
    sk.StackDeleted(at=AT, actor="alice", name="prod"),
    srv.StackRunCreated(
        at=AT,
        actor="alice",
        stack_run_id="01jsr",
        org="acme",
        stack="prod",
        run_type="apply",
        definition=sk.Definition(workspaces=["net"]),
        selected=["net"],
        failure_policy="pause",
    ),
    srv.StackNodeStarted(at=AT, actor="p", node="net", run_id="01jr", attempt=1),
    srv.StackNodeEnded(
        at=AT, actor="p", node="net", run_id="01jr", run_status="failed", outcome="failed"
    ),
    srv.StackNodesSkipped(at=AT, actor="p", nodes=["app"], because_of="net"),
    srv.StackRunPaused(at=AT, actor="p", node="net"),
    srv.StackRunAborting(at=AT, actor="p", node="net", cancel=["01jr"]),
    srv.StackRunResumed(at=AT, actor="bob", nodes=["net"]),
    srv.StackRunEnded(at=AT, actor="p", status="completed"),
]

EVENT_TYPES = [
    *get_args(RunEvent),
    *get_args(WorkspaceEvent),
    *get_args(OrgEvent),
    *get_args(nt.NotificationEvent),
    *get_args(ch.ChatEvent),
    *get_args(vcs.VcsEvent),
    *get_args(vr.VcsReportEvent),
    *get_args(rt.RunTriggerEvent),
    *get_args(sc.ScheduleEvent),
    *get_args(sso.SsoEvent),
    *get_args(ads.AuditDestinationEvent),
    *get_args(sk.StackEvent),
    *get_args(srv.StackRunEvent),
]


def test_there_is_a_sample_of_every_event_type_so_none_escapes_the_round_trip() -> None:
    assert sorted(type(e).__name__ for e in SAMPLES) == sorted(t.__name__ for t in EVENT_TYPES)
    assert set(get_args(AnyEvent)) == set(EVENT_TYPES)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_decodes_from_its_encoding_to_an_equal_struct(event: Any) -> None:
    back = decode(encode(event))
    assert type(back) is type(event)
    assert back == event


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_is_stored_under_its_explicit_tag_not_a_module_path(event: Any) -> None:
    stored = msgspec.json.decode(encode(event))
    assert stored["type"] == tag_of(event)
    assert tag_of(event).split(".")[0] in {"run", "ws", "org", "chat"}


def test_event_tags_are_unique_across_aggregates() -> None:
    tags = [tag_of(e) for e in SAMPLES]
    assert len(tags) == len(set(tags))


def test_datetimes_come_back_timezone_aware_utc() -> None:
    back = decode(encode(next(s for s in SAMPLES if isinstance(s, StepFinished))))
    assert isinstance(back, StepFinished)
    assert back.at.utcoffset() == timedelta(0)
    assert back.started_at.utcoffset() == timedelta(0)


def test_a_datetime_in_another_offset_decodes_to_the_same_instant() -> None:
    cet = timezone(timedelta(hours=1))
    event = RunQueued(at=AT.astimezone(cet), actor="scheduler")
    assert decode(encode(event)).at == AT


# ------------------------------------------------------ golden samples: past events, as stored
# Literal JSON as earlier versions wrote it. Never edit these: add new ones. A failure means a
# change broke old events (rename, retype, removal) and needs a new tag plus an upcaster.

GOLDEN: list[tuple[bytes, Any]] = [
    (
        b'{"type":"org.folder_created","at":"2026-11-29T19:00:00Z","actor":"alice",'
        b'"name":"network","parent":"platform"}',
        FolderCreated(
            at=datetime(2026, 11, 29, 19, tzinfo=UTC),
            actor="alice",
            name="network",
            parent="platform",
        ),
    ),
    (
        b'{"type":"org.folder_settings_set","at":"2026-11-29T19:00:00Z","actor":"alice",'
        b'"folder":"network","changes":{"run_timeout":1800,"four_eyes":null}}',
        FolderSettingsSet(
            at=datetime(2026, 11, 29, 19, tzinfo=UTC),
            actor="alice",
            folder="network",
            changes={"run_timeout": 1800, "four_eyes": None},
        ),
    ),
    (
        b'{"type":"ws.settings_set","at":"2026-11-29T19:00:00Z","actor":"alice",'
        b'"changes":{"require_approval":false}}',
        SettingsSet(
            at=datetime(2026, 11, 29, 19, tzinfo=UTC),
            actor="alice",
            changes={"require_approval": False},
        ),
    ),
    (
        b'{"type":"run.created","at":"2025-01-02T03:04:05Z","actor":"alice","run_id":"run-1",'
        b'"org":"acme","workspace":"network","run_type":"plan","config":{"repository":'
        b'"https://git.example.com/acme/infra.git","branch":"main","directory":".",'
        b'"variables":{"region":"eu-west-1"}},"message":"first"}',
        RunCreated(
            at=datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC),
            actor="alice",
            run_id="run-1",
            org="acme",
            workspace="network",
            run_type="plan",
            config=Workspace(
                repository="https://git.example.com/acme/infra.git",
                variables={"region": "eu-west-1"},
            ),
            message="first",
        ),
    ),
    (
        # written before optional fields were filled in: defaults apply on decode
        b'{"type":"run.created","at":"2025-01-02T03:04:05Z","actor":"alice","run_id":"run-2",'
        b'"org":"acme","workspace":"network","run_type":"apply",'
        b'"config":{"repository":"git@example.com:infra.git"}}',
        RunCreated(
            at=datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC),
            actor="alice",
            run_id="run-2",
            org="acme",
            workspace="network",
            run_type="apply",
            config=Workspace(repository="git@example.com:infra.git"),
        ),
    ),
    (
        b'{"type":"run.plan_finished","at":"2025-01-02T03:09:00.250000Z","actor":"exec-a",'
        b'"lease_id":"lease-1","commit":"c0ffee","has_changes":true,'
        b'"summary":{"add":1,"change":0,"destroy":2},"plan_object":"plans/run-1",'
        b'"plan_digest":"sha256:abc","require_approval":true}',
        PlanFinished(
            at=datetime(2025, 1, 2, 3, 9, 0, 250000, tzinfo=UTC),
            actor="exec-a",
            lease_id="lease-1",
            commit="c0ffee",
            has_changes=True,
            summary=PlanSummary(add=1, destroy=2),
            plan_object="plans/run-1",
            plan_digest="sha256:abc",
            require_approval=True,
        ),
    ),
    (
        b'{"type":"run.failed","at":"2025-01-02T03:10:00Z","actor":"reaper",'
        b'"reason":"executor_unavailable"}',
        RunFailed(
            at=datetime(2025, 1, 2, 3, 10, tzinfo=UTC),
            actor="reaper",
            reason="executor_unavailable",
        ),
    ),
    (
        b'{"type":"ws.run_released","at":"2025-01-02T03:11:00Z","actor":"scheduler",'
        b'"run_id":"run-1","status":"applied"}',
        RunReleased(
            at=datetime(2025, 1, 2, 3, 11, tzinfo=UTC),
            actor="scheduler",
            run_id="run-1",
            status="applied",
        ),
    ),
    (
        b'{"type":"org.token_issued","at":"2025-01-01T00:00:00Z","actor":"alice",'
        b'"token_id":"tok-1","token_hash":"sha256:feed","user":"bob","role":"approver"}',
        TokenIssued(
            at=datetime(2025, 1, 1, tzinfo=UTC),
            actor="alice",
            token_id="tok-1",
            token_hash="sha256:feed",
            user="bob",
            role="approver",
        ),
    ),
    (
        b'{"type":"org.group_set","at":"2026-11-29T19:00:00Z","actor":"admin",'
        b'"name":"ops","members":["alice","bob"]}',
        GroupSet(
            at=datetime(2026, 11, 29, 19, tzinfo=UTC),
            actor="admin",
            name="ops",
            members=["alice", "bob"],
        ),
    ),
    (
        b'{"type":"run.approved","at":"2026-11-29T19:00:00Z","actor":"alice",'
        b'"acknowledged":["null_resource.a","null_resource.b"]}',
        RunApproved(
            at=datetime(2026, 11, 29, 19, tzinfo=UTC),
            actor="alice",
            acknowledged=["null_resource.a", "null_resource.b"],
        ),
    ),
    (
        b'{"type":"ws.locked","at":"2026-11-29T19:00:00Z","actor":"alice",'
        b'"reason":"provider upgrade"}',
        WorkspaceLocked(
            at=datetime(2026, 11, 29, 19, tzinfo=UTC), actor="alice", reason="provider upgrade"
        ),
    ),
    (
        # an unlock without the lock it lifted: holder and reason default to ""
        b'{"type":"ws.unlocked","at":"2026-11-29T19:05:00Z","actor":"alice"}',
        WorkspaceUnlocked(at=datetime(2026, 11, 29, 19, 5, tzinfo=UTC), actor="alice"),
    ),
    (
        # a delivery recorded before stale and duplicate pushes were: it was acted on
        b'{"type":"org.vcs_delivery_accepted","at":"2026-11-29T19:00:00Z","actor":"vcs:01jvcs",'
        b'"connection_id":"01jvcs","delivery":"72d3162e-cc78-11e3-81ab-4c9367dc0958",'
        b'"event":"push","repository":"acme/net","ref":"refs/heads/main",'
        b'"commit":"6113728f27ae82c7b1a177c8d03f9e96e0adf246",'
        b'"runs":["net/01jh0000000000000000000000"]}',
        vcs.DeliveryAccepted(
            at=datetime(2026, 11, 29, 19, tzinfo=UTC),
            actor="vcs:01jvcs",
            connection_id="01jvcs",
            delivery="72d3162e-cc78-11e3-81ab-4c9367dc0958",
            event="push",
            repository="acme/net",
            ref="refs/heads/main",
            commit="6113728f27ae82c7b1a177c8d03f9e96e0adf246",
            runs=["net/01jh0000000000000000000000"],
            ignored="",
            stale=[],
            duplicate_of="",
        ),
    ),
]


@pytest.mark.parametrize(
    ("stored", "expected"),
    GOLDEN,
    ids=[f"{type(e).__name__}-{i}" for i, (_, e) in enumerate(GOLDEN)],
)
def test_golden_past_events_still_decode_to_the_same_struct(stored: bytes, expected: Any) -> None:
    assert decode(stored) == expected


def test_a_delivery_that_started_nothing_round_trips_with_why() -> None:
    """A push stale for some workspaces and brought first by another delivery."""
    event = vcs.DeliveryAccepted(
        at=AT,
        actor="vcs:01jvcs",
        connection_id="01jvcs",
        delivery="9a1f0c4e-cc78-11e3-81ab-4c9367dc0958",
        event="push",
        ref="refs/heads/main",
        commit="6113728f27ae82c7b1a177c8d03f9e96e0adf246",
        ignored=vcs.DUPLICATE,
        stale=["db"],
        duplicate_of="72d3162e-cc78-11e3-81ab-4c9367dc0958",
    )
    assert decode(encode(event)) == event


def test_unknown_fields_in_a_stored_event_are_skipped_on_decode() -> None:
    stored = (
        b'{"type":"run.created","at":"2025-01-02T03:04:05Z","actor":"alice","run_id":"run-1",'
        b'"org":"acme","workspace":"network","run_type":"plan","priority":7,'
        b'"labels":{"team":"net"},"config":{"repository":"r","future_setting":[1,2]}}'
    )
    event = decode(stored)
    assert isinstance(event, RunCreated)
    assert (event.run_id, event.config) == ("run-1", Workspace(repository="r"))


def test_unknown_fields_in_a_nested_plan_summary_are_skipped_on_decode() -> None:
    stored = (
        b'{"type":"run.apply_finished","at":"2025-01-02T03:04:05Z","actor":"exec",'
        b'"lease_id":"l","summary":{"add":1,"import":4},"duration_ms":1200}'
    )
    assert decode(stored) == ApplyFinished(
        at=datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC),
        actor="exec",
        lease_id="l",
        summary=PlanSummary(add=1),
    )


def test_an_event_of_an_unknown_type_is_refused_on_decode() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(b'{"type":"run.teleported","at":"2025-01-02T03:04:05Z","actor":"a"}')


def test_an_event_missing_a_required_field_is_refused_on_decode() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(b'{"type":"run.failed","at":"2025-01-02T03:04:05Z","actor":"a"}')


# ------------------------------------------------------------------------------ ids, subjects


@pytest.mark.parametrize(
    "value",
    ["a", "7", "acme", "run-1", "01jh5n3k6e2q8d9f0a1b2c3d4e", "a" * 63, "x-" * 31 + "y"],
)
def test_valid_id_accepts_lowercase_subject_safe_tokens(value: str) -> None:
    assert valid_id(value)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "-leading-dash",
        "Acme",
        "01JH5N3K6E2Q8D9F0A1B2C3D4E",
        "a.b",
        "a b",
        "a*",
        "a>",
        "a_b",
        "é",
        "a" * 64,
        " a",
        "a\tb",
    ],
)
def test_valid_id_rejects_anything_that_is_not_a_subject_safe_token(value: str) -> None:
    assert not valid_id(value)


@pytest.mark.parametrize("value", ["acme\n", "run-1\n"])
def test_valid_id_rejects_a_trailing_newline(value: str) -> None:
    assert not valid_id(value)


def test_subjects_put_each_aggregate_on_its_own_subject() -> None:
    assert codec.run_subject("acme", "network", "run-1") == "rp.run.acme.network.run-1"
    assert codec.ws_subject("acme", "network") == "rp.ws.acme.network"
    assert codec.org_subject("acme") == "rp.org.acme"
