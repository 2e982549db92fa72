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
MAX_CONCURRENCY = 256  # phases one executor runs at once
MAX_OPEN_RUNS = 5_000  # the ceiling of the open-runs quotas (one ledger value each)
# Each job's caps (executor/caps.py): defaults, and the least a deployment may set.
JOB_MEMORY, JOB_MEMORY_MIN = 2 * 1024**3, 16 * 1024**2
JOB_PROCESSES, JOB_PROCESSES_MIN = 512, 8
JOB_CPU_SECONDS, JOB_CPU_SECONDS_MIN = 3600, 1
JOB_DISK, JOB_DISK_MIN = 10 * 1024**3, 1024**2
JOB_TMPFS, JOB_TMPFS_MIN = 256 * 1024**2, 1024**2
JOB_FILES, JOB_FILES_MIN = 200_000, 1_000
JOB_CPUS, JOB_CPUS_MIN = 2.0, 0.01  # 0: no quota
JOB_NETWORKS = ("allowed", "none")
# Workload identity's signing keys (infra/signing.py): how often a new one is made.
WORKLOAD_KEY_ROTATION = 7 * 86400
WORKLOAD_KEY_ROTATION_RANGE = (3600, 90 * 86400)


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
    # the address kinds an identity provider may have besides public ones (`loopback`,
    # `private`); None: RUNPLANE_SSO_ALLOW, else RUNPLANE_NOTIFY_ALLOW
    sso_allow: frozenset[str] | None = None
    admin_token: str = ""
    pool: str = "default"
    terraform_binary: str = ""
    provider_mirrors: list[Path] = field(default_factory=list)
    # the host's provider cache (executor/providers.py): "" beside the jobs directory,
    # "none" off; at most provider_cache_size bytes
    provider_cache: str = ""
    provider_cache_size: int = 10 * 1024**3
    demo: bool = True
    executor_id: str = ""
    encryption_key: str = ""  # base64 keys, current first; else <data_dir>/encryption.key
    allowed_repos: str = "https://,ssh://"  # repository sources (services/app/repositories.py)
    unscoped_repos: str = "all"  # whom rules naming no organization are for: all | none
    host_git_credentials: str = ""  # organizations (or *) whose git may use the host's
    isolation: str = "auto"  # who jobs run as (executor/isolation.py MODES)
    # HTTPS (services/surfaces/tfe/tls.py): `tls` with no cert and key: a local CA and its
    # certificate
    tls: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_names: list[str] = field(default_factory=list)  # more names the local certificate covers
    webhook_max_body: int = WEBHOOK_MAX_BODY  # bytes
    webhook_concurrency: int = WEBHOOK_CONCURRENCY
    # fair share (executor/turns.py): an executor's slots, organizations' turns per round
    # (`org=n,...`), the most slots one organization holds (0: all but one while another waits)
    concurrency: int = 1
    # open runs an organization, a workspace may have (services/app/openruns.py)
    org_max_open_runs: int = 500
    workspace_max_open_runs: int = 100
    # retention (services/processes/retention.py): the deployment's default, pass interval
    log_retention_days: int = 90
    record_retention_days: int = 0  # 0: runs' whole records are kept for ever
    retention_interval: float = 3600.0
    # ?as_of= (projections/asof.py): scratch read models cached, events one request folds
    as_of_models: int = 16
    as_of_max_events: int = 20_000  # projections/asof.py MAX_EVENTS
    as_of_events_per_minute: int = 100_000  # projections/asof.py PER_MINUTE
    # runplane replay: where to stop (a sequence or an RFC 3339 time; "": the end), where
    # to write ("": the data directory's read model)
    replay_until: str = ""
    replay_output: str = ""
    # read-model snapshots (projections/snapshots.py): seconds between an api's writes
    # (0: never writes; it still restores), and how many are kept
    snapshot_interval: float = 600.0
    snapshot_keep: int = 3
    org_weights: str = ""
    org_max_phases: int = 0
    drain_timeout: float = 1800.0  # SIGTERM's drain, then a hard stop (executor/worker.py)
    warm_wait: float = 2.0  # an apply left to its planner, warm (executor/warm.py); 0: off
    warm_max_bytes: int = 1 << 30  # the planners' checkouts kept, in all
    # streaming the audit log to its destinations (services/processes/audit_stream.py):
    # seconds between tries (the last repeats), one request's timeout, records a request
    # carries, and whether http:// destinations are taken (else https:// only)
    audit_stream_retry: tuple[float, ...] = (2.0, 10.0, 60.0, 300.0)
    audit_stream_timeout: float = 10.0
    audit_stream_batch: int = 100
    audit_stream_allow_http: bool = False
    job_memory: int = JOB_MEMORY  # bytes, the most any job's processes hold at once
    job_processes: int = JOB_PROCESSES  # tasks (threads count)
    job_cpu_seconds: int = JOB_CPU_SECONDS
    job_disk: int = JOB_DISK  # bytes of its directory
    job_tmpfs: int = JOB_TMPFS  # bytes of each of the sandbox's tmpfs mounts
    job_files: int = JOB_FILES  # inodes under its directories
    job_cpus: float = JOB_CPUS  # cores at once, its group's CFS quota
    job_network: str = "allowed"  # or "none" (the sandbox only)
    terraform_binaries: list[str] = field(default_factory=list)  # what runs may name
    quotas: Quotas = field(default_factory=Quotas)  # what a tenant may grow (infra/quotas.py)
    # The deployment's URL as people and clouds reach it: workload identity's issuer
    # (services/surfaces/api/oidc.py); empty: http://<listen>
    public_url: str = ""
    workload_key_rotation: int = WORKLOAD_KEY_ROTATION  # seconds

    def issuer(self) -> str:
        """Workload identity's `iss`: the public URL, without a trailing slash."""
        return (self.public_url or f"http://{self.listen}").rstrip("/")

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
        for flag, value in (
            ("--org-max-open-runs", self.org_max_open_runs),
            ("--workspace-max-open-runs", self.workspace_max_open_runs),
        ):
            if not 1 <= value <= MAX_OPEN_RUNS:
                raise ConfigError(f"{flag} wants 1 to {MAX_OPEN_RUNS}, got {value}")
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise ConfigError(f"--concurrency wants 1 to {MAX_CONCURRENCY}")
        if not 0 <= self.drain_timeout <= 7 * 86400:
            raise ConfigError("--drain-timeout must be 0 to 604800 seconds")
        if not 0 <= self.warm_wait <= 3600 or self.warm_max_bytes < 0:
            raise ConfigError("--warm-wait wants 0 to 3600 seconds, --warm-max-bytes 0+")
        if not 0 <= self.org_max_phases <= self.concurrency:
            raise ConfigError("--org-max-phases wants 0 (automatic) to --concurrency")
        low, high = WEBHOOK_CONCURRENCY_RANGE
        if not low <= self.webhook_concurrency <= high:
            raise ConfigError(f"--webhook-concurrency wants {low} to {high}")
        if not 0 <= self.log_retention_days <= 36500 or not 1 <= self.retention_interval:
            raise ConfigError("--log-retention-days wants 0 to 36500, --retention-interval 1+")
        self._check_audit_stream()
        if not 0 <= self.snapshot_interval <= 7 * 86400 or not 1 <= self.snapshot_keep <= 100:
            raise ConfigError("--snapshot-interval wants 0 to 604800 s, --snapshot-keep 1 to 100")
        if not 0 <= self.record_retention_days <= 36500:
            raise ConfigError("--record-retention-days wants 0 (never) to 36500")
        if problems := self.quotas.problems():
            raise ConfigError("; ".join(problems))
        self._check_job_caps()
        self._check_identity()

    def _check_audit_stream(self) -> None:
        retry = self.audit_stream_retry
        if not retry or not all(0 < s <= 86400 for s in retry):
            raise ConfigError("--audit-stream-retry wants seconds (0 to 86400), comma separated")
        if not 0.1 <= self.audit_stream_timeout <= 300 or not 1 <= self.audit_stream_batch <= 1000:
            raise ConfigError(
                "--audit-stream-timeout wants 0.1 to 300 s, --audit-stream-batch 1 to 1000"
            )

    def _check_identity(self) -> None:
        low, high = WORKLOAD_KEY_ROTATION_RANGE
        if not low <= self.workload_key_rotation <= high:
            raise ConfigError(f"--workload-key-rotation wants {low} to {high} seconds")
        url = self.public_url
        scheme, _, rest = url.partition("://")
        bad = scheme not in ("http", "https") or not rest or any(c in rest for c in "?#@ ")
        if url and (bad or not url.isascii() or not url.isprintable()):
            raise ConfigError(
                f"--public-url wants http(s)://host[:port][/path] (no query, fragment or "
                f"user), got {url!r}"
            )

    def _check_job_caps(self) -> None:
        for flag, value, least in (
            ("--job-memory", self.job_memory, JOB_MEMORY_MIN),
            ("--job-processes", self.job_processes, JOB_PROCESSES_MIN),
            ("--job-cpu-seconds", self.job_cpu_seconds, JOB_CPU_SECONDS_MIN),
            ("--job-disk", self.job_disk, JOB_DISK_MIN),
            ("--job-tmpfs", self.job_tmpfs, JOB_TMPFS_MIN),
            ("--job-files", self.job_files, JOB_FILES_MIN),
        ):
            if value < least:
                raise ConfigError(f"{flag} wants at least {least}, got {value}")
        if self.job_cpus != 0 and not JOB_CPUS_MIN <= self.job_cpus <= 1024:
            raise ConfigError(f"--job-cpus wants 0 (no quota) or 0.01 to 1024, got {self.job_cpus}")
        if self.job_network not in JOB_NETWORKS:
            raise ConfigError(f"--job-network wants allowed or none, got {self.job_network!r}")
        for binary in self.terraform_binaries:
            if "/" in binary and not binary.startswith("/"):
                raise ConfigError(
                    f"--terraform-binaries: {binary!r} is neither absolute nor a name"
                )

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
