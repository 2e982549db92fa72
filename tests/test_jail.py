"""The checkout is a jail, and repositories come from where the deployment allows.

The attacks themselves, against a real nats-server and real Terraform: a repository's
symlinks that lead out of the checkout (to a canary that must stay unchanged, to
`/etc/passwd` that must not be printed), a repository inside runplane's own directories
(the data directory, an executor's mirror of another organization's repository), and
plain variables that must not travel on any command line.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events.errors import RepositoryRefused
from events.run import FailRun, StepFinished, Workspace
from executor import Executor
from executor import terraform as tf
from executor.git import GitCache
from infra.natsserver import EmbeddedNats
from infra.options import ConfigError
from services.app.commands import App
from services.app.repositories import Sources
from services.root.cli import options, parser
from tests.executor_support import Harness, git
from tests.procs import Client, Proc, free_port, wait_healthy

pytestmark = pytest.mark.terraform

MAIN_TF = """
variable "n" { default = "1" }
resource "null_resource" "hello" {
  count    = tonumber(var.n)
  triggers = { n = var.n }
}
"""
CANARY = "canary: must never change\n"
PASSWD_LINE = "root:x:0:0"


@pytest.fixture
def h(nc: NATS, app: App) -> Harness:
    return Harness(nc, app)


def commit_tree(repo: Path, files: dict[str, str], links: dict[str, str]) -> str:
    """Commit `files` (text) and `links` (name -> symlink target) on the current branch."""
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    for name, target in links.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, repo / name)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "tree")
    return git(repo, "rev-parse", "HEAD")


async def fails_with(h: Harness, ws: str, run_id: str, reason: str) -> tuple[Any, list[Any]]:
    state = await h.reaches(ws, run_id, "failed")
    assert state.reason == reason, (state.reason, state.error_message)
    return state, await h.events(ws, run_id)


async def logs_of(h: Harness, events: list[Any]) -> bytes:
    out = b""
    for e in events:
        if isinstance(e, StepFinished) and e.log_object:
            out += await h.get("rp-logs", e.log_object)
    return out


def everything_said(state: Any, events: list[Any]) -> str:
    said = [state.error_message]
    said += [e.error for e in events if isinstance(e, StepFinished)]
    said += [e.message for e in events if isinstance(e, FailRun)]
    return "\n".join(said)


# ---------------------------------------------------------------- symlinks


@pytest.mark.parametrize("name", ["runplane_backend_override.tf", "plan.tfplan"])
async def test_a_file_runplane_writes_linked_outside_fails_the_run_and_the_target_stays(
    h: Harness, repo: Path, executor: Executor, tmp_path: Path, name: str
) -> None:
    """The repository's `runplane_backend_override.tf` / `plan.tfplan` is a link to a
    canary outside: the run fails `unsafe_symlink` naming it, before Terraform wrote
    anything; the canary is as it was."""
    canary = tmp_path / "canary.txt"
    canary.write_text(CANARY)
    commit_tree(repo, {"main.tf": MAIN_TF}, {name: str(canary)})
    await h.workspace("net", Workspace(repository=str(repo)))
    run_id = await h.start_run("net")
    state, events = await fails_with(h, "net", run_id, "unsafe_symlink")
    assert name in state.error_message
    assert canary.read_text() == CANARY
    assert not any(isinstance(e, StepFinished) and e.step == "init" for e in events)


async def test_a_config_linked_to_etc_passwd_fails_and_prints_nothing_of_it(
    h: Harness, repo: Path, executor: Executor
) -> None:
    """`main.tf` -> /etc/passwd: refused before Terraform reads it; no line of the file in
    the run's error, the steps' errors or their logs."""
    assert PASSWD_LINE in Path("/etc/passwd").read_text()
    commit_tree(repo, {}, {"main.tf": "/etc/passwd"})
    await h.workspace("net", Workspace(repository=str(repo)))
    run_id = await h.start_run("net")
    state, events = await fails_with(h, "net", run_id, "unsafe_symlink")
    assert "main.tf" in state.error_message
    assert PASSWD_LINE not in everything_said(state, events)
    assert PASSWD_LINE.encode() not in await logs_of(h, events)


async def test_a_relative_link_climbing_out_of_the_checkout_fails(
    h: Harness, repo: Path, executor: Executor
) -> None:
    """A relative link in a subdirectory that climbs out (`../` far enough reaches `/`),
    and one reaching it through a chain of two links inside: both refused."""
    up = "../" * 40
    commit_tree(
        repo,
        {"main.tf": MAIN_TF},
        {"net/hostname.tf": f"{up}etc/hostname", "a.tf": "b/c.tf", "b/c.tf": f"{up}etc/hosts"},
    )
    await h.workspace("net", Workspace(repository=str(repo)))
    run_id = await h.start_run("net")
    state, _ = await fails_with(h, "net", run_id, "unsafe_symlink")
    assert "hostname.tf" in state.error_message or "c.tf" in state.error_message


async def test_links_that_stay_inside_the_checkout_are_fine(
    h: Harness, repo: Path, executor: Executor
) -> None:
    """A link to a file of the repository, and a directory linked within it, plan."""
    commit_tree(
        repo,
        {"shared/main.tf": MAIN_TF},
        {"main.tf": "shared/main.tf", "envs/prod": "../shared"},
    )
    await h.workspace("net", Workspace(repository=str(repo), variables={"n": "2"}))
    run_id = await h.start_run("net")
    await h.reaches("net", run_id, "awaiting_approval")
    await h.workspace("prod", Workspace(repository=str(repo), directory="envs/prod"))
    run_id = await h.start_run("prod")
    await h.reaches("prod", run_id, "awaiting_approval")


# ---------------------------------------------------------------- variables


async def _cmdlines() -> list[bytes]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found.append(f.read())
            except OSError:
                continue
    return found


async def test_a_300_kb_variable_plans_and_no_value_is_on_any_command_line(
    h: Harness, repo: Path, executor: Executor
) -> None:
    """300 KB do not fit on a command line (one argument is at most 128 KiB): the plan
    works, and while it runs no process's `/proc/*/cmdline` shows a plain value. The
    generated tfvars file is 0600; a repository's file of the same name counts for
    nothing, nor does a later `*.auto.tfvars.json` of the repository."""
    big = "b" * 300_000
    marker = "plain-variable-canary-5e1f"
    main = MAIN_TF + 'variable "big" {}\nvariable "marker" {}\n'
    main += 'output "sizes" { value = [length(var.big), var.marker] }\n'
    forged = '{"n": "5", "marker": "forged"}'
    commit_tree(repo, {"main.tf": main, tf.VARS_FILE: forged, "zz.auto.tfvars.json": forged}, {})
    variables = {"big": big, "marker": marker, "n": "3"}
    await h.workspace("net", Workspace(repository=str(repo), variables=variables))
    seen: list[bytes] = []
    modes: set[int] = set()
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            seen.extend(c for c in await _cmdlines() if marker.encode() in c or b"bbbbbbbb" in c)
            for f in executor.jobs_dir.glob(f"*/src/{tf.VARS_FILE}"):
                try:
                    with f.open("rb") as ours:  # the repository's, until replaced
                        if ours.read() != forged.encode():
                            modes.add(os.fstat(ours.fileno()).st_mode & 0o777)
                except FileNotFoundError:
                    pass
            await asyncio.sleep(0.01)  # a sampling watcher, not a wait for a condition

    watcher = asyncio.create_task(watch())
    try:
        run_id = await h.start_run("net")
        state = await h.reaches("net", run_id, "awaiting_approval")
    finally:
        stop.set()
        await watcher
    assert seen == []
    assert modes == {0o600}
    assert state.plan_summary is not None and state.plan_summary.add == 3  # n from the workspace
    await h.approve("net", run_id)
    await h.reaches("net", run_id, "applied")  # the saved plan carries the variables


async def test_list_and_map_variables_keep_their_minus_var_reading(
    h: Harness, repo: Path, executor: Executor
) -> None:
    """A value written for a `list` or `map` variable plans as one (a JSON tfvars string
    would be refused with "list of string required"), and the same text given to a
    `string` variable stays that text, as with `-var`."""
    main = 'variable "names" { type = list(string) }\n'
    main += 'variable "tags" { type = map(string) }\nvariable "text" { type = string }\n'
    main += 'resource "null_resource" "each" {\n  for_each = toset(var.names)\n'
    main += "  triggers = { tag = var.tags[each.key], text = var.text }\n}\n"
    commit_tree(repo, {"main.tf": main}, {})
    variables = {
        "names": '["a", "b"]',
        "tags": '{ a = "x", b = "y" }',
        "text": '["kept as text"]',
    }
    await h.workspace("net", Workspace(repository=str(repo), variables=variables))
    run_id = await h.start_run("net")
    state = await h.reaches("net", run_id, "awaiting_approval")
    assert state.plan_summary is not None and state.plan_summary.add == 2


def test_only_values_opening_a_collection_go_through_the_environment() -> None:
    from executor.phases import split_variables

    plain, exprs = split_variables({"a": "x", "b": " [1]", "c": "{}", "d": "not [a] list"})
    assert plain == {"a": "x", "d": "not [a] list"}
    assert exprs == {"b": " [1]", "c": "{}"}


# ---------------------------------------------------------------- repository sources


async def test_a_workspace_naming_another_orgs_mirror_is_refused_at_checkout(
    h: Harness, repo: Path, executor: Executor
) -> None:
    """Org A's repository is mirrored under the executor's work directory. Org B's
    workspace names that mirror (created past the API): its run fails at checkout,
    `repository_not_allowed`, and plans none of A's code."""
    commit_tree(repo, {"main.tf": MAIN_TF}, {})
    await h.workspace("net", Workspace(repository=str(repo)), org="alpha")
    run_id = await h.start_run("net", org="alpha")
    await h.reaches("net", run_id, "awaiting_approval", org="alpha")
    mirror = GitCache(executor.work_dir / "git").mirror(str(repo), org="alpha")
    assert mirror.is_dir()
    paths = [str(mirror), f"file://{mirror}", f"{mirror.parent}/../git/{mirror.name}"]
    for i, path in enumerate(paths):
        ws = f"steal{i}"
        await h.workspace(ws, Workspace(repository=path), org="bravo")
        stolen = await h.start_run(ws, org="bravo")
        state = await h.reaches(ws, stolen, "failed", org="bravo")
        assert state.reason == "repository_not_allowed", (state.reason, state.error_message)
        assert "runplane-directory" in state.error_message
        assert state.plan_summary is None


async def test_the_api_refuses_a_repository_inside_its_data_directory(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    """A standalone `runplane api`: a workspace whose repository is in its data directory
    (there: through `..` and a symlink too) is 422 `repository-not-allowed` naming the
    rule; a local path it was not told to allow is 422 too; a remote URL is fine."""
    data = tmp_path / "api"
    port = free_port()
    args = ["api", "--nats-url", nats_server.url, "--data-dir", str(data)]
    env = {"RUNPLANE_ADMIN_TOKEN": "adm"}
    api = await Proc([*args, "--listen", f"127.0.0.1:{port}"], tmp_path / "api.log", env).start()
    base = f"http://127.0.0.1:{port}"
    client = Client(base, "adm")
    link = tmp_path / "innocent"
    os.symlink(data, link)
    try:
        await wait_healthy(base)
        await client.ok("POST", "/api/v1/orgs", {"name": "acme"})
        inside = [str(data), f"{tmp_path}/x/../api/nats", f"file://{data}/work/git", str(link)]
        for path in inside:
            status, body = await client.call(
                "POST", "/api/v1/orgs/acme/workspaces", {"name": "net", "repository": path}
            )
            assert status == 422, (path, status, body)
            assert body["type"].endswith("/repository-not-allowed"), body
            assert body["rule"] == "runplane-directory", body
        status, body = await client.call(
            "POST", "/api/v1/orgs/acme/workspaces", {"name": "net", "repository": "/srv/x"}
        )
        assert (status, body.get("rule")) == (422, "allowed-repos"), body
        remote = {"name": "net", "repository": "https://git.example.com/acme/net.git"}
        await client.ok("POST", "/api/v1/orgs/acme/workspaces", remote)
    finally:
        await client.close()
        await api.stop()


def test_a_standalone_api_takes_remote_urls_only_and_up_local_paths_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The defaults of `--allowed-repos`; a pattern that is none is one line at start."""
    monkeypatch.delenv("RUNPLANE_ALLOWED_REPOS", raising=False)
    api = Sources.parse(options(parser().parse_args(["api"])).allowed_repos)
    up = Sources.parse(options(parser().parse_args(["up"])).allowed_repos)
    for repository in ("https://github.com/acme/net.git", "git@github.com:acme/net.git"):
        api.check(repository, org="acme")
        up.check(repository, org="acme")
    with pytest.raises(RepositoryRefused, match="allowed-repos"):
        api.check("/srv/git/net", org="acme")
    up.check("/", org="acme")
    with pytest.raises(ConfigError, match="--allowed-repos"):
        options(parser().parse_args(["api", "--allowed-repos", "https://,no pattern"]))


@pytest.mark.parametrize(
    ("spec", "repository", "allowed"),
    [
        ("https://", "https://github.com/acme/x.git", True),
        ("https://", "http://github.com/acme/x.git", False),
        ("ssh://", "git@github.com:acme/x.git", True),
        ("git@github.com:", "git@github.com:acme/x.git", True),
        ("git@github.com:", "bob@github.com:acme/x.git", False),
        ("github.com", "ssh://git@github.com/acme/x.git", True),
        ("github.com", "https://gitlab.com/acme/x.git", False),
        ("https://github.com/acme/", "https://github.com/acme/x.git", True),
        ("https://github.com/acme/", "https://github.com/acme/../evil/x.git", False),
        ("https://github.com/acme/", "https://github.com/acmeevil/x.git", False),
        ("/srv/git/", "/srv/git/net", True),
        ("/srv/git/", "/srv/git/../etc", False),
        ("file:///srv/git/", "file:///srv/git/net", True),
        ("file:///srv/git/", "/srv/gitx", False),
        ("https://", "/srv/git/net", False),
        ("*", "ext::sh -c touch% /tmp/pwned", False),
        ("*", "relative/path", False),
        ("*", "--upload-pack=touch /tmp/pwned", False),
    ],
)
def test_allowed_sources_match_scheme_host_and_path_prefix(
    spec: str, repository: str, allowed: bool
) -> None:
    sources = Sources.parse(spec)
    if allowed:
        sources.check(repository, org="acme")
    else:
        with pytest.raises(RepositoryRefused):
            sources.check(repository, org="acme")


def test_a_repository_pointing_into_a_guarded_directory_is_refused(tmp_path: Path) -> None:
    """A local repository outside, whose `.git` file, `.git` link or `alternates` lead
    into a guarded directory, is refused like one inside it; the exempt one is fine."""
    guarded = tmp_path / "data"
    (guarded / "work" / "git" / "m.git" / "objects").mkdir(parents=True)
    (guarded / "demo-repo").mkdir()
    sources = Sources.parse("*").guarding(guarded, "the data", exempt=[guarded / "demo-repo"])
    gitfile, linked, borrowed = (tmp_path / n for n in ("gitfile", "linked", "borrowed"))
    gitfile.mkdir()
    (gitfile / ".git").write_text(f"gitdir: {guarded}/work/git/m.git\n")
    linked.mkdir()
    os.symlink(guarded / "work" / "git" / "m.git", linked / ".git")
    (borrowed / "objects" / "info").mkdir(parents=True)
    (borrowed / "objects" / "info" / "alternates").write_text(f"{guarded}/work/git/m.git/objects\n")
    for repo in (gitfile, linked, borrowed):
        with pytest.raises(RepositoryRefused, match="runplane-directory"):
            sources.check(str(repo), org="acme")
    sources.check(str(guarded / "demo-repo"), org="acme")
    fine = tmp_path / "fine"  # (not tmp_path: world-writable, it is `unsafe-path`)
    fine.mkdir()
    git(fine, "init", "-q")
    sources.check(str(fine), org="acme")
