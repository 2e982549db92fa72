"""The binary a run's `terraform_binary` setting names, found as the job finds it.

The setting is the tenant's (an organization's admin sets it), so the executor never
looks the name up itself: as root it would see what no job may, and a message saying
whether a path exists, is a directory or is not executable would tell a tenant about
directories it cannot read. It is looked up by a process of the job (`FIND`: in the
sandbox, as its uid), which sees only what the job may run; and when the deployment lists
the binaries runs may name (`--terraform-binaries`), only those are taken. Every failure
is the same one error (`NOT_RUNNABLE`), whatever the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path

from executor import process
from executor.isolation import Jail

BINARY_NOT_FOUND = "terraform_binary_not_found"
NOT_RUNNABLE = (
    "not a binary this executor runs: it must be named in the executor's "
    "--terraform-binaries when that is set, and be an executable file the job may run "
    "(an absolute path, or a name looked up on PATH)"
)
# Run as the job: prints the file `$1` names if it is an executable file (a name: the
# first on PATH), nothing otherwise.
FIND = (
    'case "$1" in\n'
    '  /*) p="$1" ;;\n'
    "  */*) exit 1 ;;\n"  # relative: would depend on the job's directory, or the checkout
    '  *) p=$(command -v -- "$1") || exit 1 ;;\n'
    "esac\n"
    '[ -f "$p" ] && [ -x "$p" ] && printf "%s\\n" "$p"\n'
)
_TIMEOUT_S = 30.0


async def find_as_job(
    wanted: str,
    *,
    allowed: Sequence[str],
    jail: Jail | None,
    env: Mapping[str, str],
    cwd: Path,
) -> Path | None:
    """The file `wanted` names as the job sees it, or None (for whatever reason)."""
    if allowed and wanted not in allowed:
        return None
    if not wanted or "\0" in wanted or "\n" in wanted:
        return None
    proc = await process.spawn(
        ["/bin/sh", "-c", FIND, "runplane-find", wanted],
        cwd=cwd,
        env=env,
        jail=jail,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        out = await asyncio.wait_for(proc.stdout.read(64 * 1024), _TIMEOUT_S)
        code = await asyncio.wait_for(proc.wait(), _TIMEOUT_S)
    except TimeoutError:
        return None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    found = out.decode(errors="replace").rstrip("\n")
    if code != 0 or not found.startswith("/") or "\n" in found:
        return None
    return Path(found)
