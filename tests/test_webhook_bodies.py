"""Attack F9 (issue 23): the public webhook routes read nothing an unproven caller sends
before what can be judged without it is judged. GitHub's and GitLab's deliveries
(`POST /api/v1/vcs/{id}/webhook`) and Slack's calls are sent by a raw socket client that
declares a large body and sends one byte of it (tests/rawhttp_support.py): an answer that
arrives is one given without reading the body. Bodies that must be read (a real id with a
signature of the right form) are bounded: 1 MiB each by default, 16 read at once per
route family, one more answered 503 at once. Real nats-server, real API."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from functools import partial
from typing import Any

import pytest

from services.processes.vcs import signing
from services.surfaces.webhooks import vcs as webhook
from tests.api_support import Http
from tests.helpers import eventually
from tests.rawhttp_support import Pending, Raw, RawClient, chunk
from tests.slack_support import Slack, command_body, slack_fixture
from tests.vcs_support import (
    SECRET,
    connection,
    deliver,
    fixture,
    github_repo,
    pushed,
    vhttp_fixture,
)

_ = (vhttp_fixture, slack_fixture)  # the `vhttp` and `slack` fixtures
MiB = 1024 * 1024
CAP = MiB  # the default --webhook-max-body (README)
SLACK_CAP = 64 * 1024  # Slack's requests are a few KiB
CONCURRENT = 16  # the default --webhook-concurrency
MADE_UP = "01jzzzzzzzzzzzzzzzzzzzzzzz"
WRONG = "sha256=" + "0" * 64  # a signature of the right form, of nothing
REPO = "https://github.com/acme/net.git"
COMMANDS, INTERACTIONS = "/api/v1/chat/slack/commands", "/api/v1/chat/slack/interactions"


def _raw(http: Http) -> RawClient:
    server = http.client.server
    assert server.port is not None
    return RawClient(server.host, server.port)


def _path(connection_id: str) -> str:
    return f"/api/v1/vcs/{connection_id}/webhook"


def _github(signature: str) -> dict[str, str]:
    return {
        "X-GitHub-Event": "push",
        "X-GitHub-Delivery": str(uuid.uuid4()),
        "X-Hub-Signature-256": signature,
        "Content-Type": "application/json",
    }


def _push(files: list[str]) -> dict[str, Any]:
    return pushed(github_repo(fixture("github/push.branch.json"), "acme/net"), files)


async def _last_seq(http: Http) -> int:
    return await http.app.store.last_seq()


async def _refused_at_once(raw: RawClient, path: str, headers: dict[str, str]) -> Raw | None:
    """A request with its body unsent, answered within a second; None if it was not
    (then it took a slot, which its closing frees: not every slot was held yet)."""
    pending: Pending = await raw.start(path, headers, declared=1000)
    try:
        return await pending.answer(timeout=1.0)
    except TimeoutError:
        return None
    finally:
        await pending.close()


@pytest.fixture
async def conn_id(vhttp: Http) -> str:
    """acme's GitHub connection, with workspace `net` bound to it (directory net)."""
    await vhttp.org("acme")
    conn = await connection(vhttp)
    fields = {"repository": REPO, "branch": "master", "vcs_connection": conn["id"]}
    await vhttp.workspace("acme", "net", directory="net", **fields)
    return str(conn["id"])


# ---------------------------------------------------------------- VCS deliveries


async def test_attack_f9_large_bodies_without_a_proof_are_refused_unread(
    vhttp: Http, conn_id: str
) -> None:
    """F9: 60 deliveries of 8 MiB at once, unauthenticated: to a made-up id; to the real
    id with no signature, one that is not one, GitLab's token to a GitHub connection (401,
    the one refusal an unknown id gets); to the real id with a signature of the right
    form (413: over the cap). Each sent one byte of its body and was answered, so the
    server read none of them; the connections are closed; nothing is written."""
    raw = _raw(vhttp)
    before = await _last_seq(vhttp)
    gitlab = {"X-Gitlab-Event": "Push Hook", "X-Gitlab-Token": SECRET}
    unproven = [(MADE_UP, _github(WRONG))] * 20 + [(conn_id, _github(""))] * 10
    unproven += [(conn_id, _github("sha1=abc"))] * 5 + [(conn_id, gitlab)] * 5
    over = [(conn_id, _github(WRONG))] * 20
    answers = await asyncio.gather(
        *(raw.early(_path(c), h, declared=8 * MiB) for c, h in unproven + over)
    )
    for a in answers[: len(unproven)]:
        assert a.problem("unauthorized", 401)["detail"] == webhook._REFUSED
        assert a.closes
    for a in answers[len(unproven) :]:
        a.problem("body-too-large", 413)
        assert a.closes
    assert await _last_seq(vhttp) == before


@pytest.mark.parametrize(
    "connection_id", ["NOT_AN_ID", "a" * 64, "-dash-first", "under_score", "sp%20ace"]
)
async def test_attack_a_malformed_id_is_refused_before_its_body(
    vhttp: Http, conn_id: str, connection_id: str
) -> None:
    """A malformed id answers as an unknown one does, without waiting for the body."""
    a = await _raw(vhttp).early(_path(connection_id), _github(WRONG), declared=8 * MiB)
    assert a.problem("unauthorized", 401)["detail"] == webhook._REFUSED
    assert a.closes


async def test_attack_a_body_over_the_cap_is_413_and_read_no_further(
    vhttp: Http, conn_id: str
) -> None:
    """1 MiB by default: a signed delivery of exactly that is taken, one byte more is 413:
    declared, before a byte is read; chunked (no length), once it passes the cap, the
    rest unread and the connection closed."""
    payload = json.dumps(_push(["net/a.tf"])).encode()
    at_cap = payload[:-1] + b" " * (CAP - len(payload)) + b"}"
    taken = await deliver(vhttp, conn_id, "push", at_cap)
    assert taken.status == 200 and [r["workspace"] for r in taken.body["runs"]] == ["net"]
    over = at_cap[:-1] + b" }"
    before = await _last_seq(vhttp)
    (await deliver(vhttp, conn_id, "push", over)).problem("body-too-large", 413)
    raw = _raw(vhttp)
    signed = _github(signing.github_signature(SECRET, over))
    declared = await raw.early(_path(conn_id), signed, declared=len(over))
    declared.problem("body-too-large", 413)
    assert declared.closes
    pending = await raw.start(_path(conn_id), signed, declared=None, sent=b"")
    try:
        await pending.send(chunk(over + b" " * CAP) + b"0\r\n\r\n")
        chunked = await pending.answer()
    finally:
        await pending.close()
    chunked.problem("body-too-large", 413)
    assert chunked.closes
    assert await _last_seq(vhttp) == before


async def test_attack_bodies_in_flight_are_bounded_and_one_more_is_refused_at_once(
    vhttp: Http, conn_id: str
) -> None:
    """16 deliveries to the real id, each with a signature of the right form and its body
    unsent, hold the process's 16 slots for unproven VCS bodies: one more is answered 503
    with Retry-After at once, unread, and so is a valid signed delivery; once they go, a
    valid delivery is taken."""
    raw = _raw(vhttp)
    path = _path(conn_id)
    async with raw.holding(CONCURRENT, path, _github(WRONG), declared=1000):
        probe = partial(_refused_at_once, raw, path, _github(WRONG))
        busy = await eventually(probe, timeout=20, what="a prompt 503 with every slot held")
        busy.problem("unavailable", 503)
        assert busy.headers["retry-after"] == "1" and busy.closes
        signed = await deliver(vhttp, conn_id, "push", _push(["net/a.tf"]))
        signed.problem("unavailable", 503)

    async def taken() -> Any:
        a = await deliver(vhttp, conn_id, "push", _push(["net/a.tf"]), delivery="after")
        return a if a.status == 200 else None

    after = await eventually(taken, timeout=10, what="a slot freed once the holders went")
    assert [r["workspace"] for r in after.body["runs"]] == ["net"]


# ---------------------------------------------------------------- Slack


def _slack(ts: int | None, sig: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    if ts is not None:
        headers["X-Slack-Request-Timestamp"] = str(ts)
    if sig is not None:
        headers["X-Slack-Signature"] = sig
    return headers


SLACK_WRONG = "v0=" + "0" * 64


async def test_attack_slack_headers_are_judged_before_the_body(slack: Slack) -> None:
    """No signature, one not v0, no timestamp, one not a number, one out of the 5
    minutes: 401 on both routes, with one byte of a 60 KB body sent."""
    raw = _raw(slack.http)
    now = int(time.time())
    cases = [
        _slack(now, None),
        _slack(now, "v1=" + "0" * 64),
        _slack(None, SLACK_WRONG),
        _slack(now, SLACK_WRONG) | {"X-Slack-Request-Timestamp": "soon"},
        _slack(now - 6 * 60, SLACK_WRONG),
    ]
    for path in (COMMANDS, INTERACTIONS):
        for headers in cases:
            a = await raw.early(path, headers, declared=60_000, sent=b"t")
            a.problem("unauthorized", 401)
            assert a.closes, headers


async def test_attack_a_slack_body_over_its_cap_is_413_and_read_no_further(
    slack: Slack,
) -> None:
    """64 KiB: declared one byte more, 413 before a byte is read; chunked, once past it,
    the rest unread; the connection closed either way."""
    raw = _raw(slack.http)
    headers = _slack(int(time.time()), SLACK_WRONG)
    declared = await raw.early(COMMANDS, headers, declared=SLACK_CAP + 1, sent=b"t")
    declared.problem("body-too-large", 413)
    assert declared.closes
    pending = await raw.start(INTERACTIONS, headers, declared=None, sent=b"")
    try:
        await pending.send(chunk(b"t" * (4 * MiB)) + b"0\r\n\r\n")
        chunked = await pending.answer()
    finally:
        await pending.close()
    chunked.problem("body-too-large", 413)
    assert chunked.closes


async def test_attack_slack_bodies_in_flight_are_bounded(slack: Slack) -> None:
    """16 calls with well-formed, fresh headers and their bodies unsent hold Slack's 16
    slots: one more (on either route) is 503 with Retry-After at once, and so is a
    properly signed command; once they go, the command is answered."""
    await slack.org("acme", "T0ACME", "acme-signing-secret")
    raw = _raw(slack.http)
    headers = _slack(int(time.time()), SLACK_WRONG)
    body = command_body("help", team="T0ACME", user="UACMEALICE", url=slack.receiver.url("x"))
    async with raw.holding(CONCURRENT, COMMANDS, headers, declared=1000):
        probe = partial(_refused_at_once, raw, INTERACTIONS, headers)
        busy = await eventually(probe, timeout=20, what="a prompt 503 with every slot held")
        busy.problem("unavailable", 503)
        assert busy.headers["retry-after"] == "1" and busy.closes
        signed = await slack.signed(COMMANDS, body, "acme-signing-secret")
        signed.problem("unavailable", 503)

    async def answered() -> Any:
        a = await slack.signed(COMMANDS, body, "acme-signing-secret")
        return a if a.status == 200 else None

    help_text = await eventually(answered, timeout=10, what="a slot freed once the holders went")
    assert help_text.body["text"].startswith("Commands:")
