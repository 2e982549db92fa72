"""Where git gets credentials and what a start says (issue 23, F2; the attacks are in
tests/test_repo_tenancy.py): the environment runplane's git runs in has none of the
host's credential sources and only the organization's own token or deploy key; every
start says which repository rules are every organization's and who may use the host's
git credentials."""

from __future__ import annotations

import os
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from nats.aio.client import Client as NATS

from infra.gitenv import GitCredential, git_access
from infra.options import ConfigError
from services.root.cli import options, parser
from tests.bootstrap_support import built, options_for

TOKEN = "bravo-connection-token-7f3a"


def test_the_git_environment_has_no_host_credential_source_and_only_the_orgs_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The host's HOME, system config, agent, askpass and git settings stay out; the
    token is given to the repository's own scheme and host only, never on a command line."""
    for name, value in {
        "HOME": str(tmp_path),
        "SSH_AUTH_SOCK": "/run/agent.sock",
        "GIT_ASKPASS": "/bin/echo",
        "SSH_ASKPASS": "/bin/echo",
        "GIT_CONFIG_PARAMETERS": "'credential.helper'='store'",
        "GIT_SSH": "/usr/bin/ssh",
        "XDG_CONFIG_HOME": str(tmp_path),
    }.items():
        monkeypatch.setenv(name, value)
    cred = GitCredential(token=TOKEN, username="x-access-token")
    with git_access(cred, "https://git.example.com:8443/acme/net.git") as env:
        home = env["HOME"]
        assert home != str(tmp_path) and os.listdir(home) == []
        assert not {"SSH_AUTH_SOCK", "GIT_ASKPASS", "SSH_ASKPASS", "GIT_CONFIG_PARAMETERS"} & set(
            env
        )
        assert "GIT_SSH" not in env and env["XDG_CONFIG_HOME"].startswith(home)
        assert (env["GIT_CONFIG_NOSYSTEM"], env["GIT_CONFIG_GLOBAL"]) == ("1", os.devnull)
        ssh = env["GIT_SSH_COMMAND"]
        for option in ("-F /dev/null", "IdentitiesOnly=yes", "IdentityAgent=none"):
            assert option in ssh
        assert "-oIdentityFile=none" in ssh
        keys = {env[f"GIT_CONFIG_KEY_{i}"] for i in range(int(env["GIT_CONFIG_COUNT"]))}
        assert keys == {"credential.helper", "credential.https://git.example.com:8443.helper"}
        assert env["RP_GIT_PASSWORD"] == TOKEN and TOKEN not in ssh
    with git_access(cred, "git@git.example.com:acme/net.git") as env:
        assert "RP_GIT_PASSWORD" not in env  # a token only ever goes over http(s)
    with git_access(GitCredential(ssh_key="KEY"), "git@h:x") as env:
        key = env["GIT_SSH_COMMAND"].split("-oIdentityFile=")[1]
        assert Path(key).read_text() == "KEY\n" and oct(Path(key).stat().st_mode)[-3:] == "600"
    assert not Path(key).exists()  # gone with the block


async def test_every_start_says_whom_unscoped_rules_and_host_credentials_serve(
    nc: NATS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up`'s defaults (file:// among them) are every organization's: said at start, as
    the organizations given the host's git credentials are; with organizations named and
    `--unscoped-repos none` nothing is said. The flags are checked like the list."""
    for name in ("RUNPLANE_ALLOWED_REPOS", "RUNPLANE_UNSCOPED_REPOS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RUNPLANE_HOST_GIT_CREDENTIALS", "ops")
    up = options(parser().parse_args(["up", "--data-dir", str(tmp_path / "system")]))
    assert (up.unscoped_repos, up.host_git_credentials) == ("all", "ops")
    strict = options_for(tmp_path, allowed_repos="acme=https://", unscoped_repos="none")
    said: dict[str, list[Any]] = {}
    for opts in (up, strict):
        with structlog.testing.capture_logs() as seen:
            async with AsyncExitStack() as stack:
                built(nc, stack, tmp_path, opts=opts)
        warned = [s for s in seen if s["log_level"] == "warning"]
        said[opts.allowed_repos] = [
            (s["event"], s.get("rules", s.get("organizations"))) for s in warned
        ]
    assert said[up.allowed_repos] == [
        ("repository_rules_unscoped", ["https://", "ssh://", "file://"]),
        ("git_host_credentials", ["ops"]),
    ]
    assert said["acme=https://"] == []
    for bad in (["--unscoped-repos", "some"], ["--host-git-credentials", "Not An Org"]):
        with pytest.raises((ConfigError, SystemExit)):
            options(parser().parse_args(["api", *bad]))
