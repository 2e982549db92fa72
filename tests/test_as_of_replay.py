"""`runplane replay --until SEQ|TIME` (issue 25, item 3): the whole read model as it was
once the stream held that sequence, equal row for row to a replay made when the stream
ended there; real NATS, the real command side, the `runplane` console script.

On main `--until` did not exist (argparse refused it, exit 2) and `replay` had no
`until`: both tests fail there.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from infra.eventstore import EventStore
from infra.natsserver import EmbeddedNats
from projections import replay
from projections.readmodel import ReadModel
from services.app.commands import App
from tests.projection_support import ORG, new_run, varied_history

ROOT = Path(__file__).resolve().parents[1]


async def _dump(path: Path) -> dict[str, list[tuple[object, ...]]]:
    async with await ReadModel.open(path) as read:
        return await read.dump()


def _runplane(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.root.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "RUNPLANE_CONNECT_TIMEOUT": "5"},
    )


async def test_replay_until_equals_a_replay_of_the_stream_cut_there(
    app: App, store: EventStore, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    nc = app.store.nc
    await varied_history(app)
    cut = await store.last_seq()
    assert await replay(nc, tmp_path / "cut.db") == cut  # the stream ends at `cut` now
    await asyncio.sleep(0.01)
    when = datetime.now(UTC)
    await asyncio.sleep(0.01)
    for _ in range(3):  # more history after the moment, in a workspace that existed then
        await new_run(app, "net", message="later")
    await app.create_org("another", "admin")
    assert await store.last_seq() > cut
    expected = await _dump(tmp_path / "cut.db")

    assert await replay(nc, tmp_path / "until.db", until=cut) == cut
    assert await _dump(tmp_path / "until.db") == expected
    await replay(nc, tmp_path / "all.db")
    assert await _dump(tmp_path / "all.db") != expected  # the cut is not the whole

    for until in (str(cut), when.isoformat()):
        out = tmp_path / f"cli-{until[:4]}.db"
        common = ("--nats-url", nats_server.url, "--data-dir", str(tmp_path / "data"))
        done = await asyncio.to_thread(
            _runplane, "replay", *common, "--until", until, "--output", str(out)
        )
        assert done.returncode == 0, done.stderr
        assert f"up to sequence {cut} into {out}" in done.stdout, done.stdout
        assert await _dump(out) == expected, until
    assert ORG  # the history's organization, whose rows the dumps hold


async def test_replay_until_a_moment_the_stream_never_held_is_refused(
    app: App, store: EventStore, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    await app.create_org(ORG, "admin")
    last = await store.last_seq()
    common = ("--nats-url", nats_server.url, "--data-dir", str(tmp_path / "data"))
    for bad in (str(last + 5), "2001-01-01T00:00:00Z", "tomorrow", "2999-01-01T00:00:00Z"):
        done = await asyncio.to_thread(_runplane, "replay", *common, "--until", bad)
        assert done.returncode == 2, (bad, done.stdout, done.stderr)
        assert done.stderr.startswith("runplane: --until: as_of"), done.stderr
        assert "Traceback" not in done.stderr
