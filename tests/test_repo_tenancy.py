"""A repository belongs to an organization (issue 23, F2): the attacks, refused.

- org A's workspace naming a repository the deployment allows only org B is 422 at the
  API, on creation and on change, and (when it came past the API: an old event) fails at
  checkout, `repository_not_allowed`;
- `/proc/self/cwd`, `/proc/<pid>/cwd` (another process's working directory), `/sys`,
  `/dev`, an executor's jobs directory and the data directory are refused however they
  are spelled (a symlink, `..`, a `file://` URL, a `.git` file), at the API and at
  checkout;
- a private repository (a real git server over HTTP that wants a password) is never
  reached with the executor host's own credentials (its `~/.gitconfig` credential
  helper and `~/.git-credentials`): an organization with no credential of its own gets
  nothing, one with a VCS connection token is served with exactly that token, and only
  an organization the deployment names (`--host-git-credentials`) uses the host's; the
  same for the scheduler's `ls-remote` at admission and the API's webhook checks;
- a deploy key is the only key ssh is offered (no agent, no configuration file), and is
  stored write-only, sealed.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS

from events import vcs
from events.codec import encode
from events.errors import RepositoryRefused, SnapshotFailed
from events.run import StepFinished, Workspace
from services.app.gitcreds import GitAccess
from services.app.repositories import Sources, deployment_sources
from services.app.secrets import connection_secret
from services.app.snapshot import resolve_commit
from services.processes.vcs import connections
from services.processes.vcs.heads import GitHeads, HeadsError
from services.surfaces.api.context import API
from tests import bootstrap_support
from tests.api_support import ADMIN_TOKEN, Http
from tests.bootstrap_support import System, built, options_for
from tests.builders import organization
from tests.executor_support import Harness, git
from tests.git_http_support import GitServer, git_server

MAIN_TF = 'resource "null_resource" "hello" {}\n'
TOKEN = "bravo-connection-token-7f3a"
HOST_USER, HOST_PASSWORD = "host-admin", "host-password-91c2"


def work_repo(path: Path) -> Path:
    """A repository on `main` with one null resource."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "main.tf").write_text(MAIN_TF)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "one null resource")
    return path


@pytest.fixture
def sleeper() -> Iterator[int]:
    """Another process (its cwd: the system's temporary directory); its pid."""
    proc = subprocess.Popen(["sleep", "60"], cwd=tempfile.gettempdir())
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def refused_paths(tmp_path: Path, data: Path, pid: int) -> list[str]:
    """Ways to name the kernel's trees and runplane's directories as a repository."""
    jobs = Path(tempfile.gettempdir()) / "runplane-0123456789abcdef" / "jobs" / "r-plan-x"
    tmp_path.mkdir(parents=True, exist_ok=True)
    link = tmp_path / "innocent-looking"
    link.symlink_to("/proc/self/cwd")
    gitfile = tmp_path / "gitfile"
    gitfile.mkdir()
    (gitfile / ".git").write_text(f"gitdir: /proc/{pid}/cwd/.git\n")
    dotgit = tmp_path / "variant"  # git tries `variant.git` when `variant` is not there
    Path(f"{dotgit}.git").symlink_to(f"/proc/{pid}/cwd")
    return [
        "/proc/self/cwd",
        f"/proc/{pid}/cwd",
        f"/proc/{os.getpid()}/root/etc",
        "file:///proc/self/cwd",
        f"{tmp_path}/{'../' * 30}proc/self/cwd",
        str(link),
        f"file://{link}",
        str(gitfile),
        str(dotgit),
        "/sys/kernel",
        "/dev/shm",
        str(jobs),
        str(data),
        f"file://{data}/vcs-git",
        f"{data}/work/../vcs-git",
    ]


# ---------------------------------------------------------------- the rules


def test_a_rule_naming_organizations_is_theirs_alone() -> None:
    """`alpha=...` is alpha's, `bravo+charlie=...` theirs; an unscoped rule is everyone's
    unless `unscoped="none"`; a refusal lists only the organization's own rules."""
    spec = "alpha=https://git.example.com/alpha/,bravo+charlie=/srv/b/,https://github.com/"
    sources = Sources.parse(spec)
    sources.check("https://git.example.com/alpha/net.git", org="alpha")
    sources.check("/srv/b/net", org="charlie")
    sources.check("https://github.com/anyone/x.git", org="alpha")
    with pytest.raises(RepositoryRefused, match="allowed-repos") as e:
        sources.check("https://git.example.com/alpha/net.git", org="bravo")
    assert "git.example.com" not in e.value.message.split("(")[-1]  # alpha's rule not shown
    with pytest.raises(RepositoryRefused, match="allowed-repos"):
        sources.check("/srv/b/net", org="alpha")
    strict = Sources.parse(spec, unscoped="none")
    with pytest.raises(RepositoryRefused, match="allowed-repos"):
        strict.check("https://github.com/anyone/x.git", org="alpha")
    assert [p.text for p in sources.unscoped()] == ["https://github.com/"]
    assert strict.unscoped() == ()
    for bad in ("Alpha=https://", "alpha=", "alpha=not a source"):
        with pytest.raises(ValueError):
            Sources.parse(bad)
    assert Sources.parse("*", host_git="alpha").host_credentials("alpha")
    assert not Sources.parse("*", host_git="alpha").host_credentials("bravo")


def test_kernel_trees_and_runplane_directories_are_refused_however_spelled(
    tmp_path: Path, sleeper: int
) -> None:
    """Whatever `*` allows: each spelling is refused, naming its rule."""
    data = tmp_path / "data"
    (data / "vcs-git").mkdir(parents=True)
    sources = deployment_sources("*", data)
    for path in refused_paths(tmp_path, data, sleeper):
        with pytest.raises(RepositoryRefused) as e:
            sources.check(path, org="acme")
        assert e.value.rule in ("system-directory", "runplane-directory"), (path, e.value)
    sources.check(str(work_repo(tmp_path / "fine")), org="acme")


# ---------------------------------------------------------------- the API


@pytest.fixture(name="http")
async def http_fixture(system: System, tmp_path: Path) -> AsyncIterator[Http]:
    """The API with alpha's and bravo's own local sources, remote URLs for all, and no
    unscoped local paths."""
    data = tmp_path / "data"
    (data / "vcs-git").mkdir(parents=True)
    spec = f"alpha=file://{tmp_path}/alpha/,bravo=file://{tmp_path}/bravo/,https://"
    sources = deployment_sources(spec, data)
    async with system.projector(tmp_path / "rm.sqlite") as projector:
        web_app = system.web_app(projector, admin_token=ADMIN_TOKEN, repositories=sources)
        async with TestClient(TestServer(web_app)) as client:
            yield Http(client, web_app[API], system.app)


async def test_the_api_refuses_another_orgs_repository_on_create_and_change(
    http: Http, tmp_path: Path
) -> None:
    """bravo's repository is bravo's: alpha may neither create a workspace on it nor move
    one to it (422 `repository-not-allowed`, rule `allowed-repos`)."""
    bravo_repo = str(work_repo(tmp_path / "bravo" / "secret-infra"))
    alpha_repo = str(work_repo(tmp_path / "alpha" / "infra"))
    await http.org("alpha")
    await http.org("bravo")
    await http.workspace("bravo", "net", repository=bravo_repo)
    body = {"name": "steal", "repository": bravo_repo}
    for repo in (bravo_repo, f"file://{bravo_repo}", f"{tmp_path}/alpha/../bravo/secret-infra"):
        a = await http.post("/api/v1/orgs/alpha/workspaces", json={**body, "repository": repo})
        assert a.problem("repository-not-allowed", 422)["rule"] == "allowed-repos"
    await http.workspace("alpha", "net", repository=alpha_repo)
    a = await http.call(
        "PATCH", "/api/v1/orgs/alpha/workspaces/net", json={"repository": bravo_repo}
    )
    assert a.problem("repository-not-allowed", 422)["rule"] == "allowed-repos"
    shown = await http.get("/api/v1/orgs/alpha/workspaces/net")
    assert shown.body["repository"] == alpha_repo


async def test_the_api_refuses_proc_sys_dev_and_runplane_directories(
    http: Http, tmp_path: Path, sleeper: int
) -> None:
    """With `https://` (and everything else) allowed: each spelling of /proc, /sys, /dev,
    a jobs directory or the data directory is 422 `repository-not-allowed`."""
    await http.org("alpha")
    data = tmp_path / "data"
    for i, path in enumerate(refused_paths(tmp_path / "alpha", data, sleeper)):
        a = await http.post(
            "/api/v1/orgs/alpha/workspaces", json={"name": f"w{i}", "repository": path}
        )
        rule = a.problem("repository-not-allowed", 422)["rule"]
        assert rule in ("system-directory", "runplane-directory", "allowed-repos"), (path, a.body)
        if path.startswith(("/proc", "file:///proc", "/sys", "/dev")):
            assert rule == "system-directory", (path, a.body)


# ---------------------------------------------------------------- checkout


@pytest.fixture
def host_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The executor host's own git credentials, as an operator's root account has them:
    `~/.gitconfig` with the `store` helper (and an `insteadOf`), `~/.git-credentials`."""
    home = tmp_path / "host-home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return home


@pytest.fixture
async def plane(nc: NATS, tmp_path: Path) -> AsyncIterator[tuple[System, Harness]]:
    """A deployment whose local sources are alpha's and bravo's own (unscoped rules for
    no one but `http://` for all), charlie allowed the host's git credentials; its
    executor and secrets responder running."""
    spec = (
        f"alpha=file://{tmp_path}/alpha/,bravo=file://{tmp_path}/bravo/,"
        "alpha+bravo+charlie=http://127.0.0.1,bravo=ssh://git@127.0.0.1/"
    )
    opts = options_for(
        tmp_path, allowed_repos=spec, unscoped_repos="none", host_git_credentials="charlie"
    )
    async with AsyncExitStack() as stack:
        system = built(nc, stack, tmp_path, opts=opts)
        await stack.enter_async_context(system.secrets_responder())
        await stack.enter_async_context(
            bootstrap_support.executor(system, work_dir=tmp_path / "exec", executor_id="t")
        )
        yield system, Harness(nc, system.app)


async def test_another_orgs_repository_from_an_old_event_fails_at_checkout(
    plane: tuple[System, Harness], tmp_path: Path
) -> None:
    """alpha's workspace names bravo's repository, or /proc/self/cwd, past the API (as an
    event written before the rule): its run fails `repository_not_allowed` and plans
    nothing; bravo's own run of the same repository plans."""
    _, h = plane
    bravo_repo = str(work_repo(tmp_path / "bravo" / "secret-infra"))
    await h.workspace("net", Workspace(repository=bravo_repo), org="bravo")
    ok = await h.start_run("net", org="bravo")
    await h.reaches("net", ok, "awaiting_approval", org="bravo")
    for ws, repo in (("steal", bravo_repo), ("proc", "/proc/self/cwd")):
        await h.workspace(ws, Workspace(repository=repo), org="alpha")
        stolen = await h.start_run(ws, org="alpha")
        state = await h.reaches(ws, stolen, "failed", org="alpha")
        assert state.reason == "repository_not_allowed", (state.reason, state.error_message)
        assert state.plan_summary is None


async def _served(server: GitServer, h: Harness, org: str, ws: str) -> tuple[Any, str]:
    """A run of `org`'s workspace `ws` on the server's repository: its end and its logs."""
    run_id = await h.start_run(ws, org=org)

    async def ended() -> Any:
        while True:
            state = await h.run(ws, run_id, org=org)
            if state.status in ("awaiting_approval", "failed"):
                return state
            await asyncio.sleep(0.1)

    state = await asyncio.wait_for(ended(), 120)
    logs = b""
    for e in await h.events(ws, run_id, org=org):
        if isinstance(e, StepFinished) and e.log_object:
            logs += await h.get("rp-logs", e.log_object)
    return state, logs.decode(errors="replace") + state.error_message


async def test_a_private_repository_is_cloned_with_the_orgs_token_never_the_hosts(
    plane: tuple[System, Harness], tmp_path: Path, host_home: Path
) -> None:
    """The executor host can read the private repository (its credential helper and
    `~/.git-credentials`). alpha, with no credential of its own, is refused by the server
    (the host's password is never sent); bravo's VCS connection token is what the server
    sees, and nothing else; charlie, named in `--host-git-credentials`, uses the host's."""
    system, h = plane
    accounts = {HOST_USER: HOST_PASSWORD, "x-access-token": TOKEN}
    with git_server(tmp_path / "served", accounts) as server:
        url = server.repository("private", work_repo(tmp_path / "private-work"))
        (host_home / ".git-credentials").write_text(server.credential_line(HOST_USER))
        (host_home / ".gitconfig").write_text("[credential]\n\thelper = store\n")
        await _connection(system, "bravo", "gh")
        for org in ("alpha", "bravo", "charlie"):
            config = Workspace(repository=url, vcs_connection="gh" if org == "bravo" else "")
            await h.workspace("net", config, org=org)

        state, said = await _served(server, h, "alpha", "net")
        assert state.status == "failed" and state.reason == "checkout_failed", state
        assert server.served == [] and server.refused >= 1
        assert HOST_PASSWORD not in said

        state, said = await _served(server, h, "bravo", "net")
        assert state.status == "awaiting_approval", (state.reason, state.error_message)
        assert set(server.served) == {"x-access-token"}
        assert TOKEN not in said and HOST_PASSWORD not in said

        served = len(server.served)
        state, _ = await _served(server, h, "charlie", "net")
        assert state.status == "awaiting_approval", (state.reason, state.error_message)
        assert set(server.served[served:]) == {HOST_USER}


DEPLOY_KEY = "\n".join(
    (
        "-----BEGIN OPENSSH PRIVATE KEY-----",
        "b3BlbnNzaC1rZXktdjEAAAAA",
        "-----END OPENSSH PRIVATE KEY-----",
    )
)
FAKE_SSH = """#!/bin/sh
# stands in for ssh: records what git gave it, then fails as an unreachable host does
key=$(printf '%s\\n' "$@" | sed -n 's/^-oIdentityFile=//p')
{ echo "ARGS $*"; echo "AGENT ${SSH_AUTH_SOCK:-none}"; echo "HOME $HOME"; cat "$key"; } >> RECORD
exit 255
"""


async def test_a_deploy_key_is_all_ssh_is_given(
    plane: tuple[System, Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bravo's connection holds a deploy key: ssh (a recording stand-in first on PATH) is
    given that key alone, no configuration file, no agent (the host's SSH_AUTH_SOCK is
    set) and no default key; the key file is gone after the checkout."""
    system, h = plane
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "ssh-record"
    (bin_dir / "ssh").write_text(FAKE_SSH.replace("RECORD", str(record)))
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SSH_AUTH_SOCK", str(tmp_path / "agent.sock"))
    await _connection(system, "bravo", "gh")
    sealed = connections.Sealed(system.nc, system.keyring)
    await sealed.put("bravo", "gh", connections.DEPLOY_KEY, DEPLOY_KEY)
    await h.workspace(
        "ssh", Workspace(repository="ssh://git@127.0.0.1/x.git", vcs_connection="gh"), org="bravo"
    )
    run_id = await h.start_run("ssh", org="bravo")
    state = await h.reaches("ssh", run_id, "failed", org="bravo")
    assert state.reason == "checkout_failed", (state.reason, state.error_message)
    said = record.read_text()
    assert "-F /dev/null" in said and "-oIdentityAgent=none" in said, said
    assert "AGENT none" in said and DEPLOY_KEY in said
    key = said.split("-oIdentityFile=")[1].split()[0]
    assert not Path(key).exists()
    assert DEPLOY_KEY.splitlines()[1] not in state.error_message


async def _connection(system: System, org: str, connection_id: str) -> None:
    """`org`'s GitHub connection `connection_id` with the token `TOKEN`, sealed."""
    save = vcs.SaveConnection(
        actor="admin",
        connection_id=connection_id,
        org=org,
        create=True,
        name="github",
        provider="github",
        has_token=True,
    )
    await organization(system.app, org)
    await connections.command(system.app, org, save)
    sealed = connections.Sealed(system.nc, system.keyring)
    await sealed.put(org, connection_id, connections.TOKEN, TOKEN)


async def test_a_connection_takes_a_deploy_key_write_only_and_sealed(
    http: Http, system: System
) -> None:
    """`deploy_key` is stored sealed (never in an event, never answered); one that is no
    private key is 422 and nothing is stored."""
    await http.org("alpha")
    body = {"name": "gh", "provider": "github", "webhook_secret": "w" * 20}
    bad = await http.post("/api/v1/orgs/alpha/vcs-connections", json={**body, "deploy_key": "x"})
    bad.problem("invalid-command", 422)
    made = await http.post(
        "/api/v1/orgs/alpha/vcs-connections", json={**body, "deploy_key": DEPLOY_KEY}
    )
    assert made.status == 201, made.body
    assert DEPLOY_KEY not in str(made.body)
    events = await system.store.read(vcs.connection_subject("alpha", made.body["id"]))
    assert all(DEPLOY_KEY.encode() not in encode(e.event) for e in events)
    found = await connection_secret(system.app, system.secrets, "alpha", made.body["id"])
    assert found.ssh_key == DEPLOY_KEY and found.token == ""
    assert (
        await connection_secret(system.app, system.secrets, "bravo", made.body["id"])
    ).ssh_key == ""


async def test_admission_and_webhook_checks_ask_with_the_orgs_token_never_the_hosts(
    plane: tuple[System, Harness], tmp_path: Path, host_home: Path
) -> None:
    """The scheduler's `ls-remote` at admission and the API's webhook checks reach the
    private repository as the checkout does: bravo with its connection's token, alpha
    with nothing (though the host could), charlie (named) with the host's."""
    system, _ = plane
    accounts = {HOST_USER: HOST_PASSWORD, "x-access-token": TOKEN}
    with git_server(tmp_path / "served", accounts) as server:
        url = server.repository("private", work_repo(tmp_path / "private-work"))
        head = git(tmp_path / "private-work", "rev-parse", "HEAD")
        (host_home / ".git-credentials").write_text(server.credential_line(HOST_USER))
        (host_home / ".gitconfig").write_text("[credential]\n\thelper = store\n")
        await _connection(system, "bravo", "gh")
        access = GitAccess(system.app, system.secrets, system.repositories.host_credentials)
        bound = Workspace(repository=url, vcs_connection="gh")
        cred = await access.credential("bravo", bound)
        assert await resolve_commit(url, "main", timeout=30, credential=cred) == head
        assert set(server.served) == {"x-access-token"}
        with pytest.raises(SnapshotFailed) as e:
            alpha = await access.credential("alpha", Workspace(repository=url))
            await resolve_commit(url, "main", timeout=30, credential=alpha)
        assert HOST_PASSWORD not in str(e.value) and set(server.served) == {"x-access-token"}
        charlie = await access.credential("charlie", Workspace(repository=url))
        assert await resolve_commit(url, "main", timeout=30, credential=charlie) == head
        assert server.served[-1] == HOST_USER

        heads = GitHeads(tmp_path / "api-mirrors", sources=system.repositories, access=access)
        ref = "refs/heads/main"
        assert await heads.head(url, ref, org="bravo", connection="gh") == head
        assert await heads.follows(url, ref, head, [[head]], org="bravo", connection="gh") == [True]
        served = len(server.served)
        with pytest.raises(HeadsError):
            await heads.head(url, ref, org="alpha", connection="")
        assert len(server.served) == served


def test_a_standalone_scheduler_leaves_the_sources_to_the_api_as_an_executor_does() -> None:
    """Admission checks a repository again (its `ls-remote`): a standalone scheduler given
    no list allows what the API allowed, as the executor does, and still refuses the
    directories and paths every list refuses. (Its default was the api's: the benchmark's
    scheduler refused every local repository the api had taken.)"""
    from services.root.cli import options, parser

    for command in ("scheduler", "executor"):
        assert options(parser().parse_args([command])).allowed_repos == "*"
    assert options(parser().parse_args(["api"])).allowed_repos == "https://,ssh://"
