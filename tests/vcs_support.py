"""Fixtures and helpers of the VCS tests: the API with the sealed store, connections
made over HTTP, and deliveries signed as GitHub and GitLab sign them. Holds no tests."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from services.app.commands import App
from services.processes.vcs import signing
from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from services.surfaces.webhooks.vcs import DELIVERIES
from tests.api_support import Answer, Http, served

FIXTURES = Path(__file__).parent / "fixtures" / "vcs"
V1 = "/api/v1/orgs"
SECRET = "whsec-0f1e2d3c4b5a69788796a5b4c3d2e1f0"
GITHUB_REPO = "https://github.com/acme/net.git"
GITLAB_REPO = "https://gitlab.example.com/acme/net.git"
EXAMPLE_HEAD = "6113728f27ae82c7b1a177c8d03f9e96e0adf246"  # GitHub's push and tag examples'
GITLAB_HEAD = "da1560886d4f094c3e6c9ef40349f7d38b5d27d7"  # GitLab's push example's


class KnownHeads:
    """A stand-in for what repositories answer (services/processes/vcs/heads.py `Heads`):
    the head of each (repository, ref) the test says, "" for any other; no commit but a
    head follows. The example payloads' commits are in no repository a test can make, so
    the tests of matching and recording say their pushes are the heads (`EXAMPLES`); the
    stale-push tests ask real git (tests/test_vcs_stale.py)."""

    def __init__(self, heads: dict[tuple[str, str], str]) -> None:
        self.heads = dict(heads)
        self.asked: list[tuple[str, str]] = []

    async def head(self, repository: str, ref: str, **_: str) -> str:
        self.asked.append((repository, ref))
        return self.heads.get((repository, ref), "")

    async def follows(
        self, repository: str, ref: str, commit: str, lines: Sequence[Sequence[str]], **_: str
    ) -> list[bool]:
        return [False] * len(lines)


EXAMPLES = {
    (GITHUB_REPO, "refs/heads/master"): EXAMPLE_HEAD,
    (GITHUB_REPO, "refs/tags/simple-tag"): EXAMPLE_HEAD,
    (GITLAB_REPO, "refs/heads/master"): GITLAB_HEAD,
}


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())  # type: ignore[no-any-return]


@pytest.fixture(name="vhttp")
async def vhttp_fixture(system: Plane, tmp_path: Path) -> AsyncIterator[Http]:
    """The API with the sealed store (connections' secrets); the example payloads' pushes
    are their refs' heads (`KnownHeads(EXAMPLES)`, reached as `heads_of(vhttp)`)."""
    heads = KnownHeads(EXAMPLES)
    async with served(system, tmp_path / "rm.sqlite", "vcs-fixture", vcs_heads=heads) as (
        web_app,
        client,
    ):
        yield Http(client, web_app[API], system.app)


def heads_of(http: Http) -> KnownHeads:
    """The stand-in the `vhttp` fixture's API asks."""
    heads = http.client.app[DELIVERIES].heads
    assert isinstance(heads, KnownHeads)
    return heads


async def connection(
    http: Http, org: str = "acme", provider: str = "github", secret: str = SECRET, **body: Any
) -> dict[str, Any]:
    fields = {"name": f"{provider}-main", "provider": provider, "webhook_secret": secret}
    a = await http.post(f"{V1}/{org}/vcs-connections", json={**fields, **body})
    assert a.status == 201, a.body
    return a.body  # type: ignore[no-any-return]  # JSON object


def github_repo(data: dict[str, Any], full_name: str) -> dict[str, Any]:
    """The payload with its repository renamed (the only rewrite the tests make, besides
    the changed files): names and clone URLs."""
    repo = data["repository"]
    repo.update(
        full_name=full_name,
        clone_url=f"https://github.com/{full_name}.git",
        ssh_url=f"git@github.com:{full_name}.git",
        html_url=f"https://github.com/{full_name}",
    )
    pr = data.get("pull_request")
    if pr is not None and pr["head"].get("repo"):
        pr["head"]["repo"]["full_name"] = full_name
    return data


def gitlab_repo(data: dict[str, Any], path: str) -> dict[str, Any]:
    data["project"].update(
        path_with_namespace=path,
        git_http_url=f"https://gitlab.example.com/{path}.git",
        git_ssh_url=f"git@gitlab.example.com:{path}.git",
        web_url=f"https://gitlab.example.com/{path}",
    )
    return data


def pushed(data: dict[str, Any], files: list[str], after: str = "") -> dict[str, Any]:
    """A GitHub push of the example's one commit, complete, changing `files`."""
    data["created"] = False
    data["commits"] = [{**data["commits"][0], "added": files, "modified": [], "removed": []}]
    if after:
        data["after"] = after
        data["head_commit"]["id"] = after
    return data


async def deliver(
    http: Http,
    connection_id: str,
    event: str,
    payload: dict[str, Any] | bytes,
    *,
    provider: str = "github",
    secret: str = SECRET,
    delivery: str = "",
    headers: dict[str, str] | None = None,
) -> Answer:
    """POST a delivery signed as the provider signs it (no bearer token)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    delivery = delivery or str(uuid.uuid4())
    if provider == "github":
        hdrs = {
            "X-GitHub-Event": event,
            "X-GitHub-Delivery": delivery,
            "X-Hub-Signature-256": signing.github_signature(secret, body),
        }
    else:
        hdrs = {"X-Gitlab-Event": event, "X-Gitlab-Event-UUID": delivery, "X-Gitlab-Token": secret}
    hdrs["Content-Type"] = "application/json"
    hdrs.update(headers or {})
    return await http.call(
        "POST", f"/api/v1/vcs/{connection_id}/webhook", token=None, data=body, headers=hdrs
    )


async def saved_connection(
    app: App, secrets: Any, org: str, cid: str, provider: str, url: str, token: str
) -> None:
    """A VCS connection saved as the API saves one (events/vcs.py), its token sealed:
    for the reporter's tests, which drive no HTTP API."""

    from events import vcs
    from services.processes.vcs import connections

    save = vcs.SaveConnection(
        actor="test",
        connection_id=cid,
        org=org,
        create=True,
        name=cid,
        provider=provider,
        api_url=url,
        has_token=bool(token),
    )
    await connections.command(app, org, save)
    sealed = connections.Sealed(secrets.nc, secrets.keyring)
    await sealed.put(org, cid, connections.TOKEN, token)
