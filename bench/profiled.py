"""Run a runplane process with its NATS messages counted, and optionally under cProfile,
between two signals: what the lifecycle benchmark uses to say where an executor's CPU
per run goes (`RP_BENCH_PROFILE`, bench/rp.py).

    python bench/profiled.py OUT count|cprofile MODULE ARGS...

runs `python -m MODULE ARGS...`. SIGUSR1 starts the window (counters zeroed, the
profiler enabled on the event loop's thread when `cprofile`); SIGUSR2 ends it and
writes `OUT.json` (messages out and in by kind, and the process's CPU seconds in the
window, all threads) and, when `cprofile`, `OUT.prof` (`python -m pstats OUT.prof`).
Run as a script (not `-m bench.profiled`), so that the process imports runplane from its
PYTHONPATH, which may be another tree's (`RP_BENCH_TREE`).
"""

from __future__ import annotations

import cProfile
import gc
import json
import os
import runpy
import signal
import sys
import time
from collections import Counter
from types import FrameType
from typing import Any

# What a subject is, by its start: the kinds of round trip an executor makes.
KINDS = (
    ("$JS.API.DIRECT.GET.", "direct get"),
    ("$JS.API.STREAM.MSG.GET.", "leader get"),
    ("$JS.API.STREAM.MSG.DELETE.", "msg delete"),
    ("$JS.API.STREAM.INFO.", "stream info"),
    ("$JS.API.CONSUMER.", "consumer api"),
    ("$JS.API.", "other js api"),
    ("$JS.ACK.", "ack"),
    ("$O.", "object store"),
    ("$KV.", "kv"),
    ("rp.run.", "run event"),
    ("rp.ws.", "workspace event"),
    ("rp.org.", "org event"),
    ("rp.hb.", "heartbeat"),
    ("rp.log.", "live log"),
    ("rp.dispatch.", "dispatch"),
    ("rp.secrets.", "secrets"),
    ("_INBOX.", "reply"),
)


def kind(subject: str) -> str:
    for prefix, name in KINDS:
        if subject.startswith(prefix):
            return name
    return subject.split(".", 1)[0]


class Window:
    """Counters and the profiler between SIGUSR1 and SIGUSR2."""

    def __init__(self, out: str, mode: str) -> None:
        self.out = out
        self.mode = mode
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()
        self.profile: cProfile.Profile | None = None
        self.cpu0 = 0.0
        self.times0 = os.times()
        self.t0 = 0.0
        self.open = False
        self.gc_s = [0.0, 0.0, 0.0]  # the collector's time by generation, in the window
        self.gc_n = [0, 0, 0]
        self._gc_at = 0.0

    def collecting(self, phase: str, info: dict[str, int]) -> None:
        """gc.callbacks: time each collection (cProfile charges it to whatever
        allocated last)."""
        if phase == "start":
            self._gc_at = time.perf_counter()
        elif self.open:
            self.gc_s[info["generation"]] += time.perf_counter() - self._gc_at
            self.gc_n[info["generation"]] += 1

    def start(self, _sig: int, _frame: FrameType | None) -> None:
        self.sent.clear()
        self.received.clear()
        self.gc_s, self.gc_n = [0.0, 0.0, 0.0], [0, 0, 0]
        self.cpu0, self.t0, self.open = _cpu(), time.monotonic(), True
        self.times0 = os.times()
        if self.mode == "cprofile":
            self.profile = cProfile.Profile(time.thread_time)  # CPU, not wall
            self.profile.enable()

    def stop(self, _sig: int, _frame: FrameType | None) -> None:
        if self.profile is not None:
            self.profile.disable()
            self.profile.dump_stats(self.out + ".prof")
            self.profile = None
        body = {
            "sent": dict(self.sent.most_common()),
            "received": dict(self.received.most_common()),
            "cpu_s": _cpu() - self.cpu0,
            "user_s": os.times().user - self.times0.user,
            "system_s": os.times().system - self.times0.system,
            "wall_s": time.monotonic() - self.t0,
            "gc_s": self.gc_s,
            "gc_collections": self.gc_n,
            "gc_objects": len(gc.get_objects()),
        }
        self.open = False
        with open(self.out + ".part", "w") as f:
            json.dump(body, f, indent=1)
        os.replace(self.out + ".part", self.out + ".json")  # whole when the bench sees it


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _count(window: Window) -> None:
    """Count every message the process's NATS clients send and receive."""
    from nats.aio.client import Client

    publish = Client.publish
    process = Client._process_msg

    async def counted_publish(self: Client, subject: str, *args: Any, **kwargs: Any) -> None:
        if window.open:
            window.sent[kind(subject)] += 1
        await publish(self, subject, *args, **kwargs)

    async def counted_process(
        self: Client, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        if window.open:
            window.received[kind(subject.decode())] += 1
        await process(self, sid, subject, reply, data, headers)

    Client.publish = counted_publish  # type: ignore[method-assign]  # a bench probe
    Client._process_msg = counted_process  # type: ignore[method-assign]  # a bench probe


def main() -> None:
    out, mode, module, *args = sys.argv[1:]
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # bench/ is not the process's: its modules would shadow none
    window = Window(out, mode)
    _count(window)
    gc.callbacks.append(window.collecting)
    signal.signal(signal.SIGUSR1, window.start)
    signal.signal(signal.SIGUSR2, window.stop)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
