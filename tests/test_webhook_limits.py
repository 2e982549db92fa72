"""What an unproven webhook body may cost is the deployment's to set: `--webhook-max-body`
(1 MiB) and `--webhook-concurrency` (16), flags or environment, checked at start, reach
the api's intake (services/surfaces/webhooks/intake.py); a body trickled slower than the
deadline gives its slot back with a 408. Real nats-server, real API."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from infra.options import ConfigError, Options
from services.root import cli
from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from services.surfaces.webhooks.intake import DEADLINE_S, INTAKE, Intake, Limits
from tests.api_support import Http, served
from tests.bootstrap_support import built, options_for
from tests.rawhttp_support import RawClient
from tests.vcs_support import (
    EXAMPLES,
    KnownHeads,
    connection,
    deliver,
    fixture,
    github_repo,
    pushed,
)

REPO = "https://github.com/acme/net.git"
SMALL = Limits(max_body=12 * 1024, concurrent=2, deadline_s=0.5)


@pytest.fixture
async def small(system: Plane, tmp_path: Path) -> AsyncIterator[tuple[Http, str, Intake]]:
    """The API with SMALL limits, acme's GitHub connection (its id) and workspace `net`
    on it, and the API's intake."""
    knobs = {"webhook_limits": SMALL, "vcs_heads": KnownHeads(EXAMPLES)}  # pushes: heads
    async with served(system, tmp_path / "rm.sqlite", "limits", **knobs) as (web_app, client):
        http = Http(client, web_app[API], system.app)
        await http.org("acme")
        conn = await connection(http)
        fields = {"repository": REPO, "branch": "master", "vcs_connection": conn["id"]}
        await http.workspace("acme", "net", **fields)
        yield http, str(conn["id"]), web_app[INTAKE]


def _raw(http: Http) -> RawClient:
    server = http.client.server
    assert server.port is not None
    return RawClient(server.host, server.port)


def _push() -> bytes:
    data = pushed(github_repo(fixture("github/push.branch.json"), "acme/net"), ["a.tf"])
    return json.dumps(data).encode()


async def test_a_configured_cap_is_the_vcs_cap_and_bounds_slacks_too(
    small: tuple[Http, str, Intake],
) -> None:
    """12 KiB configured: a push padded to it is taken, one byte more is 413; Slack's
    cap is its own 64 KiB or the configured one, whichever is less."""
    http, conn_id, _ = small
    body = _push()
    at_cap = body[:-1] + b" " * (SMALL.max_body - len(body)) + b"}"
    assert (await deliver(http, conn_id, "push", at_cap)).status == 200
    over = at_cap[:-1] + b" }"
    (await deliver(http, conn_id, "push", over)).problem("body-too-large", 413)
    headers = {"X-Slack-Request-Timestamp": str(int(time.time())), "X-Slack-Signature": "v0=0"}
    slack = await _raw(http).early(
        "/api/v1/chat/slack/commands", headers, declared=SMALL.max_body + 1
    )
    assert "12288 bytes" in slack.problem("body-too-large", 413)["detail"]


async def test_a_body_slower_than_the_deadline_is_408_and_frees_its_slot(
    small: tuple[Http, str, Intake],
) -> None:
    """0.5 s configured: a delivery whose body stops coming is answered 408 then, and
    its slot is free again."""
    http, conn_id, intake = small
    headers = {
        "X-GitHub-Event": "push",
        "X-GitHub-Delivery": "slow",
        "X-Hub-Signature-256": "sha256=" + "0" * 64,
    }
    pending = await _raw(http).start(f"/api/v1/vcs/{conn_id}/webhook", headers, declared=1000)
    try:
        started = time.monotonic()
        answer = await pending.answer()
    finally:
        await pending.close()
    assert "0.5 s" in answer.problem("request-timeout", 408)["detail"]
    assert answer.closes and time.monotonic() - started < 5
    assert intake.in_flight("vcs") == 0


async def test_the_options_reach_the_apis_intake(nc: Any, tmp_path: Path) -> None:
    """The composition root builds the API's intake from the process's options."""
    opts = options_for(tmp_path, webhook_max_body=4096, webhook_concurrency=3)
    async with AsyncExitStack() as stack:
        plane = built(nc, stack, tmp_path, opts=opts)
        web_app = plane.web_app(plane.projector(tmp_path / "rm.sqlite"), admin_token="t")
        assert web_app[INTAKE].limits == Limits(max_body=4096, concurrent=3, deadline_s=DEADLINE_S)


def test_the_defaults_are_1_mib_and_16_and_out_of_range_settings_are_refused() -> None:
    assert Limits() == Limits(max_body=1024 * 1024, concurrent=16, deadline_s=10.0)
    assert (Options().webhook_max_body, Options().webhook_concurrency) == (1024 * 1024, 16)
    Options(webhook_max_body=1024, webhook_concurrency=1).check()
    for size in (100, 26 * 1024 * 1024):
        with pytest.raises(ConfigError, match="--webhook-max-body"):
            Options(webhook_max_body=size).check()
    for count in (0, 5000):
        with pytest.raises(ConfigError, match="--webhook-concurrency"):
            Options(webhook_concurrency=count).check()


def test_the_settings_are_flags_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--webhook-max-body` and `--webhook-concurrency`, else RUNPLANE_WEBHOOK_*."""
    monkeypatch.delenv("RUNPLANE_WEBHOOK_MAX_BODY", raising=False)
    monkeypatch.delenv("RUNPLANE_WEBHOOK_CONCURRENCY", raising=False)
    opts = cli.options(cli.parser().parse_args(["api"]))
    assert (opts.webhook_max_body, opts.webhook_concurrency) == (1024 * 1024, 16)
    argv = ["up", "--webhook-max-body", "2048", "--webhook-concurrency", "4"]
    opts = cli.options(cli.parser().parse_args(argv))
    assert (opts.webhook_max_body, opts.webhook_concurrency) == (2048, 4)
    monkeypatch.setenv("RUNPLANE_WEBHOOK_MAX_BODY", "65536")
    monkeypatch.setenv("RUNPLANE_WEBHOOK_CONCURRENCY", "8")
    opts = cli.options(cli.parser().parse_args(["api"]))
    assert (opts.webhook_max_body, opts.webhook_concurrency) == (65536, 8)
