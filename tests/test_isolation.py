"""Hostile tenants against the executor: a run's code reaches nothing of runplane's.

Each test is an attack a workspace's author can make with nothing but their repository:
HCL that reads the executor's environment or the encryption key with `file()`, and shell
(a custom step, a `local-exec` provisioner) that reads the key, the repository mirrors,
another job's directory and every process's `/proc/<pid>/environ`. Jobs run as a uid of
their own (executor/isolation.py); these tests run as root, as CI does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events.run import Workspace
from executor.errors import IsolationError
from executor.isolation import Isolation, sandbox_problem
from executor.jobfiles import adopt
from executor.uids import DEFAULT_UIDS, kill_uid, uid_range
from executor.worker import Executor, default_jobs_dir
from services.app.commands import App
from services.root.bootstrap import Plane
from tests.caps_support import Up, phase_groups, running_up
from tests.executor_support import Harness, commit, git
from tests.helpers import eventually
from tests.procs import Client, Proc, free_port, nats_servers_using, wait_healthy

pytestmark = [
    pytest.mark.terraform,
    pytest.mark.skipif(os.geteuid() != 0, reason="user isolation needs root"),
]

TOKEN = "admin-canary-9f3b6c1d2e"  # the admin token in `runplane up`'s environment
V1 = "/api/v1/orgs/acme"


NO_SANDBOX = sandbox_problem(DEFAULT_UIDS[-1]) if os.geteuid() == 0 else "not root"


@pytest.fixture(
    params=[
        "user",
        pytest.param(
            "sandbox",
            marks=pytest.mark.skipif(bool(NO_SANDBOX), reason=f"no sandbox: {NO_SANDBOX}"),
        ),
    ]
)
async def up(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Up]:
    """`runplane up` with the admin token in its environment and the key in a file; its
    jobs in each isolation a root executor has (the sandbox, and the uid fallback)."""
    mode = str(request.param)
    env = {"RUNPLANE_ENCRYPTION_KEY": ""}  # the key in a file, where a job might look
    async with running_up(tmp_path, mode, token=TOKEN, env=env) as up:
        yield up
    assert f'"isolation": "{mode}"' in up.proc.output(), "runplane up logs its isolation mode"


async def _workspace(up: Up, repo: Path, main_tf: str, name: str = "net") -> None:
    commit(repo, main_tf)
    body = {"name": name, "repository": str(repo)}
    await up.client.ok("POST", f"{V1}/workspaces", body)


async def _run(up: Up, body: dict[str, Any], ws: str = "net") -> dict[str, Any]:
    run = await up.client.ok("POST", f"{V1}/workspaces/{ws}/runs", body)
    done = await up.client.wait_status(
        "acme", run["id"], {"failed", "planned", "awaiting_approval", "applied"}, timeout=120
    )
    return done


async def _everything_said(up: Up, run: dict[str, Any]) -> str:
    """The run as the API shows it, its events and all of its logs, as one text."""
    rid = run["id"]
    shown = await up.client.ok("GET", f"{V1}/runs/{rid}")
    events = await up.client.ok("GET", f"{V1}/runs/{rid}/events")
    logs = await up.client.ok("GET", f"{V1}/runs/{rid}/logs")
    return repr((shown, events, logs))


def _lines_of(logs: dict[str, Any]) -> list[str]:
    return [str(item["text"]).rstrip("\n") for item in logs["items"]]


def _secrets(up: Up) -> list[str]:
    return [TOKEN, up.key()]


async def test_hcl_cannot_read_the_executors_environment(up: Up, repo: Path) -> None:
    """`file("/proc/<runplane up>/environ")` in a plan: the plan fails, the token is in
    nothing the run shows."""
    main = f'output "env" {{ value = file("/proc/{up.pid}/environ") }}\n'
    await _workspace(up, repo, main)
    run = await _run(up, {"type": "plan"})
    assert run["status"] == "failed", run
    said = await _everything_said(up, run)
    assert "environ" in run["error_message"]
    for secret in _secrets(up):
        assert secret not in said
    assert TOKEN not in (up.data / "readmodel.sqlite").read_bytes().decode(errors="replace")


async def test_hcl_cannot_read_the_encryption_key(up: Up, repo: Path) -> None:
    key_file = up.data / "encryption.key"
    main = f'output "key" {{ value = file("{key_file}") }}\n'
    await _workspace(up, repo, main)
    run = await _run(up, {"type": "plan"})
    assert run["status"] == "failed", run
    assert "encryption.key" in run["error_message"]
    said = await _everything_said(up, run)
    for secret in _secrets(up):
        assert secret not in said


async def test_a_custom_step_reads_nothing_of_runplane_and_is_not_root(up: Up, repo: Path) -> None:
    """A custom step tries the key, the mirrors, another job's directory and every
    process's environ; each read is refused, nothing secret is printed, `id -u` is not 0."""
    other = default_jobs_dir(up.work()) / "jobs" / "01other-plan-x" / "src"
    other.mkdir(parents=True)
    (other / "secret.tf").write_text("other-org-canary\n")
    uid = DEFAULT_UIDS[-1]  # another phase's uid (not one this test's job gets)
    adopt(other, uid)
    attack = (
        "echo uid=$(id -u); "
        f"cat {up.data}/encryption.key && echo READ-KEY; "
        f"ls {up.work()}/git && echo READ-MIRRORS; "
        f"cat {other}/secret.tf && echo READ-OTHER-JOB; "
        f"cat {up.data}/admin-token && echo READ-TOKEN-FILE; "
        "for e in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $e; done 2>/dev/null; "
        "exit 3"
    )
    steps = {"steps": [{"number": 50, "kind": "custom", "name": "attack", "command": attack}]}
    steps["steps"].append({"number": 100, "kind": "plan"})
    await up.client.ok("PUT", f"{V1}/templates/attack", steps)
    await _workspace(up, repo, 'resource "null_resource" "a" {}\n')
    run = await _run(up, {"type": "plan", "template": "attack"})
    assert run["status"] == "failed" and run["reason"] == "step_failed", run
    logs = await up.client.ok("GET", f"{V1}/runs/{run['id']}/logs?phase=custom-50")
    lines = _lines_of(logs)
    uids = [ln for ln in lines if ln.startswith("uid=")]
    assert uids and uids[0] != "uid=0", lines
    assert int(uids[0].removeprefix("uid=")) in DEFAULT_UIDS
    assert not [ln for ln in lines if ln.startswith("READ-")], lines
    said = await _everything_said(up, run)
    for secret in [*_secrets(up), "other-org-canary", "RUNPLANE_ADMIN_TOKEN"]:
        assert secret not in said, secret
    # refused by file modes, or (the sandbox) not there at all: runplane's directories
    # are hidden under empty mounts
    hidden = "No such file or directory" in said and up.mode == "sandbox"
    assert "Permission denied" in said or hidden, said


async def test_a_custom_step_runs_git_in_its_checkout_as_the_job(up: Up, repo: Path) -> None:
    """The clone borrows no object from the executor's mirror (which the job's uid cannot
    read): `git log` and `git status` work in a custom step."""
    command = "git log -1 --format=commit=%H && git status --porcelain && echo git-ok"
    steps = {"steps": [{"number": 50, "kind": "custom", "name": "git", "command": command}]}
    steps["steps"].append({"number": 100, "kind": "plan"})
    await up.client.ok("PUT", f"{V1}/templates/git", steps)
    await _workspace(up, repo, 'resource "null_resource" "a" {}\n')
    head = git(repo, "rev-parse", "HEAD")
    run = await _run(up, {"type": "plan", "template": "git"})
    logs = await up.client.ok("GET", f"{V1}/runs/{run['id']}/logs?phase=custom-50")
    lines = _lines_of(logs)
    assert run["status"] == "planned", (run, lines)
    assert f"commit={head}" in lines and "git-ok" in lines, lines


async def test_what_a_job_leaves_in_shared_temporary_directories_goes_with_its_uid(
    up: Up, repo: Path
) -> None:
    """A uid serves another organization's phase next: files a job made in /tmp,
    /var/tmp or /dev/shm (readable by that uid only) are removed when its phase ends."""
    tag = f"rp-leftover-{os.getpid()}"
    command = (
        f"echo secret > /tmp/{tag} && mkdir /var/tmp/{tag} && echo s > /var/tmp/{tag}/f "
        f"&& echo s > /dev/shm/{tag} && echo made"
    )
    steps = {"steps": [{"number": 50, "kind": "custom", "name": "leave", "command": command}]}
    steps["steps"].append({"number": 100, "kind": "plan"})
    await up.client.ok("PUT", f"{V1}/templates/leave", steps)
    await _workspace(up, repo, 'resource "null_resource" "a" {}\n')
    run = await _run(up, {"type": "plan", "template": "leave"})
    logs = await up.client.ok("GET", f"{V1}/runs/{run['id']}/logs?phase=custom-50")
    assert "made" in _lines_of(logs), logs
    for place in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.lexists(f"{place}/{tag}"), place


async def test_what_a_job_leaves_in_run_lock_or_sysv_ipc_dies_with_its_phase(
    up: Up, repo: Path
) -> None:
    """Attacks F1 and F5 (issue 23): a job leaves a secret in `/run/lock` (world-writable,
    once not swept) and a SysV shared memory segment (once pinned after the run, readable
    by the next phase of its uid, another organization's). Neither outlives the phase: the
    sandbox's `/run` and IPC namespace die with it; the uid fallback sweeps every
    world-writable directory and removes the uid's IPC objects. In the sandbox the job
    sees only its own processes, not another tenant's (or runplane's) command lines."""
    tag = f"rp-lock-{os.getpid()}-{up.mode}"
    command = (
        f"mkdir -p /run/lock; echo TOPSECRET > /run/lock/{tag} && ipcmk -M 65536 && echo made; "
        "echo procs=$(ls /proc | grep -c '^[0-9]'); "
        "for f in /proc/[0-9]*/cmdline; do echo \"CMD: $(tr '\\0' ' ' < $f)\"; done"
    )
    steps = {"steps": [{"number": 50, "kind": "custom", "name": "leave", "command": command}]}
    steps["steps"].append({"number": 100, "kind": "plan"})
    await up.client.ok("PUT", f"{V1}/templates/leave", steps)
    await _workspace(up, repo, 'resource "null_resource" "a" {}\n')
    before = _job_ipc()
    run = await _run(up, {"type": "plan", "template": "leave"})
    logs = _lines_of(await up.client.ok("GET", f"{V1}/runs/{run['id']}/logs?phase=custom-50"))
    assert "made" in logs and any("Shared memory id" in line for line in logs), logs
    assert not os.path.lexists(f"/run/lock/{tag}")
    assert _job_ipc() - before == set(), "a job's SysV segment outlived its phase"
    if up.mode == "sandbox":
        (procs,) = [int(line.split("=")[1]) for line in logs if line.startswith("procs=")]
        assert procs <= 5, logs  # bwrap's init, the shell and what it runs
        seen = [line for line in logs if line.startswith("CMD: ")]
        assert seen and not [c for c in seen if "--data-dir" in c or "nats-server" in c], seen


def _job_ipc() -> set[str]:
    """The SysV shared memory segments of the job uids now (`shmid`)."""
    head, *rows = Path("/proc/sysvipc/shm").read_text().splitlines()
    at = head.split().index("uid")
    jobs = uid_range()
    return {r.split()[1] for r in rows if int(r.split()[at]) in jobs}


async def test_a_provisioner_reads_nothing_of_the_executor(
    nc: NATS, app: App, system: Plane, repo: Path, executor: Executor, tmp_path: Path
) -> None:
    """A `local-exec` of an apply (Terraform's grandchild) tries the executor's key (the
    process's, in its data directory) and mirrors; what it could read it writes to a file
    the test reads."""
    out = tmp_path / "seen"
    key = system.opts.data_dir / "encryption.key"
    cmd = (
        f"id -u > {out}; cat {key} >> {out} && echo READ-KEY >> {out}; "
        f"ls {executor.work_dir / 'git'} >> {out} && echo READ-MIRRORS >> {out}; true"
    )
    commit(repo, _provisioned(cmd))
    h = Harness(nc, app)
    await h.workspace("net", Workspace(repository=str(repo)))
    run_id = await h.start_run("net")
    await h.reaches("net", run_id, "awaiting_approval")
    await h.approve("net", run_id)
    await h.reaches("net", run_id, "applied")
    seen = out.read_text().splitlines()
    assert seen[0] != "0" and int(seen[0]) in DEFAULT_UIDS, seen
    assert "READ-KEY" not in seen and "READ-MIRRORS" not in seen, seen
    assert key.read_text().strip() not in out.read_text()
    assert out.stat().st_uid == int(seen[0]), "written by the job's uid"


# ---------------------------------------------------------------- the parts


def test_each_phase_gets_a_uid_of_its_own_and_gives_it_back(tmp_path: Path) -> None:
    iso = Isolation.choose("user")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    roots = [tmp_path / n for n in ("a", "b")]
    for r in roots:
        r.mkdir()
    a, b = (iso.enter(r, tmp) for r in roots)
    try:
        assert a.uid is not None and b.uid is not None and a.uid != b.uid
        assert (roots[0] / "home").stat().st_uid == a.uid
        assert (roots[0] / "home").stat().st_mode & 0o777 == 0o700
        assert not iso.reclaim(a.uid), "a held uid is not reclaimed"
    finally:
        a.close()
        b.close()
    assert iso.reclaim(a.uid), "a uid given back can be reclaimed"


def _as_uid(uid: int, command: str, cwd: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", "-c", command],
        cwd=cwd,
        user=uid,
        group=uid,
        extra_groups=[],
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_closed_jobs_directories_are_sealed_from_the_next_holder_of_its_uid(
    tmp_path: Path,
) -> None:
    """Attack: org A's phase gets the uid org B's phase just gave back and reads B's plan
    file while B's directory waits to be removed. Closing seals `src/` and `home/`."""
    iso = Isolation.choose("user")
    tmp, root = tmp_path / "tmp", tmp_path / "b"
    tmp.mkdir()
    root.mkdir()
    jail = iso.enter(root, tmp)
    assert jail.uid is not None
    (root / "src").mkdir()
    (root / "src" / "plan.tfplan").write_text("org B's plan with its secrets")
    adopt(root / "src", jail.uid)
    uid = jail.uid
    jail.close()
    read = _as_uid(uid, f"cat {root}/src/plan.tfplan; ls {root}/home", "/")
    assert "org B" not in read.stdout and read.returncode != 0, read


def test_a_tree_deeper_than_pythons_recursion_is_removed_with_its_uid(tmp_path: Path) -> None:
    """Attack: a job leaves 1,200 nested directories in /tmp. shutil.rmtree recursed and
    raised there (the uid was given back, the next phase with it failed to start); the
    tree is now removed when the phase ends."""
    iso = Isolation.choose("user")
    tmp, root = tmp_path / "tmp", tmp_path / "a"
    tmp.mkdir()
    root.mkdir()
    jail = iso.enter(root, tmp)
    assert jail.uid is not None
    top = Path(f"/tmp/rp-deep-{os.getpid()}")
    made = _as_uid(
        jail.uid,
        f"mkdir {top} && cd {top} && i=0; while [ $i -lt 1200 ]; do mkdir x && cd x; "
        "i=$((i+1)); done",
        "/",
    )
    assert made.returncode == 0, made.stderr
    jail.close()
    assert not top.exists()
    (tmp_path / "a2").mkdir()
    iso.enter(tmp_path / "a2", tmp).close()  # the uid serves the next phase


async def test_closing_a_jail_kills_every_process_of_its_uid_escaped_daemons_too(
    tmp_path: Path,
) -> None:
    iso = Isolation.choose("user")
    (tmp_path / "root").mkdir()
    (tmp_path / "tmp").mkdir()
    jail = iso.enter(tmp_path / "root", tmp_path / "tmp")
    assert jail.uid is not None
    uid = jail.uid
    how = jail.spawn(
        [
            "/bin/sh",
            "-c",
            "setsid sleep 300 >/dev/null & setsid sleep 301 >/dev/null & echo go",
        ],
        {},
        tmp_path,
    )
    proc = await asyncio.create_subprocess_exec(
        *how.argv, cwd=how.cwd, env=how.env, stdout=asyncio.subprocess.PIPE, **how.options
    )
    assert proc.stdout is not None
    assert b"go" in await proc.stdout.readline()
    await proc.wait()
    assert _pids_of(jail.uid), "the daemons run on after their parent"
    jail.close()

    async def gone() -> bool:
        return not _pids_of(uid)

    await eventually(gone, what="every process of the uid gone")


def test_kill_uid_refuses_system_users() -> None:
    with pytest.raises(ValueError):
        kill_uid(0)


def test_adopt_never_follows_links_nor_changes_a_hard_linked_file(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("root's")
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_text("mine")
    (src / "link").symlink_to(outside)
    (src / "dirlink").symlink_to(tmp_path)
    os.link(outside, src / "hard")
    uid = DEFAULT_UIDS[-2]
    adopt(src, uid)
    assert (src / "d" / "f").stat().st_uid == uid and (src / "d").stat().st_uid == uid
    assert outside.stat().st_uid == 0, "neither the symlink nor the hard link moved it"
    assert tmp_path.stat().st_uid == 0


def test_a_bad_uid_range_is_a_clear_error() -> None:
    for bad in ("5", "10-20", "2000-1000", "a-b"):
        with pytest.raises(IsolationError, match="RUNPLANE_JOB_UIDS"):
            uid_range(bad)
    assert uid_range("5000-5009") == range(5000, 5010)


def test_an_unknown_isolation_mode_is_refused() -> None:
    with pytest.raises(IsolationError, match="unknown isolation"):
        Isolation.choose("chroot")


def _pids_of(uid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) == uid:
                found.append(int(entry.name))
    return found


@pytest.mark.slow  # ~20 s, the uid mode (the fallback): the sandbox's twin stays
async def test_in_the_uid_mode_nothing_of_a_job_outlives_its_killed_executor(
    tmp_path: Path, repo: Path
) -> None:
    """kill -9 of `runplane up --isolation user` mid-apply (issue 23, item 4: Terraform
    outlived it by 12 s, a provisioner's daemon until the next start): each job process's
    init, told by its parent death signal, gives Terraform one SIGTERM (it stops and
    writes `errored.tfstate`) and then kills every process of the job's uid, the daemon a
    provisioner put in a session of its own too, with no executor alive. The next start
    fails the run at once and finds no phase group left."""
    data, port = tmp_path / "data", free_port()
    daemon_pid = tmp_path / "daemon.pid"
    cmd = f"setsid sleep 300 >/dev/null 2>&1 & echo $! > {daemon_pid}; sleep 300"
    main = _provisioned(cmd)
    args = ["up", "--no-demo", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"]
    args += ["--isolation", "user"]
    env = {"RUNPLANE_ADMIN_TOKEN": TOKEN}
    base = f"http://127.0.0.1:{port}"
    first = await Proc(args, tmp_path / "up1.log", env=env).start()
    client = Client(base, TOKEN)
    try:
        await wait_healthy(base)
        await client.ok("POST", "/api/v1/orgs", {"name": "acme"})
        await _approved_apply(client, repo, main)

        async def started() -> int:
            text = daemon_pid.read_text().strip() if daemon_pid.exists() else ""
            assert text, "the provisioner has not started yet"
            return int(text)

        daemon = await eventually(started, timeout=60, what="the provisioner's daemon")
        assert _uid_of(daemon) in DEFAULT_UIDS, "the job runs as a uid of its own"
        job = _pids_of(_uid_of(daemon))  # terraform, the provider, the provisioner, sleeps
        terraform = [p for p in job if _cmdline(p).split(b"\0")[0].endswith(b"/terraform")]
        assert terraform, "terraform runs as the job's uid"
        await _kill_up(first, data)

        async def all_gone() -> bool:
            return not [p for p in job if _alive(p)] and not _alive(daemon)

        await eventually(all_gone, timeout=40, what="every process of the job gone")
        jobs = default_jobs_dir(data / "work")
        assert list(jobs.rglob("errored.tfstate")), "terraform stopped gracefully"
    finally:
        await client.close()
        first.kill()
    second = await Proc(args, tmp_path / "up2.log", env=env).start()
    client = Client(base, TOKEN)
    try:
        await wait_healthy(base)
        (run,) = (await client.ok("GET", f"{V1}/runs"))["items"]
        failed = await client.wait_status("acme", run["id"], {"failed"}, timeout=30)
        assert failed["status"] == "failed", failed
        assert not phase_groups(data), "the killed executor's phase group was swept"
    finally:
        await client.close()
        await second.stop(signal.SIGTERM)


async def _approved_apply(client: Client, repo: Path, main_tf: str) -> set[int]:
    """Workspace `net` on `main_tf`, an apply planned and approved; the job uids'
    processes from before the approval (another test's may linger)."""
    commit(repo, main_tf)
    await client.ok("POST", f"{V1}/workspaces", {"name": "net", "repository": str(repo)})
    run = await client.ok("POST", f"{V1}/workspaces/net/runs", {"type": "apply"})
    planned = await client.wait_status("acme", run["id"], {"awaiting_approval", "failed"})
    assert planned["status"] == "awaiting_approval", planned.get("error_message")
    earlier = set(_job_pids())
    await client.ok("POST", f"{V1}/runs/{run['id']}/approve", {"acknowledged": []})
    return earlier


async def _kill_up(up: Proc, data: Path) -> None:
    """kill -9 of `runplane up`, and of its embedded NATS (not under test here)."""
    up.kill()
    nats = nats_servers_using(data)
    await asyncio.wait_for(up.proc.wait(), 10) if up.proc else None
    for pid in nats:
        os.kill(pid, signal.SIGKILL)


def _provisioned(command: str) -> str:
    """main.tf: one null resource whose `local-exec` runs `command`."""
    return (
        'resource "null_resource" "a" {\n'
        f'  provisioner "local-exec" {{ command = "{command}" }}\n'
        "}\n"
    )


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def _uid_of(pid: int) -> int:
    return Path(f"/proc/{pid}").stat().st_uid


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.skipif(bool(NO_SANDBOX), reason=f"no sandbox: {NO_SANDBOX}")
async def test_a_sandboxed_terraform_stops_gracefully_with_its_executor_and_nothing_outlives_it(
    tmp_path: Path, repo: Path
) -> None:
    """kill -9 of `runplane up --isolation sandbox` mid-apply: the sandbox's init gives
    Terraform one SIGTERM, so it stops as on Ctrl-C and writes `errored.tfstate` (what the
    next executor recovers), and then every process of the job is gone with its
    namespace, the daemon a provisioner put in a session of its own too: nothing waits
    for a restart to find it."""
    data, port = tmp_path / "data", free_port()
    cmd = "setsid sleep 300 >/dev/null 2>&1 & sleep 300"
    args = ["up", "--no-demo", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"]
    args += ["--isolation", "sandbox"]
    env = {"RUNPLANE_ADMIN_TOKEN": TOKEN}
    base = f"http://127.0.0.1:{port}"
    first = await Proc(args, tmp_path / "up1.log", env=env).start()
    client = Client(base, TOKEN)
    try:
        await wait_healthy(base)
        await client.ok("POST", "/api/v1/orgs", {"name": "acme"})
        earlier = await _approved_apply(client, repo, _provisioned(cmd))

        async def sleeping() -> list[int]:
            mine = [p for p in _job_pids() if p not in earlier]  # another test's may linger
            found = [p for p in mine if _cmdline(p).startswith(b"sleep\x00300\x00")]
            assert len(found) == 2, "the provisioner and its daemon have not started yet"
            return found

        sleeps = await eventually(sleeping, timeout=60, what="the provisioner's daemon")
        job = [p for p in _job_pids() if p not in earlier]
        terraform = [p for p in job if _cmdline(p).split(b"\0")[0].endswith(b"/terraform")]
        assert terraform, "terraform runs as the job's uid"
        await _kill_up(first, data)

        async def all_gone() -> bool:
            return not [p for p in job if _alive(p)]

        await eventually(all_gone, timeout=30, what="the job ended with its executor")
        assert not [p for p in sleeps if _alive(p)], "the daemon died with the namespace"
        jobs = default_jobs_dir(data / "work")
        assert list(jobs.rglob("errored.tfstate")), "terraform stopped gracefully"
    finally:
        await client.close()
        first.kill()


def _job_pids() -> list[int]:
    """The processes of any job uid now."""
    jobs, out = uid_range(), []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and _uid_of(int(d)) in jobs:
                out.append(int(d))
        except OSError:
            continue  # ended meanwhile
    return out
