"""The pure parts of notifications, given / when / then: configurations decided and
checked, delivery ids, the backoff, the payload formats, the signatures, and the
address guard's judgement of each range."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from events import notification as nt
from events.errors import AlreadyExists, Invalid, NotFound
from services.processes.notifications import Refused, formats, guard, signing

AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _create(**kw: object) -> nt.SaveConfig:
    fields: dict[str, object] = {
        "actor": "alice",
        "config_id": "c1",
        "org": "acme",
        "create": True,
        "name": "ops",
        "destination": "generic",
        "url": "https://93.184.215.14/hook",
        "triggers": ["run:errored"],
    }
    return nt.SaveConfig(**{**fields, **kw})  # type: ignore[arg-type]  # test fields


def test_a_configuration_is_created_changed_and_deleted() -> None:
    [saved] = nt.decide(nt.ConfigState(), _create(), now=AT)
    assert isinstance(saved, nt.ConfigSaved) and saved.config.created_at == AT
    state = nt.fold([saved])
    with pytest.raises(AlreadyExists):
        nt.decide(state, _create(), now=AT)
    patch = nt.SaveConfig(actor="bob", config_id="c1", org="acme", enabled=False)
    [changed] = nt.decide(state, patch, now=AT)
    assert isinstance(changed, nt.ConfigSaved)
    assert (changed.config.enabled, changed.config.name, changed.config.created_by) == (
        False,
        "ops",
        "alice",
    )
    assert nt.decide(nt.fold([changed], state), patch, now=AT) == []  # nothing changes
    gone = nt.fold(nt.decide(state, nt.DeleteConfig(actor="a", config_id="c1"), now=AT), state)
    assert not gone.exists
    with pytest.raises(NotFound):
        nt.decide(gone, patch, now=AT)


@pytest.mark.parametrize(
    "bad",
    [
        {"name": ""},
        {"name": "a\nb"},
        {"destination": "pager"},
        {"url": "file:///etc/passwd"},
        {"url": "https://a b/"},
        {"triggers": ["run:exploded"]},
        {"triggers": ["run:errored", "run:errored"]},
    ],
)
def test_a_malformed_configuration_is_refused_with_why(bad: dict[str, object]) -> None:
    with pytest.raises(Invalid):
        nt.decide(nt.ConfigState(), _create(**bad), now=AT)


def test_configurations_apply_by_org_workspace_trigger_and_enabled() -> None:
    [e] = nt.decide(nt.ConfigState(), _create(), now=AT)
    c = e.config  # type: ignore[union-attr]  # a ConfigSaved
    assert nt.applies(c, "acme", "net", "run:errored")
    assert not nt.applies(c, "beta", "net", "run:errored")
    assert not nt.applies(c, "acme", "net", "run:created")
    ws = nt.NotificationConfig(**{**_fields(c), "workspace": "net"})
    assert nt.applies(ws, "acme", "net", "run:errored")
    assert not nt.applies(ws, "acme", "db", "run:errored")
    off = nt.NotificationConfig(**{**_fields(c), "enabled": False})
    assert not nt.applies(off, "acme", "net", "run:errored")


def _fields(c: nt.NotificationConfig) -> dict[str, Any]:
    return {f: getattr(c, f) for f in c.__struct_fields__}


def test_a_delivery_id_is_stable_and_distinct_per_config_event_and_trigger() -> None:
    a = nt.delivery_id("c1", 42, "run:errored")
    assert a == nt.delivery_id("c1", 42, "run:errored")
    others = {
        nt.delivery_id("c2", 42, "run:errored"),
        nt.delivery_id("c1", 43, "run:errored"),
        nt.delivery_id("c1", 42, "run:policy_failed"),
    }
    assert a not in others and len(others) == 3
    assert a.isalnum() and a.islower() and len(a) == 32  # a subject-safe token


def test_the_backoff_follows_the_schedule_honours_retry_after_and_gives_up() -> None:
    s = nt.SCHEDULE
    assert s == (10, 60, 300, 1800, 7200)
    at = [nt.next_retry(first_at=AT, now=AT, attempt=n) for n in range(1, 7)]
    assert [(t - AT).total_seconds() for t in at if t] == [10, 60, 300, 1800, 7200, 7200]
    longer = nt.next_retry(first_at=AT, now=AT, attempt=1, retry_after=120)
    assert longer == AT + timedelta(seconds=120)
    shorter = nt.next_retry(first_at=AT, now=AT, attempt=3, retry_after=1)
    assert shorter == AT + timedelta(seconds=300)  # never sooner than the schedule
    late = AT + timedelta(hours=23, minutes=59)
    assert nt.next_retry(first_at=AT, now=late, attempt=6) is None  # past 24 h: give up
    assert [nt.retryable_status(c) for c in (200, 400, 404, 409, 429, 500, 503)] == [
        False,
        False,
        False,
        False,
        True,
        True,
        True,
    ]


def test_a_deliverys_history_folds_to_done_once_final() -> None:
    sched = nt.DeliveryScheduled(
        at=AT,
        actor="n",
        delivery_id="d",
        config_id="c",
        org="acme",
        workspace="net",
        run_id="r",
        trigger="run:created",
        event_seq=1,
        body="{}",
    )

    def attempt(n: int, outcome: str) -> nt.DeliveryAttempted:
        return nt.DeliveryAttempted(
            at=AT,
            actor="n",
            delivery_id="d",
            config_id="c",
            attempt=n,
            trigger="run:created",
            run_id="r",
            outcome=outcome,
        )

    s = nt.delivery_fold([sched, attempt(1, "retry")])
    assert (s.attempts, s.done) == (1, False)
    s = nt.delivery_fold([sched, attempt(1, "retry"), attempt(2, "delivered"), attempt(3, "retry")])
    assert (s.attempts, s.outcome, s.done) == (2, "delivered", True)  # a late copy ignored


VIEW = formats.RunView(
    org="acme",
    workspace="net",
    run_id="01jrun",
    status="awaiting_approval",
    message="deploy <b>",
    created_by="alice",
    updated_by="bob",
    add=2,
    change=0,
    destroy=1,
    base_url="https://rp.example.com",
)


def test_the_summary_says_deletions_first() -> None:
    assert formats.summary(VIEW) == "1 delete · 2 create"
    assert formats.summary(formats.RunView(org="a", workspace="b", run_id="c")) == ""
    none = formats.RunView(org="a", workspace="b", run_id="c", add=0, change=0, destroy=0)
    assert formats.summary(none) == "no changes"


def test_slack_needs_attention_carries_the_approve_and_discard_buttons() -> None:
    blocks = formats.slack_blocks(VIEW, "run:needs_attention", with_actions=True)
    [actions] = [b for b in blocks if b["type"] == "actions"]
    buttons = {e["action_id"]: e["value"] for e in actions["elements"]}
    assert buttons == {
        "runplane_approve": "acme/net/01jrun",
        "runplane_discard": "acme/net/01jrun",
    }
    text = str(blocks)
    assert "1 delete · 2 create" in text and "awaiting_approval" in text
    assert "https://rp.example.com/orgs/acme/workspaces/net/runs/01jrun" in text
    assert not [
        b
        for b in formats.slack_blocks(VIEW, "run:errored", with_actions=True)
        if b["type"] == "actions"
    ]
    assert not [
        b
        for b in formats.slack_blocks(VIEW, "run:needs_attention", with_actions=False)
        if b["type"] == "actions"
    ]


def test_teams_is_an_adaptive_card_with_the_link_summary_and_status() -> None:
    msg = formats.teams(VIEW, "run:needs_attention")
    card = msg["attachments"][0]["content"]
    assert card["type"] == "AdaptiveCard"
    assert card["actions"][0]["url"].endswith("/runs/01jrun")
    facts = {f["title"]: f["value"] for f in card["body"][1]["facts"]}
    assert facts["Changes"] == "1 delete · 2 create" and facts["Status"] == "awaiting_approval"


def test_signatures_are_the_documented_hmacs() -> None:
    body, token = b'{"a":1}', "s3cret"
    h = signing.headers(token, body, "d1", 1_700_000_000.7)
    assert h[signing.TFE_HEADER] == hmac.new(b"s3cret", body, hashlib.sha512).hexdigest()
    mac = hmac.new(b"s3cret", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert h[signing.RP_HEADER] == f"t=1700000000,v1={mac}"
    assert h[signing.DELIVERY_HEADER] == "d1"
    assert signing.check_rp(token, body, h[signing.RP_HEADER], 1_700_000_100)
    assert not signing.check_rp(token, body, h[signing.RP_HEADER], 1_700_000_000 + 301)  # replay
    assert not signing.check_rp(token, body + b" ", h[signing.RP_HEADER], 1_700_000_000)
    assert signing.headers("", body, "d1", 0) == {signing.DELIVERY_HEADER: "d1"}


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("10.0.0.1", "private"),
        ("172.31.255.255", "private"),
        ("192.168.1.1", "private"),
        ("fd12::1", "private"),
        ("100.64.1.1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("224.0.0.251", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("240.0.0.1", "private"),
        ("93.184.215.14", "public"),
        ("2606:4700::1111", "public"),
    ],
)
def test_the_guard_names_each_range(address: str, kind: str) -> None:
    ip = ipaddress.ip_address(address)
    assert guard.kind_of(ip) == kind
    if kind == "public":
        guard.judge(ip, frozenset())
    else:
        with pytest.raises(Refused):
            guard.judge(ip, frozenset())
    if kind == "loopback":
        guard.judge(ip, frozenset({"loopback"}))  # the deployment may allow it


async def test_the_connectors_resolver_refuses_a_name_resolving_to_loopback() -> None:
    """DNS rebinding: whatever the name resolved to when saved, the address the
    connector is about to use is judged."""
    with pytest.raises(Refused):
        await guard.GuardedResolver(frozenset()).resolve("localhost", 80)
    assert await guard.GuardedResolver(frozenset({"loopback"})).resolve("localhost", 80)


def test_urls_with_credentials_or_no_host_are_refused() -> None:
    for url in ("http://user:pw@93.184.215.14/", "http:///x", "gopher://93.184.215.14/"):
        with pytest.raises(Refused):
            guard.parse(url)
