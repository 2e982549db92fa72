"""Chat-ops as a workspace-level user (events/access.py through Slack): a person of acme
whose team holds `plan` on `net`, mapped to a Slack user, presses Approve and Discard on
an apply awaiting approval and types `apply net`, `approve`, `discard` and `cancel`:
each is refused saying what is missing, and the run is untouched, while `plan net` and
`status net` work and `status other` (no access) is "not found". The same Slack user
reaching for org B (a button naming B's run, B's Slack app) gets nothing. Suspended, their
mapping is refused for every command and button, even one recorded before the
suspension and worked after it."""

from __future__ import annotations

from typing import Any

from events.run import RunApproved, RunDiscarded
from services.processes.chat import text as tx
from tests.slack_support import Slack, slack_fixture  # noqa: F401  # registers the fixture

A, B = "acme", "bravo"
TEAM_A, TEAM_B = "T0ACME", "T0BRAVO"
SECRET_A, SECRET_B = "8f742231b10e8888abcd99yyyzzz85a5", "b0b0b0b0secretofbravo0000000000"
PAM = "UACMEPAM"


async def _api_run(slack: Slack, org: str = A) -> str:
    a = await slack.http.post(f"/api/v1/orgs/{org}/workspaces/net/runs", json={"type": "apply"})
    assert a.status == 201, a.body
    return str(a.body["id"])


async def _run_events(slack: Slack, org: str, run_id: str) -> list[Any]:
    return [e.event for e in await slack.app.store.read(f"rp.run.{org}.net.{run_id}")]


async def _synced(slack: Slack) -> None:
    """Queries from Slack read this replica's projection: let it catch up first."""
    assert await slack.http.api.reached(await slack.app.store.last_seq(), 5.0)


async def _plan_user(slack: Slack) -> None:
    """pam@acme.io in acme's team `network` (plan on net), mapped to Slack's PAM."""
    http = slack.http
    await http.workspace(A, "other")
    assert (await http.post(f"/api/v1/orgs/{A}/users", json={"email": "pam@acme.io"})).status == 201
    assert (await http.post(f"/api/v1/orgs/{A}/teams", json={"name": "network"})).status == 201
    members = {"members": ["pam@acme.io"]}
    a = await http.call("PUT", f"/api/v1/orgs/{A}/teams/network/members", json=members)
    assert a.status == 200, a.body
    grant = {"team": "network", "level": "plan"}
    a = await http.call("PUT", f"/api/v1/orgs/{A}/workspaces/net/access", json=grant)
    assert a.status == 200, a.body
    await slack.map(A, PAM, "pam@acme.io")


async def _say(slack: Slack, text: str, hook: str, *, team: str = TEAM_A) -> str:
    """A slash command as PAM, worked if it writes; everything Slack was told."""
    secret = SECRET_A if team == TEAM_A else SECRET_B
    a = await slack.command(text, team=team, user=PAM, secret=secret, hook=hook)
    assert a.status == 200, a.body
    await slack.work(A)
    await slack.work(B)
    return "\n".join([str(a.body.get("text", "")), *(m["text"] for m in slack.receiver.to(hook))])


async def _press(slack: Slack, action: str, value: str, hook: str) -> str:
    a = await slack.click(action, value, team=TEAM_A, user=PAM, secret=SECRET_A, hook=hook)
    assert a.status == 200
    await slack.work(A)
    return "\n".join(m["text"] for m in slack.receiver.to(hook))


async def _untouched(slack: Slack, org: str, run_id: str) -> None:
    events = await _run_events(slack, org, run_id)
    assert not any(isinstance(e, RunApproved | RunDiscarded) for e in events), events
    assert str((await slack.app.load_run(org, "net", run_id)).state.status) == "awaiting_approval"


async def test_a_plan_users_slack_buttons_and_commands_do_what_plan_allows_and_no_more(
    slack: Slack,
) -> None:
    await slack.org(A, TEAM_A, SECRET_A)
    await slack.org(B, TEAM_B, SECRET_B)
    await _plan_user(slack)
    run_id = await _api_run(slack)
    await slack.awaiting(A, run_id)
    b_run = await _api_run(slack, B)
    await slack.awaiting(B, b_run)
    await _synced(slack)

    # What plan allows.
    assert run_id in await _say(slack, "status net", "s1")
    assert "workspace `other` not found" in await _say(slack, "status other", "s2")
    said = await _say(slack, "plan net", "p1")
    assert "pam@acme.io" in said, said
    runs = (await slack.http.get(f"/api/v1/orgs/{A}/runs")).body["items"]
    assert [(r["type"], r["created_by"]) for r in runs if r["id"] != run_id] == [
        ("plan", "pam@acme.io")
    ]

    # Beyond it: buttons and commands refused with what is missing; the run untouched.
    value = f"{A}/net/{run_id}"
    for n, action in enumerate((tx.APPROVE, tx.DISCARD, tx.CONFIRM)):
        pressed = value + ("/0000000000000000" if action == tx.CONFIRM else "")
        said = await _press(slack, action, pressed, f"b{n}")
        assert "pam@acme.io has plan on workspace net" in said and "needs write" in said, said
    for n, text in enumerate(
        ("apply net", f"approve {run_id}", f"discard {run_id} no", f"cancel {run_id}")
    ):
        said = await _say(slack, text, f"c{n}")
        assert "has plan on workspace net" in said and "needs write" in said, (text, said)
    assert "not found" in await _say(slack, "plan other", "c9")
    await _untouched(slack, A, run_id)

    # Org B: a button naming B's run through A's app, and B's own app (PAM is not linked).
    said = await _press(slack, tx.APPROVE, f"{B}/net/{b_run}", "x1")
    assert "not one of this Slack app's organization" in said, said
    assert "not linked" in await _say(slack, f"approve {b_run}", "x2", team=TEAM_B)
    assert "not linked" in await _say(slack, "plan net", "x3", team=TEAM_B)
    await _untouched(slack, B, b_run)


async def test_a_suspended_users_slack_mapping_is_refused_even_for_a_request_made_before(
    slack: Slack,
) -> None:
    """An approver-level user (write on net) queues an approval from Slack; they are
    suspended before the subscriber works it: it is refused, as is everything after."""
    await slack.org(A, TEAM_A, SECRET_A)
    await _plan_user(slack)
    grant = {"team": "network", "level": "write"}
    a = await slack.http.call("PUT", f"/api/v1/orgs/{A}/workspaces/net/access", json=grant)
    assert a.status == 200, a.body
    run_id = await _api_run(slack)
    await slack.awaiting(A, run_id)
    await _synced(slack)
    pending = await slack.click(
        tx.APPROVE, f"{A}/net/{run_id}", team=TEAM_A, user=PAM, secret=SECRET_A, hook="early"
    )
    assert pending.status == 200
    users = (await slack.http.get(f"/api/v1/orgs/{A}/users")).body["items"]
    pam = next(u for u in users if u["email"] == "pam@acme.io")
    assert (await slack.http.post(f"/api/v1/orgs/{A}/users/{pam['id']}/suspend")).status == 200
    await slack.work(A)
    early = slack.receiver.to("early")[-1]["text"]
    assert "pam@acme.io is suspended in acme" in early, early
    for n, text in enumerate(("status net", "plan net", f"approve {run_id}", "runs")):
        said = await _say(slack, text, f"s{n}")
        assert "is suspended" in said and run_id not in said, (text, said)
    assert "is suspended" in await _press(slack, tx.DISCARD, f"{A}/net/{run_id}", "late")
    await _untouched(slack, A, run_id)
    runs: list[dict[str, Any]] = (await slack.http.get(f"/api/v1/orgs/{A}/runs")).body["items"]
    assert [r["id"] for r in runs] == [run_id]
