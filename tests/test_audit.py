"""The organization's audit log (issue 25, items 1 and 2): the auditor records commands
from the event log, the api records refusals where they happen, each organization's
records form one linear hash chain with signed checkpoints, `GET .../audit` reads it
(org admins and the right `read-audit` only), and `runplane audit verify` proves it."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

from nats.aio.client import Client as NATS

from events.audit import Facts
from infra.auditkeys import AuditKeys
from infra.auditlog import AuditLog
from services.root.bootstrap import Plane
from tests.access_support import person
from tests.api_support import Http, http_fixture  # noqa: F401  # `http`
from tests.audit_support import recorded, records, verify
from tests.helpers import eventually
from tests.slack_support import Slack, slack_fixture, slack_id  # noqa: F401  # `slack`
from tests.ui.support import Ui, ui_fixture  # noqa: F401  # `ui`

V1 = "/api/v1/orgs"


async def test_commands_are_recorded_with_who_via_what_and_the_request(
    http: Http, system: Plane, nc: NATS
) -> None:
    """A run created and a workspace made through the API each get a record naming the
    actor, its kind, the surface, the thing, the request id the caller gave and the
    client's address; the record carries its event's sequence and hash, not its content."""
    await system.start_auditor(checkpoint_s=0.1)
    tokens = await http.org("a")
    await http.workspace("a", "net")
    run = await http.run("a", "net", token=tokens["operator"], headers={"X-Request-Id": "req-42"})
    (made,) = await recorded(nc, "a", "run.created")
    assert made["actor"] == "operator-user" and made["actor_kind"] == "token"
    assert made["via"] == "api" and made["thing"] == f"run net/{run['id']}"
    assert made["request_id"] == "req-42" and made["client"] == "127.0.0.1"
    assert made["outcome"] == "ok" and made["src"] > 0 and len(made["src_hash"]) == 64
    (org,) = await recorded(nc, "a", "org.created")
    assert org["thing"] == "organization a"
    (ws,) = await recorded(nc, "a", "ws.created")
    assert ws["actor_kind"] == "admin" and ws["thing"] == "workspace net"
    assert "message" not in made and "config" not in made


async def test_a_viewers_apply_is_refused_and_the_refusal_is_on_the_record(
    http: Http, system: Plane, nc: NATS
) -> None:
    """403 to a viewer's apply, and a `refused` record of it in the org's chain, with the
    request id the answer carried."""
    tokens = await http.org("a")
    await http.workspace("a", "net")
    body = {"type": "apply"}
    a = await http.post(f"{V1}/a/workspaces/net/runs", json=body, token=tokens["viewer"])
    a.problem("forbidden", 403)
    (refusal,) = await recorded(nc, "a", "refused POST /api/v1/orgs/{org}/workspaces/{ws}/runs")
    assert refusal["outcome"] == "refused" and refusal["status"] == 403
    assert refusal["detail"] == "forbidden" and refusal["actor"] == "viewer-user"
    assert refusal["thing"] == "workspace net"
    assert refusal["request_id"] == a.headers["X-Request-ID"]


async def test_a_conflict_on_approve_is_recorded_but_not_other_409s(
    http: Http, system: Plane, nc: NATS
) -> None:
    """Approving a run that awaits nothing is 409 on the record; a 409 elsewhere (an
    organization that exists) is not."""
    await system.start_auditor(checkpoint_s=0.1)
    await http.org("a")
    await http.workspace("a", "net")
    run = await http.run("a", "net")
    a = await http.post(f"{V1}/a/runs/{run['id']}/approve", json={"acknowledged": []})
    assert a.status == 409, a.body
    assert (await http.post("/api/v1/orgs", json={"name": "a"})).status == 409
    (r,) = await recorded(nc, "a", "refused POST /api/v1/orgs/{org}/runs/{run}/approve")
    assert r["status"] == 409 and r["thing"] == f"run {run['id']}"
    await recorded(nc, "a", "run.created")
    assert not [x for _, x in await records(nc, "a") if '/api/v1/orgs"' in json.dumps(x)]


async def test_org_a_cannot_read_org_b_s_audit_nor_write_into_it(
    http: Http, system: Plane, nc: NATS
) -> None:
    """A's admin: 404 on B's audit; A's refusals on B's paths are 404 and recorded nowhere;
    a name made to look like another record (quotes, B's org; a newline is refused
    already) stays a string of a record of A: every JSON line of A's export is one record of A."""
    await system.start_auditor(checkpoint_s=0.1)
    a_tokens = await http.org("a")
    await http.org("b")
    await http.workspace("b", "secret")
    forged = 'x"}{"org":"b","n":1,"action":"run.approved'
    t = await http.post(f"{V1}/a/tokens", json={"user": forged, "role": "admin"})
    assert t.status == 201, t.body
    evil = t.body["token"]
    (await http.get(f"{V1}/b/audit", token=evil)).problem("not-found", 404)
    (await http.get(f"{V1}/b/audit", token=a_tokens["admin"])).problem("not-found", 404)
    for path in (f"{V1}/b/workspaces/secret/runs", f"{V1}/b/workspaces"):
        a = await http.post(path, json={"type": "apply", "name": "x"}, token=evil)
        assert a.status == 404, a.body
    body = {"name": "net", "repository": "https://example.com/infra.git"}
    assert (await http.post(f"{V1}/a/workspaces", json=body, token=evil)).status == 201
    await recorded(nc, "a", "ws.created")
    (await http.get(f"{V1}/a/audit", token=a_tokens["viewer"])).problem("forbidden", 403)
    export = await http.client.get(
        f"{V1}/a/audit?format=jsonl", headers={"Authorization": f"Bearer {evil}"}
    )
    lines = (await export.read()).decode().splitlines()
    assert lines and all(json.loads(line)["org"] == "a" for line in lines)
    assert any(json.loads(line)["actor"] == forged for line in lines)
    b = [r for _, r in await records(nc, "b")]
    assert {r["org"] for r in b} == {"b"} and not [r for r in b if r["actor"] == forged]
    assert (await verify(nc))[0] == 0


async def test_the_audit_right_reads_without_admin_and_filters_page(
    http: Http, system: Plane, nc: NATS
) -> None:
    """A team with the right `read-audit` (no level) reads the log; filters by action and
    outcome; a cursor pages without repeating or skipping."""
    await system.start_auditor(checkpoint_s=0.1)
    await http.org("a")
    for i in range(5):
        await http.workspace("a", f"w{i}")
    made = await http.post(f"{V1}/a/teams", json={"name": "auditors", "rights": ["read-audit"]})
    assert made.status == 201, made.body
    token = await person(http, "a", "eve@a.io", "auditors")
    await recorded(nc, "a", "ws.created", 5)
    seen: list[int] = []
    cursor = 0
    while True:
        query = f"action=ws.created&limit=2&cursor={cursor}"
        page = await http.get(f"{V1}/a/audit?{query}", token=token)
        assert page.status == 200, page.body
        seen.extend(i["seq"] for i in page.body["items"])
        assert all(i["action"] == "ws.created" for i in page.body["items"])
        if page.body["next"] is None:
            break
        cursor = page.body["next"]
    assert len(seen) == 5 == len(set(seen)) and seen == sorted(seen)
    page = await http.get(f"{V1}/a/audit?outcome=refused", token=token)
    assert page.body["items"] == []
    (await http.get(f"{V1}/a/audit?outcome=maybe", token=token)).problem("invalid-query", 400)

    async def published() -> list[dict[str, str]] | None:
        keys = await http.get("/api/v1/audit/keys", token=None)  # public: no token
        assert keys.status == 200, keys.body
        return keys.body["keys"] or None  # type: ignore[no-any-return]  # JSON

    (key,) = await eventually(published, what="the checkpoint key published")
    assert key["alg"] == "Ed25519" and len(key["public"]) == 64 and set(key) == {
        "kid", "alg", "public", "created",
    }  # fmt: skip


async def test_two_writers_on_one_chain_keep_it_linear(nc: NATS, system: Plane) -> None:
    """Two writers (two processes' AuditLog) append 40 records each at once to one chain:
    80 records numbered 1..80, each linked to the one before, and verify passes."""
    one, two = AuditLog(nc), AuditLog(nc)

    def facts(i: int, who: str) -> Facts:
        return Facts(
            org="c", at=datetime.now(UTC), actor=who, actor_kind="user", via="api",
            action="refused POST x", thing="organization c", outcome="refused", status=403,
        )  # fmt: skip

    await asyncio.gather(
        *(one.append(facts(i, "one")) for i in range(40)),
        *(two.append(facts(i, "two")) for i in range(40)),
    )
    chain = [r for _, r in await records(nc, "c")]
    assert [r["n"] for r in chain] == list(range(1, 81))
    await one.checkpoint("c", AuditKeys(nc, system.keyring), datetime.now(UTC))
    code, out = await verify(nc, org="c")
    assert code == 0, out


async def test_a_killed_auditor_loses_and_doubles_nothing(
    http: Http, system: Plane, process: object, nc: NATS
) -> None:
    """The auditor is stopped after a few records, twice, then two auditors start at once
    from the same cursor (racing on every record): each command has exactly one record."""
    await http.org("a")
    for i in range(12):
        await http.workspace("a", f"w{i}")
    for stop_after in (2, 5):
        auditor = await system.start_auditor(checkpoint_s=0.05)
        await recorded(nc, "a", "ws.created", stop_after)
        await auditor.__aexit__(None, None, None)
    await system.start_auditor(checkpoint_s=0.05)
    await system.start_auditor(checkpoint_s=0.05)
    await recorded(nc, "a", "ws.created", 12)
    await asyncio.sleep(0.5)  # both have gone over everything by now: no late double
    chain = [r for _, r in await records(nc, "a") if r.get("src")]
    srcs = [r["src"] for r in chain]
    assert len(srcs) == len(set(srcs)) and srcs == sorted(srcs)
    assert len([r for r in chain if r["action"] == "ws.created"]) == 12
    code, out = await verify(nc)
    assert code == 0, out


async def test_a_chain_of_refusals_alone_is_checkpointed(nc: NATS, system: Plane) -> None:
    """Records the api appends (refusals), with no event behind them, are signed too:
    the auditor sees every append and checkpoints the chain within its interval, and a
    chain left unsigned while no auditor ran is signed after the next one starts."""
    facts = Facts(
        org="z", at=datetime.now(UTC), actor="v", actor_kind="token", via="api",
        action="refused POST x", thing="organization z", outcome="refused", status=403,
    )  # fmt: skip
    await AuditLog(nc).append(facts)  # before any auditor: seen at its start
    await system.start_auditor(checkpoint_s=0.1)

    async def signed() -> bool:
        chain = [r for _, r in await records(nc, "z")]
        return chain[-1].get("kind") == "checkpoint" and chain[-1]["n"] == 2

    await eventually(signed, timeout=10, what="a checkpoint after the refusal")
    code, out = await verify(nc, org="z")
    assert code == 0 and "1 checkpoints verified, 0 after the last one" in out, out


async def test_a_run_made_through_chat_is_recorded_via_chat_with_its_request(
    slack: Slack, system: Plane, nc: NATS
) -> None:
    """`apply net` from Slack: the run's record says bob, via chat, from slack, with the
    Slack request's id; on main its events carried no origin (via: the cause alone)."""
    await system.start_auditor(checkpoint_s=0.1)
    await slack.org("acme", "T0ACME", "8f742231b10e8888abcd99yyyzzz85a5")
    a = await slack.command(
        "apply net", team="T0ACME", user=slack_id("acme", "bob"),
        secret="8f742231b10e8888abcd99yyyzzz85a5", hook="m",
    )  # fmt: skip
    assert a.status == 200, a.body
    assert await slack.work("acme") == 1
    (made,) = await recorded(nc, "acme", "run.created")
    assert (made["actor"], made["via"], made["client"]) == ("bob", "chat", "slack")
    assert made["actor_kind"] == "user" and made["request_id"]


async def test_a_refusal_in_the_web_ui_is_recorded_via_ui(ui: Ui, nc: NATS) -> None:
    """An approver approving a run that awaits nothing in the web UI: the run page again
    with 409, and a `refused` record via ui (the UI answers that refusal itself)."""
    tokens = await ui.http.org("a")
    await ui.http.workspace("a", "net")
    run = await ui.http.run("a", "net")
    browser = ui.browser()
    await browser.signin(tokens["approver"])
    await browser.get(f"/orgs/a/runs/{run['id']}")
    page = await browser.post(f"/orgs/a/runs/{run['id']}/approve", [])
    assert page.status == 409, page.text[:300]

    async def refused() -> dict[str, object] | None:
        found = [r for _, r in await records(nc, "a") if r.get("outcome") == "refused"]
        return found[0] if found else None

    r = await eventually(refused, timeout=10, what="the UI's refusal on the record")
    assert (r["via"], r["actor"], r["status"]) == ("ui", "approver-user", 409)
    assert r["thing"] == f"run {run['id']}" and str(r["action"]).endswith("/approve")


async def test_the_audit_page_shows_the_records_to_admins_only(ui: Ui, nc: NATS) -> None:
    """The web UI's audit page: an admin sees the records (a refusal among them), and the
    nav links to it; a viewer is refused and has no link; B's admin finds no A."""
    tokens = await ui.http.org("a")
    b_tokens = await ui.http.org("b")
    await ui.http.workspace("a", "net")
    viewer_try = await ui.http.post(
        f"{V1}/a/workspaces/net/runs", json={"type": "apply"}, token=tokens["viewer"]
    )
    assert viewer_try.status == 403
    await recorded(nc, "a", "refused POST /api/v1/orgs/{org}/workspaces/{ws}/runs")
    admin = ui.browser()
    await admin.signin(tokens["admin"])
    page = await admin.get("/orgs/a/audit?outcome=refused")
    assert page.status == 200 and 'href="/orgs/a/audit"' in page.text
    assert "viewer-user (token)" in page.text and "refused 403" in page.text
    viewer = ui.browser()
    await viewer.signin(tokens["viewer"])
    assert (await viewer.get("/orgs/a/audit")).status == 403
    assert 'href="/orgs/a/audit"' not in (await viewer.get("/orgs/a")).text
    other = ui.browser()
    await other.signin(b_tokens["admin"])
    assert (await other.get("/orgs/a/audit")).status == 404
