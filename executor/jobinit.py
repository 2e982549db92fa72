"""The Python init a job process starts under where the shell init (executor/shellinit.py,
which does the same for a fortieth of the CPU) cannot serve: a sandbox without a
network, whose state backend only this one carries in, or a host whose `env` or
`fs.suid_dumpable` the shell init cannot use.

`JOB_INIT` runs as the job's uid (the system's python3, which any uid may run: the
executor's own may be in a directory jobs cannot cross) and starts the job's process.
It takes the group's interrupts without acting (the job's process gets them too and
stops as on Ctrl-C). Its parent death signal (set by itself, after the uid switch:
a change of credentials clears it) says its executor died: it then gives the job's
process exactly one SIGTERM (a second would make Terraform exit at once, writing no
`errored.tfstate`), waits for it up to `STOP_GRACE_S`, and kills every process of its
uid (`kill(-1)`: in the uid mode all of the phase's, a daemon in a session of its own
too; in the sandbox all of its PID namespace). So nothing of a job outlives its executor,
with or without systemd and without waiting for the next start. It makes itself
undumpable, so that the job (the same uid) cannot reach its files through /proc.

Its arguments: the pid its parent must have (0: do not check, the sandbox's init has
none in its namespace), a file descriptor to report on (-1: none), `PORT:SOCKET` or ""
(a sandbox without a network: it listens on loopback's PORT in the job's namespace and
carries each connection to the unix socket SOCKET, where the executor serves the phase's
state backend, whose address Terraform has), then the job's argv.
On that descriptor it says which of the sandbox's tmpfs mounts were full when the job
ended (`tmpfs /tmp`): a write there was refused at the cap (executor/caps.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
from collections.abc import Mapping, Sequence
from pathlib import Path

STATE_SOCKET = "state.sock"  # in the phase's directory (executor/statebackend.py)
STOP_GRACE_S = 90  # Terraform stopping on SIGTERM takes ~12 s (its state backend is gone)
SCRATCH = ("/tmp", "/var/tmp", "/run", "/dev/shm")  # the sandbox's tmpfs mounts
# Connections the init carries to the state socket at once (two threads each); more wait
# in the listen backlog. Terraform's http backend uses one or two.
RELAYED = 8

JOB_INIT = """
import ctypes, os, signal, subprocess, sys, time
libc = ctypes.CDLL(None)
parent, report, carry = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if carry:
    import socket, threading
    port, path = carry.split(":", 1)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", int(port)))
    srv.listen(64)
    def pipe(a, b, ends):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            ends.pop()
        except IndexError:
            a.close()
            b.close()
            slots.release()
    slots = threading.BoundedSemaphore(RELAYED)
    def serve():
        while True:
            slots.acquire()
            c = srv.accept()[0]
            u = socket.socket(socket.AF_UNIX)
            try:
                u.connect(path)
            except OSError:
                c.close()
                u.close()
                slots.release()
                continue
            ends = [1]
            threading.Thread(target=pipe, args=(c, u, ends), daemon=True).start()
            threading.Thread(target=pipe, args=(u, c, ends), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
s = {"told": 0, "sent": 0, "job": None}
def stop(*_):
    s["told"] = s["told"] or time.monotonic()
    if s["job"] is not None and not s["sent"]:
        s["sent"] = 1
        s["job"].send_signal(signal.SIGTERM)
signal.signal(signal.SIGINT, lambda *_: None)
signal.signal(signal.SIGTERM, stop)
libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)
libc.prctl(4, 0, 0, 0, 0)
if parent and os.getppid() != parent:
    stop()
s["job"] = subprocess.Popen(sys.argv[4:])
if s["told"]:
    stop()
while True:
    try:
        code = s["job"].wait(0.5)
        break
    except subprocess.TimeoutExpired:
        if s["told"] and time.monotonic() - s["told"] > GRACE:
            os.kill(-1, signal.SIGKILL)
if report >= 0:
    os.set_blocking(report, False)
    for place in SCRATCH:
        try:
            st = os.statvfs(place)
            if st.f_blocks and not st.f_bavail:
                os.write(report, ("tmpfs " + place + chr(10)).encode())
        except OSError:
            pass
if s["told"]:
    os.kill(-1, signal.SIGKILL)
sys.exit(128 - code if code < 0 else code)
""".replace("GRACE", str(STOP_GRACE_S)).replace("SCRATCH", repr(SCRATCH))
JOB_INIT = JOB_INIT.replace("RELAYED", str(RELAYED))


def init_python() -> str:
    """A python3 any uid may run (the job's init), or ""."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        real = os.path.realpath(path)
        if os.path.isfile(real) and os.stat(real).st_mode & 0o001:
            return real
    return ""


def under_init(argv: Sequence[str], *, parent: int, report: int = -1, carry: str = "") -> list[str]:
    """`argv` started by JOB_INIT (module docstring)."""
    return [init_python(), "-I", "-S", "-c", JOB_INIT, str(parent), str(report), carry, *argv]


def state_carry(env: Mapping[str, str], root: Path) -> str:
    """`PORT:SOCKET` for JOB_INIT when the phase serves its state on `root`'s socket and
    Terraform is told a loopback address; else ""."""
    found = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/state", env.get("TF_HTTP_ADDRESS", ""))
    socket = root / STATE_SOCKET
    return f"{found.group(1)}:{socket}" if found and socket.exists() else ""


def read_reports(fd: int) -> list[str]:
    """What the inits of a phase reported so far (the places found full), without
    waiting: `tmpfs PLACE` (JOB_INIT: PLACE was full) or `tmpfs PLACE FREE BLOCKS` (the
    shell init, executor/shellinit.py: `stat -f` of each; full when it has blocks and
    none free). Anything else is no report."""
    out: list[str] = []
    while select.select([fd], [], [], 0)[0]:
        with contextlib.suppress(BlockingIOError):
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            out += [place for line in chunk.decode().splitlines() if (place := _full(line))]
            continue
        break
    return out


def _full(line: str) -> str:
    """The place a report line says was full, or ""."""
    words = line.split()
    if len(words) not in (2, 4) or words[0] != "tmpfs" or words[1] not in SCRATCH:
        return ""
    if len(words) == 4 and not (words[2] == "0" and words[3].isdigit() and int(words[3]) > 0):
        return ""
    return words[1]
