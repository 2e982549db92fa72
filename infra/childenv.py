"""What child processes (git, terraform) inherit, and how they are stopped.

Children get the host's environment, so that providers find the executor host's cloud
credentials, but never runplane's own settings: a `local-exec` provisioner in a workspace's
repository must not be able to print the admin token, the encryption key or the NATS
credentials of the process that runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence

# Names the process's own secrets and settings live under.
_PRIVATE_PREFIXES = ("RUNPLANE_", "NATS_")

# git must never wait for a person or for a silent server.
GIT_DEFAULTS = {
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_SSH_COMMAND": "ssh -oBatchMode=yes -oConnectTimeout=15 "
    "-oServerAliveInterval=15 -oServerAliveCountMax=2",
}


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The host's environment without runplane's own variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE_PREFIXES)}
    env.update(extra or {})
    return env


def git_env() -> dict[str, str]:
    """For git: the child environment, with prompts off and ssh bounded (unless the host
    configured its own ssh command)."""
    env = child_env()
    env["GIT_TERMINAL_PROMPT"] = "0"
    env.setdefault("GIT_SSH_COMMAND", GIT_DEFAULTS["GIT_SSH_COMMAND"])
    return env


async def run_quietly(
    argv: Sequence[str], env: Mapping[str, str], timeout: float
) -> tuple[int, bytes, bytes]:
    """Run `argv` (git, most often) with no input, in `/` (no repository around it lends
    its remotes or config) and a session of its own: its exit code, output and error
    output. Past `timeout` it is killed with all it started (`kill_group`) and
    TimeoutError is raised."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(env),
        cwd="/",
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        await kill_group(proc)
        raise
    return proc.returncode or 0, out, err


async def kill_group(proc: asyncio.subprocess.Process, *, wait: float = 5.0) -> None:
    """SIGKILL a child started with `start_new_session=True` and all it started.

    Killing only the child is not enough: a grandchild (ssh under git) keeps the pipes
    open, and waiting for the child would then never end.
    """
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), wait)
