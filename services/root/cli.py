"""The `runplane` console script: `up`, `api`, `scheduler`, `executor`, `subscribers`,
`replay`, `logs`, `nats status`; as the API's client: `login`, `logout`, `run`, `workspace`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import structlog

from executor.turns import parse_weights
from infra import logs, quotas
from infra.natsclient import NatsAuth
from infra.options import (
    WEBHOOK_CONCURRENCY,
    WEBHOOK_MAX_BODY,
    WORKLOAD_KEY_ROTATION,
    ConfigError,
    Options,
    prepare_data_dir,
    private_files,
)
from infra.sizes import parse_size
from services.app import repositories
from services.root import audit_cmd, identity_flags, past_flags, provider_flags, tenant_flags
from services.surfaces.client import commands as client
from services.surfaces.client import logs as logs_cli

log = structlog.get_logger(__name__)


def _common(p: argparse.ArgumentParser, *, listen: bool = False) -> None:
    p.add_argument(
        "--data-dir", type=Path, default=Path(os.environ.get("RUNPLANE_DATA_DIR", ".runplane"))
    )
    _nats_opts(p)
    p.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default="auto",
        help="auto: on a terminal `people` for up (a line per run transition, warnings), "
        "`console` for the others; JSON when stderr is not a terminal",
    )
    p.add_argument(
        "--allowed-repos",
        default=os.environ.get("RUNPLANE_ALLOWED_REPOS", ""),
        help="comma-separated repository sources workspaces may name: schemes (https://), "
        "hosts, path prefixes (/srv/git/), each for some organizations only after "
        "`org+org=`; default: remote URLs only (up: local paths too)",
    )
    p.add_argument(
        "--unscoped-repos",
        choices=repositories.UNSCOPED_CHOICES,
        default=os.environ.get("RUNPLANE_UNSCOPED_REPOS", "all"),
        help="whom an --allowed-repos rule naming no organization is for: all (the default, "
        "said at every start) or none (also RUNPLANE_UNSCOPED_REPOS)",
    )
    p.add_argument(
        "--host-git-credentials",
        default=os.environ.get("RUNPLANE_HOST_GIT_CREDENTIALS", ""),
        metavar="ORG[,ORG...]",
        help="organizations (or *) whose repositories git may reach with this host's own "
        "credentials (~/.git-credentials, helpers, ssh keys and agent); every other one "
        "uses its VCS connection's only (also RUNPLANE_HOST_GIT_CREDENTIALS)",
    )
    tenant_flags.open_runs_opts(p)
    tenant_flags.retention_opts(p)
    identity_flags.identity_opts(p)
    if listen:
        p.add_argument("--listen", default=os.environ.get("RUNPLANE_LISTEN", "127.0.0.1:8080"))
        p.add_argument(
            "--behind-tls-proxy",
            action="store_true",
            default=os.environ.get("RUNPLANE_BEHIND_TLS_PROXY", "") in ("1", "true", "yes"),
            help="browsers reach the API through a TLS proxy that sets X-Forwarded-Proto "
            "(also RUNPLANE_BEHIND_TLS_PROXY=1): the web UI's cookies are Secure when it "
            "says https; without it the header is ignored (a client could send it)",
        )
        p.add_argument(
            "--terraform-login",
            choices=("browser", "token"),
            default=os.environ.get("RUNPLANE_TERRAFORM_LOGIN", "browser"),
            help="how `terraform login` gets a token (also RUNPLANE_TERRAFORM_LOGIN): browser "
            "(login.v1: a browser signed in to the web UI allows it), or token (it asks for "
            "one made at /app/settings/tokens and pasted at its prompt)",
        )
        _webhook_opts(p)
        past_flags.as_of_opts(p)
        past_flags.snapshot_opts(p)
        identity_flags.sso_opts(p)


def _webhook_opts(p: argparse.ArgumentParser) -> None:
    """What an unproven webhook body (GitHub, GitLab, Slack) may cost the api process."""
    p.add_argument(
        "--webhook-max-body",
        type=int,
        default=os.environ.get("RUNPLANE_WEBHOOK_MAX_BODY", str(WEBHOOK_MAX_BODY)),
        help="bytes a webhook delivery may have, 413 beyond (also RUNPLANE_WEBHOOK_MAX_BODY; "
        "default 1 MiB; Slack's requests at most 64 KiB)",
    )
    p.add_argument(
        "--webhook-concurrency",
        type=int,
        default=os.environ.get("RUNPLANE_WEBHOOK_CONCURRENCY", str(WEBHOOK_CONCURRENCY)),
        help="unproven webhook bodies read at once, for VCS deliveries and for Slack each; "
        "one more is answered 503 (also RUNPLANE_WEBHOOK_CONCURRENCY; default 16)",
    )


class _RefuseSecret(argparse.Action):
    """`--nats-password VALUE` would put the secret in argv (and, being a prefix of
    `--nats-password-file`, argparse would read it as a file name and print it)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object, **__: object) -> None:
        env = self.option_strings[0].removeprefix("--").upper().replace("-", "_")
        parser.error(
            f"{self.option_strings[0]} would put the secret on the command line: "
            f"set RUNPLANE_{env} or use {self.option_strings[0]}-file"
        )


def _nats_opts(p: argparse.ArgumentParser) -> None:
    """Where NATS is and how to authenticate. Secrets are never taken on the command line
    (any local user can read argv in /proc): a password or token comes from the
    environment or from a file named here."""
    g = p.add_argument_group("NATS (each flag also RUNPLANE_NATS_*; secrets: env or file)")
    g.add_argument(
        "--nats-url",
        action="append",
        dest="nats_urls",
        metavar="URL[,URL...]",
        help="use these NATS servers (repeatable, or comma separated) instead of starting one",
    )
    g.add_argument("--nats-user", default="", help="user (password: RUNPLANE_NATS_PASSWORD)")
    for secret in ("--nats-password", "--nats-token"):
        g.add_argument(secret, nargs="?", action=_RefuseSecret, help=argparse.SUPPRESS)
    g.add_argument("--nats-password-file", default="", metavar="PATH", help="file with a password")
    g.add_argument("--nats-token-file", default="", metavar="PATH", help="file with a token")
    g.add_argument("--nats-nkey", default="", metavar="PATH", help="nkey seed file")
    g.add_argument("--nats-creds", default="", metavar="PATH", help="credentials (.creds) file")
    g.add_argument("--nats-tls-ca", default="", metavar="PATH", help="CA to verify servers")
    g.add_argument("--nats-tls-cert", default="", metavar="PATH", help="client certificate")
    g.add_argument("--nats-tls-key", default="", metavar="PATH", help="client certificate key")
    g.add_argument(
        "--replicas",
        type=int,
        default=int(os.environ.get("RUNPLANE_REPLICAS", "0") or 0),
        help="replicas of every stream, bucket and consumer (default: 1 alone, 3 on a "
        "cluster); existing ones are never lowered",
    )


_NATS_FLAGS: tuple[str, ...] = ("user", "password_file", "token_file", "nkey", "creds")
_NATS_FLAGS += ("tls_ca", "tls_cert", "tls_key")


def _nats_auth(ns: argparse.Namespace) -> NatsAuth:
    flags = {name: getattr(ns, f"nats_{name}", "") for name in _NATS_FLAGS}
    return NatsAuth.from_env(os.environ, **flags)


def _executor_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool", default=os.environ.get("RUNPLANE_POOL", "default"))
    p.add_argument(
        "--terraform-binary",
        default=os.environ.get("RUNPLANE_TERRAFORM_BINARY", ""),
        help="terraform or tofu binary (default: the bundled Terraform 1.0.3)",
    )
    provider_flags.add(p)
    p.add_argument(
        "--isolation",
        choices=("auto", "sandbox", "user", "bwrap", "none"),
        default=os.environ.get("RUNPLANE_ISOLATION", "auto"),
        help="how jobs run: a uid of their own in namespaces of their own (sandbox, needs "
        "root and bubblewrap), that uid alone (user, needs root), a bubblewrap sandbox as "
        "the executor's user (bwrap), or the executor itself (none); auto: the first that "
        "works (executor/isolation.py)",
    )
    tenant_flags.share_opts(p)
    _job_opts(p)


# (flag, environment, default, what): each job's caps (executor/caps.py)
_JOB_SIZES = (
    ("--job-memory", "RUNPLANE_JOB_MEMORY", "2GiB", "memory all of a job's processes hold"),
    ("--job-disk", "RUNPLANE_JOB_DISK", "10GiB", "disk of a job's directory"),
    (
        "--job-tmpfs",
        "RUNPLANE_JOB_TMPFS",
        "256MiB",
        "each of the sandbox's /tmp, /var/tmp, /run, /dev/shm",
    ),
)
_JOB_COUNTS = (
    ("--job-processes", "RUNPLANE_JOB_PROCESSES", "512", "processes and threads of a job"),
    ("--job-cpu-seconds", "RUNPLANE_JOB_CPU_SECONDS", "3600", "CPU time of a phase"),
    ("--job-files", "RUNPLANE_JOB_FILES", "200000", "files and directories a job has"),
)


def _job_opts(p: argparse.ArgumentParser) -> None:
    """Each job's caps, network and the binaries a run may name."""
    g = p.add_argument_group("jobs (each flag also its RUNPLANE_JOB_* variable)")
    for flag, env, default, what in _JOB_SIZES:
        g.add_argument(
            flag,
            default=os.environ.get(env, default),
            metavar="SIZE",
            help=f"the most {what} (also {env}; default {default}; e.g. 512MiB)",
        )
    for flag, env, default, what in _JOB_COUNTS:
        g.add_argument(
            flag,
            default=os.environ.get(env, default),
            metavar="N",
            help=f"the most {what} (also {env}; default {default})",
        )
    g.add_argument(
        "--job-cpus",
        default=os.environ.get("RUNPLANE_JOB_CPUS", "2"),
        metavar="CORES",
        help="the most cores a job's processes use at once, e.g. 0.5 (also RUNPLANE_JOB_CPUS; "
        "default 2; 0: no quota)",
    )
    g.add_argument(
        "--job-network",
        choices=("allowed", "none"),
        default=os.environ.get("RUNPLANE_JOB_NETWORK", "allowed"),
        help="none: jobs get a network of their own with loopback only (needs --isolation "
        "sandbox; also RUNPLANE_JOB_NETWORK)",
    )
    g.add_argument(
        "--terraform-binaries",
        default=os.environ.get("RUNPLANE_TERRAFORM_BINARIES", ""),
        metavar="LIST",
        help="comma-separated paths or names a run's terraform_binary setting may name "
        "(also RUNPLANE_TERRAFORM_BINARIES); default: any the job itself can run",
    )


def _job_caps(ns: argparse.Namespace) -> dict[str, int]:
    """The caps' flags as Options fields; ConfigError for one that is not a number."""
    out: dict[str, int] = {}
    for flag, env, default, _ in (*_JOB_SIZES, *_JOB_COUNTS):
        text = str(getattr(ns, flag[2:].replace("-", "_"), default))
        try:
            out[flag[2:].replace("-", "_")] = (
                parse_size(text) if (flag, env, default, _) in _JOB_SIZES else int(text)
            )
        except ValueError as e:
            raise ConfigError(f"{flag} ({env}): {e}") from e
    return out


def _job_cpus(ns: argparse.Namespace) -> float:
    try:
        return float(getattr(ns, "job_cpus", "2"))
    except ValueError as e:
        raise ConfigError(f"--job-cpus (RUNPLANE_JOB_CPUS): {e}") from e


_QUOTA_HELP = {
    "state_max_mb": "MiB a state version may have; a larger one is refused (413 "
    "state-too-large, or the run's apply fails) and never stored",
    "state_versions_per_workspace": "state versions a workspace keeps; the oldest "
    "that are not its current state go first",
    "state_mb_per_workspace": "MiB of state versions a workspace keeps (oldest first)",
    "state_versions_per_org": "state versions an organization keeps in all (the oldest "
    "that are no workspace's current state go first)",
    "state_mb_per_org": "MiB of state versions an organization keeps in all",
    "log_max_mb": "MiB of log a run's phase may print; past it the log is cut with a "
    "marker line and the step's metrics say how much was left out",
}


def _quota_opts(p: argparse.ArgumentParser) -> None:
    """What a tenant may grow (infra/quotas.py): each flag also RUNPLANE_<FLAG>."""
    g = p.add_argument_group("quotas (each also RUNPLANE_<NAME>; bounds: README)")
    for name, (default, _, high) in quotas.RANGES.items():
        g.add_argument(
            quotas.FLAGS[name],
            type=int,
            default=os.environ.get(quotas.ENV[name], str(default)),
            metavar="N",
            help=f"{_QUOTA_HELP[name]} (default {default}, at most {high})",
        )


def _quotas(ns: argparse.Namespace) -> quotas.Quotas:
    given = {name: getattr(ns, name) for name in quotas.RANGES if hasattr(ns, name)}
    return quotas.Quotas(**given)


def _tls_opts(p: argparse.ArgumentParser, *, local: bool) -> None:
    """HTTPS for the API (the Terraform CLI speaks only HTTPS): services/surfaces/tfe/tls.py."""
    g = p.add_argument_group("TLS")
    if local:
        g.add_argument(
            "--tls",
            action="store_true",
            help="serve HTTPS: the given --tls-cert/--tls-key, or a certificate of a local "
            "CA made in the data directory (its path is printed to trust)",
        )
        g.add_argument(
            "--tls-name",
            dest="tls_names",
            action="append",
            default=[],
            metavar="NAME",
            help="a host name or address the local certificate also covers (repeatable)",
        )
    g.add_argument("--tls-cert", default="", metavar="PATH", help="certificate chain (PEM)")
    g.add_argument("--tls-key", default="", metavar="PATH", help="its private key (PEM)")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="runplane", description=__doc__)
    sub = root.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run everything on this machine (embedded NATS by default)")
    _common(up, listen=True)
    _executor_opts(up)
    _quota_opts(up)
    up.add_argument("--no-demo", dest="demo", action="store_false", help="skip the demo workspace")
    _tls_opts(up, local=True)
    api = sub.add_parser("api", help="run the HTTP API and its projector")
    _common(api, listen=True)
    _quota_opts(api)
    _tls_opts(api, local=False)
    sched = sub.add_parser("scheduler", help="run admission and dispatch")
    _common(sched)
    subs = sub.add_parser("subscribers", help="run every subscriber of the event log")
    _common(subs)
    ex = sub.add_parser("executor", help="run an executor")
    _common(ex)
    _executor_opts(ex)
    _quota_opts(ex)
    past_flags.add_parser(sub, _common)
    logs_cli.add_parser(sub)
    client.add_parsers(sub)
    nats_cmd = sub.add_parser("nats", help="inspect runplane's streams, buckets and consumers")
    nats_sub = nats_cmd.add_subparsers(dest="nats_command", required=True)
    status = nats_sub.add_parser(
        "status", help="replicas, leader, lag and messages of everything runplane declares"
    )
    _common(status)
    status.add_argument(
        "--repair", action="store_true", help="raise what has fewer replicas than the setting"
    )
    audit_cmd.add_parser(sub, _common)
    return root


def _nats_url(ns: argparse.Namespace) -> str:
    """Flags, else RUNPLANE_NATS_URL: each may hold several comma-separated servers."""
    given = ns.nats_urls or [os.environ.get("RUNPLANE_NATS_URL", "")]
    return ",".join(u for u in given if u)


def _publish_url(url: str) -> None:
    """One public URL for every reader: the SSO callback, notification and VCS links read
    RUNPLANE_PUBLIC_URL, and the processes `up` starts inherit it."""
    if url:
        os.environ["RUNPLANE_PUBLIC_URL"] = url


def options(ns: argparse.Namespace) -> Options:
    """The process's options; ConfigError for a setting that cannot be used."""
    default = repositories.DEFAULTS.get(ns.command, repositories.API_DEFAULT)
    allowed = getattr(ns, "allowed_repos", "") or default
    unscoped = getattr(ns, "unscoped_repos", "all")
    host_git = getattr(ns, "host_git_credentials", "")
    try:
        repositories.Sources.parse(allowed, unscoped=unscoped, host_git=host_git)
    except ValueError as e:
        raise ConfigError(f"--allowed-repos: {e}") from e
    try:
        parse_weights(getattr(ns, "org_weights", ""))
    except ValueError as e:
        raise ConfigError(f"--org-weights: {e}") from e
    opts = Options(
        allowed_repos=allowed,
        unscoped_repos=unscoped,
        host_git_credentials=host_git,
        data_dir=ns.data_dir,
        nats_url=_nats_url(ns),
        nats_auth=_nats_auth(ns),
        replicas=ns.replicas,
        listen=getattr(ns, "listen", "127.0.0.1:8080"),
        behind_tls_proxy=getattr(ns, "behind_tls_proxy", False),
        terraform_login=getattr(ns, "terraform_login", "browser"),
        sso_allow=identity_flags.kinds(getattr(ns, "sso_allow", None)),
        admin_token=os.environ.get("RUNPLANE_ADMIN_TOKEN", ""),
        encryption_key=os.environ.get("RUNPLANE_ENCRYPTION_KEY", ""),
        pool=getattr(ns, "pool", "default"),
        terraform_binary=getattr(ns, "terraform_binary", ""),
        **provider_flags.options(ns),
        demo=getattr(ns, "demo", True),
        isolation=getattr(ns, "isolation", "auto"),
        tls=getattr(ns, "tls", False),
        tls_cert=getattr(ns, "tls_cert", ""),
        tls_key=getattr(ns, "tls_key", ""),
        tls_names=list(getattr(ns, "tls_names", []) or []),
        webhook_max_body=getattr(ns, "webhook_max_body", WEBHOOK_MAX_BODY),
        webhook_concurrency=getattr(ns, "webhook_concurrency", WEBHOOK_CONCURRENCY),
        concurrency=getattr(ns, "concurrency", 1),
        org_max_open_runs=getattr(ns, "org_max_open_runs", 500),
        workspace_max_open_runs=getattr(ns, "workspace_max_open_runs", 100),
        org_weights=getattr(ns, "org_weights", ""),
        org_max_phases=getattr(ns, "org_max_phases", 0),
        job_network=getattr(ns, "job_network", "allowed"),
        terraform_binaries=[
            b.strip() for b in getattr(ns, "terraform_binaries", "").split(",") if b.strip()
        ],
        quotas=_quotas(ns),
        **tenant_flags.retention(ns),  # and the executor's drain
        **past_flags.options(ns),
        public_url=getattr(ns, "public_url", ""),
        workload_key_rotation=getattr(ns, "workload_key_rotation", WORKLOAD_KEY_ROTATION),
    )
    _publish_url(opts.public_url)
    for name, value in (_job_caps(ns) if hasattr(ns, "job_memory") else {}).items():
        setattr(opts, name, value)  # the caps' flags: up and executor only
    if hasattr(ns, "job_cpus"):
        opts.job_cpus = _job_cpus(ns)
    return opts


async def _dispatch(command: str, opts: Options) -> None:
    from services.root import processes

    runners = {
        "up": processes.up,
        "api": processes.api,
        "scheduler": processes.scheduler,
        "executor": processes.executor,
        "subscribers": processes.subscribers,
        "replay": processes.replay,
    }
    prepare_data_dir(opts.data_dir)
    async with AsyncExitStack() as stack:
        await runners[command](opts, stack)


async def _nats_command(ns: argparse.Namespace, opts: Options) -> int:
    from services.root import natsstatus

    async with AsyncExitStack() as stack:
        return await natsstatus.status(opts, stack, repair=ns.repair, out=sys.stdout)


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if ns.command == "logs":  # an API client: no NATS, no structlog
        return logs_cli.main(ns)
    if ns.command in client.COMMANDS:  # likewise
        return client.main(ns)
    private_files()  # before anything is written into the data directory
    logs.configure(ns.log_format, for_people=ns.command == "up")
    try:
        opts = options(ns)
        opts.check()
        if ns.command == "nats":
            return asyncio.run(_nats_command(ns, opts))
        if ns.command == "audit":
            return asyncio.run(audit_cmd.run(ns, opts))
        asyncio.run(_dispatch(ns.command, opts))
    except ConfigError as e:
        print(f"runplane: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        print(
            f"runplane: {e.strerror or e}: {getattr(e, 'filename', '') or ''}".rstrip(": "),
            file=sys.stderr,
        )
        return 1
    except Exception as e:  # one line for the user, the details in the log
        log.exception("fatal")
        print(f"runplane: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
