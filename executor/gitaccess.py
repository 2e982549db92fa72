"""Which credential a phase's checkout uses: its organization's own, never the host's.

The host's git credentials (its `~/.git-credentials`, credential helpers, ssh keys and
agent) serve only the organizations the deployment names (`--host-git-credentials`,
`RepositoryRules.host_credentials`). Every other checkout runs git in an environment
without them (infra/gitenv.py), with the token and deploy key of the workspace's VCS
connection, asked of the secrets responder under the phase's lease (executor/secrets.py),
and masked from every log; a workspace with no connection clones anonymously.
"""

from __future__ import annotations

import structlog

from executor import secrets as secret_vars
from executor.errors import StepFailed
from executor.job import Job
from infra.gitenv import HOST, NONE, GitCredential

log = structlog.get_logger(__name__)


async def credential(job: Job) -> GitCredential:
    """The credential the phase's checkout runs git with; StepFailed (`checkout`) if the
    workspace's connection has one that cannot be had."""
    ctx = job.ctx
    if job.tools.sources.host_credentials(ctx.org):
        log.info("git_credential", source="host")
        return HOST
    if not ctx.config.vcs_connection:
        return NONE
    vault = job.tools.custody.vault
    try:
        secret = await secret_vars.fetch_git(
            vault.nc,
            vault.keyring,
            org=ctx.org,
            ws=ctx.ws,
            run_id=ctx.run_id,
            lease_id=ctx.lease_id,
        )
    except StepFailed as e:
        why = e.message.removeprefix("secret variables unavailable: ")
        raise StepFailed(
            "checkout", f"the git credential is unavailable: {why}", reason=e.reason
        ) from e
    found = GitCredential(token=secret.token, username=secret.username, ssh_key=secret.ssh_key)
    job.tools.masker.add(found.secrets())
    log.info("git_credential", source="vcs_connection", connection=ctx.config.vcs_connection)
    return found
