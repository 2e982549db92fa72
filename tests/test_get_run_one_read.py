"""GET of one run is one statement on the read model (issue 26, item 7: GET run p99 at
100,000 runs): the row, its board entries, its pins (snapshot, steps, policies, the last
plan's commit author and message) and its measured steps in one trip to the read
connection's thread, and the answer is the one a list gives for the same run.

Every golden run (tests/golden: every run type and ending) is folded into one read model
through the projector's own batch (projections/batch.py)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import msgspec

from events.codec import run_subject
from projections import schema
from projections.batch import apply_batch
from projections.ordered import Delivered
from projections.readmodel import ReadModel
from tests.golden_record import GOLDEN, ORG, WS

MEASURED = "measured-apply"
_USED = b'"cpu_seconds":0.5,"wall_seconds":1.25,"peak_memory_bytes":4096,"metrics":{'


def _runs() -> dict[str, list[bytes]]:
    """Every golden run's events by run id, and one more: the applied run again with
    every step measured (executor/usage.py's figures), which no golden has."""
    runs = {}
    for expected_file in sorted(GOLDEN.glob("*.expected.json")):
        run_id = msgspec.json.decode(expected_file.read_bytes())["run_id"]
        events = expected_file.with_name(expected_file.name.replace(".expected.json", ".jsonl"))
        runs[run_id] = events.read_bytes().splitlines()
    runs[MEASURED] = [
        re.sub(rb'"metrics":\{', _USED, raw.replace(b"apply-applied", MEASURED.encode()))
        for raw in runs["apply-applied"]
    ]
    return runs


async def _goldens(path: Path) -> list[str]:
    """Every golden run folded into the read model at `path`; their ids."""
    writer = await schema.connect(path)
    msgs, ids, seq = [], [], 0
    for run_id, events in _runs().items():
        ids.append(run_id)
        for raw in events:
            seq += 1
            msgs.append(Delivered(seq, run_subject(ORG, WS, run_id), raw, time.time_ns()))
    try:
        await apply_batch(writer, msgs, after=0)
    finally:
        await writer.close()
    return ids


async def test_get_run_answers_what_the_list_answers_for_every_golden_run(
    tmp_path: Path,
) -> None:
    path = tmp_path / "read.db"
    ids = await _goldens(path)
    read = await ReadModel.open(path)
    try:
        for live in (False, True):
            listed = {r["id"]: r for r in await read.runs.find(ORG, limit=1000, live=live)}
            assert set(listed) == set(ids)
            got: dict[str, dict[str, Any]] = {}
            for run_id in ids:
                one = await read.runs.get(ORG, run_id, live=live)
                assert one is not None, run_id
                assert one == listed[run_id], run_id
                got[run_id] = one
            assert await read.runs.get("another-org", ids[0], live=live) is None
            assert await read.runs.get(ORG, "no-such-run", live=live) is None
        # The comparison covers what the pins add: some runs have each of them.
        answers = list(got.values())
        assert any(a["snapshot"] is not None for a in answers)
        assert any(a["commit_author"] is not None for a in answers)
        assert got[MEASURED]["usage"]["wall_seconds"] > 0
        assert any(a["steps"] for a in answers)
        assert any(a["policies"] for a in answers)
    finally:
        await read.close()


async def test_get_run_is_one_statement_on_the_read_connection(tmp_path: Path) -> None:
    """Before, a GET was five trips to the connection's thread (BEGIN, the row, the
    state and measured steps, the last plan, COMMIT), each a hand-off to aiosqlite's
    thread and back; the GET run p99 at 100,000 runs was 4.4 ms against a 2 ms target."""
    path = tmp_path / "read.db"
    ids = await _goldens(path)
    read = await ReadModel.open(path)
    statements: list[str] = []
    try:
        await read.db.set_trace_callback(statements.append)
        for run_id in ids:
            statements.clear()
            assert await read.runs.get(ORG, run_id, live=True) is not None
            assert len(statements) == 1, statements
            assert statements[0].lstrip().upper().startswith("SELECT")
    finally:
        await read.close()
