"""CPU of one job process started by the executor's spawn path (issue 26, item 3):
`executor.process.run` of `/bin/true` through a phase's `Jail`, in a process as big as an
executor (`--ballast-mb` of touched memory: a fork copies its page tables), N times.

Prints the CPU per spawn of this process (the fork or vfork, the asyncio plumbing) and
of its children (the exec chain, bwrap, the init, `true`), from getrusage. Runs the tree
given by `--tree` (default: this one), so that a tree before can be measured alike:

    python bench/spawncpu.py --tree /work/before-spawn --isolation sandbox -n 200
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import tempfile
from pathlib import Path


def _cpu(who: int) -> float:
    use = resource.getrusage(who)
    return use.ru_utime + use.ru_stime


async def _main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(args.tree).resolve()))
    from executor.caps import JobCaps
    from executor.isolation import Isolation
    from executor.output import Masker
    from executor.process import StepLog, run

    ballast = [bytearray(os.urandom(64)) * (1 << 14) for _ in range(args.ballast_mb)]
    isolation = Isolation.choose(args.isolation, caps=JobCaps())
    with tempfile.TemporaryDirectory(prefix="spawncpu-") as base:
        top = Path(base)
        (top / "jobs" / "phase").mkdir(parents=True)
        (top / "tmp").mkdir()
        for path in (top, top / "jobs"):
            path.chmod(0o711)
        jail = isolation.enter(top / "jobs" / "phase", top / "tmp")
        log = StepLog(top / "step.log", Masker())
        env = {"PATH": "/usr/bin:/bin"}
        try:
            for _ in range(5):  # warm: imports, the shell init's install, setpriv's look
                await run(["/bin/true"], cwd=jail.home, env=env, step_log=log, jail=jail)
            own, kids = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
            for _ in range(args.n):
                code = await run(["/bin/true"], cwd=jail.home, env=env, step_log=log, jail=jail)
                assert code == 0, code
            own = _cpu(resource.RUSAGE_SELF) - own
            kids = _cpu(resource.RUSAGE_CHILDREN) - kids
        finally:
            log.close()
            jail.close()
    del ballast
    print(
        f"{args.tree} {args.isolation}: per spawn {1000 * own / args.n:.2f} ms executor "
        f"+ {1000 * kids / args.n:.2f} ms children = {1000 * (own + kids) / args.n:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--isolation", default="sandbox")
    parser.add_argument("-n", type=int, default=200)
    parser.add_argument("--ballast-mb", type=int, default=100)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
