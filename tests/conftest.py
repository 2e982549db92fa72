"""Shared fixtures: a real nats-server per test (port 0, its own store), real Terraform."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from executor import Executor
from infra import streams
from infra.eventstore import EventStore
from infra.natsclient import client_env
from infra.natsserver import EmbeddedNats
from services.app.commands import App
from services.root.bootstrap import Plane
from tests import bootstrap_support
from tests.bootstrap_support import Process, built
from tests.provider import fake_provider_mirror


def _helper_modules() -> list[str]:
    """The modules under tests/ that hold no tests (the support modules, tests/builders.py,
    ...) and that nothing has imported yet (this conftest imports a few itself)."""
    top = Path(__file__).parent
    found = []
    for path in sorted(top.rglob("*.py")):
        if path.name.startswith("test_") or path.name in ("conftest.py", "__init__.py"):
            continue
        name = ".".join(path.relative_to(top.parent).with_suffix("").parts)
        if name not in sys.modules:
            found.append(name)
    return found


# A helper's assert fails as a test's does, its values shown: pytest rewrites the asserts of
# the helper modules too, as it does the test modules' (the helpers were moved out of them).
pytest.register_assert_rewrite(*_helper_modules())

_OLD_BASETEMP_S = 6 * 3600


def pytest_configure(config: pytest.Config) -> None:
    """Jobs run as a uid of their own (executor/isolation.py) and tests hand them paths in
    `tmp_path`, so the jobs must cross the directories above it. pytest's shared
    `/tmp/pytest-of-<user>` is made 0700 again by every session that starts (every
    developer's on a shared machine): each session gets a base of its own instead, 0711
    (sessions' bases older than six hours are removed).

    Those paths are the host's: a sandboxed job (its own empty /tmp, the system read-only)
    could not write them, so the suite's executors run jobs in the uid mode
    (RUNPLANE_ISOLATION, which `runplane` processes read too), unless a test names its
    isolation; tests/test_isolation.py runs its attacks in both."""
    os.environ.setdefault("RUNPLANE_ISOLATION", "user")
    if config.option.basetemp or os.geteuid() != 0:
        return
    top = Path(tempfile.gettempdir())
    for old in top.glob("rp-tests-*"):
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > _OLD_BASETEMP_S:
                shutil.rmtree(old, ignore_errors=True)
    base = Path(tempfile.mkdtemp(prefix="rp-tests-", dir=top))
    os.chmod(base, 0o711)
    config.option.basetemp = str(base / "t")


@pytest.fixture(autouse=True)
async def _no_phase_outlives_its_test() -> AsyncIterator[None]:
    """Tests share one event loop: a phase (or its heartbeat) still running once the
    test's fixtures are down is an executor that stopped without it. Reported with the
    test's name, then cancelled, so it spills into no other test."""
    before = set(asyncio.all_tasks())
    yield
    left = [
        t
        for t in asyncio.all_tasks() - before
        if not t.done() and _PHASE_TASK.fullmatch(t.get_name())
    ]
    if not left:
        return
    for t in left:
        t.cancel()
    await asyncio.wait(left, timeout=5)  # one that swallows its cancel is reported anyway
    names = sorted(t.get_name() for t in left)
    warnings.warn(f"phase tasks outlived the test: {names}", stacklevel=1)


_PHASE_TASK = re.compile(r"[0-9a-z]{26}-(plan|apply|custom-[0-9]+)(-beat)?")  # executor/runner.py


@pytest.fixture(autouse=True)
def _jobs_may_write_tmp_path(request: pytest.FixtureRequest) -> None:
    """Tests hand jobs paths in `tmp_path` (a provisioner's marker, a step's output): it
    is theirs to write (sticky, like /tmp), the session's base theirs to cross. What the
    executor keeps private (its work directory, the key) it makes private itself."""
    if "tmp_path" not in request.fixturenames:
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")
    os.chmod(tmp_path, 0o1777)
    base = Path(str(request.config.option.basetemp or ""))
    if base.name == "t" and base in tmp_path.parents:
        os.chmod(base, 0o711)


@pytest.fixture
async def nats_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[EmbeddedNats]:
    """A fresh nats-server with JetStream on a random port and a temporary store; it
    takes only its own credentials (`server.connect()`). They are put in this test's
    environment as a deployment would (`RUNPLANE_NATS_USER`/`_PASSWORD`), so a runplane
    process the test starts with `--nats-url server.url` authenticates as well."""
    async with EmbeddedNats(tmp_path / "nats") as server:
        for name, value in client_env(server.auth).items():
            monkeypatch.setenv(name, value)
        yield server


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[NATS]:
    """A connection with every runplane stream declared."""
    conn = await nats_server.connect()
    await streams.declare(conn, conn.jetstream())
    yield conn
    await conn.close()


@pytest.fixture
async def system(nc: NATS, tmp_path: Path) -> AsyncIterator[Plane]:
    """The graph a runplane process runs, built by the composition root
    (tests/bootstrap_support.py): one event store (`store`), one `App` (`app`; it
    admits without snapshots), one key ring, one secret store."""
    async with AsyncExitStack() as stack:
        yield built(nc, stack, tmp_path)


@pytest.fixture
async def process(nc: NATS, tmp_path: Path) -> AsyncIterator[Process]:
    """`process(conn=None, **knobs)`: another process of the same deployment on `conn`
    (default: `nc`), its own graph (event store, `App`; the deployment's key ring), as a
    replica or a writer that dies. `knobs`: tests/bootstrap_support.py `built`'s
    (`store=` shares one, `pinning=`)."""
    async with AsyncExitStack() as stack:

        def another(conn: NATS | None = None, **knobs: Any) -> Plane:
            return built(conn or nc, stack, tmp_path, **knobs)

        yield another


@pytest.fixture
def store(system: Plane) -> EventStore:
    return system.store


@pytest.fixture
def app(system: Plane) -> App:
    return system.app


@pytest.fixture
def fake_mirror(tmp_path: Path) -> Path:
    """A provider mirror with the `fake` test provider (`tests/provider`), for
    `TerraformConfig(provider_mirrors=[fake_mirror])`."""
    return fake_provider_mirror(tmp_path)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """An empty git repository on branch main."""
    path = tmp_path / "repo"
    path.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=path, check=True)
    return path


@pytest.fixture
async def executor(system: Plane, tmp_path: Path) -> AsyncIterator[Executor]:
    """A running executor of `system` with quick heartbeats, short polls and a short
    stop grace."""
    async with bootstrap_support.executor(
        system, work_dir=tmp_path / "exec", executor_id="test-exec"
    ) as ex:
        yield ex
