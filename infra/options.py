"""A process's options and its data directory: what every layer above may be configured
with, and the one error a wrong setting raises (`ConfigError`, one line saying how to fix it).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from infra import natsclient
from infra.crypto import KeyConfigError, KeyRing, load_keyring
from infra.natsclient import NatsAuth
from infra.quotas import Quotas
from infra.replicas import MAX_REPLICAS

# What an unproven webhook body may cost (services/surfaces/webhooks/intake.py): its size
# (GitHub caps its own at 25 MB; a real push or pull request is a few hundred KiB at most),
# and how many are read at once per route family and api process.
WEBHOOK_MAX_BODY = 1024 * 1024
WEBHOOK_MAX_BODY_RANGE = (1024, 25 * 1024 * 1024)
WEBHOOK_CONCURRENCY = 16
WEBHOOK_CONCURRENCY_RANGE = (1, 1024)


class ConfigError(Exception):
    """A setting is missing or wrong; the message says which and how to fix it."""


@dataclass
class Options:
    data_dir: Path = Path(".runplane")
    nats_url: str = ""  # one server or several, comma separated; empty: the embedded one
    nats_auth: NatsAuth = field(default_factory=NatsAuth)
    replicas: int = 0  # of every stream, bucket and consumer; 0: 1 alone, 3 on a cluster
    listen: str = "127.0.0.1:8080"
    behind_tls_proxy: bool = (
        False  # X-Forwarded-Proto is believed (services/surfaces/ui/sessions.py)
    )
    terraform_login: str = "browser"  # or "token": no login.v1 (services/surfaces/tfe/discovery.py)
    admin_token: str = ""
    pool: str = "default"
    terraform_binary: str = ""
    provider_mirrors: list[Path] = field(default_factory=list)
    demo: bool = True
    executor_id: str = ""
    encryption_key: str = ""  # base64 keys, current first; else <data_dir>/encryption.key
    allowed_repos: str = "https://,ssh://"  # repository sources (services/app/repositories.py)
    isolation: str = "auto"  # who jobs run as (executor/isolation.py MODES)
    # HTTPS (services/surfaces/tfe/tls.py): `tls` with no cert and key: a local CA and its
    # certificate
    tls: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_names: list[str] = field(default_factory=list)  # more names the local certificate covers
    webhook_max_body: int = WEBHOOK_MAX_BODY  # bytes
    webhook_concurrency: int = WEBHOOK_CONCURRENCY
    quotas: Quotas = field(default_factory=Quotas)  # what a tenant may grow (infra/quotas.py)

    def nats_servers(self) -> list[str]:
        """The `--nats-url` list, checked (a bad URL is a `ConfigError`)."""
        try:
            return natsclient.server_list([self.nats_url])
        except natsclient.NatsSettingError as e:
            raise ConfigError(str(e)) from e

    def check(self) -> None:
        """Settings that can be judged before anything starts."""
        self.host_port()
        self.nats_servers()
        if not 0 <= self.replicas <= MAX_REPLICAS:
            raise ConfigError(f"--replicas wants 1 to {MAX_REPLICAS}, got {self.replicas}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.terraform_login not in ("browser", "token"):
            wanted = "--terraform-login wants browser or token"
            raise ConfigError(f"{wanted}, got {self.terraform_login}")
        low, high = WEBHOOK_MAX_BODY_RANGE
        if not low <= self.webhook_max_body <= high:
            raise ConfigError(f"--webhook-max-body wants {low} to {high} bytes")
        low, high = WEBHOOK_CONCURRENCY_RANGE
        if not low <= self.webhook_concurrency <= high:
            raise ConfigError(f"--webhook-concurrency wants {low} to {high}")
        if problems := self.quotas.problems():
            raise ConfigError("; ".join(problems))

    def host_port(self) -> tuple[str, int]:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"--listen wants HOST:PORT, got {self.listen!r}")
        return host or "127.0.0.1", int(port)


def admin_token(opts: Options) -> str:
    """The bootstrap admin token: given, or generated once into the data directory (0600)."""
    if opts.admin_token:
        return opts.admin_token
    path = opts.data_dir / "admin-token"
    if path.exists():
        return path.read_text().strip()
    prepare_data_dir(opts.data_dir)
    token = f"rp_admin_{secrets.token_urlsafe(32)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


PRIVATE_UMASK = 0o077


def private_files() -> None:
    """From now on, what this process (and nats-server, git, terraform under it) creates
    is its owner's alone: files 0600, directories 0700. The data directory holds the
    keys, the NATS credentials and store, the read model (and SQLite's -wal and -shm,
    made with the database's mode) and the job directories."""
    os.umask(PRIVATE_UMASK)


def prepare_data_dir(path: Path) -> None:
    """Create the data directory 0700, and take group and other access away from one
    made before (by an older runplane under a wider umask)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)


def keyring(opts: Options, *, create: bool = False) -> KeyRing:
    """The deployment's keys; with `create`, a missing key file is generated once.

    `runplane up` generates the key once into its data directory and every component it
    runs shares it; a standalone `api`, `scheduler` or `executor` takes it from
    `RUNPLANE_ENCRYPTION_KEY` or from `<data-dir>/encryption.key`, and refuses to start
    without one (one line saying how to provide it)."""
    try:
        return load_keyring(opts.encryption_key, opts.data_dir, create=create)
    except KeyConfigError as e:
        raise ConfigError(str(e)) from e
