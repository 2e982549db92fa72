"""The read model's queries of organizations (`ReadModel.orgs`): one, and its API tokens
(`ReadModel.integrations` has what it connects to)."""

from __future__ import annotations

from typing import Any

from projections.reader import Reader

# A token's row with its revocation and last use (each apart: projections/schema.py).
_TOKEN_COLS = (
    "t.token_id, t.user, t.role, t.created_at, t.created_by, t.expires_at, u.last_used_at"
    ", r.revoked_at"
)
_TOKEN_JOIN = (
    "tokens t LEFT JOIN token_revocations r ON r.token_id = t.token_id"
    " LEFT JOIN token_uses u ON u.token_id = t.token_id"
)


class Orgs:
    """Organizations and their tokens, each as a plain dict ready for JSON."""

    def __init__(self, read: Reader) -> None:
        self._read = read

    async def get(self, org: str) -> dict[str, Any] | None:
        row = await self._read.row(
            "SELECT name, created_at, created_by FROM orgs WHERE name = ?", (org,)
        )
        return dict(row) if row else None

    async def token(self, token_hash: str) -> dict[str, Any] | None:
        """Who a token (given by its SHA-256 hex digest) belongs to, with its lifecycle:
        `revoked_at`, `expires_at` and `last_used_at` (each null if not so)."""
        row = await self._read.row(
            f"SELECT t.org, {_TOKEN_COLS} FROM {_TOKEN_JOIN} WHERE t.token_hash = ?",
            (token_hash,),
        )
        return dict(row) if row else None

    async def tokens(self, org: str) -> list[dict[str, Any]]:
        """The organization's tokens not revoked, oldest first: never a hash."""
        rows = await self._read.rows(
            f"SELECT {_TOKEN_COLS} FROM {_TOKEN_JOIN} WHERE t.org = ? AND r.token_id IS NULL"
            " ORDER BY t.created_at, t.token_id",
            (org,),
        )
        return [{k: row[k] for k in row.keys() if k != "revoked_at"} for row in rows]
