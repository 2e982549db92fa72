"""The command side: every write (api, scheduler, executor, processes) goes through an
`App`: the single-aggregate commands of organizations and workspaces here, on top of a
run's flows across aggregates (services/app/flows.py), on top of one load-decide-append
loop with one retry policy (services/app/execute.py)."""

from __future__ import annotations

import asyncio
import secrets
from datetime import datetime
from typing import Any

from events import inherit
from events import org as org_agg
from events import run as run_agg
from events import workspace as ws_agg
from events.codec import org_subject, ws_subject
from events.errors import NotFound
from infra import tracing
from infra.eventstore import Append
from infra.ids import hash_token
from services.app.admission import Admission
from services.app.aggregates import ORG, WORKSPACE
from services.app.execute import Result


class App(Admission):
    """The command side. `clock` and `ids` are injected so tests can pin them."""

    # ------------------------------------------------------------ organizations

    @tracing.command
    async def create_org(self, name: str, actor: str) -> Result[org_agg.OrgState]:
        return await self.org_command(name, org_agg.CreateOrg(actor=actor, name=name))

    @tracing.command
    async def issue_token(
        self,
        org: str,
        user: str,
        role: str,
        actor: str,
        *,
        expires_at: datetime | None = None,
        kind: str = "",
        owner: str = "",
        level: str = "",
        name: str = "",
    ) -> tuple[str, Result[org_agg.OrgState]]:
        """Issue a token scoped to the organization; only its hash is stored. `kind`
        "user" (owner: a user id) or "team" (owner: a team) makes a personal or team
        token (events/access.py); none, an organization token of `role`."""
        token = f"rp_{secrets.token_urlsafe(32)}"
        cmd = org_agg.IssueToken(
            actor=actor,
            token_id=self.ids(),
            token_hash=hash_token(token),
            user=user,
            role=role,
            expires_at=expires_at,
            kind=kind,
            owner=owner,
            level=level,
            name=name,
        )
        return token, await self.org_command(org, cmd)

    @tracing.command
    async def record_token_use(self, org: str, token_id: str, user: str) -> int:
        """Record that a token was used now, on its own uses subject: a fact the api saw
        (the token authenticated a request), so there is nothing to decide. Raises
        Conflict if another replica recorded one at the same moment: that one will do."""
        subject = org_agg.uses_subject(org, token_id)
        seq, _ = await self.store.last(subject)
        event = org_agg.TokenUsed(at=self.clock(), actor=user, token_id=token_id)
        append = Append(subject=subject, event=event, expected=seq, msg_id=self.ids())
        return await self.store.append([append])

    # ------------------------------------------------------------ workspaces

    @tracing.command
    async def create_workspace(
        self, org: str, name: str, config: run_agg.Workspace, actor: str, *, folder: str = ""
    ) -> Result[ws_agg.WorkspaceState]:
        """Create a workspace, in `folder` of the organization if given (it must exist:
        folders are never removed, so checking first is enough)."""

        o = await self.load_org(org)
        if not o.state.exists:
            raise NotFound("organization does not exist")
        if folder and folder not in o.state.folders:
            raise NotFound(f"folder {folder} does not exist")
        cmd = ws_agg.CreateWorkspace(actor=actor, org=org, name=name, config=config, folder=folder)
        return await self.execute(WORKSPACE, ws_subject(org, name), cmd)

    @tracing.command
    async def set_variables(
        self, org: str, name: str, variables: dict[str, str], actor: str
    ) -> Result[ws_agg.WorkspaceState]:
        """Replace a workspace's plain variables; runs already created keep their own."""
        cmd = ws_agg.SetVariables(actor=actor, variables=variables)
        return await self._workspace_command(org, name, cmd)

    @tracing.command
    async def change_workspace(
        self, org: str, name: str, changes: dict[str, Any], actor: str
    ) -> Result[ws_agg.WorkspaceState]:
        """Change members of a workspace's configuration (`ws.config_changed`, only those
        that differ); runs already created keep the configuration they copied."""
        cmd = ws_agg.ChangeConfig(actor=actor, changes=changes)
        return await self._workspace_command(org, name, cmd)

    @tracing.command
    async def delete_workspace(
        self, org: str, name: str, actor: str
    ) -> Result[ws_agg.WorkspaceState]:
        """Delete a workspace no run holds or waits for (IllegalTransition naming one
        otherwise). A run created meanwhile finds its enqueue refused and is canceled
        (`create_run`): the workspace subject's checked appends decide which goes."""
        return await self._workspace_command(org, name, ws_agg.DeleteWorkspace(actor=actor))

    @tracing.command
    async def purge_workspace(
        self, org: str, name: str, actor: str
    ) -> Result[ws_agg.WorkspaceState]:
        """Free a deleted workspace's name (`ws.purged`); its events stay in the stream."""
        return await self._workspace_command(org, name, ws_agg.PurgeWorkspace(actor=actor))

    @tracing.command
    async def lock_workspace(
        self, org: str, name: str, reason: str, actor: str
    ) -> Result[ws_agg.WorkspaceState]:
        """Lock a workspace: runs still queue, none is admitted until it is unlocked."""
        return await self._workspace_command(
            org, name, ws_agg.LockWorkspace(actor=actor, reason=reason)
        )

    @tracing.command
    async def unlock_workspace(
        self, org: str, name: str, actor: str, *, admin: bool
    ) -> Result[ws_agg.WorkspaceState]:
        """Lift a workspace's lock (its holder, or an org admin); the scheduler then admits."""
        return await self._workspace_command(
            org, name, ws_agg.UnlockWorkspace(actor=actor, admin=admin)
        )

    @tracing.command
    async def record_state_push(
        self, org: str, name: str, cmd: ws_agg.RecordStatePush
    ) -> Result[ws_agg.WorkspaceState]:
        """Record a state version the lock's holder pushed (services/surfaces/tfe/state_push.py)."""
        return await self._workspace_command(org, name, cmd)

    async def _workspace_command(
        self, org: str, name: str, cmd: ws_agg.WorkspaceCommand
    ) -> Result[ws_agg.WorkspaceState]:
        return await self.execute(WORKSPACE, ws_subject(org, name), cmd)

    # ------------------------------------------------------------ settings and folders

    @tracing.command
    async def org_command(self, org: str, command: org_agg.OrgCommand) -> Result[org_agg.OrgState]:
        """Decide and append an organization command (folders, settings, tokens)."""

        return await self.execute(ORG, org_subject(org), command)

    @tracing.command
    async def set_workspace_settings(
        self, org: str, name: str, changes: dict[str, Any], actor: str
    ) -> Result[ws_agg.WorkspaceState]:
        """Change a workspace's own settings (null unsets one); runs admitted keep theirs."""
        cmd = ws_agg.SetSettings(actor=actor, changes=changes)
        return await self._workspace_command(org, name, cmd)

    async def effective_settings(self, org: str, ws: str) -> inherit.Resolved:
        """Every setting's effective value for a workspace, with its origin, read from
        the organization and workspace aggregates (no read model needed)."""
        o, w = await asyncio.gather(self.load_org(org), self.load_ws(org, ws))
        return inherit.for_workspace(o.state, w.state)
