"""What a pull request's comment says: a row per workspace, ids and numbers only.

A tenant controls its workspaces' names (validated `[a-z0-9-]` at creation, reduced to
that again here), its plans and its Terraform's output; the comment shows the names, a
status word from runplane's own vocabulary (`WORDS`), the plan's counts and links built
from ids. No variable, no plan attribute, no error text: nothing that could carry
markdown, HTML, a mention (`@everyone`, `@org/team`) or a secret.
"""

from __future__ import annotations

import os
import re
from urllib.parse import quote

from events import vcs_report as vr
from services.processes.notifications.formats import PUBLIC_URL_ENV

MAX_ROWS = 200  # rows in the comment (GitHub takes 65,536 characters)
_SAFE = re.compile(r"[^a-z0-9._-]")
_SHA = re.compile(r"^[0-9a-f]{7,64}$")


def safe(text: str) -> str:
    """A name as the comment shows it: runplane's id characters only (a workspace name
    is one already; anything else could open markdown, a mention or HTML)."""
    return _SAFE.sub("_", text.lower())[:64] or "_"


def marker(key: str) -> str:
    return f"<!-- runplane:{key} -->"


def run_url(base_url: str, org: str, ws: str, run_id: str) -> str:
    base = (base_url or os.environ.get(PUBLIC_URL_ENV, "")).rstrip("/")
    parts = (quote(safe(p), safe="") for p in (org, ws, run_id))
    o, w, r = parts
    return f"{base}/orgs/{o}/workspaces/{w}/runs/{r}"


def render(state: vr.PrReport, *, key: str, org: str, base_url: str) -> str:
    """The comment's markdown: one row per workspace, ids and numbers only."""
    head = vr.head_commit(state)
    lines = [marker(key), "### runplane plans", ""]
    if _SHA.match(head):
        lines += [f"Latest commit: `{head[:12]}`", ""]
    lines += ["| Workspace | Plan | Changes | Commit | Run |", "|---|---|---|---|---|"]
    rows = sorted(state.rows.values(), key=lambda r: r.workspace)
    for row in rows[:MAX_ROWS]:
        lines.append(_row(row, org, base_url))
    if len(rows) > MAX_ROWS:
        lines += ["", f"and {len(rows) - MAX_ROWS} more workspaces"]
    return "\n".join(lines) + "\n"


def _row(row: vr.PrRow, org: str, base_url: str) -> str:
    counts = "-"
    if row.add is not None:
        counts = f"+{int(row.add)} ~{int(row.change or 0)} -{int(row.destroy or 0)}"
    commit = f"`{row.commit[:7]}`" if _SHA.match(row.commit) else "-"
    url = run_url(base_url, org, row.workspace, row.run_id)
    word = row.status if row.status in WORDS else "unknown"
    return f"| `{safe(row.workspace)}` | {word} | {counts} | {commit} | [run]({url}) |"


WORDS = frozenset(
    {
        "queued",
        "planning",
        "running",
        "needs attention",
        "planned",
        "no changes",
        "errored",
        "policy failed",
        "canceled",
        "discarded",
    }
)
