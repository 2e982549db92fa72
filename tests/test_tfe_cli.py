"""The real Terraform 1.0.3 (`backend "remote"`) against `runplane up --tls`, end to end.

`terraform login` (login.v1: on a pseudo-terminal, its browser part signed in to runplane's
web UI) stores a token of its own (Terraform 1.0 has no TF_TOKEN_<host>), the
generated local CA trusted through SSL_CERT_FILE. `init` creates the workspace; `state
push`, `state pull`, `state list` and `output` work on the very state runplane's own
runs write: a runplane run's version is what the CLI pulls, and the serial the CLI
pushes is what the next runplane run continues from.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
import re
import ssl
import subprocess
import time
from pathlib import Path

import aiohttp
from yarl import URL

from executor.terraform import default_binary
from services.surfaces.tfe.login import AUTHZ
from tests.tfe_cli_support import CLOUD_HCL, HCL, _newer_terraform, ok, plane, terraform
from tests.tfe_support import Terminal


def _repo(path: Path) -> Path:
    """A git repository whose configuration has one output (no provider: offline)."""
    path.mkdir()
    (path / "main.tf").write_text('output "greeting" { value = "from runplane" }\n')
    for cmd in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "add", "."],
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init"],
    ):
        subprocess.run(cmd, cwd=path, check=True)
    return path


async def browser(base: str, ca: Path, token: str, authz_url: str) -> str:
    """A person's browser: signs in to runplane's web UI with a token, opens the page the
    CLI printed and allows; where runplane redirects it (the CLI's listener, with the
    code)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    connector = aiohttp.TCPConnector(ssl=ctx)
    jar = aiohttp.CookieJar(unsafe=True)
    html_only = {"Accept": "text/html"}
    async with aiohttp.ClientSession(connector=connector, cookie_jar=jar) as b:
        async with b.get(base + "/", headers=html_only) as r:
            page = await r.text()
        found = re.search(r'name="csrf" value="([^"]+)"', page)
        assert found, page
        signin = {"token": token, "csrf": found.group(1)}
        async with b.post(base + "/signin", data=signin, allow_redirects=False) as r:
            assert r.status == 303, await r.text()
        async with b.get(URL(authz_url, encoded=True), headers=html_only) as r:
            page = await r.text()
            assert r.status == 200 and "alice" in page, page
        fields = {
            k: html.unescape(v) for k, v in re.findall(r"name='([^']+)' value='([^']*)'", page)
        }
        fields["decision"] = "allow"
        async with b.post(base + AUTHZ, data=fields, allow_redirects=False) as r:
            assert r.status == 303, await r.text()
            back = r.headers["Location"]
    assert back.startswith("http://localhost:100") and "code=" in back
    return back


async def follow_back(back: str, term: Terminal) -> None:
    """The browser follows runplane's redirect to Terraform's listener, which takes the
    code. Terraform listens on 127.0.0.1 only ("tcp4"), so the browser goes there. CI saw
    no 200 come back three times, though Terraform then said it had the token: once it
    has the code it may exchange it and exit before its answer is flushed. So what
    counts is that the listener answered 200 or that Terraform says it got the token;
    every attempt is told if neither happens."""
    loopback = URL(back, encoded=True).with_host("127.0.0.1")
    attempts: list[str] = []
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as plain:
        while time.monotonic() < deadline:
            try:
                async with plain.get(loopback) as r:
                    attempts.append(f"HTTP {r.status}")
                    if r.status == 200:
                        return
            except aiohttp.ClientError as e:
                attempts.append(repr(e))
            if "Terraform has obtained and saved an API token" in term.drain():
                return
            await asyncio.sleep(0.25)
    raise AssertionError(
        f"Terraform's listener took no code; tried {attempts[:5]}...{attempts[-3:]}"
    )


async def login_v1(binary: str, host: str, ca: Path, token: str, env: dict[str, str]) -> str:
    """`terraform login HOST` on a pseudo-terminal, its browser part done by `browser`;
    what it printed."""
    term = Terminal([binary, "login", "-no-color", host], env)
    try:
        await asyncio.to_thread(term.expect, rb"Enter a value:")
        term.send("yes\n")
        found = await asyncio.to_thread(
            term.expect, rb"https://[^\s']+/app/oauth/authorize\?[^\s']+"
        )
        try:
            back = await browser(f"https://{host}", ca, token, found.group(0).decode())
            await follow_back(back, term)
        except (AssertionError, aiohttp.ClientError) as e:
            raise AssertionError(f"{e!r}; terraform said: {term.drain()}") from e
        code = await asyncio.to_thread(term.finish)
        assert code == 0, term.text()
        return term.text()
    finally:
        term.close()


async def test_terraform_cli_inits_pushes_pulls_and_continues_runplanes_state(
    tmp_path: Path,
) -> None:
    async with plane(tmp_path) as (api, host, ca, up):
        assert f"SSL_CERT_FILE={ca}" in up.output()
        assert (ca.parent / "server-key.pem").stat().st_mode & 0o777 == 0o600
        assert (ca.parent / "ca-key.pem").stat().st_mode & 0o777 == 0o600
        await api.ok("POST", "/api/v1/orgs", {"name": "acme"})
        issued = await api.ok(
            "POST", "/api/v1/orgs/acme/tokens", {"user": "alice", "role": "admin"}
        )
        home = tmp_path / "home"
        (home / ".terraform.d").mkdir(parents=True)  # Terraform 1.0's login makes no directory
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "SSL_CERT_FILE": str(ca),
            "CHECKPOINT_DISABLE": "1",
            "BROWSER": "/bin/false",  # no browser: it prints the URL instead
        }
        # `terraform login`: login.v1, the browser signed in to runplane allows it
        said = await login_v1(str(default_binary()), host, ca, issued["token"], env)
        assert "Success! Terraform has obtained and saved an API token." in said, said
        saved = json.loads((home / ".terraform.d" / "credentials.tfrc.json").read_text())
        cli_token = saved["credentials"][host]["token"]
        assert cli_token.startswith("rp_") and cli_token != issued["token"]  # a token of its own
        tokens = (await api.ok("GET", "/api/v1/orgs/acme/tokens"))["items"]
        assert sorted(t["user"] for t in tokens) == ["alice", "alice"]
        assert {t["role"] for t in tokens} == {"admin"}
        env["TF_IN_AUTOMATION"] = "1"

        # a workspace runplane runs from git: its run writes state serial 1
        repo = _repo(tmp_path / "repo")
        await api.ok(
            "POST", "/api/v1/orgs/acme/workspaces", {"name": "net", "repository": str(repo)}
        )
        run = await api.ok("POST", "/api/v1/orgs/acme/workspaces/net/runs", {"type": "apply"})
        await api.run_to(run["id"], {"awaiting_approval", "applied", "failed", "no_changes"})
        r = await api.call(
            "POST", f"/api/v1/orgs/acme/runs/{run['id']}/approve", {"acknowledged": []}
        )
        assert r[0] in (200, 409), r
        done = await api.run_to(run["id"], {"applied", "failed", "no_changes"})
        assert done["status"] in ("applied", "no_changes"), done
        versions = (await api.ok("GET", "/api/v1/orgs/acme/workspaces/net/state-versions"))["items"]
        assert versions, "runplane's run wrote a state version"
        run_serial, lineage = versions[0]["serial"], versions[0]["lineage"]

        # the CLI on the same workspace
        work = tmp_path / "cli"
        work.mkdir()
        (work / "main.tf").write_text(HCL.format(host=host, ws="net"))
        ok(terraform(work, env, "init", "-input=false", "-no-color"))
        pulled = json.loads(ok(terraform(work, env, "state", "pull")))
        assert (pulled["serial"], pulled["lineage"]) == (run_serial, lineage)
        assert pulled["outputs"]["greeting"]["value"] == "from runplane"

        # push the next serial: a resource and an output
        pushed = {
            **pulled,
            "serial": run_serial + 1,
            "outputs": {"greeting": {"value": "from the cli", "type": "string"}},
            "resources": [
                {
                    "mode": "managed",
                    "type": "null_resource",
                    "name": "a",
                    "provider": 'provider["registry.terraform.io/hashicorp/null"]',
                    "instances": [
                        {"schema_version": 0, "attributes": {"id": "1", "triggers": None}}
                    ],
                }
            ],
        }
        (work / "next.tfstate").write_text(json.dumps(pushed))
        ok(terraform(work, env, "state", "push", "next.tfstate"))
        again = json.loads(ok(terraform(work, env, "state", "pull")))
        # Terraform's state manager writes it one serial on (what it read differs)
        cli_serial = again["serial"]
        assert cli_serial > run_serial and again["lineage"] == lineage
        assert ok(terraform(work, env, "state", "list")).split() == ["null_resource.a"]
        out = json.loads(ok(terraform(work, env, "output", "-json")))
        assert out["greeting"]["value"] == "from the cli"
        ws = await api.ok("GET", "/api/v1/orgs/acme/workspaces/net")
        assert ws["lock"] is None, "the CLI's lock was released"

        # a stale state (the run's serial again, other content) is refused by the CLI
        stale = {**pulled, "outputs": {}}
        (work / "stale.tfstate").write_text(json.dumps(stale))
        refused = terraform(work, env, "state", "push", "stale.tfstate")
        assert refused.returncode != 0
        assert json.loads(ok(terraform(work, env, "state", "pull")))["serial"] == cli_serial

        # runplane's next run continues from the CLI's serial, in the same lineage
        run2 = await api.ok("POST", "/api/v1/orgs/acme/workspaces/net/runs", {"type": "apply"})
        await api.run_to(run2["id"], {"awaiting_approval", "applied", "failed", "no_changes"})
        await api.call("POST", f"/api/v1/orgs/acme/runs/{run2['id']}/approve", {"acknowledged": []})
        done2 = await api.run_to(run2["id"], {"applied", "failed", "no_changes"})
        assert done2["status"] in ("applied", "no_changes"), done2
        last = json.loads(ok(terraform(work, env, "state", "pull")))
        assert last["lineage"] == lineage and last["serial"] > cli_serial
        assert last["outputs"]["greeting"]["value"] == "from runplane"

        # init of a workspace that does not exist creates it
        other = tmp_path / "cli2"
        other.mkdir()
        (other / "main.tf").write_text(HCL.format(host=host, ws="fresh"))
        ok(terraform(other, env, "init", "-input=false", "-no-color"))
        created = await api.ok("GET", "/api/v1/orgs/acme/workspaces/fresh")
        assert created["created_by"] == "alice"


async def test_a_cloud_block_inits_pushes_pulls_and_reads_outputs(tmp_path: Path) -> None:
    """The `cloud` block of a newer Terraform (1.11 here): `init` creates the workspace
    (and its request to set the workspace's version is refused: runplane chooses), a
    push asks for state upload URLs, takes the refusal as "inline then" and sends the
    state in the request; `output` reads the outputs list and, finding no detailed
    types, the whole state."""
    binary = _newer_terraform()
    async with plane(tmp_path) as (api, host, ca, _):
        await api.ok("POST", "/api/v1/orgs", {"name": "acme"})
        issued = await api.ok("POST", "/api/v1/orgs/acme/tokens", {"user": "bob", "role": "admin"})
        home = tmp_path / "home"
        (home / ".terraform.d").mkdir(parents=True)
        creds = {"credentials": {host: {"token": issued["token"]}}}
        (home / ".terraform.d" / "credentials.tfrc.json").write_text(json.dumps(creds))
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "SSL_CERT_FILE": str(ca),
            "TF_IN_AUTOMATION": "1",
            "CHECKPOINT_DISABLE": "1",
        }
        work = tmp_path / "cli"
        work.mkdir()
        (work / "main.tf").write_text(CLOUD_HCL.format(host=host, ws="edge"))
        ok(terraform(work, env, "init", "-input=false", "-no-color", binary=binary))
        assert (await api.call("GET", "/api/v1/orgs/acme/workspaces/edge"))[0] == 200
        state = {
            "version": 4,
            "terraform_version": "1.0.3",
            "serial": 4,
            "lineage": "8e5b8f54-0000-4000-8000-000000000001",
            "outputs": {"greeting": {"value": "first", "type": "string"}},
            "resources": [],
        }
        (work / "s.tfstate").write_text(json.dumps(state))
        ok(terraform(work, env, "state", "push", "s.tfstate", binary=binary))
        # into a workspace with no state the CLI writes its own lineage (Terraform's doing)
        first = json.loads(ok(terraform(work, env, "state", "pull", binary=binary)))
        assert first["outputs"] == state["outputs"]
        # the next one continues it: the same lineage, a higher serial
        nxt = {**first, "serial": first["serial"] + 1}
        nxt["outputs"] = {"greeting": {"value": "from the cloud block", "type": "string"}}
        (work / "s2.tfstate").write_text(json.dumps(nxt))
        ok(terraform(work, env, "state", "push", "s2.tfstate", binary=binary))
        pulled = json.loads(ok(terraform(work, env, "state", "pull", binary=binary)))
        assert pulled["lineage"] == first["lineage"] and pulled["serial"] > first["serial"]
        out = json.loads(ok(terraform(work, env, "output", "-json", binary=binary)))
        assert out["greeting"]["value"] == "from the cloud block"
        ws = await api.ok("GET", "/api/v1/orgs/acme/workspaces/edge")
        assert ws["lock"] is None
