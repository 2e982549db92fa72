"""Attacks on the TFE API: capability URLs that are not what they were signed for, and
one organization's token reaching for another's objects on every route family.

Each test first shows the legitimate call working, so none passes on a server that
simply lacks the routes."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import msgspec
import pytest
from yarl import URL

from infra.crypto import KeyRing
from services.surfaces.tfe.capability import CapabilityError, Signer
from services.surfaces.tfe.context import TFE
from tests.tfe_support import Tfe, a_state, tfe_fixture

__all__ = ["tfe_fixture"]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


async def _pushed(tfe: Tfe, org: str, token: str, outputs: dict[str, str]) -> tuple[str, str]:
    """A workspace `net` of `org` with a state; its id and its state's download path."""
    ws_id = await tfe.cli_workspace(org, "net", token=token)
    assert (await tfe.lock(ws_id, token=token)).status == 200
    a = await tfe.push(ws_id, a_state(1, outputs=outputs), token=token)
    assert a.status == 201, a.body
    return ws_id, URL(a.body["data"]["attributes"]["hosted-state-download-url"]).path


def _token(path: str) -> str:
    return path.rsplit("/", 1)[1]


def _with_token(path: str, token: str) -> str:
    return path.rsplit("/", 1)[0] + "/" + token


# ---------------------------------------------------------------- capabilities


def test_a_capability_grants_its_one_object_of_its_one_kind_until_it_expires() -> None:
    now = [1_000_000.0]
    signer = Signer.of(KeyRing.generate())
    signer.clock = lambda: now[0]
    token = signer.sign("state", "acme", "acme/net/1-abc", ttl=60)
    assert signer.verify(token, "state") == ("acme", "acme/net/1-abc")
    signer.check(token, "state", "acme", "acme/net/1-abc")
    for kind, org, obj in (
        ("state", "acme", "acme/net/2-def"),  # another object's id
        ("state", "beta", "acme/net/1-abc"),  # another organization
        ("upload", "acme", "acme/net/1-abc"),  # another kind
    ):
        with pytest.raises(CapabilityError):
            signer.check(token, kind, org, obj)
    now[0] += 60
    with pytest.raises(CapabilityError):
        signer.verify(token, "state")  # expired
    other = Signer.of(KeyRing.generate())
    other.clock = signer.clock
    now[0] -= 60
    with pytest.raises(CapabilityError):
        other.verify(token, "state")  # another deployment's key
    for bad in ("", ".", "a.b", token + "x", "x" + token, token.replace(".", ".."), "é" * 10):
        with pytest.raises(CapabilityError):
            signer.verify(bad, "state")


def test_a_capability_signed_before_a_key_rotation_still_verifies() -> None:
    old = KeyRing.generate()
    token = Signer.of(old).sign("state", "acme", "x", ttl=60)
    rotated = KeyRing(current=KeyRing.generate().current, older=(old.current,))
    assert Signer.of(rotated).verify(token, "state") == ("acme", "x")


async def test_a_state_url_tampered_expired_or_moved_to_another_org_opens_nothing(
    tfe: Tfe,
) -> None:
    a_tokens, b_tokens = await tfe.org("acme"), await tfe.org("beta")
    _, a_path = await _pushed(tfe, "acme", a_tokens["admin"], {"secret": "acme's"})
    _, b_path = await _pushed(tfe, "beta", b_tokens["admin"], {"secret": "beta's"})
    status, body = await tfe.raw(a_path)
    assert status == 200 and b"acme's" in body  # the URL itself opens it, no header

    token = _token(a_path)
    payload_text, mac = token.split(".")
    payload = json.loads(_unb64(payload_text))
    b_payload = json.loads(_unb64(_token(b_path).split(".")[0]))

    def forged(**change: Any) -> str:
        names = ("kind", "org", "object_id", "expires", "holder")[: len(payload)]
        fields = dict(zip(names, payload, strict=True))
        fields.update(change)
        return _b64(json.dumps(list(fields.values())).encode()) + "." + mac

    attempts = {
        # org A's URL pointed at org B's object (and org), the mac kept
        "org B's object": forged(org="beta", object_id=b_payload[2]),
        "another object's id": forged(object_id=payload[2].replace("acme/net/", "acme/other/")),
        "a longer life": forged(expires=payload[3] + 86400),
        "another kind": forged(kind="upload"),
        "a flipped mac": payload_text + "." + ("A" if mac[0] != "A" else "B") + mac[1:],
        "no mac": payload_text,
        "junk": "not-a-capability",
    }
    for what, bad in attempts.items():
        status, body = await tfe.raw(_with_token(a_path, bad))
        assert status == 404, what
        assert b"acme's" not in body and b"beta's" not in body, what
        assert json.loads(body)["errors"][0]["status"] == "404", what

    # signed by this deployment for org acme, but naming beta's object: still refused
    signer = tfe.client.app[TFE].signer
    assert signer is not None
    cross = signer.sign("state", "acme", b_payload[2], ttl=60)
    status, body = await tfe.raw(_with_token(a_path, cross))
    assert status == 404 and b"beta's" not in body

    # expired: the same URL, once its time has passed
    real_clock = signer.clock
    signer.clock = lambda: real_clock() + 601
    try:
        status, body = await tfe.raw(a_path)
        assert status == 404 and b"acme's" not in body
    finally:
        signer.clock = real_clock


# ---------------------------------------------------------------- organizations


async def test_org_a_token_sees_nothing_of_org_b_on_any_route(tfe: Tfe) -> None:
    a_tokens, b_tokens = await tfe.org("acme"), await tfe.org("beta")
    a_ws, _ = await _pushed(tfe, "acme", a_tokens["admin"], {"x": "a"})
    b_ws, _ = await _pushed(tfe, "beta", b_tokens["admin"], {"x": "b"})
    b_current = await tfe.tfe(
        "GET", f"/api/v2/workspaces/{b_ws}/current-state-version", token=b_tokens["admin"]
    )
    b_sv = b_current.body["data"]["id"]
    a_current = await tfe.tfe(
        "GET", f"/api/v2/workspaces/{a_ws}/current-state-version", token=a_tokens["admin"]
    )
    a_sv = a_current.body["data"]["id"]
    raw = json.dumps(a_state(7)).encode()
    push_body = {
        "data": {
            "type": "state-versions",
            "attributes": {
                "serial": 7,
                "lineage": json.loads(raw)["lineage"],
                "md5": hashlib.md5(raw).hexdigest(),
                "state": base64.b64encode(raw).decode(),
                "force": True,
            },
        }
    }
    ws_body = {"data": {"type": "workspaces", "attributes": {"name": "planted"}}}
    routes: list[tuple[str, str, Any]] = [
        ("GET", "/api/v2/organizations/{org}", None),
        ("GET", "/api/v2/organizations/{org}/entitlement-set", None),
        ("GET", "/api/v2/organizations/{org}/workspaces", None),
        ("POST", "/api/v2/organizations/{org}/workspaces", ws_body),
        ("GET", "/api/v2/organizations/{org}/workspaces/net", None),
        ("GET", "/api/v2/workspaces/{ws}", None),
        ("POST", "/api/v2/workspaces/{ws}/actions/unlock", None),
        ("POST", "/api/v2/workspaces/{ws}/actions/force-unlock", None),
        ("POST", "/api/v2/workspaces/{ws}/state-versions", push_body),
        ("POST", "/api/v2/workspaces/{ws}/actions/lock", None),
        ("GET", "/api/v2/workspaces/{ws}/vars", None),
        ("GET", "/api/v2/workspaces/{ws}/current-state-version", None),
        ("GET", "/api/v2/workspaces/{ws}/current-state-version-outputs", None),
        ("GET", "/api/v2/state-versions/{sv}", None),
    ]
    a_admin = a_tokens["admin"]
    for method, template, body in routes:
        kw: dict[str, Any] = {} if body is None else {"json": body}
        own = template.format(org="acme", ws=a_ws, sv=a_sv)
        theirs = template.format(org="beta", ws=b_ws, sv=b_sv)
        mine = await tfe.tfe(method, own, token=a_admin, **kw)
        assert mine.status in (200, 201, 409), (own, mine.status, mine.body)  # it exists
        got = await tfe.tfe(method, theirs, token=a_admin, **kw)
        assert got.status == 404, (theirs, got.status, got.body)
        assert got.body["errors"][0]["status"] == "404"
    # beta's state and lock are as beta left them
    after = await tfe.tfe(
        "GET", f"/api/v2/workspaces/{b_ws}/current-state-version", token=b_tokens["admin"]
    )
    assert after.body["data"]["id"] == b_sv
    b_row = await tfe.get("/api/v1/orgs/beta/workspaces/net")
    assert b_row.body["lock"]["holder"] == "admin-user"
    assert (await tfe.get("/api/v1/orgs/beta/workspaces/planted")).status == 404
    listed = await tfe.tfe("GET", "/api/v2/organizations/acme/workspaces", token=a_admin)
    assert "planted" in {w["attributes"]["name"] for w in listed.body["data"]}
    assert msgspec.json.encode(listed.body).count(b"beta") == 0


async def test_a_viewer_reads_but_neither_locks_nor_pushes_nor_creates(tfe: Tfe) -> None:
    tokens = await tfe.org("acme")
    ws_id, _ = await _pushed(tfe, "acme", tokens["admin"], {"x": "a"})
    viewer = tokens["viewer"]
    assert (await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}", token=viewer)).status == 200
    assert (await tfe.lock(ws_id, token=viewer)).status == 403
    pushed = await tfe.push(ws_id, a_state(2), token=viewer, force=True)
    assert pushed.status == 403
    made = await tfe.tfe(
        "POST",
        "/api/v2/organizations/acme/workspaces",
        token=tokens["operator"],
        json={"data": {"type": "workspaces", "attributes": {"name": "x"}}},
    )
    assert made.status == 403
