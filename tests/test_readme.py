"""The README's quick start, walked as text: every fenced command of its "Run it" section
(and then of "Templates" and "Policies", which follow on from it) runs, in order, in one
shell, against a fresh `runplane up`, so the README cannot drift from the product. `up`'s
banner prints the same commands, which a second test holds to the README's.

What differs from a person's first hour, and only that: the server listens on a free
port, not 8080 (`localhost:8080` in the text is rewritten, and `RUNPLANE_URL` tells
`runplane logs`); `./dev up` itself is this test's `runplane up`; and `./dev` runs in a
copy of the clone whose `.venv` is this interpreter (the real `dev` script, a stand-in
virtualenv). curl fails on an HTTP error (`--fail-with-body`), so a refused request fails
the walk, as does any failing command (`set -euo pipefail`).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest

from services.root.processes import quickstart
from tests.procs import ROOT, Client, Proc, free_port, wait_healthy

pytestmark = pytest.mark.terraform

README = ROOT / "README.md"
_FENCE = re.compile(r"^```sh\n(.*?)^```", re.M | re.S)
PRELUDE = """set -euo pipefail
curl() { command curl --fail-with-body "$@"; }
"""


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n") if f"\n## {title}\n" in text else -1
    if start < 0:
        start = text.index(f"\n### {title}\n")
    rest = text[start + 1 :]
    end = re.search(r"^##+ ", rest[3:], re.M)
    return rest[: end.start() + 3] if end else rest


def commands(title: str) -> list[str]:
    """Every fenced `sh` block of the section, as written."""
    return [block.rstrip("\n") for block in _FENCE.findall(section(title))]


def _clone(tmp: Path) -> Path:
    """The clone as `./dev` sees it: its script, its project file, a virtualenv whose
    `runplane` is the code under test (installed: the stamp is newer than pyproject)."""
    clone = tmp / "clone"
    (clone / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "dev", clone / "dev")
    shutil.copy(ROOT / "pyproject.toml", clone / "pyproject.toml")
    script = clone / ".venv" / "bin" / "runplane"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} -m services.root.cli "$@"\n')
    script.chmod(0o755)
    (clone / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (clone / ".venv" / ".runplane-installed").touch()
    return clone


async def _shell(script: str, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        script,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        return -1, out.decode(errors="replace") + "\n(timed out)"
    return proc.returncode or 0, out.decode(errors="replace")


def test_the_run_it_section_starts_with_dev_up_and_sets_what_it_uses() -> None:
    blocks = commands("Run it")
    assert blocks[0] == "./dev up"
    walk = "\n".join(blocks[1:])
    for needed in ("TOKEN=", "H=", "RUN=$("):
        assert needed in walk, needed
    prerequisites = section("Run it").split("```")[0]
    for tool in ("python3", "git", "curl", "jq"):
        assert f"`{tool}`" in prerequisites, tool


async def test_the_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The demo run plans, waits for approval, is approved and applied; the templates
    example then ends `no_changes` with its notify step skipped, never run."""
    clone = _clone(tmp_path)
    port = free_port()
    data = clone / ".runplane"
    up = Proc(["up", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"], tmp_path / "up")
    up.env.pop("RUNPLANE_ADMIN_TOKEN", None)  # the README reads .runplane/admin-token
    await up.start()
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base)
        run_it = commands("Run it")[1:]  # [0] is `./dev up`: the process above
        later = [*commands("Templates"), *commands("Policies")]
        script = PRELUDE + "\n".join([*run_it, 'echo "QUICKSTART_RUN=$RUN"', *later])
        script = script.replace("localhost:8080", f"localhost:{port}")
        shell_env = {**up.env, "RUNPLANE_URL": base}
        code, out = await _shell(script, clone, shell_env, timeout=240)
        assert code == 0, out[-4000:]

        client = Client(base, (data / "admin-token").read_text().strip())
        try:
            first = re.search(r"QUICKSTART_RUN=(\S+)", out)
            assert first, out[-2000:]
            run = await client.ok("GET", f"/api/v1/orgs/demo/runs/{first[1]}")
            assert run["status"] == "applied", run
            assert "run.apply_finished" in out  # the events command's output
            listed = await client.ok("GET", "/api/v1/orgs/demo/runs")
            linted = listed["items"][0]
            assert (linted["template"], linted["status"]) == ("linted", "no_changes"), linted
            shown = [(s["number"], s["name"], s["status"]) for s in linted["steps"]]
            assert shown == [
                (50, "lint", "done"),
                (100, "plan", "done"),
                (101, "policy (implied)", "done"),
                (150, "approval", "skipped"),
                (200, "apply", "skipped"),
                (300, "notify", "skipped"),
            ]
            assert "300 notify: skipped" in out
            assert f"applied {linted['id']}" not in out
            setting = await client.ok("GET", "/api/v1/orgs/demo/settings")
            assert setting["settings"]["templates"] == {"apply": "linted"}
            policy = await client.ok("GET", "/api/v1/orgs/demo/policies/no-deletes")
            assert policy["enforcement"] == "hard-mandatory"
        finally:
            await client.close()
    finally:
        code = await up.stop(signal.SIGTERM)
    assert code == 0, up.output()[-3000:]
    # Not a terminal: JSON lines, a run_transition among them for each status.
    moves = [
        line for line in up.output().splitlines() if '"run_transition"' in line and first[1] in line
    ]
    assert [re.search(r'"status": "(\w+)"', m)[1] for m in moves] == [  # type: ignore[index]
        "pending",
        "queued",
        "planning",
        "awaiting_approval",
        "apply_queued",
        "applying",
        "applied",
    ]


def test_up_s_banner_prints_the_readme_s_commands() -> None:
    """The banner's commands are the README's, but for the token's value, the server's
    address (`--url` for `logs` when it is not the default) and where `./dev` is."""
    written = commands("Run it")[1].splitlines()
    printed = quickstart(
        "http://127.0.0.1:8080", "rp_admin_x", "demo", "hello", runplane="./dev runplane"
    )

    def same(line: str) -> str:
        line = line.replace("127.0.0.1:8080", "localhost:8080")
        return re.sub(r"\s+# .*$", "", line).strip()

    assert printed[0] == "TOKEN=rp_admin_x" and written[0].startswith("TOKEN=$(cat ")
    assert [same(x) for x in printed[1:]] == [same(x) for x in written[1:]]
    elsewhere = quickstart("http://127.0.0.1:9", "t", "demo", "hello", runplane="/c/dev runplane")
    assert (
        elsewhere[6]
        == "/c/dev runplane logs -f $RUN --org demo --token $TOKEN --url http://127.0.0.1:9"
    )
