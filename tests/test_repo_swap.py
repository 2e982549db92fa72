"""A local repository whose path another uid can change is refused (an attacker's review
of issue 23 item 8: a TOCTOU giving cross-org repository reads).

Org A's long-running job (uid mode) owns `/tmp/evil` in the shared, sticky /tmp and
swaps it between a harmless repository and org B's: its checkout (`/proc/<pid>/cwd`
of a process working in it) or the executor's mirror of it (`<work>/git/<key>.git`).
org A's workspace names `/tmp/evil`. The API, the executor (before its checkout) and the
scheduler (before its `ls-remote` at admission) each checked where the link pointed,
then root's git read the same string again: org B's code in org A's checkout.

Now a path any component of which someone other than root can change is refused
(`unsafe-path`), at the API (422), at checkout (`repository_not_allowed`) and at
admission; git reads the checked path resolved. The races here are real: the attacker
is a process of another uid (nobody) flipping the link as fast as it can while org A's
checkouts, runs and admissions go.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS

from events.errors import RepositoryRefused, SnapshotFailed
from events.run import RunState, Workspace
from executor import Executor, git
from executor.errors import StepFailed
from executor.git import GitCache
from executor.output import Masker
from executor.process import StepLog
from services.app.commands import App
from services.app.repositories import Sources, deployment_sources
from services.app.snapshot import Snapshotter
from services.surfaces.api.context import API
from tests.api_support import ADMIN_TOKEN, Http
from tests.bootstrap_support import System
from tests.executor_support import Harness
from tests.executor_support import git as run_git

NOBODY = 65534  # org A's job's uid
Flip = Callable[..., None]
HARMLESS_TF = 'resource "null_resource" "harmless" {}\n'
SECRET_TF = "".join(f'resource "null_resource" "bravo_secret_{i}" {{}}\n' for i in range(3))
SECRET_FILE = "BRAVO-SECRET.txt"
# The attacker: swaps `link` between its targets as fast as it can, atomically.
FLIPPER = """
import os, sys
link, targets = sys.argv[1], sys.argv[2:]
tmp = link + ".flip"
i = 0
while True:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    os.symlink(targets[i % len(targets)], tmp)
    os.replace(tmp, link)
    i += 1
"""


def repository(path: Path, main_tf: str, extra: dict[str, str] | None = None) -> Path:
    """A root-owned repository on `main`."""
    path.mkdir(parents=True)
    run_git(path, "init", "-q", "-b", "main")
    for name, text in {"main.tf": main_tf, **(extra or {})}.items():
        (path / name).write_text(text)
    run_git(path, "add", "-A")
    run_git(path, "commit", "-q", "-m", "infra")
    return path


def head(path: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True)
    return out.stdout.strip()


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A directory like /tmp: root's, sticky, world-writable."""
    path = tmp_path / "shared"
    path.mkdir()
    os.chmod(path, 0o1777)
    return path


@pytest.fixture
def harmless(tmp_path: Path) -> Path:
    return repository(tmp_path / "alpha" / "harmless", HARMLESS_TF)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """Org B's checkout: its code and a secret file."""
    return repository(tmp_path / "bravo" / "infra", SECRET_TF, {SECRET_FILE: "bravo only\n"})


@pytest.fixture
def bravo_cwd(secret: Path) -> Iterator[str]:
    """`/proc/<pid>/cwd` of a process of org B's working in its checkout (a Terraform)."""
    proc = subprocess.Popen(["sleep", "120"], cwd=secret)
    try:
        yield f"/proc/{proc.pid}/cwd"
    finally:
        proc.kill()
        proc.wait()


def plant(link: Path, target: Path | str) -> Path:
    """`link` -> `target`, as the attacker's uid makes it."""
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    return link


@pytest.fixture
def flipping(shared: Path) -> Iterator[Flip]:
    """Start the attacker (as nobody) flipping `shared/evil` between targets."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*targets: str) -> None:
        args = ["/usr/bin/python3", "-c", FLIPPER, str(shared / "evil"), *targets]
        procs.append(subprocess.Popen(args, user=NOBODY, group=NOBODY, cwd="/"))

    yield start
    for p in procs:
        p.kill()
        p.wait()


async def started(shared: Path, flip: Flip, *targets: str) -> Path:
    """The flipper running, `shared/evil` already made by it."""
    flip(*targets)
    link = shared / "evil"
    for _ in range(500):
        if link.is_symlink() and link.lstat().st_uid == NOBODY:
            return link
        await asyncio.sleep(0.01)
    raise AssertionError("the flipper made no link")


# ---------------------------------------------------------------- the rule


def test_a_path_another_uid_can_change_is_refused(
    tmp_path: Path, shared: Path, harmless: Path
) -> None:
    """Each way another uid could change what a path names between the check and git's
    read is `unsafe-path`; a root-owned repository, also through root's own symlink or
    directly in the sticky directory, is taken and pinned: its resolved path."""
    sources = Sources.parse("file://")
    evil_link = plant(shared / "evil", harmless)
    theirs = shared / "theirs"  # a directory of the attacker's, a root-owned repository in it
    theirs.mkdir()
    inside = repository(theirs / "repo", HARMLESS_TF)
    os.chown(theirs, NOBODY, NOBODY)
    open_dir = tmp_path / "open"  # world-writable, not sticky: anyone renames what is in it
    open_repo = repository(open_dir / "repo", HARMLESS_TF)
    os.chmod(open_dir, 0o777)
    writable = repository(tmp_path / "writable", HARMLESS_TF)
    os.chmod(writable, 0o777)  # anyone may add a `.git` to it
    not_a_repo = shared / "plain"  # git would go on to `plain.git`, which anyone may make
    not_a_repo.mkdir()
    their_gitfile = tmp_path / "gitfile"
    their_gitfile.mkdir()
    (their_gitfile / ".git").write_text(f"gitdir: {harmless}/.git\n")
    os.chown(their_gitfile / ".git", NOBODY, NOBODY)
    alternates = repository(tmp_path / "alternates", HARMLESS_TF)
    info = alternates / ".git" / "objects" / "info"
    info.mkdir(exist_ok=True)
    os.chmod(info, 0o777)  # anyone may write an `alternates` into it
    refused = [
        str(evil_link),
        f"file://{evil_link}",
        f"{evil_link}/.git",
        str(inside),
        str(open_repo),
        str(writable),
        str(shared / "not-yet"),  # anyone may make it
        str(not_a_repo),
        str(their_gitfile),
        str(alternates),
    ]
    for path in refused:
        with pytest.raises(RepositoryRefused) as e:
            sources.check(path, org="alpha")
        assert e.value.rule == "unsafe-path", (path, e.value)
    # Root's own: taken, resolved.
    direct = repository(shared / "roots", HARMLESS_TF)  # like the tests' own tmp_path
    roots_link = tmp_path / "alpha" / "link"
    roots_link.symlink_to(harmless)
    assert sources.check(str(direct), org="alpha") == str(direct)
    assert sources.check(str(roots_link), org="alpha") == str(harmless)
    assert sources.check(f"file://{roots_link}", org="alpha") == f"file://{harmless}"
    assert sources.check(f"{tmp_path}/alpha/../alpha/harmless", org="alpha") == str(harmless)
    assert sources.check("/nonexistent/repo", org="alpha") == "/nonexistent/repo"


# ---------------------------------------------------------------- the API


@pytest.fixture(name="http")
async def http_fixture(system: System, tmp_path: Path) -> AsyncIterator[Http]:
    """The API with local repositories allowed to every organization (`up`'s default)."""
    sources = deployment_sources("https://,ssh://,file://", tmp_path / "data")
    async with system.projector(tmp_path / "rm.sqlite") as projector:
        web_app = system.web_app(projector, admin_token=ADMIN_TOKEN, repositories=sources)
        async with TestClient(TestServer(web_app)) as client:
            yield Http(client, web_app[API], system.app)


async def test_the_api_refuses_a_link_another_uid_owns(
    http: Http, shared: Path, harmless: Path
) -> None:
    """org A's workspace naming its own link in the shared directory (pointing, for now,
    at a harmless repository) is 422 `repository-not-allowed`, rule `unsafe-path`, on
    creation and on change; the harmless repository itself is fine."""
    link = plant(shared / "evil", harmless)
    await http.org("alpha")
    for i, repo in enumerate((str(link), f"file://{link}")):
        a = await http.post(
            "/api/v1/orgs/alpha/workspaces", json={"name": f"w{i}", "repository": repo}
        )
        assert a.problem("repository-not-allowed", 422)["rule"] == "unsafe-path", a.body
    await http.workspace("alpha", "net", repository=str(harmless))
    a = await http.call(
        "PATCH", "/api/v1/orgs/alpha/workspaces/net", json={"repository": str(link)}
    )
    assert a.problem("repository-not-allowed", 422)["rule"] == "unsafe-path"


# ---------------------------------------------------------------- the races


async def test_a_flipping_link_never_gets_org_bs_code_into_org_as_checkout(
    tmp_path: Path, shared: Path, harmless: Path, secret: Path, bravo_cwd: str, flipping: Flip
) -> None:
    """The executor's check and git's clone (executor/phases.py `_checkout`: the sources'
    check, then git on what it gives) 150 times while the attacker flips the link between
    the harmless repository, org B's checkout and `/proc/<pid>/cwd` in it: org B's file
    is never in org A's checkout (every attempt is refused: `unsafe-path`, or
    `system-directory` when the link points into /proc as it is checked)."""
    link = await started(shared, flipping, str(harmless), str(secret), str(harmless), bravo_cwd)
    sources = Sources.parse("file://")
    leaked, refused = [], 0
    rules: set[str] = set()
    for i in range(150):
        dest = tmp_path / "checkouts" / str(i)
        dest.parent.mkdir(exist_ok=True)
        try:
            target = sources.check(str(link), org="alpha") or str(link)
        except RepositoryRefused as e:
            rules.add(e.rule)
            refused += 1
            continue
        step_log = StepLog(tmp_path / f"{i}.log", Masker())
        try:
            await git.checkout(target, dest, branch="main", step_log=step_log)
        except StepFailed:
            continue
        if (dest / SECRET_FILE).exists():
            leaked.append(i)
    assert leaked == [], f"org B's code in org A's checkout in {len(leaked)} of 150 attempts"
    assert refused == 150, rules


async def test_a_flipping_link_never_gets_org_bs_head_at_admission(
    shared: Path, harmless: Path, secret: Path, bravo_cwd: str, flipping: Flip
) -> None:
    """The scheduler's `ls-remote` at admission, 100 times under the same attack: it never
    answers org B's head (each admission fails, naming `unsafe-path`)."""
    link = await started(shared, flipping, str(harmless), str(secret), str(harmless), bravo_cwd)
    taker = Snapshotter()
    taker.sources = Sources.parse("file://")
    bravo_head, answers, refusals = head(secret), [], 0
    for i in range(100):
        run = RunState(run_id=f"r{i}", org="alpha", config=Workspace(repository=str(link)))
        try:
            answers.append((await taker(run)).commit)
        except SnapshotFailed as e:
            refusals += "unsafe-path" in str(e) or "system-directory" in str(e)
    assert bravo_head not in answers, f"org B's head answered {answers.count(bravo_head)} times"
    assert refusals == 100, answers


@pytest.fixture
def h(nc: NATS, app: App) -> Harness:
    return Harness(nc, app)


async def test_org_as_runs_never_plan_org_bs_mirror_through_a_flipping_link(
    h: Harness, executor: Executor, shared: Path, harmless: Path, secret: Path, flipping: Flip
) -> None:
    """Real runs: org B's run fills the executor's mirror of its repository; org A's
    workspaces name the link the attacker flips between the harmless repository and that
    mirror. None of org A's runs plans org B's resources: each fails at checkout,
    `repository_not_allowed` (`unsafe-path`, or `runplane-directory` when the link points
    at the mirror as it is checked)."""
    await h.workspace("net", Workspace(repository=str(secret)), org="bravo")
    ok = await h.start_run("net", org="bravo")
    await h.reaches("net", ok, "awaiting_approval", org="bravo")
    mirror = GitCache(executor.work_dir / "git").mirror(str(secret), org="bravo")
    assert mirror.is_dir()
    link = await started(shared, flipping, str(harmless), str(mirror))
    outcomes = []
    for i in range(8):
        ws = f"evil{i}"
        await h.workspace(ws, Workspace(repository=str(link)), org="alpha")
        outcomes.append(await ended(h, ws, await h.start_run(ws, org="alpha")))
    planned_bravo = [s.run_id for s in outcomes if s.plan_summary and s.plan_summary.add == 3]
    assert planned_bravo == [], f"org A planned org B's code in runs {planned_bravo}"
    for state in outcomes:
        assert state.reason == "repository_not_allowed", (state.reason, state.error_message)
        why = state.error_message
        assert "unsafe-path" in why or "runplane-directory" in why, why


async def ended(h: Harness, ws: str, run_id: str) -> RunState:
    for _ in range(600):
        state = await h.run(ws, run_id, "alpha")
        if str(state.status) in ("failed", "awaiting_approval", "planned", "errored"):
            return state
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id} did not end")
