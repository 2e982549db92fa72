"""The executor's repository cache (executor/git.py `GitCache`): each phase still gets a
fresh clone at exactly its commit, nothing from another run, whatever the cache holds;
and the small-object upload path (executor/objects.py) stores what nats-py reads back."""

from __future__ import annotations

import asyncio
import fcntl
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext as JetStream

from events.run import RunState, Workspace
from events.templates import SaveTemplate, TemplateStep
from events.workspace import RunReleased
from executor import Executor, git
from executor.errors import StepFailed
from executor.git import GitCache
from executor.objects import LOGS_BUCKET, Objects
from executor.output import Masker
from executor.process import StepLog
from infra.streams import declare, dispatch_subject
from services.app.commands import App
from services.app.snapshot import Snapshotter
from tests.bootstrap_support import Process
from tests.executor_support import git as sh
from tests.helpers import eventually


def commit(repo: Path, files: dict[str, str | None], message: str = "change") -> str:
    """Write (None: delete) files, commit them on the current branch, return the sha."""
    for name, text in files.items():
        if text is None:
            sh(repo, "rm", "-q", name)
        else:
            (repo / name).write_text(text)
            sh(repo, "add", name)
    sh(repo, "commit", "-q", "-m", message)
    return sh(repo, "rev-parse", "HEAD")


def borrowed(dest: Path) -> bool:
    """The clone was made from the cache: it borrows the mirror's objects."""
    return (dest / ".git" / "objects" / "info" / "alternates").is_file()


def detached(dest: Path) -> bool:
    """HEAD names a commit, not a branch."""
    return subprocess.run(["git", "symbolic-ref", "-q", "HEAD"], cwd=dest).returncode == 1


def files(dest: Path) -> dict[str, str]:
    """Every file of a checkout but git's own, with its text."""
    return {
        str(p.relative_to(dest)): p.read_text()
        for p in sorted(dest.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(dest).parts
    }


class Dirs:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.n = 0
        (tmp_path / "jobs").mkdir()

    def new(self) -> tuple[Path, StepLog]:
        """A fresh phase directory's `src` (not yet there) and a step log for it."""
        self.n += 1
        root = self.tmp / "jobs" / f"job{self.n}"
        root.mkdir()
        return root / "src", StepLog(root / "checkout.log", Masker())


def log_text(step_log: StepLog) -> str:
    step_log.close()
    return step_log.path.read_text()


@pytest.fixture
def dirs(tmp_path: Path) -> Dirs:
    return Dirs(tmp_path)


@pytest.fixture
def cache(tmp_path: Path) -> GitCache:
    return GitCache(tmp_path / "work" / "git")


async def pinned(cache: GitCache, repo: Path, dirs: Dirs, sha: str) -> tuple[Path, str]:
    dest, lg = dirs.new()
    found = await cache.checkout(
        str(repo), dest, org="acme", branch="main", commit=sha, step_log=lg
    )
    assert found.sha == sha
    return dest, log_text(lg)


async def test_two_commits_through_the_cache_each_see_exactly_their_files(
    cache: GitCache, repo: Path, dirs: Dirs
) -> None:
    """Runs at two commits of one repository: each clone has its commit's files and no
    other, a clean status, HEAD detached at the commit; what one run wrote into its
    directory is not in the next. The newer commit, missing from the mirror, is fetched."""
    first = commit(repo, {"main.tf": "v1\n", "old.tf": "old\n"}, "first")
    a, log_a = await pinned(cache, repo, dirs, first)
    (a / "left-over.txt").write_text("from run a")
    (a / "main.tf").write_text("edited by run a")
    second = commit(repo, {"main.tf": "v2\n", "old.tf": None, "new.tf": "new\n"}, "second")
    b, log_b = await pinned(cache, repo, dirs, second)
    again, _ = await pinned(cache, repo, dirs, first)

    assert files(b) == {"main.tf": "v2\n", "new.tf": "new\n"}
    assert files(again) == {"main.tf": "v1\n", "old.tf": "old\n"}
    for dest, sha in ((b, second), (again, first)):
        assert sh(dest, "rev-parse", "HEAD") == sha
        assert sh(dest, "status", "--porcelain", "--untracked-files=all") == ""
        assert sh(dest, "remote", "get-url", "origin") == str(repo)
    assert detached(b)
    for text in (log_a, log_b):
        assert "cannot be used" not in text
    assert borrowed(a) and borrowed(b) and borrowed(again)
    assert [p.name for p in cache.root.iterdir() if p.suffix == ".git"] == [
        cache.mirror(str(repo), org="acme").name
    ]


async def test_the_mirror_keeps_no_repository_url(cache: GitCache, repo: Path, dirs: Dirs) -> None:
    """The URL (credentials and all) is given to each fetch, never stored in the mirror."""
    sha = commit(repo, {"main.tf": "v1\n"})
    await pinned(cache, repo, dirs, sha)
    dest, lg = dirs.new()
    await cache.checkout(str(repo), dest, org="acme", branch="main", step_log=lg)  # a branch fetch
    stored = [p for p in cache.mirror(str(repo), org="acme").rglob("*") if p.is_file()]
    assert stored and not [p for p in stored if str(repo).encode() in p.read_bytes()]


async def test_the_commit_is_described_from_the_cache(
    cache: GitCache, repo: Path, dirs: Dirs
) -> None:
    sha = commit(repo, {"main.tf": "x\n"}, "add the network\n\nbody")
    dest, lg = dirs.new()
    found = await cache.checkout(
        str(repo), dest, org="acme", branch="main", commit=sha, step_log=lg
    )
    assert found == git.Commit(sha, "t <t@example.com>", "add the network")
    dest, lg = dirs.new()
    assert (
        await cache.checkout(str(repo), dest, org="acme", branch="main", commit=sha, step_log=lg)
        == found
    )


async def test_an_unpinned_run_gets_the_branch_head_after_the_branch_moved(
    cache: GitCache, repo: Path, dirs: Dirs
) -> None:
    """The branch moved after the mirror was filled: the next unpinned clone is at the new
    head, on the branch (as `git clone --single-branch --branch` leaves it)."""
    first = commit(repo, {"main.tf": "v1\n"})
    dest, lg = dirs.new()
    found = await cache.checkout(str(repo), dest, org="acme", branch="main", step_log=lg)
    assert found.sha == first
    second = commit(repo, {"main.tf": "v2\n"})
    dest, lg = dirs.new()
    found = await cache.checkout(str(repo), dest, org="acme", branch="main", step_log=lg)
    assert found.sha == second == sh(dest, "rev-parse", "HEAD")
    assert files(dest) == {"main.tf": "v2\n"}
    assert sh(dest, "symbolic-ref", "--short", "HEAD") == "main"
    assert sh(dest, "rev-parse", "origin/main") == second
    assert sh(dest, "status", "--porcelain") == ""
    assert "cannot be used" not in log_text(lg) and borrowed(dest)


async def test_a_rewritten_branch_still_gives_each_pinned_commit(
    cache: GitCache, repo: Path, dirs: Dirs
) -> None:
    """A force-pushed branch: its new commit (unrelated history) is fetched; the old
    commit, already in the mirror, is still exactly itself."""
    old = commit(repo, {"main.tf": "old\n"})
    await pinned(cache, repo, dirs, old)
    sh(repo, "checkout", "-q", "--orphan", "rewritten")
    sh(repo, "rm", "-q", "-r", "--cached", ".")
    (repo / "main.tf").unlink()
    new = commit(repo, {"other.tf": "new\n"})
    sh(repo, "branch", "-q", "-M", "rewritten", "main")
    dest, _ = await pinned(cache, repo, dirs, new)
    assert files(dest) == {"other.tf": "new\n"}
    dest, _ = await pinned(cache, repo, dirs, old)
    assert files(dest) == {"main.tf": "old\n"}


async def test_a_mirror_that_lost_its_objects_is_fetched_again(
    cache: GitCache, repo: Path, dirs: Dirs
) -> None:
    sha = commit(repo, {"main.tf": "v1\n"})
    await pinned(cache, repo, dirs, sha)
    objects = cache.mirror(str(repo), org="acme") / "objects"
    shutil.rmtree(objects)
    objects.mkdir()
    dest, text = await pinned(cache, repo, dirs, sha)
    assert files(dest) == {"main.tf": "v1\n"}
    assert sh(dest, "rev-parse", "HEAD") == sha
    assert sh(dest, "status", "--porcelain") == ""
    assert "cannot be used" not in text and borrowed(dest)


async def test_a_corrupted_mirror_falls_back_to_a_plain_clone(
    cache: GitCache, repo: Path, dirs: Dirs
) -> None:
    first = commit(repo, {"main.tf": "v1\n"})
    await pinned(cache, repo, dirs, first)
    for f in (cache.mirror(str(repo), org="acme") / "objects").rglob("*"):
        if f.is_file():  # a new file: never write through a hard link
            f.unlink()
            f.write_bytes(b"garbage")
    second = commit(repo, {"main.tf": "v2\n"})
    for sha, text in ((first, "v1\n"), (second, "v2\n")):
        dest, log = await pinned(cache, repo, dirs, sha)
        assert files(dest) == {"main.tf": text}
        assert sh(dest, "rev-parse", "HEAD") == sha
        assert sh(dest, "status", "--porcelain") == ""
        assert "cannot be used" in log and "Cloning into" in log
        assert not borrowed(dest)  # a plain clone, not borrowing the broken mirror's objects


async def test_a_mirror_that_is_not_a_repository_falls_back(
    cache: GitCache, repo: Path, dirs: Dirs
) -> None:
    sha = commit(repo, {"main.tf": "v1\n"})
    mirror = cache.mirror(str(repo), org="acme")
    mirror.mkdir(parents=True)
    (mirror / "HEAD").write_text("garbage")
    dest, lg = dirs.new()
    found = await cache.checkout(str(repo), dest, org="acme", branch="main", step_log=lg)
    assert found.sha == sha and files(dest) == {"main.tf": "v1\n"}
    assert "cannot be used" in log_text(lg)


async def test_a_removed_mirror_is_made_again(cache: GitCache, repo: Path, dirs: Dirs) -> None:
    first = commit(repo, {"main.tf": "v1\n"})
    await pinned(cache, repo, dirs, first)
    shutil.rmtree(cache.mirror(str(repo), org="acme"))
    second = commit(repo, {"main.tf": "v2\n"})
    dest, text = await pinned(cache, repo, dirs, second)
    assert files(dest) == {"main.tf": "v2\n"} and "cannot be used" not in text
    assert borrowed(dest)
    assert cache.mirror(str(repo), org="acme").is_dir()


async def test_a_mirror_held_locked_too_long_falls_back(
    tmp_path: Path, repo: Path, dirs: Dirs
) -> None:
    """Another executor's fetch holding the mirror: after `lock_wait`, a plain clone."""
    cache = GitCache(tmp_path / "work" / "git", lock_wait=0.2)
    sha = commit(repo, {"main.tf": "v1\n"})
    cache.root.mkdir(parents=True)
    mirror = cache.mirror(str(repo), org="acme")
    fd = os.open(cache.root / f"{mirror.stem}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        dest, text = await pinned(cache, repo, dirs, sha)
    finally:
        os.close(fd)
    assert files(dest) == {"main.tf": "v1\n"}
    assert "stayed locked" in text


async def test_executors_sharing_a_work_dir_check_out_at_once(
    tmp_path: Path, repo: Path, dirs: Dirs
) -> None:
    """Two caches on one directory (two executors), eight clones at once at three commits
    of an empty cache: each clone is exactly its commit, one mirror is made."""
    shas = [commit(repo, {"main.tf": f"v{i}\n", f"f{i}.tf": "x\n"}) for i in range(3)]
    caches = [GitCache(tmp_path / "work" / "git") for _ in range(2)]
    jobs = [(caches[i % 2], shas[i % 3], *dirs.new()) for i in range(8)]
    found = await asyncio.gather(
        *(
            c.checkout(str(repo), d, org="acme", branch="main", commit=s, step_log=lg)
            for c, s, d, lg in jobs
        )
    )
    for (_, sha, dest, lg), got in zip(jobs, found, strict=True):
        i = shas.index(sha)
        assert got.sha == sha == sh(dest, "rev-parse", "HEAD")
        assert files(dest) == {"main.tf": f"v{i}\n", **{f"f{k}.tf": "x\n" for k in range(i + 1)}}
        assert "cannot be used" not in log_text(lg) and borrowed(dest)
    assert len([p for p in caches[0].root.iterdir() if p.suffix == ".git"]) == 1
    assert not list(caches[0].root.glob("*.tmp-*"))


async def test_an_unknown_branch_fails_with_gits_message(
    cache: GitCache, repo: Path, dirs: Dirs
) -> None:
    commit(repo, {"main.tf": "v1\n"})
    dest, lg = dirs.new()
    with pytest.raises(StepFailed) as e:
        await cache.checkout(str(repo), dest, org="acme", branch="nope", step_log=lg)
    assert e.value.reason == "checkout_failed" and "nope" in e.value.message


async def test_a_commit_the_repository_lacks_fails(cache: GitCache, repo: Path, dirs: Dirs) -> None:
    commit(repo, {"main.tf": "v1\n"})
    dest, lg = dirs.new()
    with pytest.raises(StepFailed) as e:
        await cache.checkout(
            str(repo), dest, org="acme", branch="main", commit="ab" * 20, step_log=lg
        )
    assert e.value.reason == "checkout_failed"


async def test_a_branch_name_the_cache_does_not_write_takes_the_plain_clone(
    cache: GitCache, repo: Path, dirs: Dirs
) -> None:
    commit(repo, {"main.tf": "v1\n"})
    sh(repo, "branch", "feat+x")
    dest, lg = dirs.new()
    await cache.checkout(str(repo), dest, org="acme", branch="feat+x", step_log=lg)
    assert files(dest) == {"main.tf": "v1\n"}
    assert "cannot be used" in log_text(lg)


# ---------------------------------------------------------------- object uploads


@pytest.mark.parametrize("size", [0, 10, 128 * 1024, 300 * 1024 + 7])
async def test_an_uploaded_log_reads_back_whole(nc: NATS, tmp_path: Path, size: int) -> None:
    """Small objects skip nats-py's lookups; what nats-py reads back is the file."""
    await declare(nc, nc.jetstream())
    src = tmp_path / "step.log"
    src.write_bytes(os.urandom(size))
    objects = Objects(nc.jetstream())
    await objects.upload(LOGS_BUCKET, "r/plan/checkout.log", src, fresh=True)
    buf = io.BytesIO()
    store = await nc.jetstream().object_store(LOGS_BUCKET)
    info = await store.get("r/plan/checkout.log", writeinto=buf)
    assert buf.getvalue() == src.read_bytes()
    assert info.info.size == size


# ---------------------------------------------------------------- through the executor

SHOW = '{ git rev-parse HEAD; ls -A; cat main.tf; } > "$TF_VAR_out.$RUNPLANE_RUN_ID"'


async def _custom_run(app: App, scheduler: App, js: JetStream, ws: str) -> str:
    """A run of the `show` template, admitted with its snapshot (pinned) by `scheduler`
    (the scheduler's App), dispatched."""
    run_id = str((await app.create_run("acme", ws, "apply", "alice", template="show")).state.run_id)
    assert await scheduler.admit_next("acme", ws) == run_id
    pin = getattr(scheduler, "pin_run", None)  # admission may leave the pinning to it
    if pin is not None:
        await pin("acme", ws, run_id)
    body = {"org": "acme", "workspace": ws, "run_id": run_id, "phase": "custom-100"}
    await js.publish(dispatch_subject("default", "acme"), json.dumps(body).encode())
    return run_id


async def test_custom_steps_run_in_a_clone_of_exactly_their_commit(
    nc: NATS, app: App, process: Process, repo: Path, executor: Executor, tmp_path: Path
) -> None:
    """Runs at two commits through the executor and its cache: each step's command sees
    its commit and only its commit's files; the phases' directories are removed."""
    scheduler = process(store=app.store, pinning=Snapshotter).app  # it takes snapshots
    await app.create_org("acme", "alice")
    step = TemplateStep(number=100, kind="custom", name="show", command=SHOW)
    await app.org_command("acme", SaveTemplate(actor="alice", name="show", steps=[step]))
    out = tmp_path / "seen"
    config = Workspace(repository=str(repo), variables={"out": str(out)})
    await app.create_workspace("acme", "net", config, "alice")
    js = nc.jetstream()
    changes: list[dict[str, str | None]] = [
        {"main.tf": "v1\n", "old.tf": "x"},
        {"main.tf": "v2\n", "old.tf": None},
        {},
    ]
    expected = [[".git", "main.tf", "old.tf", "v1"], [".git", "main.tf", "v2"]]
    for change, files_then in zip(changes, [*expected, expected[-1]], strict=True):
        sha = commit(repo, change) if change else sh(repo, "rev-parse", "HEAD")
        run_id = await _custom_run(app, scheduler, js, "net")

        async def ended(run_id: str = run_id) -> RunState:
            state: RunState = (await app.load_run("acme", "net", run_id)).state
            assert state.terminal, state.status
            return state

        done = await eventually(ended, what=f"run {run_id} ended")
        assert str(done.status) == "applied", done.error_message
        assert done.commit == sha
        lines = Path(f"{out}.{run_id}").read_text().splitlines()
        assert lines == [sha, *files_then]
    assert (executor.work_dir / "git").is_dir()

    async def removed() -> bool:
        return not any(executor.jobs_dir.iterdir())

    await eventually(removed, what="phase directories removed")


async def test_a_run_the_executor_ends_is_released_by_the_schedulers_admission_not_by_it(
    nc: NATS, app: App, process: Process, repo: Path, executor: Executor, tmp_path: Path
) -> None:
    """The executor's last report of a run leaves the workspace alone: the scheduler's
    admission attempt on the run's end (events/react.py) releases it, once. (The
    executor's own release raced that one and mostly lost: a conflict and two reads of
    the workspace per run.) With no scheduler running here, the workspace still holds
    the ended run until an admission attempt, which releases it and admits the next."""
    scheduler = process(store=app.store, pinning=Snapshotter).app
    await app.create_org("acme", "alice")
    step = TemplateStep(number=100, kind="custom", name="show", command=SHOW)
    await app.org_command("acme", SaveTemplate(actor="alice", name="show", steps=[step]))
    config = Workspace(repository=str(repo), variables={"out": str(tmp_path / "seen")})
    await app.create_workspace("acme", "net", config, "alice")
    commit(repo, {"main.tf": "v1\n"})
    run_id = await _custom_run(app, scheduler, nc.jetstream(), "net")

    async def applied() -> bool:
        state: RunState = (await app.load_run("acme", "net", run_id)).state
        assert str(state.status) == "applied", (state.status, state.error_message)
        return True

    await eventually(applied, what=f"run {run_id} applied")
    ws = (await app.load_ws("acme", "net")).state
    assert ws.active == run_id  # the executor did not release it
    envs = await app.store.read("rp.ws.acme.net")
    assert not [e for e in envs if isinstance(e.event, RunReleased)]
    created = await app.create_run("acme", "net", "apply", "alice", template="show")
    next_id = str(created.state.run_id)
    assert await scheduler.admit_next("acme", "net") == next_id  # released, then admitted
    envs = await app.store.read("rp.ws.acme.net")
    released = [e.event for e in envs if isinstance(e.event, RunReleased)]
    assert [(r.run_id, r.status, r.actor) for r in released] == [(run_id, "applied", "scheduler")]
