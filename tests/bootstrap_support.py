"""The system under test as the composition root builds it (services/root/bootstrap.py):
the graph a runplane process runs, over the test's nats-server, with a test's knobs as
keyword overrides. Holds no tests itself.

What differs from a deployment is only what a test asks for: the data directory is in
the test's `tmp_path`, repositories may come from anywhere (the tests' are local), and an
admitted run is queued without a snapshot (`unpinned`) unless the test gives `pinning`
(most tests' workspaces name no repository that `git ls-remote` could read).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from executor.terraform import TerraformConfig
from executor.worker import Executor
from infra import options
from infra.options import Options, prepare_data_dir
from services.app.flows import SnapshotHook
from services.app.secrets import SecretStore
from services.app.snapshot import Snapshotter
from services.root import bootstrap
from services.root.bootstrap import Pinning, Plane

# The `system` fixture's type, by a name that is not tests/plane_support.py's `Plane`.
System = Plane
# The `process` fixture (tests/conftest.py): `process(conn, **knobs)` builds another process.
Process = Callable[..., Plane]


def options_for(root: Path, **changes: Any) -> Options:
    """A process's options, its data directory `<root>/system` (made 0700, as the CLI
    makes it), any repository source allowed."""
    isolation = os.environ.get("RUNPLANE_ISOLATION", "user")  # tests/conftest.py
    opts = Options(
        **{"data_dir": root / "system", "allowed_repos": "*", "isolation": isolation, **changes}
    )
    prepare_data_dir(opts.data_dir)
    return opts


def unpinned(_: SecretStore) -> SnapshotHook | None:
    """No admission snapshot: an admitted run is queued at once, not `pinning`."""
    return None


def git_snapshots(secrets: SecretStore) -> Snapshotter:
    """The deployment's snapshots, `git ls-remote` given 10 s (a loaded test machine)."""
    return Snapshotter(secrets, timeout=10)


def pinned_by(hook: SnapshotHook) -> Pinning:
    """Admission snapshots taken by `hook` (a test's stand-in for `git ls-remote`)."""
    return lambda _: hook


def built(
    nc: NATS,
    stack: AsyncExitStack,
    root: Path,
    *,
    opts: Options | None = None,
    pinning: Pinning = unpinned,
    **knobs: Any,
) -> Plane:
    """The process's graph on `nc`, its components started into `stack`. Its key ring is
    the one `runplane up` makes in the data directory (so every plane a test builds in
    `root` shares it, as one deployment's processes do). `knobs`: `store`, `clock`,
    `ids`, `keyring` (bootstrap.build)."""
    opts = opts or options_for(root)
    if "keyring" not in knobs:
        knobs["keyring"] = options.keyring(opts, create=True)
    return bootstrap.build(opts, nc, stack, pinning=pinning, **knobs)


def executor(plane: Plane, **knobs: Any) -> Executor:
    """An executor of `plane`, not started: quick heartbeats, short polls and a short stop
    grace unless `knobs` says otherwise, and its own provider mirror in its work
    directory (several run in one test process)."""
    quick: dict[str, Any] = {
        "heartbeat_interval": 0.2,
        "grace_period": 5.0,
        "fetch_timeout": 0.2,
        "terraform": TerraformConfig(),
    }
    return plane.executor(**{**quick, **knobs})
