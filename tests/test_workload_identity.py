"""Workload identity: runplane as an OIDC issuer, each plan and apply phase given a JWT a
cloud verifies with the published keys alone (docs/workload-identity.md).

Verified here as a cloud does: PyJWT, the key picked from the JWKS by the token's `kid`,
signature, `iss`, `aud`, `exp` and `sub` checked. The claims come from the run's own
aggregate; the attack tests are what a hostile organization A can try: names and
settings that would shift the subject to organization B's workspace, asking for a token
under B's subject, and a job reading the signing key.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jwt
import pytest
from nats.aio.client import Client as NATS

from events import wire
from events import workload as wl
from events.run import RunState
from events.values import Cause, Snapshot, Workspace
from events.wire import SecretsRequest, secrets_subject
from events.workload_rules import DEFAULT_AUDIENCE, DEFAULT_TTL, MAX_TTL
from executor.isolation import sandbox_problem
from executor.uids import DEFAULT_UIDS
from infra.crypto import KeyRing
from infra.signing import AHEAD, KEEP_AFTER, PRIVATE_MEMBERS, SigningKeys, context
from services.app.workload import Minter
from tests.builders import api_workspace
from tests.executor_support import git
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.workload_support import ISSUER, verify

V1 = "/api/v1/orgs/acme"
NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def _run(org: str = "acme", ws: str = "net", **settings: Any) -> RunState:
    pinned = {k: {"value": v, "origin": "workspace"} for k, v in settings.items()}
    return RunState(
        run_id="01jrun",
        org=org,
        workspace=ws,
        run_type="apply",
        config=Workspace(repository="https://example.com/x.git", branch="main"),
        snapshot=Snapshot(commit="abc123", settings=pinned),
        cause=Cause(kind="vcs", ref="refs/heads/main"),
        created_at=NOW,
        phase="apply",
    )


# ---------------------------------------------------------------- claims (pure)


def test_claims_name_the_runs_own_org_workspace_and_phase() -> None:
    run = _run(workload_identity=True, workload_identity_audience="aws.workload.identity")
    c = wl.claims(run, phase="apply", folders=["platform", "net"], issuer=ISSUER, now=NOW, jti="j")
    assert c["sub"] == "organization:acme:workspace:net:run_phase:apply"
    assert c["aud"] == "aws.workload.identity" and c["iss"] == ISSUER
    assert c["exp"] - c["iat"] == DEFAULT_TTL and c["nbf"] == c["iat"]
    assert c["terraform_workspace_id"] == "ws-acme.net"
    assert c["terraform_full_workspace"] == "organization:acme:workspace:net"
    assert c["terraform_folder"] == "platform/net"
    assert c["terraform_vcs_ref"] == "refs/heads/main" and c["terraform_commit"] == "abc123"
    assert set(c) == set(wl.CLAIMS)


def test_no_token_when_off_for_a_custom_phase_or_a_name_that_is_no_id() -> None:
    with pytest.raises(wl.WorkloadRefused, match="off"):
        wl.claims(_run(), phase="plan", folders=[], issuer=ISSUER, now=NOW, jti="j")
    on = _run(workload_identity=True)
    with pytest.raises(wl.WorkloadRefused, match="custom-50"):
        wl.claims(on, phase="custom-50", folders=[], issuer=ISSUER, now=NOW, jti="j")
    # A name that would shift the subject's fields (a forged aggregate: the API refuses it).
    forged = _run(ws="net:run_phase:apply", workload_identity=True)
    with pytest.raises(wl.WorkloadRefused, match="subject-safe"):
        wl.claims(forged, phase="plan", folders=[], issuer=ISSUER, now=NOW, jti="j")
    with pytest.raises(wl.WorkloadRefused, match="subject-safe"):
        wl.claims(on, phase="plan", folders=["a:organization:b"], issuer=ISSUER, now=NOW, jti="j")


def test_the_token_never_outlives_the_runs_timeout() -> None:
    run = _run(workload_identity=True, workload_identity_ttl=7200, run_timeout=1800)
    later = NOW + timedelta(seconds=600)
    c = wl.claims(run, phase="plan", folders=[], issuer=ISSUER, now=later, jti="j")
    assert c["exp"] - c["iat"] == 1200, "what is left of run_timeout, not the ttl"
    with pytest.raises(wl.WorkloadRefused, match="run_timeout"):
        wl.claims(
            run, phase="plan", folders=[], issuer=ISSUER, now=NOW + timedelta(hours=1), jti="j"
        )


# ---------------------------------------------------------------- keys (real NATS)


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


async def test_the_jwks_has_public_members_only_and_verifies_what_is_signed(nc: NATS) -> None:
    ring = KeyRing.generate()
    keys = SigningKeys(nc, ring)
    claims = {"iss": ISSUER, "aud": "a", "sub": "s", "iat": 1, "nbf": 1, "jti": "j"}
    token = await keys.sign({**claims, "exp": int(time.time()) + 60})
    jwks = await keys.jwks()
    assert jwks["keys"] and all(not (PRIVATE_MEMBERS & set(k)) for k in jwks["keys"])
    assert {k["kty"] for k in jwks["keys"]} == {"RSA"} and jwks["keys"][0]["alg"] == "RS256"
    assert verify(token, jwks, "a")["sub"] == "s"
    stored, _ = await keys.read()
    key = stored.keys[0]
    assert b"PRIVATE KEY" not in key.sealed, "sealed, never in clear in NATS"
    assert b"PRIVATE KEY" in ring.open(key.sealed, context(key.kid))
    with pytest.raises(Exception):  # noqa: B017  # another deployment's ring opens nothing
        KeyRing.generate().open(key.sealed, context(key.kid))


async def test_rotation_keeps_old_tokens_verifiable_until_they_expire(nc: NATS) -> None:
    clock = Clock()
    keys = SigningKeys(nc, KeyRing.generate(), rotate_after=3600, clock=clock, cache_s=0)
    base = {"iss": ISSUER, "aud": "a", "sub": "s", "jti": "j"}

    def stamped() -> dict[str, Any]:  # by the real clock: the cloud's (PyJWT's) is that
        now = int(time.time())
        return {**base, "iat": now, "nbf": now, "exp": now + MAX_TTL}

    old = await keys.sign(stamped())
    old_kid = jwt.get_unverified_header(old)["kid"]
    clock.t += 3600 - AHEAD  # the next key is made, published, not yet signing
    early = await keys.sign(stamped())
    jwks = await keys.jwks()
    assert len(jwks["keys"]) == 2 and jwt.get_unverified_header(early)["kid"] == old_kid
    clock.t += AHEAD
    new = await keys.sign(stamped())
    new_kid = jwt.get_unverified_header(new)["kid"]
    assert new_kid != old_kid, "signed by the new key once it has been published long enough"
    jwks = await keys.jwks()
    for token in (old, early, new):
        verify(token, jwks, "a", ISSUER)  # the old key is still published
    clock.t += KEEP_AFTER + 1  # every token the old key signed has expired
    kids = [k["kid"] for k in (await keys.jwks())["keys"]]
    assert old_kid not in kids and new_kid in kids, "gone once its tokens are; the new stays"


async def test_processes_racing_to_rotate_agree_on_one_key(nc: NATS) -> None:
    ring = KeyRing.generate()
    racers = [SigningKeys(nc, ring) for _ in range(4)]
    claims = {"iss": ISSUER, "aud": "a", "sub": "s", "exp": int(time.time()) + 60}
    tokens = await asyncio.gather(*(k.sign(claims) for k in racers))
    kids = {jwt.get_unverified_header(t)["kid"] for t in tokens}
    stored, _ = await racers[0].read()
    assert len(kids) == 1 and [k.kid for k in stored.keys] == list(kids), "one write won"


# ---------------------------------------------------------------- the API


async def test_discovery_and_jwks_are_public_and_cached_briefly(plane: Plane) -> None:
    found = await plane.http.get("/.well-known/openid-configuration", token=None)
    assert found.status == 200, found.body
    doc = found.body
    assert doc["issuer"] == ISSUER and doc["jwks_uri"] == ISSUER + "/.well-known/jwks.json"
    assert doc["id_token_signing_alg_values_supported"] == ["RS256"]
    assert doc["subject_types_supported"] == ["public"] and doc["response_types_supported"]
    assert "terraform_run_phase" in doc["claims_supported"]
    keys = await plane.http.get("/.well-known/jwks.json", token=None)
    assert keys.status == 200 and keys.body["keys"], keys.body
    assert "max-age=300" in keys.headers["Cache-Control"]
    assert not any(PRIVATE_MEMBERS & set(k) for k in keys.body["keys"]), "never a private part"


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("workload_identity_ttl", 10**9),
        ("workload_identity_ttl", 0),
        ("workload_identity_ttl", "3600"),
        ("workload_identity_audience", ["a", "b"]),
        ("workload_identity_audience", ""),
        ("workload_identity_audience", "has space"),
        ("workload_identity_audience", "x" * 256),
        ("workload_identity", "yes"),
    ],
)
async def test_bad_settings_are_a_4xx_problem_and_change_nothing(
    plane: Plane, setting: str, value: Any
) -> None:
    await api_workspace(plane.http, name="net")
    a = await plane.http.call("PATCH", f"{V1}/workspaces/net/settings", json={setting: value})
    assert setting in a.problem("invalid-command", 422)["detail"], a.body
    now = await plane.http.get(f"{V1}/workspaces/net/settings")
    assert setting not in now.body["settings"], now.body


async def test_names_that_would_shift_the_subject_are_refused(plane: Plane) -> None:
    """Org A cannot name a workspace or folder so that its subject reads as org B's."""
    for name in ("b:workspace:net", "net:run_phase:apply", "B", "a/b"):
        a = await plane.http.post(
            f"{V1}/workspaces", json={"name": name, "repository": "https://example.com/x.git"}
        )
        assert 400 <= a.status < 500, (name, a.status)
        f = await plane.http.post(f"{V1}/folders", json={"name": name})
        assert 400 <= f.status < 500, (name, f.status)


async def test_a_request_under_another_orgs_subject_gets_no_token(plane: Plane) -> None:
    """A run's lease asked on org B's subject (a forged request; jobs never reach NATS):
    the run is loaded from the subject's organization, where it does not exist."""
    await plane.http.org("bravo")
    req = SecretsRequest(run_id="01jrun", lease_id="lease", workload=True)
    msg = await plane.nc.request(secrets_subject("bravo", "net"), wire.encode(req), timeout=5)
    answer = wire.decode_secrets_reply(msg.data)
    assert answer.error and not answer.sealed, answer


# ---------------------------------------------------------------- a real phase

# A plan records the token reversed in a resource's triggers (the masker hides it as
# written; a plan-only run: an apply would read another token), an apply's provisioner
# prints the environment's token reversed, and tries the places a job could find the
# signing key: NATS's store, the data directory, the /proc of the process that signs
# (this one). Reversed, the token passes the masker: the test reads what the job read.
PLAN_TF = r"""
variable "runplane_workload_identity_token_file" { type = string }
resource "null_resource" "p" {
  triggers = { t = strrev(file(var.runplane_workload_identity_token_file)) }
}
"""
APPLY_TF = r"""
variable "pid" { type = string }
resource "null_resource" "t" {
  provisioner "local-exec" {
    command = <<-EOT
      printf 'APPLY=%s\n' "$(printf %s "$TFC_WORKLOAD_IDENTITY_TOKEN" | rev)"
      printf 'PLAIN=%s\n' "$TFC_WORKLOAD_IDENTITY_TOKEN"
      for p in /proc/${var.pid}/environ /proc/${var.pid}/mem /proc/${var.pid}/maps \
               DATA/encryption.key DATA NATS; do
        if [ -d "$p" ]; then [ -n "$(ls -A "$p" 2>/dev/null)" ] && echo "READ=:$p"
        else head -c 1 "$p" >/dev/null 2>&1 && echo "READ=:$p"; fi
      done
      echo "DONE=$((1+1))"
    EOT
  }
}
"""
REVERSED_JWT = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*Jye")
PLAIN_JWT = re.compile(r"eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")


async def _get(plane: Plane, path: str) -> Any:
    seq = await plane.app.store.last_seq()
    a = await plane.http.get(path, headers={"RP-Min-Seq": str(seq)})
    assert a.status == 200, a.body
    return a.body


async def _log(plane: Plane, run_id: str, phase: str) -> str:
    body = await _get(plane, f"{V1}/runs/{run_id}/logs?phase={phase}&limit=10000")
    return "\n".join(str(i["text"]) for i in body["items"])


def _tokens(text: str) -> list[str]:
    return [m[::-1] for m in REVERSED_JWT.findall(text)]


@pytest.fixture(params=["sandbox", "user"])
def isolation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The jobs' isolation, set before the plane is built (tests/bootstrap_support.py)."""
    mode = str(request.param)
    if os.geteuid() != 0:
        pytest.skip("the sandbox and uid modes need root")
    if mode == "sandbox" and (why := sandbox_problem(DEFAULT_UIDS[-1])):
        pytest.skip(f"no sandbox here: {why}")
    monkeypatch.setenv("RUNPLANE_ISOLATION", mode)
    return mode


@pytest.mark.terraform
async def test_a_phase_gets_a_token_a_cloud_verifies_and_the_key_stays_out_of_reach(
    isolation: str, plane: Plane, tmp_path: Path
) -> None:
    """Plan and apply each get a token that verifies against the published JWKS with
    the run's own subject and claims; the token is masked in logs; the job reads neither
    the key ring, NATS's store nor the signing process's /proc."""
    data = plane.system.opts.data_dir
    apply_tf = APPLY_TF.replace("DATA", str(data)).replace("NATS", str(tmp_path / "nats"))
    assert (await plane.http.post(f"{V1}/folders", json={"name": "platform"})).status == 201
    settings = {"workload_identity": True, "workload_identity_audience": "sts.example.com"}
    for ws, tf in (("net", PLAN_TF), ("app", apply_tf)):
        repo = tmp_path / f"repo-{ws}"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        commit(repo, {"main.tf": tf})
        await api_workspace(
            plane.http,
            repo,
            ws,
            folder="platform",
            variables={"pid": str(os.getpid())} if ws == "app" else {},
            settings=settings,
        )
    await plane.executor("ex1")
    planned = await plane.start("net", "plan")
    done = await plane.reaches("net", planned, "planned", "failed")
    assert str(done.status) == "planned", done.error_message
    run_id = await plane.start("app")
    await plane.reaches("app", run_id, "awaiting_approval")
    await plane.approve(run_id)
    done = await plane.reaches("app", run_id, "applied", "failed")
    assert str(done.status) == "applied", done.error_message
    jwks = (await plane.http.get("/.well-known/jwks.json", token=None)).body

    plan_tokens = _tokens(json.dumps(await _get(plane, f"{V1}/runs/{planned}/changes")))
    apply_log = await _log(plane, run_id, "apply")
    apply_tokens = _tokens(apply_log)
    assert plan_tokens and apply_tokens, apply_log[-2000:]
    for token, ws, run, phase in (
        (plan_tokens[0], "net", planned, "plan"),
        (apply_tokens[0], "app", run_id, "apply"),
    ):
        claims = verify(token, jwks, "sts.example.com")
        assert claims["sub"] == f"organization:acme:workspace:{ws}:run_phase:{phase}"
        assert claims["terraform_run_id"] == run and claims["terraform_run_phase"] == phase
        assert claims["terraform_folder"] == "platform"
        assert claims["terraform_organization_name"] == "acme"
        assert 0 < claims["exp"] - time.time() <= DEFAULT_TTL
        with pytest.raises(jwt.InvalidAudienceError):
            verify(token, jwks, "another.audience")
    assert plan_tokens[0] != apply_tokens[0], "a token per phase"

    assert "PLAIN=***" in apply_log, apply_log[-2000:]
    for run, phase in ((planned, "plan"), (run_id, "plan"), (run_id, "apply")):
        assert not PLAIN_JWT.search(await _log(plane, run, phase)), f"{phase} log: a token"
    assert "DONE=2" in apply_log, apply_log[-2000:]
    assert not re.findall(r"READ=:/[^\s\"]*", apply_log), apply_log[-3000:]


async def test_issuing_a_token_costs_a_few_milliseconds(plane: Plane) -> None:
    """The figure in README.md: a token as the responder mints it (the run's org and
    workspace loaded, the claims built, RS256 signed); the first includes making the
    deployment's first key."""
    await api_workspace(plane.http, name="net")
    minter = Minter(plane.app, plane.system.signing, ISSUER)
    run = _run(workload_identity=True)
    jwks: dict[str, Any] = {}
    times = []
    for _ in range(51):
        started = time.perf_counter()
        token = await minter.mint(run)
        times.append((time.perf_counter() - started) * 1000)
        jwks = jwks or await plane.system.signing.jwks()
        assert verify(token, jwks, DEFAULT_AUDIENCE)["sub"].endswith(":run_phase:apply")
    warm = sorted(times[1:])
    p50, p99 = warm[len(warm) // 2], warm[-1]
    print(f"token issuance: first {times[0]:.1f} ms, then p50 {p50:.2f} ms, max {p99:.2f} ms")
    assert p50 < 50, warm
