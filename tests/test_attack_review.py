"""Attacks on issue 12's change (notifications, chat-ops, traces, the consumer loop), each
played for real (nats-server, HTTP receivers, signed Slack requests): a hostile webhook
receiver, a Slack user with too small a role, a forged or crafted request."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from events import notification as nt
from events import run as R
from events.codec import run_subject
from events.run import RunApproved, RunDiscarded
from infra.eventstore import EventStore
from services.app.commands import App
from services.processes.chat import signing
from services.processes.chat import text as tx
from services.processes.chat.poster import Poster
from services.processes.notifications import outbox
from services.processes.notifications.delivery import Dispatcher, Policy
from services.processes.notifications.subscriber import Notifier
from services.processes.notifications.tokens import TokenError
from tests.api_support import Http
from tests.helpers import eventually
from tests.notify_support import (  # noqa: F401  # the fixtures
    TOKEN,
    Receiver,
    Rig,
    nhttp_fixture,
    policy_fixture,
    rig_fixture,
)
from tests.slack_support import Slack, command_body, slack_fixture, slack_id  # noqa: F401  # the fixture

A, TEAM_A, SECRET_A = "acme", "T0ACME", "8f742231b10e8888abcd99yyyzzz85a5"


# ---------------------------------------------------------------- a hostile receiver


async def test_a_receiver_asking_to_retry_in_a_billion_years_is_given_up_not_hammered(
    rig: Rig,
) -> None:
    """`Retry-After: 999...9` made `next_retry` overflow (timedelta / datetime): the
    attempt was never recorded and the lane put the job back as a first attempt every
    schedule[0] seconds, forever (a first attempt never asks whether the configuration
    still exists, so even deleting it did not stop it). Now: one attempt, given up."""
    async with Receiver(token=TOKEN, then=429, retry_after="9" * 30) as r:
        cfg = await rig.config(r.url)
        await rig.notify_created()
        await eventually(lambda: _got(r, 1), what="the first attempt")
        did = r.got[0].delivery
        rows = await eventually(lambda: _final(rig, cfg, did), what="the attempt recorded")
        assert [(a.status_code, a.outcome) for a in rows] == [(429, "gave_up")]
        assert rig.dispatcher.busy() == 0
        assert len(r.got) == 1  # not hammered


async def _got(r: Receiver, n: int) -> bool:
    return len(r.got) >= n


async def _final(r: Rig, cfg: Any, did: str) -> list[Any]:
    rows = await r.attempts(cfg, did)
    return rows if rows and rows[-1].outcome in ("delivered", "failed", "gave_up") else []


# ---------------------------------------------------------------- Slack: roles


async def _awaiting_run(slack: Slack) -> str:
    a = await slack.http.post(f"/api/v1/orgs/{A}/workspaces/net/runs", json={"type": "apply"})
    assert a.status == 201, a.body
    run_id = str(a.body["id"])
    await slack.awaiting(A, run_id)
    return run_id


async def test_a_viewer_named_in_approvers_may_not_approve_from_slack_as_from_the_api(
    slack: Slack,
) -> None:
    """approvers ["vera"], vera a viewer: the API's approve route needs operator (the
    approvers rule narrows who among operators approves, it grants no role), so vera's
    token gets 403; from Slack the worker skipped that check and vera approved."""
    tokens = await slack.org(A, TEAM_A, SECRET_A)
    s = await slack.http.call(
        "PATCH", f"/api/v1/orgs/{A}/workspaces/net/settings", json={"approvers": ["vera"]}
    )
    assert s.status == 200, s.body
    run_id = await _awaiting_run(slack)
    api = await slack.http.post(f"/api/v1/orgs/{A}/runs/{run_id}/approve", token=tokens["vera"])
    assert api.status == 403, api.body
    value = f"{A}/net/{run_id}"
    vera = slack_id(A, "vera")
    await slack.click(tx.APPROVE, value, team=TEAM_A, user=vera, secret=SECRET_A, hook="va")
    await slack.command(f"approve {run_id}", team=TEAM_A, user=vera, secret=SECRET_A, hook="vc")
    await slack.click(tx.DISCARD, value, team=TEAM_A, user=vera, secret=SECRET_A, hook="vd")
    await slack.work(A)
    envs = await slack.app.store.read(f"rp.run.{A}.net.{run_id}")
    acted = [e.event for e in envs if isinstance(e.event, (RunApproved, RunDiscarded))]
    assert acted == [], acted
    for hook in ("va", "vc", "vd"):
        reply = " ".join(str(m.get("text", "")) for m in slack.receiver.to(hook))
        assert "has read on workspace net" in reply and "needs write" in reply, (hook, reply)


# ---------------------------------------------------------------- the guard's answers


async def test_a_name_refused_by_the_guard_does_not_answer_its_internal_address(
    nhttp: Http, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's refusal is answered to the tenant (the 422 of a save, a verify's and
    every delivery's `error`): it named the address a host resolved to, so an
    organization's admin read the deployment's internal DNS (`db.corp` is 10.1.2.3)
    one POST at a time. Now it names only the kind of address."""
    await nhttp.org("acme")
    path = "/api/v1/orgs/acme/notifications"
    saved = await nhttp.post(path, json={"name": "x", "url": "http://localhost:9/hook"})
    assert saved.status == 201, saved.body  # loopback allowed (the fixture): saved
    monkeypatch.delenv("RUNPLANE_NOTIFY_ALLOW")
    refused = await nhttp.post(path, json={"name": "y", "url": "http://localhost:9/hook"})
    refused.problem("destination-refused", 422)
    verify = await nhttp.post(f"{path}/{saved.body['id']}/verify")
    assert verify.status == 200, verify.body
    rows = await eventually(lambda: _attempts(nhttp, str(saved.body["id"])))
    for text in (str(refused.body), str(verify.body), str(rows)):
        assert "localhost" in text and "loopback" in text, text
        assert "127.0.0.1" not in text and "::1" not in text, text


async def _attempts(http: Http, config_id: str) -> list[Any]:
    a = await http.get(f"/api/v1/orgs/acme/notifications/{config_id}/deliveries")
    return a.body["items"] if a.status == 200 else []  # type: ignore[no-any-return]


# ---------------------------------------------------------------- Slack: the raw body


async def test_a_slack_request_whose_body_comes_in_two_segments_is_read_whole(
    slack: Slack,
) -> None:
    """`content.read(n)` answers what has arrived, not n bytes: a body in two TCP
    segments (a large interaction payload) was checked on its first part, and Slack's
    own signed request was refused 401. Now the body is read to its end (bounded)."""
    await slack.org(A, TEAM_A, SECRET_A)
    body = command_body("help", team=TEAM_A, user=slack_id(A, "bob"), url="https://x/")
    stamp = str(int(time.time()))
    head = (
        "POST /api/v1/chat/slack/commands HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        "Content-Type: application/x-www-form-urlencoded\r\n"
        f"Content-Length: {len(body)}\r\nX-Slack-Request-Timestamp: {stamp}\r\n"
        f"X-Slack-Signature: {signing.signature(SECRET_A, stamp, body)}\r\n\r\n"
    ).encode()
    server = slack.http.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(head + body[:100])
        await writer.drain()
        with contextlib.suppress(TimeoutError):  # the first part alone answers nothing
            early = await asyncio.wait_for(reader.readline(), 0.5)
            pytest.fail(f"answered on half the body: {early!r}")
        writer.write(body[100:])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert b"Commands:" in answer


# ---------------------------------------------------------------- Slack: response_url


async def test_a_response_url_with_credentials_does_not_pass_for_an_allowed_prefix() -> None:
    """A signed request's response_url is chosen by whoever holds the signing secret (the
    organization's admin). With a deployment's prefix written without its final slash
    (`RP_SLACK_RESPONSE_URLS=http://127.0.0.1:8080`), `http://127.0.0.1:8080@<any
    host>/` passed the prefix test and was posted to (SSRF from inside the network)."""
    async with Receiver() as allowed_one, Receiver() as elsewhere:
        prefix = allowed_one.url.removesuffix("/hook")
        poster = Poster((prefix,))
        sneaky = prefix + "@" + elsewhere.url.removeprefix("http://")
        async with poster:
            assert await poster.post(sneaky, {"text": "hi"}) == 0
            assert await poster.post(prefix + "1/x", {"text": "hi"}) == 0  # another port
            assert await poster.post(allowed_one.url, {"text": "hi"}) == 200
        assert elsewhere.got == [] and len(allowed_one.got) == 1


async def test_a_delivery_whose_attempt_keeps_raising_stops_once_its_configuration_is_gone(
    app: App, store: EventStore
) -> None:
    """An attempt that raises (here: its token does not open, e.g. sealed with a key
    since retired) is put back on its lane as it was, a first attempt: and a first
    attempt never asks whether its configuration still exists, so deleting the
    configuration did not stop the lane trying it every schedule[0] seconds for the
    life of the process. Now it is asked, as before a retry."""
    await app.create_org("acme", "alice")
    await app.create_workspace("acme", "net", R.Workspace(repository="https://e.com/r"), "alice")

    async def broken_token(org: str, config_id: str) -> str:
        raise TokenError(f"the token of {config_id} does not open")

    fast = Policy(allow=frozenset({"loopback"}), schedule=(0.05,), timeout=2.0)
    record, current = outbox.recorder(store), outbox.current(store)
    async with Receiver() as r, Dispatcher(fast, broken_token, record, current) as d:
        notifier = Notifier(store, d)
        cmd = nt.SaveConfig(
            actor="alice",
            config_id=app.ids(),
            org="acme",
            create=True,
            name="ops",
            url=r.url,
            destination="generic",
            triggers=["run:created"],
        )
        await outbox.command(app, "acme", cmd)
        run = (await app.create_run("acme", "net", "apply", "alice")).state
        subject = run_subject("acme", "net", run.run_id)
        envs = await store.read(subject)
        first = envs[0].event
        assert isinstance(first, R.RunCreated)
        await notifier.on_event(envs[0].seq, subject, first, R.fold([first]))
        assert d.busy() == 1
        delete = nt.DeleteConfig(actor="alice", config_id=cmd.config_id)
        await outbox.command(app, "acme", delete)
        await eventually(lambda: _idle(d), what="the delivery dropped with its configuration")
        assert r.got == []


async def _idle(d: Dispatcher) -> bool:
    return d.busy() == 0


@pytest.mark.parametrize(
    "url", ["http://a..b/hook", "http://" + "a" * 64 + ".com/", "http://127.0.0.1\uff0fevil.com/"]
)
async def test_a_url_whose_host_is_no_host_name_is_refused_not_a_500(nhttp: Http, url: str) -> None:
    """The idna codec (an empty or a 64-character label) and urlsplit (a netloc NFKC
    turns into a separator) raise ValueError, not OSError: the guard let it out, and
    saving such a destination answered 500 internal-error (and logged a traceback)."""
    await nhttp.org("acme")
    a = await nhttp.post("/api/v1/orgs/acme/notifications", json={"name": "x", "url": url})
    a.problem("destination-refused", 422)


# ---------------------------------------------------------------- a webhook's URL


async def test_a_webhooks_url_is_its_credential_and_only_admins_read_it(nhttp: Http) -> None:
    """A Slack or Teams incoming webhook's URL carries its secret in its path: whoever
    reads it posts in the channel as runplane (a forged "approve here" message). The
    token is write-only, but a viewer read the URL of every configuration."""
    tokens = await nhttp.org("acme")
    hook = "https://93.184.215.14/services/T0ACME/B0HOOK/s3cr3tXYZw3bh00kp4th"  # no DNS here
    body = {"name": "chat", "destination": "slack", "url": hook, "triggers": ["run:errored"]}
    made = await nhttp.post("/api/v1/orgs/acme/notifications", json=body)
    assert made.status == 201 and made.body["url"] == hook, made.body
    one = f"/api/v1/orgs/acme/notifications/{made.body['id']}"
    assert (await nhttp.get(one)).body["url"] == hook  # the admin token
    assert (await nhttp.get(one, token=tokens["admin"])).body["url"] == hook
    for role in ("viewer", "operator", "approver"):
        for path in (one, "/api/v1/orgs/acme/notifications"):
            a = await nhttp.get(path, token=tokens[role])
            assert a.status == 200, a.body
            assert "s3cr3t" not in str(a.body) and "B0HOOK" not in str(a.body), (role, a.body)
        assert (await nhttp.get(one, token=tokens[role])).body["url"] == "https://93.184.215.14/…"
