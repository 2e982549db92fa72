"""The read model's tables, and opening a SQLite database that holds them.

Tables are declared once as `Table` values: the DDL, the upsert and delete statements and
the row order of `dump()` all derive from the same column list. Bump `VERSION` whenever a
table changes; a database of another version is emptied and rebuilt by replay, since a
read model is only ever a fold of the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiosqlite

# (The board's tables, BOARD_TABLES, came without a bump: nothing of the events' fold
# changed, and where they are missing they are created empty and folded from the start.)
VERSION = 18

Row = dict[str, Any]
Key = tuple[Any, ...]


class Table:
    """A table's columns and primary key, and the statements derived from them."""

    def __init__(self, name: str, pk: tuple[str, ...], *columns: str) -> None:
        self.name = name
        self.pk = pk
        self.columns = tuple((c.split(" ", 1)[0], c.split(" ", 1)[1]) for c in columns)
        self.names = tuple(c for c, _ in self.columns)
        # itemgetter: rows are built per event, so this is on the replay's hot path.
        self.values: Callable[[Row], tuple[Any, ...]] = operator.itemgetter(*self.names)
        self._key = operator.itemgetter(*pk)
        cols = ", ".join(f"{c} {t}" for c, t in self.columns)
        # Text keys: the row lives in the key's b-tree, one lookup instead of two.
        rowid = "" if pk == ("seq",) else " WITHOUT ROWID"
        key = ", ".join(pk)
        self.ddl = f"CREATE TABLE IF NOT EXISTS {name} ({cols}, PRIMARY KEY ({key})){rowid}"
        marks = ", ".join("?" * len(self.names))
        self.upsert = f"INSERT OR REPLACE INTO {name} ({', '.join(self.names)}) VALUES ({marks})"
        self.delete = f"DELETE FROM {name} WHERE {' AND '.join(f'{c} = ?' for c in pk)}"
        self.select = f"SELECT {', '.join(self.names)} FROM {name}"
        self.select_sorted = f"{self.select} ORDER BY {key}"

    def key(self, row: Row) -> Key:
        key = self._key(row)
        return key if len(self.pk) > 1 else (key,)


CHECKPOINT = Table("checkpoint", ("id",), "id INTEGER CHECK (id = 1)", "seq INTEGER NOT NULL")
ORGS = Table("orgs", ("name",), "name TEXT NOT NULL", "created_at TEXT", "created_by TEXT")
TOKENS = Table(
    "tokens",
    ("token_hash",),
    "token_hash TEXT NOT NULL",
    "token_id TEXT",
    "org TEXT",
    "user TEXT",
    "role TEXT",
    "created_at TEXT",
    "created_by TEXT",
    "expires_at TEXT",  # NULL: never expires
)
# Apart from `tokens` (keyed by hash), so that folding a revocation or a use (which name
# the token by id) writes a row without reading one back.
TOKEN_REVOCATIONS = Table(
    "token_revocations",
    ("token_id",),
    "token_id TEXT NOT NULL",
    "org TEXT",
    "revoked_at TEXT",
    "revoked_by TEXT",
)
TOKEN_USES = Table(  # the last org.token_used of each token
    "token_uses",
    ("token_id",),
    "token_id TEXT NOT NULL",
    "last_used_at TEXT",
)
WORKSPACES = Table(
    "workspaces",
    ("org", "name"),
    "org TEXT NOT NULL",
    "name TEXT NOT NULL",
    "repository TEXT",
    "branch TEXT",
    "directory TEXT",
    "variables_json TEXT",
    "created_at TEXT",
    "created_by TEXT",
    "active_run TEXT",
    "heartbeat_timeout INTEGER",
    "dispatch_timeout INTEGER",
    "managed_state INTEGER",  # 0: the workspace brings its own backend
    "lock_json TEXT",  # {"holder", "reason", "locked_at"} while locked, else NULL
    "folder TEXT",  # the folder it inherits settings from; "" for the organization
    "vcs_connection TEXT",  # the VCS connection whose webhooks start its runs; "" none
    "triggers_json TEXT",  # {trigger_paths, trigger_any_change, trigger_tags, vcs_run_type}
    "deleted_at TEXT",  # NULL unless deleted (ws.deleted); a purge removes the row
)
WS_QUEUE = Table(
    "ws_queue",
    ("org", "workspace", "run_id"),
    "org TEXT NOT NULL",
    "workspace TEXT NOT NULL",
    "run_id TEXT NOT NULL",
    "position INTEGER NOT NULL",  # the stream sequence of ws.run_enqueued: FIFO order
)
RUNS = Table(
    "runs",
    ("id",),
    "id TEXT NOT NULL",
    "org TEXT NOT NULL",
    "workspace TEXT NOT NULL",
    "type TEXT",
    "status TEXT",
    "created_by TEXT",
    "created_at TEXT",
    "updated_at TEXT",
    "message TEXT",
    "commit_sha TEXT",
    "has_changes INTEGER",
    "plan_add INTEGER",
    "plan_change INTEGER",
    "plan_destroy INTEGER",
    "apply_add INTEGER",
    "apply_change INTEGER",
    "apply_destroy INTEGER",
    "plan_digest TEXT",
    "approved_by TEXT",
    "acknowledged_json TEXT",
    "reason TEXT",
    "error_message TEXT",
    "phase TEXT",
    "lease_id TEXT",
    "executor_id TEXT",
    "last_seq INTEGER",
    "cause_json TEXT",  # events.values.Cause; NULL for runs created before causes were
    "state_json TEXT",  # events.run.RunState, so the next event folds with the core's evolve
    "log_removed_at TEXT",  # retention removed its stored logs then (run.log_pruned)
)
STEPS = Table(
    "steps",
    ("run_id", "phase", "step"),
    "run_id TEXT NOT NULL",
    "phase TEXT NOT NULL",
    "step TEXT NOT NULL",
    "status TEXT",
    "started_at TEXT",
    "ended_at TEXT",
    "duration_ms INTEGER",
    "error TEXT",
    "log_object TEXT",
    "started_seq INTEGER",  # start order
    "metrics_json TEXT",  # the executor's StepFinished.metrics (duration, lines, counts)
)
CHANGES = Table(  # the plan's resource changes, for review (projections/changes.py)
    "changes",
    ("run_id", "position"),
    "run_id TEXT NOT NULL",
    "position INTEGER NOT NULL",  # order in the plan
    "address TEXT NOT NULL",
    "type TEXT",
    "module TEXT",
    "action TEXT",
    "attributes_json TEXT",  # [AttributeChange], sensitive values already "(sensitive)"
    "replace_paths_json TEXT",
)
RESOURCE_STATES = Table(  # each resource's stages during the apply (projections/changes.py)
    "resource_states",
    ("run_id", "address", "stage"),
    "run_id TEXT NOT NULL",
    "address TEXT NOT NULL",
    "stage INTEGER NOT NULL",  # 0, and 1 for the second stage of a replacement
    "action TEXT",
    "state TEXT",
    "error TEXT",
    "updated_at TEXT",
)
STATE_VERSIONS = Table(  # run.state_version, ws.state_pushed (projections/state_versions.py)
    "state_versions",
    ("org", "workspace", "seq"),
    "org TEXT NOT NULL",
    "workspace TEXT NOT NULL",
    "seq INTEGER NOT NULL",  # the event's stream sequence: newest last
    "run_id TEXT",
    "serial INTEGER",
    "lineage TEXT",
    "digest TEXT",
    "object TEXT",
    "size INTEGER",
    "created_at TEXT",
    "recovered INTEGER DEFAULT 0",  # left on disk by a dead executor, recorded at restart
    "pushed_by TEXT",  # ws.state_pushed: the user whose CLI pushed it (NULL: a run wrote it)
    "forced INTEGER DEFAULT 0",  # pushed with -force
    "rollback_of TEXT",  # a rollback's: the version (object) it copies (NULL: none)
    "reason TEXT",  # a rollback's: why, as its admin said
)
EVENTS = Table(
    "events",
    ("seq",),
    "seq INTEGER",
    "subject TEXT NOT NULL",
    "org TEXT",
    "workspace TEXT",
    "run_id TEXT",
    "type TEXT",
    "at TEXT",
    "actor TEXT",
    "data_json TEXT",  # the event exactly as stored, unknown fields included
    "stored_at TEXT",  # when JetStream stored it
)
NOTIFICATIONS = Table(  # notification configurations (events/notification.py); no token
    "notifications",
    ("id",),
    "id TEXT NOT NULL",
    "org TEXT NOT NULL",
    "workspace TEXT",  # NULL: the organization's
    "name TEXT",
    "destination TEXT",
    "url TEXT",
    "triggers_json TEXT",
    "enabled INTEGER",
    "has_token INTEGER",
    "created_at TEXT",
    "created_by TEXT",
    "updated_at TEXT",
)
NOTIFY_ATTEMPTS = Table(  # every attempt of every delivery, in stream order
    "notify_attempts",
    ("config_id", "seq"),
    "config_id TEXT NOT NULL",
    "seq INTEGER NOT NULL",
    "org TEXT",
    "delivery_id TEXT",
    "attempt INTEGER",
    "trig TEXT",
    "run_id TEXT",
    "at TEXT",
    "status_code INTEGER",
    "excerpt TEXT",
    "error TEXT",
    "outcome TEXT",
    "next_retry_at TEXT",
)
SCHEDULE_FIRES = Table(  # every fire time a schedule handled (events/schedule.py)
    "schedule_fires",
    ("schedule_id", "seq"),
    "schedule_id TEXT NOT NULL",
    "seq INTEGER NOT NULL",
    "org TEXT",
    "workspace TEXT",
    "fire_time TEXT",
    "outcome TEXT",  # fired | skipped
    "run_id TEXT",
    "reason TEXT",
    "waiting_run TEXT",
    "missed INTEGER",
    "detail TEXT",
    "at TEXT",
)
STACKS = Table("stacks", ("org", "name"), "org TEXT NOT NULL", "name TEXT NOT NULL",  # stacks
    "definition_json TEXT", "changed_at TEXT", "changed_by TEXT", "seq INTEGER")  # fmt: skip
SLACK_APPS = Table(  # an organization's Slack app (events/chat.py); secrets sealed apart
    "slack_apps",
    ("org",),
    "org TEXT NOT NULL",
    "team_id TEXT NOT NULL",
    "bot_token INTEGER",
    "configured_at TEXT",
    "configured_by TEXT",
)
SLACK_USERS = Table(  # which runplane user each Slack user is, per organization
    "slack_users",
    ("org", "slack_id"),
    "org TEXT NOT NULL",
    "slack_id TEXT NOT NULL",
    "user TEXT NOT NULL",
    "mapped_at TEXT",
    "mapped_by TEXT",
)
VCS_CONNECTIONS = Table(  # VCS connections (events/vcs.py); never a secret or a token
    "vcs_connections",
    ("id",),
    "id TEXT NOT NULL",
    "org TEXT NOT NULL",
    "name TEXT",
    "provider TEXT",
    "api_url TEXT",
    "has_secret INTEGER",
    "has_token INTEGER",
    "created_at TEXT",
    "created_by TEXT",
    "updated_at TEXT",
)
VCS_BINDINGS = Table(  # workspaces bound to a VCS connection: what a webhook matches
    "vcs_bindings",
    ("org", "workspace"),
    "org TEXT NOT NULL",
    "workspace TEXT NOT NULL",
    "connection TEXT NOT NULL",
    "repo_key TEXT NOT NULL",  # the repository's path, lowercase, no .git (acme/net)
    "branch TEXT",
    "directory TEXT",
    # what a push must touch when no trigger paths are set: the directory as a prefix
    # ("" the whole repository), NULL when trigger paths or any change decide instead
    "dir_prefix TEXT",
    "trigger_paths_json TEXT",
    "trigger_any_change INTEGER",
    "trigger_tags_json TEXT",
    "run_type TEXT",
)
VCS_DELIVERIES = Table(  # each delivery a connection recorded, in stream order
    "vcs_deliveries",
    ("connection", "seq"),
    "connection TEXT NOT NULL",
    "seq INTEGER NOT NULL",
    "org TEXT",
    "delivery TEXT",
    "at TEXT",
    "event TEXT",
    "ignored TEXT",  # "" acted on; stale | duplicate
    "record_json TEXT",  # repository, ref, commit, runs, stale, duplicate_of
)
REMOVED_RUNS = Table(  # runs whose whole record retention removed (run.removed): a tombstone
    "removed_runs",
    ("id",),
    "id TEXT NOT NULL",
    "org TEXT NOT NULL",
    "workspace TEXT NOT NULL",
    "removed_at TEXT NOT NULL",
    "seq INTEGER NOT NULL",  # the sequence of its run.removed
)
SKIPPED = Table(
    "skipped",
    ("seq",),
    "seq INTEGER",
    "subject TEXT NOT NULL",
    "type TEXT",
    "reason TEXT",
)

# The heartbeat board (RP_HEARTBEATS), folded apart from the events (projections/board.py):
# its own checkpoint, a stream sequence of its own; a rebuild of the events leaves it be.
BOARD_CHECKPOINT = Table(
    "board_checkpoint", ("id",), "id INTEGER CHECK (id = 1)", "seq INTEGER NOT NULL"
)
LIVENESS = Table(  # each board entry, as its last message says (projections/liveness.py)
    "run_liveness",
    ("run_id", "phase"),
    "run_id TEXT NOT NULL",
    "phase TEXT NOT NULL",  # a phase's entry, or `deadline`: the run's limits
    "seq INTEGER NOT NULL",  # the message's stream sequence: an older one never replaces it
    "at TEXT NOT NULL",  # when the server stored it
    "lease_id TEXT",  # "" while nobody holds the phase (a `dispatched` marker)
    "executor_id TEXT",
    "timeout INTEGER",
    "recheck INTEGER",
    "dispatched_at TEXT",
    "run_deadline TEXT",
    "approval_deadline TEXT",
)
BOARD_TABLES: tuple[Table, ...] = (BOARD_CHECKPOINT, LIVENESS)

TABLES: tuple[Table, ...] = (
    CHECKPOINT,
    ORGS,
    TOKENS,
    TOKEN_REVOCATIONS,
    TOKEN_USES,
    WORKSPACES,
    WS_QUEUE,
    RUNS,
    STEPS,
    CHANGES,
    RESOURCE_STATES,
    STATE_VERSIONS,
    EVENTS,
    NOTIFICATIONS,
    NOTIFY_ATTEMPTS,
    SCHEDULE_FIRES,
    STACKS,  # came without a bump too: no stack event is older than the table
    SLACK_APPS,
    SLACK_USERS,
    VCS_CONNECTIONS,
    VCS_BINDINGS,
    VCS_DELIVERIES,
    REMOVED_RUNS,
    SKIPPED,
)
BY_NAME = {t.name: t for t in TABLES}

INDEXES = (
    "CREATE INDEX IF NOT EXISTS runs_by_org ON runs (org, created_at DESC, id DESC)",
    "CREATE INDEX IF NOT EXISTS runs_by_ws ON runs (org, workspace, created_at DESC, id DESC)",
    "CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, seq)",
    "CREATE INDEX IF NOT EXISTS ws_queue_order ON ws_queue (org, workspace, position)",
    "CREATE INDEX IF NOT EXISTS tokens_by_org ON tokens (org, created_at)",
    "CREATE INDEX IF NOT EXISTS notifications_by_org ON notifications (org, workspace, id)",
    "CREATE INDEX IF NOT EXISTS slack_apps_by_team ON slack_apps (team_id)",
    "CREATE INDEX IF NOT EXISTS vcs_connections_by_org ON vcs_connections (org, id)",
    "CREATE INDEX IF NOT EXISTS vcs_bindings_on ON vcs_bindings (connection, repo_key, branch)",
)


# ---------------------------------------------------------------- opening


async def connect(path: Path, *, fast_unsafe: bool = False) -> aiosqlite.Connection:
    """Open the database in autocommit mode (transactions are explicit) with the schema.

    `fast_unsafe` is for a replay into a scratch file that is thrown away on failure:
    no journal, no fsync until the end.
    """
    db = await aiosqlite.connect(path, isolation_level=None)
    try:
        await _prepare(db, fast_unsafe=fast_unsafe)
    except BaseException:  # a connection half set up (the write lock, maybe) goes now
        await asyncio.shield(db.close())
        raise
    return db


async def _prepare(db: aiosqlite.Connection, *, fast_unsafe: bool) -> None:
    if fast_unsafe:
        await db.execute("PRAGMA journal_mode = OFF")
        await db.execute("PRAGMA synchronous = OFF")
        await db.execute("PRAGMA cache_size = -65536")
    else:
        await db.execute("PRAGMA journal_mode = WAL")
        # WAL + NORMAL: a commit survives a crash of the process; an OS crash may lose the
        # last transactions, which the checkpoint makes harmless (they are re-projected).
        await db.execute("PRAGMA synchronous = NORMAL")
    await db.execute("PRAGMA busy_timeout = 5000")
    # A replay builds the secondary indexes once at the end: faster than row by row.
    await _ensure_schema(db, indexes=not fast_unsafe)


async def _ensure_schema(db: aiosqlite.Connection, *, indexes: bool) -> None:
    async with db.execute("PRAGMA user_version") as cur:
        row = await cur.fetchone()
    version = row[0] if row else 0
    try:  # BEGIN inside: cancelled while queued, it runs anyway, and so must the ROLLBACK
        await db.execute("BEGIN IMMEDIATE")
        if version != VERSION:
            await _drop_all(db)
        for table in (*TABLES, *BOARD_TABLES):
            await db.execute(table.ddl)
        if indexes:
            await create_indexes(db)
        await db.execute("INSERT OR IGNORE INTO checkpoint (id, seq) VALUES (1, 0)")
        await db.execute("INSERT OR IGNORE INTO board_checkpoint (id, seq) VALUES (1, 0)")
        await db.execute(f"PRAGMA user_version = {VERSION}")
        await db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.OperationalError):  # no transaction: BEGIN failed
            await db.execute("ROLLBACK")
        raise


async def create_indexes(db: aiosqlite.Connection) -> None:
    for index in INDEXES:
        await db.execute(index)


async def _drop_all(db: aiosqlite.Connection) -> None:
    """Drop every table: a read model of another schema version is rebuilt from the stream."""
    async with db.execute("SELECT name FROM sqlite_master WHERE type = 'table'") as cur:
        names = [r[0] for r in await cur.fetchall()]
    for name in names:
        if not name.startswith("sqlite_"):
            await db.execute(f'DROP TABLE IF EXISTS "{name}"')


async def reset(db: aiosqlite.Connection, tables: tuple[Table, ...] = TABLES) -> None:
    """Empty every table of the events' fold (or of `tables`, the first of which is their
    checkpoint) and move the checkpoint back to 0, in one transaction."""
    try:  # BEGIN inside: cancelled while queued, it runs anyway, and so must the ROLLBACK
        await db.execute("BEGIN IMMEDIATE")
        for table in tables:
            await db.execute(f"DELETE FROM {table.name}")
        await db.execute(f"INSERT INTO {tables[0].name} (id, seq) VALUES (1, 0)")
        await db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.OperationalError):  # no transaction: BEGIN failed
            await db.execute("ROLLBACK")
        raise


async def checkpoint(db: aiosqlite.Connection, table: Table = CHECKPOINT) -> int:
    """The last stream sequence the database covers (of the board, with BOARD_CHECKPOINT)."""
    async with db.execute(f"SELECT seq FROM {table.name} WHERE id = 1") as cur:
        row = await cur.fetchone()
    return int(row[0]) if row else 0
