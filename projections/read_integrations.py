"""The read model's queries of what an organization connects to (`ReadModel.integrations`):
its notification configurations and their delivery attempts, its VCS connections and the
workspaces bound to them, and its Slack app (chat-ops)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from projections import notifications, vcs
from projections.reader import Reader


class Integrations:
    """Notifications, VCS connections and Slack, each as a plain dict ready for JSON."""

    def __init__(self, read: Reader) -> None:
        self._read = read

    async def notifications(self, org: str, ws: str | None) -> list[dict[str, Any]]:
        """Notification configurations of the organization (`ws` None) or a workspace."""
        return await notifications.list_configs(self._read.rows, org, ws)

    async def notification(self, org: str, config_id: str) -> dict[str, Any] | None:
        return await notifications.get_config(self._read.rows, org, config_id)

    async def notify_attempts(self, org: str, config_id: str) -> list[dict[str, Any]]:
        return await notifications.attempts(self._read.rows, org, config_id)

    async def vcs_connections(self, org: str) -> list[dict[str, Any]]:
        return await vcs.list_connections(self._read.rows, org)

    async def vcs_connection(self, org: str, connection_id: str) -> dict[str, Any] | None:
        return await vcs.get_connection(self._read.rows, org, connection_id)

    async def vcs_bindings(
        self, org: str, connection_id: str, repo_keys: Sequence[str], **narrow: Any
    ) -> list[dict[str, Any]]:
        """The workspaces bound to the connection on one of these repositories that a
        change may concern (`projections.vcs.bindings`)."""
        return await vcs.bindings(self._read.rows, org, connection_id, repo_keys, **narrow)

    async def vcs_deliveries(
        self, org: str, connection_id: str, *, before: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        return await vcs.deliveries(self._read.rows, org, connection_id, before=before, limit=limit)

    async def vcs_repositories(self, org: str, workspaces: Sequence[str]) -> dict[str, str]:
        return await vcs.repositories(self._read.rows, org, workspaces)

    # ------------------------------------------------------------ chat-ops

    async def slack_orgs(self, team_id: str) -> list[str]:
        """The organizations whose Slack app names this team (usually one), by name."""
        rows = await self._read.rows(
            "SELECT org FROM slack_apps WHERE team_id = ? ORDER BY org", (team_id,)
        )
        return [r["org"] for r in rows]

    async def slack_app(self, org: str) -> dict[str, Any] | None:
        row = await self._read.row(
            "SELECT team_id, bot_token, configured_at, configured_by FROM slack_apps WHERE org = ?",
            (org,),
        )
        return None if row is None else dict(row) | {"bot_token": bool(row["bot_token"])}

    async def slack_users(self, org: str) -> list[dict[str, Any]]:
        rows = await self._read.rows(
            "SELECT slack_id, user, mapped_at, mapped_by FROM slack_users WHERE org = ?"
            " ORDER BY slack_id",
            (org,),
        )
        return [dict(r) for r in rows]
