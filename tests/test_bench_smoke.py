"""The benchmark suite runs end to end at tiny sizes and reports every figure, so it
cannot rot unnoticed (bench/README.md; the real figures come from `./dev bench`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ("append", "replay", "lifecycle", "latency", "admission", "reads")


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


@pytest.mark.slow  # ~30 s: run with the benchmarks
def test_the_benchmarks_run_and_report_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "smoke" and doc["machine"]["cpus"]
    raw = doc["raw"]
    for figure in (
        raw["sync_publish"]["msgs_per_s"],
        raw["sync_publish"]["p50_ms"],
        raw["sync_publish"]["p99_ms"],
        raw["pipelined_publish"]["msgs_per_s"],
        raw["pipelined_atomic_batches"]["batches_per_s"],
        doc["benchmarks"]["replay"]["raw_push_replay"]["msgs_per_s"],
    ):
        assert _number(figure) and figure > 0
    figs = doc["benchmarks"]
    assert set(BENCHMARKS) <= set(figs)
    for name in BENCHMARKS:
        assert "error" not in figs[name], (name, figs[name])
    assert _number(figs["append"]["events_per_s"])
    assert _number(figs["replay"]["events_per_s"])
    assert figs["replay"]["applied"] == figs["replay"]["events_in_stream"]
    assert figs["lifecycle"]["all_terminal"] and _number(figs["lifecycle"]["events_per_s"])
    assert figs["latency"]["all_queued"] and _number(figs["latency"]["p99_ms"])
    for at in figs["admission"]["by_workspaces"].values():
        assert at["all_admitted"] and _number(at["admitted_per_s"]) and at["rss_mb"] > 0
    assert _number(figs["reads"]["p99_ms"]) and figs["reads"]["statuses"] == {
        "200": figs["reads"]["requests"]
    }
    rows = {row["name"]: row for row in doc["table"]}
    assert len(rows) >= 10 and all("passed" in row for row in rows.values())
    assert "benchmark" in proc.stdout and ("PASS" in proc.stdout or "FAIL" in proc.stdout)
