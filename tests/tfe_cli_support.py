"""The real Terraform CLI against `runplane up --tls` (tests/test_tfe_*_cli.py): `plane`
starts it with its own CA and answers an HTTPS client (`Https`); `terraform` runs the
CLI and `ok` requires it succeeded; the `backend "remote"` and `cloud` blocks
(`HCL`, `BACKEND`, `CLOUD_HCL`; the latter needs a newer Terraform, `_newer_terraform`);
and `Cli`, the `cli` fixture: an organization, a token in the CLI's own configuration,
and a working directory per workspace. Holds no tests itself."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from executor.terraform import TerraformConfig, default_binary, prepare
from tests.helpers import eventually
from tests.procs import Proc, free_port, signal

TOKEN = "t0ken-for-tfe-tests"
HCL = """\
terraform {{
  backend "remote" {{
    hostname     = "{host}"
    organization = "acme"
    workspaces {{ name = "{ws}" }}
  }}
}}
output "greeting" {{ value = "hello" }}
"""


class Https:
    """runplane's API over HTTPS, trusting the local CA `up` made."""

    def __init__(self, base: str, ca: Path, token: str = TOKEN) -> None:
        self.base = base
        self.ssl = ssl.create_default_context(cafile=str(ca))
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self.ssl),
            headers={"Authorization": f"Bearer {token}"},
        )

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body)
        async with self.session.request(method, self.base + path, data=data) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text else None)

    async def ok(self, method: str, path: str, body: Any = None) -> Any:
        status, payload = await self.call(method, path, body)
        assert 200 <= status < 300, (status, payload)
        return payload

    async def run_to(self, run_id: str, wanted: set[str]) -> dict[str, Any]:
        async def probe() -> dict[str, Any]:
            status, r = await self.call("GET", f"/api/v1/orgs/acme/runs/{run_id}")
            return r if status == 200 and r["status"] in wanted else {}

        return await eventually(probe, timeout=90, interval=0.2, what=f"run {run_id} in {wanted}")


def terraform(
    cwd: Path, env: dict[str, str], *args: str, binary: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary or str(default_binary()), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@asynccontextmanager
async def plane(tmp_path: Path) -> AsyncIterator[tuple[Https, str, Path, Proc]]:
    """`runplane up --tls` with its own CA; the API client, host:port, CA path, process."""
    data, port = tmp_path / "data", free_port()
    host = f"localhost:{port}"
    up = await Proc(
        ["up", "--tls", "--no-demo", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"],
        tmp_path / "up.log",
        env={"RUNPLANE_ADMIN_TOKEN": TOKEN},
    ).start()
    ca = data.resolve() / "tls" / "ca.pem"
    api: Https | None = None
    try:

        async def healthy() -> bool:
            nonlocal api
            if not ca.is_file():
                return False
            api = api or Https(f"https://{host}", ca)
            try:
                return (await api.call("GET", "/readyz"))[0] == 200
            except (aiohttp.ClientError, ssl.SSLError):
                return False

        await eventually(healthy, timeout=60, interval=0.1, what="runplane up --tls")
        assert api is not None
        yield api, host, ca, up
    finally:
        if api is not None:
            await api.session.close()
        code = await up.stop(signal.SIGTERM)
    assert code == 0, up.output()[-3000:]


CLOUD_HCL = """\
terraform {{
  cloud {{
    hostname     = "{host}"
    organization = "acme"
    workspaces {{ name = "{ws}" }}
  }}
}}
output "greeting" {{ value = "hello" }}
"""
NEWER = Path("/usr/local/bin/terraform")


def _newer_terraform() -> str:
    """A Terraform >= 1.1 on this machine (for the `cloud` block), else skip."""
    if not NEWER.is_file():
        pytest.skip("no Terraform >= 1.1 on this machine")
    out = subprocess.run(
        [str(NEWER), "version", "-json"],
        capture_output=True,
        text=True,
        env={"HOME": "/nonexistent", "PATH": os.environ["PATH"]},
        check=False,
    )
    version = tuple(int(p) for p in json.loads(out.stdout)["terraform_version"].split(".")[:2])
    if version < (1, 1):
        pytest.skip(f"{NEWER} is older than 1.1")
    return str(NEWER)


BACKEND = """\
terraform {{
  backend "remote" {{
    hostname     = "{host}"
    organization = "acme"
    workspaces {{ name = "{ws}" }}
  }}
}}
"""


def resources(n: int) -> str:
    return "".join(f'resource "null_resource" "r{i}" {{}}\n' for i in range(n))


@dataclass
class Cli:
    api: Https
    host: str
    env: dict[str, str]
    root: Path

    def workdir(self, ws: str, body: str) -> Path:
        work = self.root / ws
        work.mkdir(exist_ok=True)
        (work / "main.tf").write_text(BACKEND.format(host=self.host, ws=ws) + body)
        return work

    def tf(self, work: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return terraform(work, self.env, *args)

    async def runs(self, ws: str) -> list[dict[str, Any]]:
        return list((await self.api.ok("GET", f"/api/v1/orgs/acme/workspaces/{ws}/runs"))["items"])

    async def newest(self, ws: str, status: str) -> dict[str, Any]:
        """The workspace's newest run once runplane's read model shows it `status` (the
        CLI may exit before the projection has caught up)."""

        async def probe() -> dict[str, Any]:
            runs = await self.runs(ws)
            return runs[0] if runs and runs[0]["status"] == status else {}

        return await eventually(probe, timeout=30, interval=0.1, what=f"{ws}'s run {status}")


@pytest.fixture(name="cli")
async def cli_fixture(tmp_path: Path) -> AsyncIterator[Cli]:
    async with plane(tmp_path) as (api, host, ca, _):
        await api.ok("POST", "/api/v1/orgs", {"name": "acme"})
        issued = await api.ok(
            "POST", "/api/v1/orgs/acme/tokens", {"user": "alice", "role": "admin"}
        )
        # the CLI's own provider mirror (the null provider, offline) and its credentials
        local = prepare(TerraformConfig(), tmp_path / "cli-terraform")
        rc = local.cli_config
        rc.write_text(
            rc.read_text() + f'\ncredentials "{host}" {{\n  token = "{issued["token"]}"\n}}\n'
        )
        home = tmp_path / "home"
        home.mkdir()
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "TF_CLI_CONFIG_FILE": str(rc),
            "SSL_CERT_FILE": str(ca),
            "TF_IN_AUTOMATION": "1",
            "CHECKPOINT_DISABLE": "1",
        }
        root = tmp_path / "cli"
        root.mkdir()
        yield Cli(api, host, env, root)
