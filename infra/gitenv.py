"""The environment git runs in: the organization's credentials only, never the host's.

A workspace's repository is its organization's, so what reaches it must be that
organization's own credential (`GitCredential`: its VCS connection's token, or a deploy
key). git and ssh otherwise find the host's: `~/.gitconfig`'s credential helpers and
`url.<base>.insteadOf`, `~/.git-credentials`, `~/.netrc` (curl), `/etc/gitconfig`, the
SSH agent, `~/.ssh/config` and `~/.ssh/id_*`. `git_access` shuts each out:

- only a few host variables pass (`PATH`, locale, proxies, the CA bundle); `HOME` is an
  empty directory of this process's, so no `~/.gitconfig`, `~/.git-credentials`,
  `~/.netrc` or `$XDG_CONFIG_HOME/git` is found; `GIT_CONFIG_NOSYSTEM`,
  `GIT_CONFIG_GLOBAL=/dev/null`; no `SSH_AUTH_SOCK`, `GIT_ASKPASS`, `SSH_ASKPASS`;
  prompts off (`GIT_TERMINAL_PROMPT=0`);
- ssh reads no configuration file (`-F /dev/null`: neither the user's nor the system's),
  offers no agent's key and no default `~/.ssh/id_*` (ssh finds those through the
  password database, not `HOME`), only the deploy key if there is one
  (`IdentitiesOnly`), and never asks (`BatchMode`); host keys are checked against the
  host's known hosts, which it never writes (`StrictHostKeyChecking=yes`);
- a token is given by a credential helper set for the repository's own scheme and host
  only (`credential.https://host.helper`, in `GIT_CONFIG_*` variables), so a redirect
  to another host does not get it; its value is in git's environment, which no job's
  uid can read.

`GitCredential(host=True)` is the host's environment as before (less runplane's own
variables): only for the organizations a deployment names (`--host-git-credentials`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from infra.childenv import git_env as host_git_env

# What passes from the host: no credential is among them.
_PASSED = (
    "PATH",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TMPDIR",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "all_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "GIT_SSL_CAINFO",
    "GIT_SSL_CAPATH",
)
SSH_OPTIONS = (
    "-F",
    "/dev/null",
    "-oBatchMode=yes",
    "-oConnectTimeout=15",
    "-oServerAliveInterval=15",
    "-oServerAliveCountMax=2",
    "-oIdentitiesOnly=yes",
    "-oIdentityAgent=none",
    "-oStrictHostKeyChecking=yes",
    "-oUpdateHostKeys=no",
    "-oPasswordAuthentication=no",
    "-oKbdInteractiveAuthentication=no",
    "-oControlMaster=no",
    "-oControlPath=none",
)
# The helper reads the token from git's environment: never on a command line.
_HELPER = (
    '!f() { test "$1" = get || exit 0; '
    'printf "username=%s\\npassword=%s\\n" "$RP_GIT_USERNAME" "$RP_GIT_PASSWORD"; }; f'
)


@dataclass(frozen=True)
class GitCredential:
    """What a checkout authenticates with (all empty: nothing, anonymously)."""

    token: str = ""  # the https password (a VCS connection's token)
    username: str = ""  # its user name (`x-access-token` for GitHub, `oauth2` for GitLab)
    ssh_key: str = ""  # an ssh private key (a deploy key)
    host: bool = False  # the host's own credentials: the deployment allows this organization

    def secrets(self) -> list[str]:
        """What to mask in anything git prints."""
        return [s for s in (self.token, self.ssh_key) if s]


NONE = GitCredential()
HOST = GitCredential(host=True)

_home: Path | None = None


def empty_home() -> Path:
    """An empty directory of this process's (0700), git's and ssh's `HOME`."""
    global _home  # one per process, made when first needed
    if _home is None or not _home.is_dir():
        _home = Path(tempfile.mkdtemp(prefix="rp-git-home-"))
    for entry in _home.iterdir():  # nothing may have been left there to be read
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return _home


@contextlib.contextmanager
def git_access(credential: GitCredential, repository: str) -> Iterator[dict[str, str]]:
    """git's environment for `repository` with `credential` (module doc); a deploy key
    lives in a private file for the length of the block."""
    if credential.host:
        yield host_git_env()
        return
    keydir = Path(tempfile.mkdtemp(prefix="rp-git-key-")) if credential.ssh_key else None
    try:
        key = "none"
        if keydir is not None:
            path = keydir / "key"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(credential.ssh_key.strip() + "\n")
            key = str(path)
        yield isolated_env(credential, repository, key_file=key)
    finally:
        if keydir is not None:
            shutil.rmtree(keydir, ignore_errors=True)


def isolated_env(credential: GitCredential, repository: str, *, key_file: str) -> dict[str, str]:
    """The environment without any of the host's credential sources (module doc)."""
    home = str(empty_home())
    env = {k: v for k, v in os.environ.items() if k in _PASSED or k.startswith("LC_")}
    env.setdefault("PATH", os.defpath)
    ssh = ["ssh", *SSH_OPTIONS, f"-oIdentityFile={key_file}"]
    env.update(
        {
            "HOME": home,
            "XDG_CONFIG_HOME": os.path.join(home, ".config"),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_SSH_COMMAND": shlex.join(ssh),
        }
    )
    config = [("credential.helper", "")]  # no helper but the one below
    scope = _credential_scope(repository)
    if credential.token and scope:
        config += [(f"credential.{scope}.helper", _HELPER)]
        env["RP_GIT_USERNAME"] = credential.username or "x-access-token"
        env["RP_GIT_PASSWORD"] = credential.token
    env["GIT_CONFIG_COUNT"] = str(len(config))
    for i, (key, value) in enumerate(config):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    return env


def _credential_scope(repository: str) -> str:
    """`https://host[:port]` of an http(s) repository ("" for any other): where its token
    may go."""
    try:
        parts = urlsplit(repository)
        port = parts.port
    except ValueError:
        return ""
    if parts.scheme.lower() not in ("https", "http") or not parts.hostname:
        return ""
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    return f"{parts.scheme.lower()}://{host}" + (f":{port}" if port else "")
