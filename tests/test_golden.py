"""Golden histories: recorded runs of every run type and ending replay to the state and
read-model rows they had when recorded, so no change to the core re-statuses an old run.

`tests/golden/<name>.jsonl` holds a run's events as stored; `<name>.expected.json` what
the code of the day folded from them (tests/golden_record.py wrote both). Events change
only by adding (STYLE.md 6), so the comparison lets a later field or column appear but
never lets a recorded one change or vanish.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from events import run as R
from tests.golden_record import GOLDEN, SCENARIOS, replay

NAMES = sorted(p.name.removesuffix(".jsonl") for p in GOLDEN.glob("*.jsonl"))


def _load(name: str) -> tuple[list[bytes], dict[str, Any]]:
    lines = (GOLDEN / f"{name}.jsonl").read_bytes().splitlines()
    expected = msgspec.json.decode((GOLDEN / f"{name}.expected.json").read_bytes())
    return lines, expected


def differences(recorded: Any, actual: Any, at: str = "") -> list[str]:
    """Where `actual` does not keep what was recorded: a changed value, a missing key or a
    list of another length. Keys only `actual` has are additions, and fine."""
    if isinstance(recorded, dict):
        if not isinstance(actual, dict):
            return [f"{at}: {actual!r} is no longer an object"]
        out = []
        for key, value in recorded.items():
            if key not in actual:
                out.append(f"{at}.{key}: gone")
            else:
                out.extend(differences(value, actual[key], f"{at}.{key}"))
        return out
    if isinstance(recorded, list):
        if not isinstance(actual, list) or len(actual) != len(recorded):
            return [f"{at}: {actual!r} != recorded {recorded!r}"]
        return [
            d
            for i, (r, a) in enumerate(zip(recorded, actual, strict=True))
            for d in differences(r, a, f"{at}[{i}]")
        ]
    return [] if recorded == actual else [f"{at}: {actual!r} != recorded {recorded!r}"]


@pytest.mark.parametrize("name", NAMES)
def test_a_recorded_run_replays_to_the_state_and_rows_it_had(name: str) -> None:
    """The state after every event, the final RunState and every read-model row (runs,
    steps, changes, resource states, state versions, audit) are as recorded."""
    lines, expected = _load(name)
    actual = replay(lines, expected["run_id"])
    problems = differences(expected, {"run_id": expected["run_id"], **actual})
    assert not problems, "\n".join(problems[:20])


def test_the_goldens_cover_every_run_type_and_every_ending() -> None:
    """plan, apply, destroy and drift; every terminal status; failures for several
    reasons; a custom step, a policy step, an approval timeout."""
    finals = [_load(n)[1]["state"] for n in NAMES]
    assert {s["run_type"] for s in finals} == set(R.RUN_TYPES)
    assert {s["status"] for s in finals} == {str(s) for s in R.TERMINAL}
    reasons = {s["reason"] for s in finals if s["status"] == "failed"}
    assert {"policy_failed", "executor_unavailable", "step_failed", "run_timeout"} <= reasons
    assert any(s["template"] for s in finals)
    assert "approval_timeout" in {s["reason"] for s in finals if s["status"] == "discarded"}
    assert set(SCENARIOS) <= set(NAMES), "a scenario without its recording"


def test_differences_catch_a_changed_or_missing_value_and_allow_an_added_one() -> None:
    """The comparison itself can fail: a re-status, a lost column, a shorter trail."""
    recorded = {"state": {"status": "applied", "step_at": 4}, "trail": [1, 2]}
    assert (
        differences(
            recorded, {"state": {"status": "applied", "step_at": 4, "new": 1}, "trail": [1, 2]}
        )
        == []
    )
    assert differences(recorded, {"state": {"status": "failed", "step_at": 4}, "trail": [1, 2]})
    assert differences(recorded, {"state": {"status": "applied"}, "trail": [1, 2]})
    assert differences(recorded, {"state": {"status": "applied", "step_at": 4}, "trail": [1]})


def test_goldens_are_stored_bytes_that_still_decode(tmp_path: Path) -> None:
    """Each line is one stored event of the run's own subject type (a run event)."""
    for name in NAMES:
        lines, _ = _load(name)
        assert lines and all(line.startswith(b'{"type":"run.') for line in lines), name
