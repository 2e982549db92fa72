"""A workspace's git credential: its organization's own, from the workspace's VCS connection.

The connection's token (what statuses are posted with, services/processes/vcs) is sealed
in the secrets bucket under `<org>._vcs.<connection id>.token`, bound to that key; its
deploy key (an ssh private key) under `.deploy_key`. A workspace names a connection of
its own organization (the API checks; the key is under the run's organization whatever a
run's configuration says), so what is read here can only be that organization's.

`GitAccess.credential` is what the processes that ask a repository (the scheduler's
`ls-remote` at admission, the API's webhook checks) run git with; an executor gets the
same through the secrets responder, under its lease (services/app/secrets.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from events.run import Workspace
from events.wire import GitSecret
from infra.gitenv import HOST, NONE, GitCredential
from services.app.execute import Repository
from services.app.secrets import SecretStore, connection_secret


def as_credential(secret: GitSecret) -> GitCredential:
    return GitCredential(token=secret.token, username=secret.username, ssh_key=secret.ssh_key)


@dataclass
class GitAccess:
    """Which credential a process's git uses for a workspace of an organization: the
    host's where the deployment allows it that (`host_credentials`), else its own."""

    repo: Repository
    secrets: SecretStore | None
    host_credentials: Callable[[str], bool] = field(default=lambda _: False)

    async def credential(self, org: str, config: Workspace) -> GitCredential:
        if self.host_credentials(org):
            return HOST
        if self.secrets is None or not config.vcs_connection:
            return NONE
        return await self.of_connection(org, config.vcs_connection)

    async def of_connection(self, org: str, connection_id: str) -> GitCredential:
        if self.host_credentials(org):
            return HOST
        if self.secrets is None:
            return NONE
        return as_credential(await connection_secret(self.repo, self.secrets, org, connection_id))
