"""The spawn helper (executor/spawnhelper.py) is one file every job of the machine's
executors goes through, the first steps as root: what a job of one organization does to
it must reach no other's job. Real job uids and bubblewrap; as root, as CI runs."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pytest

from executor import spawnhelper
from executor.caps import JobCaps
from executor.isolation import Isolation, Jail
from tests.caps_support import NO_SANDBOX
from tests.jail_support import jails as jails  # the fixture
from tests.jail_support import run_as_job

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="job uids need root")
SANDBOX = pytest.param(
    "sandbox", marks=pytest.mark.skipif(bool(NO_SANDBOX), reason=f"no sandbox: {NO_SANDBOX}")
)
MODES = ["user", SANDBOX]


@pytest.fixture
def helper() -> str:
    found = spawnhelper.spawn_helper()
    if not found:
        pytest.skip("the spawn helper cannot be built here (no cc -static)")
    return found


def _jail(tmp_path: Path, mode: str, name: str = "phase") -> Jail:
    # the scope of its control groups (the jobs directory's parent): a name of its own,
    # not the test's, which a session running the same test at once would share
    base = Path(tempfile.mkdtemp(dir=tmp_path))
    root, tmp = base / "jobs" / name, base / f"tmp-{name}"
    root.mkdir(parents=True)
    tmp.mkdir()
    for path in (tmp_path, base, base / "jobs", tmp):
        path.chmod(0o711)  # the job crosses them to its own directory
    return Isolation.choose(mode, caps=JobCaps()).enter(root, tmp)


async def _run(jail: Jail, argv: list[str], tmp_path: Path) -> tuple[int, str]:
    return await run_as_job(jail, argv, tmp_path / f"{jail.root.name}.log")


POISON = """
h=$1
d=$(dirname "$h")
cat "$h" > /dev/null 2>&1 && echo "attack: read"
(printf 'x' >> "$h") 2>/dev/null && echo "attack: wrote"
mv -f "$h" "$h.x" 2>/dev/null && echo "attack: moved"
rm -f "$h" 2>/dev/null
[ -e "$h" ] || echo "attack: removed"
cp /bin/sh "$d/planted" 2>/dev/null  # the sandbox's own /run may take it: not the host's
cp /bin/sh "$h.new" 2>/dev/null && mv -f "$h.new" "$h" 2>/dev/null && echo "attack: replaced"
echo done
"""


@pytest.mark.parametrize("mode", MODES)
async def test_attack_a_job_can_neither_read_nor_replace_the_helper_the_next_job_runs_as_root(
    tmp_path: Path, jails: list[Jail], mode: str, helper: str
) -> None:
    """Attack: org A's job reads the helper, appends to it, renames, removes or replaces
    it, or plants a file beside it, so that org B's next job process (whose first steps
    the helper does as root) runs A's code. Every attempt is refused (a root-only
    directory, an execute-only file; in the sandbox a read-only bind), the file is the one
    built, and the next phase, of another uid, runs through it as before."""
    before = hashlib.sha256(Path(helper).read_bytes()).hexdigest()
    jail = _jail(tmp_path, mode)
    jails.append(jail)
    code, log = await _run(jail, ["/bin/sh", "-c", POISON, "sh", helper], tmp_path)
    assert code == 0 and log.strip().endswith("done"), log
    assert "attack:" not in log, log
    assert spawnhelper.usable(Path(helper))
    assert hashlib.sha256(Path(helper).read_bytes()).hexdigest() == before
    assert not (Path(helper).parent / "planted").exists()
    other = _jail(tmp_path, mode, "other")
    jails.append(other)
    assert other.uid != jail.uid
    code, log = await _run(other, ["/bin/sh", "-c", "id -u"], tmp_path)
    assert (code, log.split()) == (0, [str(other.uid)]), log


TAKE = """
h=$1; shift
for uid in 0 "$@"; do
  "$h" --reuid=$uid --regid=$uid --clear-groups --no-new-privs --pdeathsig TERM \
    runplane-spawn $PPID -- -- /bin/sh -c 'echo "attack: ran as $(id -u)"'
  echo "exit $?"
done
"""


@pytest.mark.parametrize("mode", MODES)
async def test_attack_a_job_running_the_helper_itself_takes_no_other_uid(
    tmp_path: Path, jails: list[Jail], mode: str, helper: str
) -> None:
    """Attack: the job may execute the helper (it is in the job's own chain), and asks it
    for root's uid and for another phase's (another organization's). The helper is no
    setuid program and the job has no capability: every switch is refused (exit 125)
    and nothing runs."""
    jail, other = _jail(tmp_path, mode), _jail(tmp_path, mode, "other")
    jails += [jail, other]
    code, log = await _run(jail, ["/bin/sh", "-c", TAKE, "sh", helper, str(other.uid)], tmp_path)
    assert code == 0, log
    assert "attack:" not in log, log
    assert log.count("exit 125") == 2, log
