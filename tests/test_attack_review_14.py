"""Attack review of issue 14 / 15 (run causes, VCS, run triggers, rerun, TFE): each test
is an attack by a hostile organization that worked on the tree before its fix."""

from __future__ import annotations

import subprocess
import sys
import time

from services.vcs import matching

# ---------------------------------------------------------------- trigger globs


def test_a_tenants_trigger_glob_cannot_hold_the_api_on_one_path() -> None:
    """Org A's admin saves trigger_paths ["**a**a**a**a**a**a**a**a**b"] (27 characters,
    within the body's 256) and signs a push naming one path of 300 "a"s: a
    backtracking regex took hours on it inside the API's event loop, every
    organization's requests waiting. Matched in a child process, so the old code fails
    this test at its deadline instead of hanging it."""
    code = (
        "from services.vcs import matching;"
        "print(matching.glob_match('**a' * 8 + '**b', 'a' * 300),"
        " matching.glob_match('**a' * 80 + 'b', 'a' * 4096))"
    )
    started = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("matching one glob against one path took over 10 s") from None
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    assert time.monotonic() - started < 10


def test_trigger_globs_keep_their_meaning() -> None:
    cases = [
        ("**/", "", True),
        ("**/a", "a", True),
        ("**/a", "x/y/a", True),
        ("**/a", "ba", False),
        ("a/**", "a/b/c", True),
        ("a**b", "a/x/b", True),
        ("a*b", "a/b", False),
        ("?**/", ".", True),
        ("[]]x", "]x", True),
        ("[]", "[]", True),  # no class: was a ValueError out of the webhook
        ("[z-a]", "[z-a]", True),  # no class: was a re.error out of the webhook
        ("**a" * 8 + "**", "a" * 8, True),
    ]
    for pattern, path, hit in cases:
        assert matching.glob_match(pattern, path) is hit, (pattern, path)
