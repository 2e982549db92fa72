"""schemathesis against `/api/v1/openapi.json` of a live API (a real port, a real
nats-server, the real projector), three ways:

- with a valid token (the admin token, and an organization's admin token): no 5xx, and
  every 4xx is RFC 9457 problem details (`application/problem+json`, `type`, `title`,
  `status` equal to the answer's);
- with another organization's token, every path aimed at the victim organization (its
  name, and its real workspace, run, folder and group where the path has them): only
  401/403/404, and no body names anything of the victim's that the request did not;
- with no token or an unknown one: only 401, nothing of the victim in any body.

Findings are collected over every operation, then reported together."""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from infra import streams
from infra.crypto import KeyRing
from infra.natsserver import EmbeddedNats
from services.surfaces.api import middleware
from services.surfaces.api.context import API
from tests.bootstrap_support import built
from tests.reliability.support import ThreadLoop

ADMIN = f"fuzz-admin-{secrets.token_hex(8)}"
PROBLEM = "application/problem+json"
PUBLIC = {("GET", path) for path in middleware.PUBLIC} | {
    # signed by Slack, not a bearer token: fuzzed with hostile text in tests/test_slack.py
    ("POST", "/api/v1/chat/slack/commands"),
    ("POST", "/api/v1/chat/slack/interactions"),
}
# Answered about the caller itself, whoever it is: another organization's token is
# answered its own (its leak checks still apply), never the victim's.
OWN = {("GET", "/api/v1/whoami")}


class LiveApi(ThreadLoop):
    """nats-server + App + Projector + the aiohttp app on 127.0.0.1:<random>, in a thread."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.run(self._start(Path(self.dir.name)))

    async def _start(self, root: Path) -> None:
        self.server = EmbeddedNats(root / "nats")
        await self.server.__aenter__()
        self.nc = await self.server.connect()
        await streams.declare(self.nc, self.nc.jetstream())
        # the api's graph, as the composition root builds it (started here by hand)
        system = built(self.nc, AsyncExitStack(), root, keyring=KeyRing.generate())
        app = system.app
        self.projector = system.projector(root / "rm.sqlite")
        await self.projector.__aenter__()
        started = await app.create_org("fuzz-fixture", "test")
        assert await self.projector.wait_for(started.seq)
        web_app = system.web_app(self.projector, admin_token=ADMIN, repositories=None)
        api = web_app[API]
        api.token_wait = 0.05  # an unknown token is refused at once, not after a wait
        api.read_wait = 0.05  # a fuzzed RP-Min-Seq far ahead answers 503 stale-read at once
        self.runner = web.AppRunner(web_app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.projector.__aexit__(None, None, None)
        await self.nc.close()
        await self.server.__aexit__(None, None, None)

    def close(self) -> None:
        self.run(self._stop())
        super().close()
        self.dir.cleanup()


@dataclass
class World:
    """What exists: org acme (fuzzed with valid tokens) and org victim (attacked)."""

    url: str
    acme_admin: str
    mallory: str  # an admin token of org mallory
    acme: dict[str, str]  # path parameter -> a real name of acme's
    victim: dict[str, str]  # path parameter -> a real name of the victim's
    needles: list[str]  # what of the victim's must never show to an outsider


@dataclass
class Tally:
    requests: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    findings: dict[str, str] = field(default_factory=dict)  # key -> first example

    def find(self, key: str, example: str) -> None:
        self.findings.setdefault(key, example)


def _post(url: str, token: str, path: str, body: Any) -> dict[str, Any]:
    r = requests.post(
        url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10
    )
    assert r.status_code in (200, 201), (path, r.status_code, r.text)
    return r.json()  # type: ignore[no-any-return]  # a JSON object


def _seed(url: str) -> World:
    tag = secrets.token_hex(4)
    for org in ("acme", "victim", "mallory"):
        _post(url, ADMIN, "/api/v1/orgs", {"name": org})
    acme = _post(url, ADMIN, "/api/v1/orgs/acme/tokens", {"user": "ann", "role": "admin"})
    mallory = _post(url, ADMIN, "/api/v1/orgs/mallory/tokens", {"user": "mal", "role": "admin"})
    ws, folder, group, user = f"vault-{tag}", f"fold-{tag}", f"grp-{tag}", f"vic-{tag}"
    secret = f"TOP_{tag}"
    _post(url, ADMIN, "/api/v1/orgs/victim/tokens", {"user": user, "role": "admin"})
    _post(url, ADMIN, "/api/v1/orgs/victim/folders", {"name": folder, "parent": None})
    _post(url, ADMIN, "/api/v1/orgs/victim/groups", {"name": group, "members": [user]})
    body = {
        "name": ws,
        "repository": f"https://example.com/{tag}.git",
        "folder": folder,
        "secret_variables": {secret: f"value-{tag}"},
    }
    _post(url, ADMIN, "/api/v1/orgs/victim/workspaces", body)
    run = _post(url, ADMIN, f"/api/v1/orgs/victim/workspaces/{ws}/runs", {"type": "apply"})
    _post(url, ADMIN, "/api/v1/orgs/acme/workspaces", {"name": "net", "repository": "r"})
    mine = _post(url, ADMIN, "/api/v1/orgs/acme/workspaces/net/runs", {"type": "apply"})
    return World(
        url=url,
        acme_admin=acme["token"],
        mallory=mallory["token"],
        acme={"org": "acme", "ws": "net", "run": mine["id"]},
        victim={"org": "victim", "ws": ws, "run": run["id"], "folder": folder, "group": group},
        needles=[ws, run["id"], folder, group, user, secret, tag],
    )


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    live = LiveApi()
    try:
        yield _seed(live.url)
    finally:
        live.close()


def _operations(url: str) -> list[Any]:
    schema = schemathesis.openapi.from_url(
        f"{url}/api/v1/openapi.json", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    )
    return [op.ok() for op in schema.get_all_operations()]  # type: ignore[union-attr]


def _path_params(op: Any) -> set[str]:
    return {seg.strip("{}") for seg in op.path.split("/") if seg.startswith("{")}


def _fixed_query(op: Any) -> dict[str, str] | None:
    # `follow=1` streams a run's logs until it ends, and these runs never end
    return {"follow": "0"} if op.path.endswith("/logs") else None


def _is_problem(resp: Any) -> str:
    """Why the answer is not RFC 9457 problem details ("" if it is). `resp` is
    schemathesis' Response: lowercase header names, each with a list of values."""
    ctype = (resp.headers.get("content-type") or [""])[0].split(";")[0].strip()
    if ctype != PROBLEM:
        return f"content type {ctype!r}"
    try:
        body = resp.json()
    except ValueError:
        return "body is not JSON"
    if not isinstance(body, dict):
        return "body is not an object"
    if not isinstance(body.get("type"), str) or not isinstance(body.get("title"), str):
        return "no type or title"
    if body.get("status") != resp.status_code:
        return f"status {body.get('status')!r} != {resp.status_code}"
    return ""


def _fuzz(
    world: World,
    tally: Tally,
    *,
    token: str | None,
    examples: int,
    modes: list[GenerationMode],
    pins: list[dict[str, str] | None],
    judge: Any,
    deadline: float,
) -> None:
    """Run every operation's strategies (each mode, with each set of pinned path
    parameters, None for none) for `examples` examples through `judge(op, case, resp)`,
    which records findings in `tally` (never raises, so every operation is run)."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    session = requests.Session()
    for op in _operations(world.url):
        if time.monotonic() > deadline:
            break  # generating the remaining operations' cases would spend the next share
        if (op.method.upper(), op.path) in PUBLIC:
            continue
        params = _path_params(op)
        strategies = [
            op.as_strategy(
                generation_mode=mode,
                path_parameters={k: v for k, v in pin.items() if k in params} if pin else None,
                query=_fixed_query(op),
            )
            for mode in modes
            for pin in pins
        ]

        send = _sender(world.url, session, headers, op, tally, judge, deadline)
        given(case=st.one_of(*strategies))(
            settings(
                max_examples=examples,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate],  # judges record, never raise
            )(send)
        )()


def _sender(
    url: str,
    session: requests.Session,
    headers: dict[str, str],
    op: Any,
    tally: Tally,
    judge: Any,
    deadline: float,
) -> Any:
    def send(case: Any) -> None:
        if time.monotonic() > deadline:
            return
        try:
            resp = case.call(base_url=url, session=session, headers=headers, timeout=10)
        except requests.RequestException as e:
            tally.find(f"{op.method} {op.path}: transport {type(e).__name__}", str(e))
            return
        tally.requests += 1
        tally.by_status[resp.status_code] += 1
        judge(op, case, resp)

    return send


def _stale_read(resp: Any) -> bool:
    """503 stale-read: RP-Min-Seq is ahead of the read model (documented, not an error).
    It names only the stream's sequence, which any token's own writes show (RP-Seq)."""
    return resp.status_code == 503 and "/problems/stale-read" in resp.text


def _example(case: Any, resp: Any) -> str:
    return f"{resp.status_code} {resp.text[:300]}\n    {case.as_curl_command()}"


def _request_text(case: Any) -> str:
    return f"{case.formatted_path} {case.query} {json.dumps(case.body, default=str)}"


def _fuzz_all(world: World, examples: int, budget: float) -> dict[str, Tally]:
    # Each kind of caller has its share of the budget: on a busy machine the valid
    # token's cases alone would spend all of it and leave the attacks untried.
    start = time.monotonic()
    valid_until, outsider_until = start + budget * 0.5, start + budget * 0.8
    deadline = start + budget
    positive, negative = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
    valid, outsider, anonymous = Tally(), Tally(), Tally()

    def judge_valid(op: Any, case: Any, resp: Any) -> None:
        where = f"{op.method.upper()} {op.path}"
        if resp.status_code >= 500 and not _stale_read(resp):
            valid.find(f"{where}: {resp.status_code}", _example(case, resp))
        if resp.status_code >= 400 and (why := _is_problem(resp)):
            valid.find(f"{where}: {resp.status_code} not a problem ({why})", _example(case, resp))

    def judge_sealed(tally: Tally, allowed: set[int]) -> Any:
        def judge(op: Any, case: Any, resp: Any) -> None:
            where = f"{op.method.upper()} {op.path}"
            if _stale_read(resp):
                pass  # a fuzzed RP-Min-Seq ahead of the read model: the same for any org
            elif (op.method.upper(), op.path) in OWN and resp.status_code == 200:
                pass  # its own identity
            elif resp.status_code not in allowed:
                tally.find(f"{where}: {resp.status_code}", _example(case, resp))
            elif why := _is_problem(resp):
                tally.find(f"{where}: not a problem ({why})", _example(case, resp))
            asked = _request_text(case)
            for needle in world.needles:
                if needle in resp.text and needle not in asked:
                    tally.find(f"{where}: leaks {needle}", _example(case, resp))

        return judge

    for token in (ADMIN, world.acme_admin):
        _fuzz(
            world,
            valid,
            token=token,
            examples=examples,
            modes=[positive, negative],
            pins=[None, world.acme],
            judge=judge_valid,
            deadline=valid_until,
        )
    _fuzz(
        world,
        outsider,
        token=world.mallory,
        examples=max(2, examples // 2),
        modes=[positive],
        pins=[world.victim],
        judge=judge_sealed(outsider, {401, 403, 404}),
        deadline=outsider_until,
    )
    anonymous_tokens: list[str | None] = [None, "rp_not-a-token"]
    for nobody in anonymous_tokens:
        _fuzz(
            world,
            anonymous,
            token=nobody,
            examples=max(2, examples // 4),
            modes=[positive],
            pins=[world.victim],
            judge=judge_sealed(anonymous, {401}),
            deadline=deadline,
        )
    return {"valid token": valid, "another org's token": outsider, "no token": anonymous}


def _report(tallies: dict[str, Tally]) -> None:
    findings = []
    for name, t in tallies.items():
        print(f"{name}: {t.requests} requests, statuses {dict(sorted(t.by_status.items()))}")
        for key, example in t.findings.items():
            findings.append(f"[{name}] {key}\n    {example}")
    print(f"total {sum(t.requests for t in tallies.values())} requests fuzzed")
    assert not findings, "\n".join(findings)
    assert all(t.requests for t in tallies.values())


def test_fuzz_the_api(world: World) -> None:
    """CI size: a handful of examples per operation and mode, bounded to ~30 s (the slow
    suite's run below sends 150 each)."""
    _report(_fuzz_all(world, examples=6, budget=30))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_the_api_at_length(world: World) -> None:
    _report(_fuzz_all(world, examples=150, budget=900))
