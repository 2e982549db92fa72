"""Tokens have a lifecycle: listed (never their secret), revoked (refused at once, on every
replica, even one whose read model is behind), expiring (401 token-expired), with their
last use recorded boundedly; all of it in the event history with actor and time. And the
attacks: another organization's admin, a lesser role, the bootstrap admin token."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiosqlite
import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS

from events import org
from events.codec import org_subject
from events.errors import Invalid, NotFound
from events.org import RevokeToken, TokenIssued, TokenRevoked, TokenUsed, uses_subject
from infra.natsserver import EmbeddedNats
from projections import replay
from projections.readmodel import ReadModel
from services.surfaces.api.context import API
from tests.api_support import ADMIN_TOKEN, Http, http_fixture  # noqa: F401  # `http`
from tests.bootstrap_support import System, built
from tests.gwt import NOW, Aggregate, given
from tests.helpers import eventually

V1 = "/api/v1"
TOKENS = f"{V1}/orgs/acme/tokens"
START = datetime(2030, 6, 1, 12, 0, tzinfo=UTC)
LISTED = {
    "token_id",
    "user",
    "role",
    "created_at",
    "created_by",
    "expires_at",
    "last_used_at",
    "expired",
    "kind",
    "owner",
    "level",
    "name",
}


class Clock:
    """The App's clock, moved by hand: expiry and "last used" without waiting."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def system(nc: NATS, tmp_path: Path, clock: Clock) -> AsyncIterator[System]:
    """The graph on the test's clock (overrides conftest's `system`: `app` and `http`
    are built over it)."""
    async with AsyncExitStack() as stack:
        yield built(nc, stack, tmp_path, clock=clock)


async def _issue(http: Http, org_name: str = "acme", **body: Any) -> dict[str, Any]:
    a = await http.post(
        f"{V1}/orgs/{org_name}/tokens", json={"user": "ci", "role": "viewer", **body}
    )
    assert a.status == 201, a.body
    return a.body  # type: ignore[no-any-return]  # JSON object


async def _listed(http: Http, token: str = ADMIN_TOKEN, org_name: str = "acme") -> list[Any]:
    a = await http.get(f"{V1}/orgs/{org_name}/tokens", token=token)
    assert a.status == 200, a.body
    return a.body["items"]  # type: ignore[no-any-return]  # JSON list


def _dump(body: Any) -> str:
    return msgspec.json.encode(body).decode()


async def _org_events(http: Http, kind: type) -> list[Any]:
    return [
        e.event for e in await http.app.store.read(org_subject("acme")) if isinstance(e.event, kind)
    ]


# ---------------------------------------------------------------- the core


ORG = Aggregate(initial=org.INITIAL, decide=org.decide, evolve=org.evolve)
CREATED = org.OrgCreated(at=NOW, actor="root", name="acme")
ISSUED = TokenIssued(
    at=NOW, actor="alice", token_id="tok-1", token_hash="h", user="bob", role="viewer"
)
REVOKED = TokenRevoked(at=NOW, actor="alice", token_id="tok-1")


def test_a_revocation_records_who_revoked_which_token_and_when() -> None:
    state = (
        given(ORG, CREATED, ISSUED)
        .when(RevokeToken(actor="carol", token_id="tok-1"))
        .then(TokenRevoked(at=NOW, actor="carol", token_id="tok-1"))
    )
    assert state.revoked == frozenset({"tok-1"})


def test_revoking_a_revoked_token_again_records_nothing() -> None:
    given(ORG, CREATED, ISSUED, REVOKED).when(RevokeToken(actor="carol", token_id="tok-1")).then()


@pytest.mark.parametrize("token_id", ["tok-2", "admin", ""])
def test_a_token_the_organization_never_issued_is_not_found(token_id: str) -> None:
    given(ORG, CREATED, ISSUED).when(RevokeToken(actor="carol", token_id=token_id)).then_error(
        NotFound
    )


@pytest.mark.parametrize("delta", [timedelta(0), timedelta(seconds=-1)])
def test_a_token_cannot_be_issued_already_expired(delta: timedelta) -> None:
    cmd = org.IssueToken(
        actor="alice", token_id="tok-2", token_hash="h2", user="bob", expires_at=NOW + delta
    )
    given(ORG, CREATED).when(cmd).then_error(Invalid)


# ---------------------------------------------------------------- listing


async def test_the_list_shows_each_tokens_lifecycle_and_never_its_secret_nor_hash(
    http: Http, clock: Clock
) -> None:
    """id, user, role, created, expires, last used: and neither the token nor its digest
    appears anywhere in the answer."""
    tokens = await http.org("acme")
    expiring = await _issue(http, expires_in=3600)
    assert expiring["expires_at"] == "2030-06-01T13:00:00.000000Z"
    a = await http.get(TOKENS)
    assert a.status == 200
    raw = _dump(a.body)
    for secret in [*tokens.values(), expiring["token"]]:
        assert secret not in raw
        assert hashlib.sha256(secret.encode()).hexdigest() not in raw
    rows = {r["token_id"]: r for r in a.body["items"]}
    assert len(rows) == 5
    for r in rows.values():
        assert set(r) == LISTED
    row = rows[expiring["token_id"]]
    assert (row["user"], row["role"], row["created_by"]) == ("ci", "viewer", "admin")
    assert row["created_at"] == "2030-06-01T12:00:00.000000Z"
    assert row["expires_at"] == "2030-06-01T13:00:00.000000Z"
    assert (row["last_used_at"], row["expired"]) == (None, False)
    assert sorted(r["role"] for r in rows.values() if r["expires_at"] is None) == sorted(
        ("viewer", "operator", "approver", "admin")
    )


# ---------------------------------------------------------------- revocation


async def test_a_revoked_token_is_refused_at_once_and_the_revocation_is_in_the_history(
    http: Http,
) -> None:
    """The attack test: on old main a leaked token stayed valid for ever (no DELETE)."""
    tokens = await http.org("acme")
    leaked = await _issue(http, role="operator")
    assert (await http.get(f"{V1}/orgs/acme", token=leaked["token"])).status == 200
    a = await http.call("DELETE", f"{TOKENS}/{leaked['token_id']}", token=tokens["admin"])
    assert a.status == 204, a.body
    assert int(a.headers["RP-Seq"]) > 0
    b = await http.get(f"{V1}/orgs/acme", token=leaked["token"])
    assert "revoked" in b.problem("unauthorized", 401)["detail"]
    assert 'error="invalid_token"' in b.headers["WWW-Authenticate"]
    (
        await http.post(f"{V1}/orgs/acme/workspaces/net/runs", token=leaked["token"], json={})
    ).problem("unauthorized", 401)
    assert leaked["token_id"] not in {r["token_id"] for r in await _listed(http)}
    [revoked] = await _org_events(http, TokenRevoked)
    assert (revoked.token_id, revoked.actor, revoked.at) == (
        leaked["token_id"],
        "admin-user",
        START,
    )
    # revoking again is harmless (a retried DELETE) and records nothing more
    again = await http.call("DELETE", f"{TOKENS}/{leaked['token_id']}", token=tokens["admin"])
    assert again.status == 204
    assert len(await _org_events(http, TokenRevoked)) == 1
    assert (await http.get(f"{V1}/orgs/acme", token=tokens["viewer"])).status == 200


async def test_a_replica_whose_read_model_is_behind_the_revocation_does_not_accept_the_token(
    http: Http, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """Replica B's projection is held back (its database locked by a slow writer) while
    the token is revoked through replica A: B answers 503 stale-read, never 200, and 401
    once it has caught up."""
    await http.org("acme")
    leaked = await _issue(http)
    nc_b = await nats_server.connect()
    try:
        async with AsyncExitStack() as stack:  # replica B: a process of its own
            replica = built(nc_b, stack, tmp_path)
            db_b = tmp_path / "rm-b.sqlite"
            projector_b = await stack.enter_async_context(replica.projector(db_b))
            web_b = replica.web_app(
                projector_b, admin_token="b", secret_store=None, repositories=None
            )
            web_b[API].token_wait = 0.3
            async with TestClient(TestServer(web_b)) as client_b:
                b = Http(client_b, web_b[API], web_b[API].app)
                assert (await b.get(f"{V1}/orgs/acme", token=leaked["token"])).status == 200
                # A second writer holds B's database: B's projector cannot commit a batch
                lock = await aiosqlite.connect(tmp_path / "rm-b.sqlite", isolation_level=None)
                await lock.execute("BEGIN IMMEDIATE")
                try:
                    a = await http.call("DELETE", f"{TOKENS}/{leaked['token_id']}")
                    assert a.status == 204
                    behind = await b.get(f"{V1}/orgs/acme", token=leaked["token"])
                    behind.problem("stale-read", 503)
                    assert projector_b.seq < a.seq
                finally:
                    await lock.execute("ROLLBACK")
                    await lock.close()

                async def refused() -> bool:
                    c = await b.get(f"{V1}/orgs/acme", token=leaked["token"])
                    return c.status == 401

                await eventually(refused, timeout=20, what="replica B refusing the token")
    finally:
        await nc_b.close()


# ---------------------------------------------------------------- expiry


async def test_an_expired_token_is_refused_as_token_expired(http: Http, clock: Clock) -> None:
    await http.org("acme")
    by_seconds = await _issue(http, expires_in=60)
    by_date = await _issue(http, expires_at="2030-06-01T14:30:00+02:00")  # 12:30 UTC
    for t in (by_seconds, by_date):
        assert (await http.get(f"{V1}/orgs/acme", token=t["token"])).status == 200
    clock.advance(seconds=60)
    a = await http.get(f"{V1}/orgs/acme", token=by_seconds["token"])
    body = a.problem("token-expired", 401)
    assert body["expired_at"] == "2030-06-01T12:01:00.000000Z"
    assert 'error="invalid_token"' in a.headers["WWW-Authenticate"]
    assert (await http.get(f"{V1}/orgs/acme", token=by_date["token"])).status == 200
    clock.advance(minutes=29)
    (await http.get(f"{V1}/orgs/acme", token=by_date["token"])).problem("token-expired", 401)
    expired = {r["token_id"]: r["expired"] for r in await _listed(http)}
    assert expired[by_seconds["token_id"]] and expired[by_date["token_id"]]
    issued = {e.token_id: e.expires_at for e in await _org_events(http, TokenIssued)}
    assert issued[by_date["token_id"]] == datetime(2030, 6, 1, 12, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("body", "slug", "status"),
    [
        ({"expires_in": -5}, "invalid-command", 422),
        ({"expires_in": 0}, "invalid-command", 422),
        ({"expires_in": 10**12}, "invalid-command", 422),
        ({"expires_in": 60, "expires_at": "2031-01-01T00:00:00Z"}, "invalid-command", 422),
        ({"expires_at": "2030-06-01T11:59:59Z"}, "invalid-command", 422),  # in the past
        ({"expires_at": "2100-01-01T00:00:00Z"}, "invalid-command", 422),  # beyond 10 years
        ({"expires_at": "2031-01-01T00:00:00"}, "invalid-body", 400),  # no offset
        ({"expires_in": "soon"}, "invalid-body", 400),
        ({"expires_on": "2031-01-01"}, "invalid-body", 400),
    ],
)
async def test_a_bad_expiry_is_refused_as_problem_details(
    http: Http, body: dict[str, Any], slug: str, status: int
) -> None:
    await http.org("acme")
    (await http.post(TOKENS, json={"role": "viewer", **body})).problem(slug, status)
    assert len(await _org_events(http, TokenIssued)) == 4  # only http.org's


async def test_revoking_an_unknown_or_malformed_token_id_is_a_problem(http: Http) -> None:
    await http.org("acme")
    (await http.call("DELETE", f"{TOKENS}/01jnosuchtoken0000000000000")).problem("not-found", 404)
    (await http.call("DELETE", f"{TOKENS}/Not_An_Id")).problem("invalid-id", 422)
    (await http.call("DELETE", f"{V1}/orgs/nowhere/tokens/01jx")).problem("not-found", 404)
    (await http.get(f"{V1}/orgs/nowhere/tokens")).problem("not-found", 404)


# ---------------------------------------------------------------- last used


async def test_last_used_is_recorded_at_most_once_per_period_off_the_orgs_history(
    http: Http, clock: Clock
) -> None:
    """Each use does not make an event: one per token per 15 minutes, on the token's own
    uses subject, so the organization's aggregate (read by every settings decision) does
    not grow with use."""
    await http.org("acme")
    t = await _issue(http)

    async def last_used() -> str | None:
        [row] = [r for r in await _listed(http) if r["token_id"] == t["token_id"]]
        return row["last_used_at"]  # type: ignore[no-any-return]  # JSON string

    async def uses() -> list[Any]:
        return [e.event for e in await http.app.store.read(uses_subject("acme", t["token_id"]))]

    assert await last_used() is None
    for _ in range(20):
        assert (await http.get(f"{V1}/orgs/acme", token=t["token"])).status == 200
    assert await eventually(last_used) == "2030-06-01T12:00:00.000000Z"
    clock.advance(minutes=14)
    assert (await http.get(f"{V1}/orgs/acme", token=t["token"])).status == 200
    assert len(await uses()) == 1
    clock.advance(minutes=1)
    assert (await http.get(f"{V1}/orgs/acme", token=t["token"])).status == 200

    async def moved() -> bool:
        return await last_used() == "2030-06-01T12:15:00.000000Z"

    await eventually(moved, what="last_used_at moving on")
    recorded = await uses()
    assert [(type(u), u.token_id, u.actor) for u in recorded] == [
        (TokenUsed, t["token_id"], "ci")
    ] * 2
    assert [u.at for u in recorded] == [START, START + timedelta(minutes=15)]
    assert await _org_events(http, TokenUsed) == []  # none on the organization's subject


# ---------------------------------------------------------------- the attacks


async def test_another_orgs_admin_can_neither_list_nor_revoke_nor_see_its_tokens(
    http: Http,
) -> None:
    acme = await http.org("acme")
    beta = await http.org("beta")
    beta_ci = await _issue(http, "beta")
    acme_admin = acme["admin"]
    (await http.get(f"{V1}/orgs/beta/tokens", token=acme_admin)).problem("not-found", 404)
    path = f"{V1}/orgs/beta/tokens/{beta_ci['token_id']}"
    (await http.call("DELETE", path, token=acme_admin)).problem("not-found", 404)
    # beta's token id through acme's own path: not one of acme's tokens
    path = f"{TOKENS}/{beta_ci['token_id']}"
    (await http.call("DELETE", path, token=acme_admin)).problem("not-found", 404)
    listed = await _listed(http, acme_admin)
    assert beta_ci["token_id"] not in {r["token_id"] for r in listed}
    assert {r["user"] for r in listed} == {f"{r}-user" for r in org.ROLES}
    assert (await http.get(f"{V1}/orgs/beta", token=beta_ci["token"])).status == 200
    assert len(await _listed(http, beta["admin"], "beta")) == 5


async def test_roles_below_admin_can_neither_list_nor_revoke_tokens(http: Http) -> None:
    tokens = await http.org("acme")
    victim = await _issue(http)
    for role in ("viewer", "operator", "approver"):
        (await http.get(TOKENS, token=tokens[role])).problem("forbidden", 403)
        path = f"{TOKENS}/{victim['token_id']}"
        (await http.call("DELETE", path, token=tokens[role])).problem("forbidden", 403)
    assert (await http.get(f"{V1}/orgs/acme", token=victim["token"])).status == 200


async def test_the_bootstrap_admin_token_is_no_org_token_to_revoke(http: Http) -> None:
    tokens = await http.org("acme")
    for token_id in ("admin", "test-admin-token"):
        a = await http.call("DELETE", f"{TOKENS}/{token_id}", token=tokens["admin"])
        a.problem("not-found", 404)
    assert ADMIN_TOKEN not in _dump(await _listed(http, tokens["admin"]))
    assert (await http.post(f"{V1}/orgs", json={"name": "gamma"})).status == 201
    # the superuser may list and revoke in any organization
    victim = await _issue(http)
    assert (await http.call("DELETE", f"{TOKENS}/{victim['token_id']}")).status == 204
    (await http.get(f"{V1}/orgs/acme", token=victim["token"])).problem("unauthorized", 401)


async def test_a_rebuilt_read_model_has_the_same_token_lifecycle_rows(
    http: Http, clock: Clock, tmp_path: Path
) -> None:
    """Revocations, expiries and uses are folded from events only: a replay from sequence
    1 writes exactly the live rows (and the uses subject is read as the org's)."""
    await http.org("acme")
    kept = await _issue(http, expires_in=600)
    gone = await _issue(http)
    assert (await http.get(f"{V1}/orgs/acme", token=kept["token"])).status == 200
    assert (await http.call("DELETE", f"{TOKENS}/{gone['token_id']}")).status == 204
    last = await http.app.store.last_seq()
    assert await http.api.reached(last, 5)
    live = await http.api.read.dump()
    assert await replay(http.api.projector.nc, tmp_path / "rebuilt.sqlite") == last
    async with await ReadModel.open(tmp_path / "rebuilt.sqlite") as rebuilt:
        dump = await rebuilt.dump()
    for table in ("tokens", "token_revocations", "token_uses", "events"):
        assert dump[table] == live[table], table
    assert [r[0] for r in live["token_uses"]] == [kept["token_id"]]
    assert {r[2] for r in live["events"] if r[5] == "org.token_used"} == {"acme"}
