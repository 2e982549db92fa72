"""Chat-ops through Slack, with Slack's side played for real: signed requests, a local
`response_url` receiver. Every rule is the core's: who may approve, four-eyes,
confirm_destructive, roles and a stale run come back from `decide`, not from here."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest

from events import chat as chat_agg
from events.run import CancelRun, ResourceChange, RunApproved, RunDiscarded
from infra.consumer import Consumer
from infra.eventstore import Append
from services.processes.chat import signing
from services.processes.chat import text as tx
from services.processes.chat.subscriber import build
from services.processes.chat.worker import digest_of
from tests.helpers import eventually
from tests.slack_support import (  # noqa: F401  # registers the fixture
    Slack,
    command_body,
    slack_fixture,
    slack_id,
)

A, B = "acme", "bravo"
TEAM_A, TEAM_B = "T0ACME", "T0BRAVO"
SECRET_A, SECRET_B = "8f742231b10e8888abcd99yyyzzz85a5", "b0b0b0b0secretofbravo0000000000"
COMMANDS = "/api/v1/chat/slack/commands"
HOSTILE = "<!channel> deploy <http://evil.example|click me> & <@U0BOSS>"


def ua(user: str, org: str = A) -> str:
    return slack_id(org, user)


async def _run_events(slack: Slack, org: str, run_id: str) -> list[Any]:
    envs = await slack.app.store.read(f"rp.run.{org}.net.{run_id}")
    return [e.event for e in envs]


async def _api_run(slack: Slack, org: str = A, message: str = "") -> str:
    body = {"type": "apply", "message": message} if message else {"type": "apply"}
    a = await slack.http.post(f"/api/v1/orgs/{org}/workspaces/net/runs", json=body)
    assert a.status == 201, a.body
    return str(a.body["id"])


async def _runs(slack: Slack, org: str = A) -> list[dict[str, Any]]:
    """The organization's runs, once the projection holds everything written so far."""
    seq = str(await slack.app.store.last_seq())
    a = await slack.http.get(f"/api/v1/orgs/{org}/runs", headers={"RP-Min-Seq": seq})
    assert a.status == 200, a.body
    return a.body["items"]  # type: ignore[no-any-return]  # JSON list


async def _synced(slack: Slack) -> None:
    """Queries from Slack read this replica's projection: let it catch up first."""
    assert await slack.http.api.reached(await slack.app.store.last_seq(), 5.0)


def _texts(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m.get("text", "")) for m in messages)


# ---------------------------------------------------------------- signatures


def test_the_signature_is_slacks_own_as_slack_sdk_computes_and_verifies_it() -> None:
    """Cross-check with Slack's SDK: the same v0 signature for the same body and time,
    and its verifier accepts ours."""
    signature = pytest.importorskip("slack_sdk.signature")  # a test-only dependency
    verifier_class = signature.SignatureVerifier
    body = command_body("status net", team=TEAM_A, user="U1", url="https://hooks.slack.com/x")
    ts = str(int(time.time()))
    ours = signing.signature(SECRET_A, ts, body)
    verifier = verifier_class(SECRET_A)
    assert ours == verifier.generate_signature(timestamp=ts, body=body)
    assert verifier.is_valid(body, ts, ours)
    assert not verifier.is_valid(body, ts, signing.signature(SECRET_B, ts, body))


async def test_a_missing_wrong_or_old_signature_is_a_401_problem_and_nothing_is_recorded(
    slack: Slack,
) -> None:
    await slack.org(A, TEAM_A, SECRET_A)
    body = command_body("plan net", team=TEAM_A, user=ua("alice"), url=slack.receiver.url("x"))
    now = int(time.time())
    cases = {
        "no signature": {"X-Slack-Signature": ""},
        "no timestamp": {"X-Slack-Request-Timestamp": ""},
        "not v0": {"X-Slack-Signature": "v1=" + "0" * 64},
        "wrong secret": {"X-Slack-Signature": signing.signature("guess", str(now), body)},
        "timestamp not the signed one": {"X-Slack-Request-Timestamp": str(now - 1)},
        "not a number": {"X-Slack-Request-Timestamp": "\uff11\uff12\uff13"},
    }
    for what, headers in cases.items():
        a = await slack.signed(COMMANDS, body, SECRET_A, ts=now, headers=headers)
        assert a.problem("unauthorized", 401), what
    old = await slack.signed(COMMANDS, body, SECRET_A, ts=now - 6 * 60)  # signed, but old
    assert "more than 5 minutes" in old.problem("unauthorized", 401)["detail"]
    future = await slack.signed(COMMANDS, body, SECRET_A, ts=now + 6 * 60)
    future.problem("unauthorized", 401)
    # a body changed after signing
    sig = signing.signature(SECRET_A, str(now), body)
    headers = {"X-Slack-Signature": sig}
    tampered = body.replace(b"plan", b"apply")
    (await slack.signed(COMMANDS, tampered, SECRET_A, ts=now, headers=headers)).problem(
        "unauthorized", 401
    )
    assert await slack.requests(A) == []


async def test_a_replayed_request_is_refused_inside_the_window_and_out_of_it(
    slack: Slack,
) -> None:
    """The same signed bytes again: refused (the request's subject, named by its
    signature, is taken), worked once; and once the 5 minutes pass, refused by time."""
    await slack.org(A, TEAM_A, SECRET_A)
    body = command_body("plan net", team=TEAM_A, user=ua("bob"), url=slack.receiver.url("r"))
    now = int(time.time())
    first = await slack.signed(COMMANDS, body, SECRET_A, ts=now)
    assert first.status == 200 and "Working on `plan net`" in first.body["text"], first.body
    again = await slack.signed(COMMANDS, body, SECRET_A, ts=now)
    assert "replay" in again.problem("unauthorized", 401)["detail"]
    assert await slack.work(A) == 1
    clock = slack.app.clock
    slack.app.clock = lambda: clock() + signing.WINDOW + signing.WINDOW / 5
    try:
        late = await slack.signed(COMMANDS, body, SECRET_A, ts=now)
        assert "more than 5 minutes" in late.problem("unauthorized", 401)["detail"]
    finally:
        slack.app.clock = clock
    assert len(await _runs(slack)) == 1


# ---------------------------------------------------------------- who


async def test_an_unmapped_slack_user_can_do_nothing(slack: Slack) -> None:
    await slack.org(A, TEAM_A, SECRET_A)
    run_id = await _api_run(slack)
    await slack.awaiting(A, run_id)
    for text in ("plan net", "status net", f"approve {run_id}"):
        a = await slack.command(text, team=TEAM_A, user="U0STRANGER", secret=SECRET_A)
        assert a.status == 200 and "not linked" in a.body["text"], a.body
    value = f"{A}/net/{run_id}"
    assert await slack.requests(A) == []  # commands: answered at once, nothing recorded
    a = await slack.click(
        tx.APPROVE, value, team=TEAM_A, user="U0STRANGER", secret=SECRET_A, hook="u"
    )
    assert a.status == 200
    assert await slack.work(A) == 1  # a click: the worker replies through response_url
    reply = slack.receiver.to("u")[-1]
    assert "not linked" in reply["text"] and reply["replace_original"] is False
    assert not any(isinstance(e, RunApproved) for e in await _run_events(slack, A, run_id))
    state = (await slack.app.load_run(A, "net", run_id)).state
    assert str(state.status) == "awaiting_approval"
    # a mapping to a user whose tokens are all revoked gives no standing either
    tokens = (await slack.http.get(f"/api/v1/orgs/{A}/tokens")).body["items"]
    for t in tokens:
        if t["user"] == "bob":
            d = await slack.http.call("DELETE", f"/api/v1/orgs/{A}/tokens/{t['token_id']}")
            assert d.status in (200, 204), d.body
    a = await slack.command("plan net", team=TEAM_A, user=ua("bob"), secret=SECRET_A)
    assert "holds no valid token" in a.body["text"], a.body


async def test_a_viewer_may_read_but_not_plan_approve_or_discard(slack: Slack) -> None:
    await slack.org(A, TEAM_A, SECRET_A)
    run_id = await _api_run(slack)
    await slack.awaiting(A, run_id)
    await _synced(slack)
    a = await slack.command("status net", team=TEAM_A, user=ua("vera"), secret=SECRET_A)
    assert run_id in a.body["text"] and "awaiting_approval" in a.body["text"], a.body
    for n, text in enumerate(("plan net", f"approve {run_id}", f"discard {run_id} no")):
        hook = f"v{n}"
        a = await slack.command(text, team=TEAM_A, user=ua("vera"), secret=SECRET_A, hook=hook)
        assert a.status == 200
        await slack.work(A)
        reply = _texts(slack.receiver.to(hook))
        assert "vera has read" in reply and "needs" in reply, reply  # (events/access.py)
    state = (await slack.app.load_run(A, "net", run_id)).state
    assert str(state.status) == "awaiting_approval"
    assert [r["id"] for r in await _runs(slack)] == [run_id]


# ---------------------------------------------------------------- the run's life


async def test_apply_from_slack_creates_the_run_as_the_user_and_the_message_follows_it(
    slack: Slack,
) -> None:
    """`apply net`: answered at once, worked after; the run is bob's; the message is
    posted to response_url, then replaced in place when the run awaits approval (with
    the Approve / Discard buttons) and when it is approved."""
    await slack.org(A, TEAM_A, SECRET_A)
    a = await slack.command("apply net", team=TEAM_A, user=ua("bob"), secret=SECRET_A, hook="m")
    assert (a.status, a.body["response_type"]) == (200, "ephemeral"), a.body
    assert await slack.work(A) == 1
    assert await slack.work(A) == 0  # done is done: a redelivery works nothing again
    first = slack.receiver.to("m")
    assert len(first) == 1 and "pending" in first[0]["text"] and "bob" in first[0]["text"]
    runs = await _runs(slack)
    assert [(r["created_by"], r["type"]) for r in runs] == [("bob", "apply")]
    run_id = runs[0]["id"]
    assert run_id in first[0]["text"]

    state = await slack.awaiting(A, run_id)
    plan_finished = (await _run_events(slack, A, run_id))[-1]
    assert await slack.updater.on_run_event(plan_finished, state) == 1
    card = slack.receiver.to("m")[-1]
    assert card["replace_original"] is True and "awaiting_approval" in card["text"]
    buttons = card["blocks"][-1]["elements"]
    assert [(b["action_id"], b["value"]) for b in buttons] == [
        (tx.APPROVE, f"{A}/net/{run_id}"),
        (tx.DISCARD, f"{A}/net/{run_id}"),
    ]
    step = next(e for e in await _run_events(slack, A, run_id) if type(e).__name__ == "StepStarted")
    assert await slack.updater.on_run_event(step, state) == 0  # a step: the run did not move

    c = await slack.click(
        tx.APPROVE, f"{A}/net/{run_id}", team=TEAM_A, user=ua("alice"), secret=SECRET_A, hook="b"
    )
    assert c.status == 200
    await slack.work(A)
    approved = [e for e in await _run_events(slack, A, run_id) if isinstance(e, RunApproved)]
    assert len(approved) == 1
    ev = approved[0]
    assert (ev.actor, ev.via) == ("alice", "slack")
    assert ev.via_detail["user"] == ua("alice") and ev.via_detail["channel"] == "C0CHAN"
    assert ev.via_detail["message"] == "1700000000.000100"
    reply = slack.receiver.to("b")[-1]
    assert reply["replace_original"] is True and "approved by alice" in reply["text"]
    seq = str(await slack.app.store.last_seq())
    shown = await slack.http.get(f"/api/v1/orgs/{A}/runs/{run_id}", headers={"RP-Min-Seq": seq})
    assert shown.body["approved_by"] == "alice"


async def test_discard_and_cancel_from_slack_record_the_user_and_the_reason(slack: Slack) -> None:
    await slack.org(A, TEAM_A, SECRET_A)
    run_id = await _api_run(slack)
    await slack.awaiting(A, run_id)
    text = f"discard {run_id} not today <!here>"
    await slack.command(text, team=TEAM_A, user=ua("bob"), secret=SECRET_A, hook="d")
    await slack.work(A)
    discarded = [e for e in await _run_events(slack, A, run_id) if isinstance(e, RunDiscarded)]
    assert [(e.actor, e.via, e.reason) for e in discarded] == [
        ("bob", "slack", "not today <!here>")
    ]
    reply = slack.receiver.to("d")[-1]["text"]
    assert "&lt;!here&gt;" in reply and "<!here>" not in reply
    # stale: the run moved on, the core answers 409 and Slack hears it
    await slack.command(
        f"approve {run_id}", team=TEAM_A, user=ua("alice"), secret=SECRET_A, hook="s"
    )
    await slack.work(A)
    assert "discarded" in slack.receiver.to("s")[-1]["text"]

    second = await _api_run(slack)
    await slack.command(f"cancel {second}", team=TEAM_A, user=ua("bob"), secret=SECRET_A, hook="c")
    await slack.work(A)
    state = (await slack.app.load_run(A, "net", second)).state
    assert (str(state.status), slack.receiver.to("c")[-1]["text"].count("canceled") > 0) == (
        "canceled",
        True,
    )


# ---------------------------------------------------------------- the core's rules


async def test_four_eyes_holds_through_slack(slack: Slack) -> None:
    """four_eyes: bob created the run from Slack and may not approve it from Slack; alice may."""
    await slack.org(A, TEAM_A, SECRET_A)
    s = await slack.http.call(
        "PATCH", f"/api/v1/orgs/{A}/workspaces/net/settings", json={"four_eyes": True}
    )
    assert s.status == 200, s.body
    await slack.command("apply net", team=TEAM_A, user=ua("bob"), secret=SECRET_A)
    await slack.work(A)
    run_id = (await _runs(slack))[0]["id"]
    await slack.awaiting(A, run_id)
    value = f"{A}/net/{run_id}"
    await slack.click(tx.APPROVE, value, team=TEAM_A, user=ua("bob"), secret=SECRET_A, hook="4")
    await slack.work(A)
    assert "four_eyes is on" in slack.receiver.to("4")[-1]["text"]
    assert not any(isinstance(e, RunApproved) for e in await _run_events(slack, A, run_id))
    await slack.click(tx.APPROVE, value, team=TEAM_A, user=ua("alice"), secret=SECRET_A, hook="5")
    await slack.work(A)
    approved = [e.actor for e in await _run_events(slack, A, run_id) if isinstance(e, RunApproved)]
    assert approved == ["alice"]


async def test_approvers_and_groups_come_from_the_org(slack: Slack) -> None:
    """approvers ["group:ops"]: alice (approver role, not in ops) is refused; bob, an
    operator in group ops, approves from Slack."""
    await slack.org(A, TEAM_A, SECRET_A)
    g = await slack.http.post(f"/api/v1/orgs/{A}/groups", json={"name": "ops", "members": ["bob"]})
    assert g.status == 201, g.body
    s = await slack.http.call(
        "PATCH", f"/api/v1/orgs/{A}/workspaces/net/settings", json={"approvers": ["group:ops"]}
    )
    assert s.status == 200, s.body
    run_id = await _api_run(slack)
    await slack.awaiting(A, run_id)
    value = f"{A}/net/{run_id}"
    await slack.click(tx.APPROVE, value, team=TEAM_A, user=ua("alice"), secret=SECRET_A, hook="g1")
    await slack.work(A)
    assert "not among the workspace's approvers" in slack.receiver.to("g1")[-1]["text"]
    await slack.click(tx.APPROVE, value, team=TEAM_A, user=ua("bob"), secret=SECRET_A, hook="g2")
    await slack.work(A)
    approved = [e.actor for e in await _run_events(slack, A, run_id) if isinstance(e, RunApproved)]
    assert approved == ["bob"]


async def test_confirm_destructive_asks_to_acknowledge_every_address_first(slack: Slack) -> None:
    """Approve on a plan that deletes and replaces: no approval, an ephemeral confirmation
    listing every address; a confirm button whose list was altered acknowledges nothing;
    the real one approves, acknowledging all of them."""
    await slack.org(A, TEAM_A, SECRET_A)
    s = await slack.http.call(
        "PATCH", f"/api/v1/orgs/{A}/workspaces/net/settings", json={"confirm_destructive": True}
    )
    assert s.status == 200, s.body
    run_id = await _api_run(slack)
    changes = [
        ResourceChange(address="null_resource.a", type="null_resource", action="replace"),
        ResourceChange(
            address='null_resource.b["<!channel>"]', type="null_resource", action="delete"
        ),
    ]
    state = await slack.awaiting(A, run_id, changes=changes)
    value = f"{A}/net/{run_id}"
    await slack.click(tx.APPROVE, value, team=TEAM_A, user=ua("alice"), secret=SECRET_A, hook="x1")
    await slack.work(A)
    confirm = slack.receiver.to("x1")[-1]
    assert confirm["response_type"] == "ephemeral" and confirm["replace_original"] is False
    assert "null_resource.a" in confirm["text"] and "&lt;!channel&gt;" in confirm["text"]
    assert "<!channel>" not in confirm["text"]
    button = confirm["blocks"][-1]["elements"][0]
    assert button["action_id"] == tx.CONFIRM
    assert button["value"] == f"{value}/{digest_of(state.destructive)}"
    assert not any(isinstance(e, RunApproved) for e in await _run_events(slack, A, run_id))

    forged = f"{value}/{digest_of(['null_resource.a'])}"
    await slack.click(tx.CONFIRM, forged, team=TEAM_A, user=ua("alice"), secret=SECRET_A, hook="x2")
    await slack.work(A)
    assert "acknowledges every one" in slack.receiver.to("x2")[-1]["text"]
    assert not any(isinstance(e, RunApproved) for e in await _run_events(slack, A, run_id))

    await slack.click(
        tx.CONFIRM, button["value"], team=TEAM_A, user=ua("alice"), secret=SECRET_A, hook="x3"
    )
    await slack.work(A)
    approved = [e for e in await _run_events(slack, A, run_id) if isinstance(e, RunApproved)]
    assert [(e.actor, e.acknowledged) for e in approved] == [("alice", state.destructive)]

    # the slash command goes the same way
    cancel = CancelRun(actor="admin", reason="make room")
    await slack.app.run_command(A, "net", run_id, cancel)
    second = await _api_run(slack)
    await slack.awaiting(A, second, changes=changes)
    await slack.command(
        f"approve {second}", team=TEAM_A, user=ua("alice"), secret=SECRET_A, hook="x4"
    )
    await slack.work(A)
    assert slack.receiver.to("x4")[-1]["blocks"][-1]["elements"][0]["action_id"] == tx.CONFIRM
    assert not any(isinstance(e, RunApproved) for e in await _run_events(slack, A, second))


# ---------------------------------------------------------------- organizations apart


async def test_one_orgs_slack_cannot_act_on_another_orgs_runs(slack: Slack) -> None:
    """Org A's Slack user with a button value tampered to org B's run: refused, B's run
    untouched. Org A's secret signing a request naming B's team: 401. And org B naming A's
    team gains nothing: A's requests are still A's, B's secret signs none of them."""
    await slack.org(A, TEAM_A, SECRET_A)
    await slack.org(B, TEAM_B, SECRET_B)
    b_run = await _api_run(slack, B)
    await slack.awaiting(B, b_run)
    value = f"{B}/net/{b_run}"
    await slack.click(tx.APPROVE, value, team=TEAM_A, user=ua("alice"), secret=SECRET_A, hook="t")
    await slack.work(A)
    assert "not one of this Slack app's organization" in slack.receiver.to("t")[-1]["text"]
    await slack.command(
        f"approve {b_run}", team=TEAM_A, user=ua("alice"), secret=SECRET_A, hook="t2"
    )
    await slack.work(A)
    assert "not found" in slack.receiver.to("t2")[-1]["text"]
    # A's secret, B's team (and B's mapped user)
    a = await slack.click(
        tx.APPROVE, value, team=TEAM_B, user=ua("alice", B), secret=SECRET_A, hook="t3"
    )
    a.problem("unauthorized", 401)
    assert not any(isinstance(e, RunApproved) for e in await _run_events(slack, B, b_run))

    # B claims A's team: A's requests still verify as A's, and B's secret proves nothing
    put = {"team_id": TEAM_A}
    assert (await slack.http.call("PUT", f"/api/v1/orgs/{B}/chat/slack", json=put)).status == 200
    a_run = await _api_run(slack, A)
    await _synced(slack)
    ok = await slack.command("status net", team=TEAM_A, user=ua("alice"), secret=SECRET_A)
    assert a_run in ok.body["text"], ok.body
    a = await slack.command(f"approve {b_run}", team=TEAM_A, user=ua("alice", B), secret="nope")
    a.problem("unauthorized", 401)


# ---------------------------------------------------------------- hostile text


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("approve ../x", "is not a run id"),
        ("approve", "usage: `approve <run id>`"),
        ("status ../../etc", "is not a workspace"),
        ("plan net extra words", "too many words"),
        ("runs sideways", "is not a run status"),
        ("frobnicate <!channel>", "unknown command"),
        ("approve \x00\x1b[31m", "is not a run id"),
        ("discard 01abc " + "r" * 600, "the reason is 600 characters"),
        ("approve " + "ü" * 5000, "characters long; at most 1000"),
        ("status 网络", "is not a workspace"),
        ("approve 😀" * 3, "is not a run id"),
    ],
)
async def test_a_bad_command_gets_a_clear_reply_never_a_traceback(
    slack: Slack, text: str, says: str
) -> None:
    await slack.org(A, TEAM_A, SECRET_A)
    a = await slack.command(text, team=TEAM_A, user=ua("bob"), secret=SECRET_A)
    assert a.status == 200 and a.body["response_type"] == "ephemeral", a.body
    assert says in a.body["text"], a.body["text"]
    assert "<!channel>" not in a.body["text"] and "Traceback" not in a.body["text"]
    assert len(a.body["text"]) < 2000
    assert await slack.requests(A) == []


async def test_slack_markup_in_a_runs_message_is_shown_not_obeyed(slack: Slack) -> None:
    """A run's message with `<!channel>` and `<http://evil|x>` is escaped in the card."""
    await slack.org(A, TEAM_A, SECRET_A)
    run_id = await _api_run(slack, message=HOSTILE)
    await slack.awaiting(A, run_id)
    await slack.click(
        tx.DISCARD, f"{A}/net/{run_id}", team=TEAM_A, user=ua("bob"), secret=SECRET_A, hook="e"
    )
    await slack.work(A)
    card = slack.receiver.to("e")[-1]
    text = card["blocks"][0]["text"]["text"]
    assert "&lt;!channel&gt;" in text and "&lt;http://evil.example|click me&gt;" in text
    for raw in ("<!channel>", "<http://", "<@U0BOSS>"):
        assert raw not in text and raw not in card["text"]
    assert "&amp;" in text


# ---------------------------------------------------------------- configuration


async def test_the_slack_app_is_configured_by_an_admin_and_its_secrets_never_shown(
    slack: Slack,
) -> None:
    tokens = await slack.org(A, TEAM_A, SECRET_A)
    path = f"/api/v1/orgs/{A}/chat/slack"
    shown = await slack.http.get(path)
    assert shown.body["team_id"] == TEAM_A and shown.body["signing_secret"] == "(sensitive)"
    assert shown.body["bot_token"] is None
    put = {"team_id": TEAM_A, "bot_token": "xoxb-very-secret-bot-token"}
    assert (await slack.http.call("PUT", path, json=put)).body["bot_token"] == "(sensitive)"
    denied = await slack.http.call("PUT", path, json=put, token=tokens["alice"])
    denied.problem("forbidden", 403)
    users = await slack.http.get(path + "/users")
    assert {u["user"] for u in users.body["items"]} == {"alice", "bob", "vera"}
    one = await slack.http.get(f"{path}/users/{ua('bob')}")
    assert one.body == {"slack_id": ua("bob"), "user": "bob"}
    d = await slack.http.call("DELETE", f"{path}/users/{ua('bob')}")
    assert d.status == 204
    (await slack.http.get(f"{path}/users/{ua('bob')}")).problem("not-found", 404)
    (await slack.http.call("PUT", f"{path}/users/u-lower", json={"user": "x"})).problem(
        "invalid-id", 422
    )
    first = await slack.http.call("PUT", f"/api/v1/orgs/{B}/chat/slack", json={"team_id": "T1"})
    assert first.status in (404, 422), first.body  # no org B; and no secret
    # removed: its requests are refused, its secrets gone, a new one needs a secret again
    assert (await slack.http.call("DELETE", path)).status == 204
    a = await slack.command("help", team=TEAM_A, user=ua("alice"), secret=SECRET_A)
    a.problem("unauthorized", 401)
    assert await slack.config.secret(A, "slack-signing-secret") == ""
    again = await slack.http.call("PUT", path, json={"team_id": TEAM_A})
    assert "needs the signing_secret" in again.problem("invalid-command", 422)["detail"]
    # no secret in any event or the read model's audit
    envs = await slack.app.store.read("rp.>")
    raw = b"".join(chat_agg_encode(e.event) for e in envs)
    assert SECRET_A.encode() not in raw and b"xoxb-very-secret" not in raw
    assert b"hooks" not in raw  # response_urls are sealed too


def chat_agg_encode(event: Any) -> bytes:
    from events.codec import encode

    return encode(event)


_ = chat_agg  # the module under test's events are matched by type above


# ---------------------------------------------------------------- the subscribers


async def test_the_subscribers_work_what_was_recorded_and_keep_the_message_current(
    slack: Slack,
) -> None:
    """Through the one consumer loop: a command recorded while no subscriber ran is
    worked when they start (the log is the outbox); the message is replaced as the run
    awaits approval and once the button approves it; a request older than 30 minutes is
    recorded done as `expired`, not worked."""
    await slack.org(A, TEAM_A, SECRET_A)
    a = await slack.command("apply net", team=TEAM_A, user=ua("bob"), secret=SECRET_A, hook="e")
    assert a.status == 200
    stale = chat_agg.SlackRequestReceived(
        at=slack.app.clock() - timedelta(hours=1),
        actor=ua("bob"),
        request_id="0" * 32,
        kind="command",
        team_id=TEAM_A,
        slack_user=ua("bob"),
        text="plan net",
    )
    subject = chat_agg.request_subject(A, stale.request_id)
    await slack.app.store.append([Append(subject=subject, event=stale, expected=0)])
    for sub in build(slack.app, slack.config.keyring, slack.worker.poster):
        consumer = await slack.stack.enter_async_context(
            Consumer(slack.http.app.store.nc, sub, states=slack.app.states)
        )
        await asyncio.wait_for(consumer.ready.wait(), 10)

    async def posted(hook: str, n: int) -> list[dict[str, Any]]:
        got = slack.receiver.to(hook)
        assert len(got) >= n, got
        return got

    first = (await eventually(lambda: posted("e", 1), what="the run's card"))[0]
    assert "pending" in first["text"] and "bob" in first["text"]
    runs = await _runs(slack)
    assert [r["created_by"] for r in runs] == ["bob"]  # the stale `plan net` made none
    run_id = runs[0]["id"]
    await slack.awaiting(A, run_id)

    async def awaiting_shown() -> bool:
        return any("awaiting_approval" in m["text"] for m in slack.receiver.to("e"))

    await eventually(awaiting_shown, what="the card updated in place")
    shown = [m for m in slack.receiver.to("e") if "awaiting_approval" in m["text"]][-1]
    assert shown["replace_original"] is True
    value = shown["blocks"][-1]["elements"][0]["value"]
    await slack.click(tx.APPROVE, value, team=TEAM_A, user=ua("alice"), secret=SECRET_A, hook="f")

    async def approved() -> list[Any]:
        return [e for e in await _run_events(slack, A, run_id) if isinstance(e, RunApproved)]

    ev = (await eventually(approved, what="the approval"))[0]
    assert (ev.actor, ev.via) == ("alice", "slack")
    await eventually(lambda: posted("f", 1), what="the clicked message replaced")

    async def expired() -> bool:
        envs = await slack.app.store.read(subject)
        return any(getattr(e.event, "outcome", "") == "expired" for e in envs)

    await eventually(expired, what="the stale request expired")


def test_a_confirmation_lists_every_address_of_a_large_plan_in_sections() -> None:
    """300 long addresses: every one is listed (in sections within Slack's limits), the
    button acknowledges the digest of them all; past 45 sections the rest are counted."""
    many = [f'module.m["{"x" * 80}"].null_resource.r[{i}]' for i in range(300)]
    msg = tx.confirmation("acme/net/r1", "r1", many, digest_of(many))
    sections = [b for b in msg["blocks"] if b["type"] == "section"]
    assert all(len(b["text"]["text"]) <= tx.MAX_FIELD for b in sections)
    assert len(msg["blocks"]) <= 50
    listed = "\n".join(b["text"]["text"] for b in sections)
    assert all(a in listed for a in many)
    assert msg["blocks"][-1]["elements"][0]["value"] == f"acme/net/r1/{digest_of(many)}"
    huge = [f"null_resource.r{'y' * 200}[{i}]" for i in range(2000)]
    msg = tx.confirmation("acme/net/r1", "r1", huge, digest_of(huge))
    assert len(msg["blocks"]) <= 50 and "more: see the run's changes" in msg["text"]


async def test_a_create_redelivered_after_its_run_was_made_makes_no_second_run(
    slack: Slack,
) -> None:
    """The worker died after creating the run, before recording the request done: the
    redelivered request finds the run (its id comes from the request) and links it."""
    await slack.org(A, TEAM_A, SECRET_A)
    await slack.command("plan net", team=TEAM_A, user=ua("bob"), secret=SECRET_A, hook="p")
    (event,) = await slack.requests(A)
    who = await slack.config.who(A, ua("bob"))
    _, run_id = await slack.worker.work(A, event, who)  # the work, and no `done`
    assert await slack.work(A) == 1  # redelivered
    assert [r["id"] for r in await _runs(slack)] == [run_id]
    assert run_id in slack.receiver.to("p")[-1]["text"]
