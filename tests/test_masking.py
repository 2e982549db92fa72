"""Secret masking: no secret value leaves the executor in any form Terraform or a shell
prints it in (raw, JSON-escaped by Go or Python, Go-quoted, HCL-quoted, line by line),
in logs, step errors, run errors, plan changes, events, objects or the read model.

The canary values hold every character an encoder treats specially (`<>&"\\`, a quote,
non-ASCII, U+2028, `${`, a tab) and a line break; each line carries a random core that
no encoding changes, so a core found anywhere is a leak, whatever the encoding."""

from __future__ import annotations

import json
import secrets
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from events.policies import PolicyResult
from events.run import FailRun, FinishPlan, FinishStep, PlanSummary, ReportResource
from events.values import AttributeChange, ResourceChange
from executor import process
from executor.output import Masker, masked_command
from executor.process import StepLog
from tests.builders import api_workspace
from tests.canary_support import assert_no_file_holds, assert_no_stream_holds, tricky_canary
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.state_support import current_state

V1 = "/api/v1/orgs/acme"


canary = tricky_canary


def _clean(masked: str, cores: list[str]) -> bool:
    return not any(core in masked for core in cores)


# ---------------------------------------------------------------- the forms, one by one


def _terraform_prints(value: str) -> list[str]:
    """What Terraform 1.0.3 printed for `value` (copied from its output by hand, not
    computed by runplane's code): its `-json` UI (Go's HTML-safe JSON), a diagnostic's
    `%q` both decoded and inside `-json`, its plain UI's heredoc lines."""
    line1, line2 = value.split("\n")
    go_json_1 = line1.replace("\\", "\\\\").replace('"', '\\"')
    go_json_1 = go_json_1.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    go_json_1 = go_json_1.replace("\u2028", "\\u2028")
    go_json_2 = line2.replace("\t", "\\t")
    quoted = (
        line1.replace("\\", "\\\\").replace('"', '\\"').replace("\u2028", "\\u2028")
        + "\\n"
        + line2.replace("\t", "\\t")
    )
    quoted_in_json = quoted.replace("\\", "\\\\").replace('"', '\\"')
    quoted_in_json = quoted_in_json.replace("<", "\\u003c").replace(">", "\\u003e")
    quoted_in_json = quoted_in_json.replace("&", "\\u0026")
    return [
        f'{{"@message":"null_resource.t: (local-exec): {go_json_1}","type":"x"}}',
        f'{{"@message":"null_resource.t: (local-exec): {go_json_2}","type":"x"}}',
        f'{{"outputs":{{"o":{{"value":"{go_json_1}\\n{go_json_2}"}}}}}}',
        f'Invalid value for "v" parameter: cannot convert "{quoted}" to number;',
        f'"detail":"cannot convert \\"{quoted_in_json}\\" to number"',
        f'  var.s is "{quoted}"',
        f"            {line1}",  # `terraform show`: a heredoc, indented
        f"            {line2}",
        f"TF_VAR_s={line1}",  # printenv
        line2,
    ]


def test_every_form_terraform_and_a_shell_print_is_masked() -> None:
    value, cores = canary()
    mask = Masker([value])
    for printed in _terraform_prints(value):
        assert not _clean(printed, cores), "the sample holds the secret"
        assert _clean(mask(printed), cores), printed


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_python_json_of_the_value_and_of_each_line_is_masked(ensure_ascii: bool) -> None:
    value, cores = canary()
    mask = Masker([value])
    samples = [json.dumps({"v": value}, ensure_ascii=ensure_ascii)]
    samples += [json.dumps(line, ensure_ascii=ensure_ascii) for line in value.split("\n")]
    for sample in samples:
        assert _clean(mask(sample), cores), sample


def test_hcl_quoting_of_the_plain_ui_is_masked() -> None:
    """HCL escapes `${` and `%{` by doubling their first character."""
    value, cores = canary()
    line2 = value.split("\n")[1].strip()
    hcl = line2.replace("${", "$${").replace("%{", "%%{").replace("\t", "\\t")
    assert _clean(Masker([value])(f'  "v" = "{hcl}"'), cores)


def test_a_short_line_of_a_multi_line_secret_is_hidden_only_as_a_whole_line() -> None:
    value = "first-line-of-the-key\nab1\nlast-line-of-the-key"
    mask = Masker([value])
    assert mask("ab1\n") == "***\n", "alone on its line (echo, printenv, cat)"
    assert mask("null_resource.t: (local-exec): ab1") == "null_resource.t: (local-exec): ***"
    assert mask("grab1 tab1") == "grab1 tab1", "a common fragment elsewhere is left alone"


def test_masking_keeps_text_without_secrets_as_it_is() -> None:
    value, _ = canary()
    text = 'null_resource.t: Creating... {"a":"\\u003c"} $${x}\n'
    assert Masker([value])(text) == text


def test_policy_masker_adds_values_and_leaves_the_jobs_masker_alone() -> None:
    value, cores = canary()
    job_mask = Masker(["hunter2hunter2"])
    policy_mask = job_mask.with_values([value])
    assert _clean(policy_mask(json.dumps(value)), cores)
    assert policy_mask("hunter2hunter2") == "***"
    assert job_mask.secrets == ["hunter2hunter2"]


# ---------------------------------------------------------------- reports


def test_reports_leave_the_executor_with_their_free_text_masked() -> None:
    """The last pass over a report: messages, errors, plan changes and policy messages
    are masked; ids, addresses and digests are not touched."""
    value, cores = canary()
    mask = Masker([value, "deadbeef"])
    shown = {"v": value, value: [value]}
    plan = FinishPlan(
        actor="executor:e",
        lease_id="l1",
        commit="c0ffee",
        has_changes=True,
        summary=PlanSummary(add=1),
        plan_object="plans/r1",
        plan_digest="deadbeef00",
        commit_message=f"oops {value}",
        changes=[
            ResourceChange(
                address="null_resource.t",
                type="null_resource",
                action="create",
                attributes=[AttributeChange(name="triggers", after=shown)],
            )
        ],
        policies=[
            PolicyResult(
                name="p", enforcement="advisory", scope="org", passed=False, messages=[value]
            )
        ],
    )
    masked = masked_command(mask, plan)
    assert isinstance(masked, FinishPlan)
    assert masked.plan_digest == "deadbeef00", "a digest is never masked"
    assert _clean(json.dumps([masked.commit_message, masked.policies[0].messages]), cores)
    assert masked.changes[0].attributes[0].after == {"v": "***", "***": ["***"]}
    assert masked.changes[0].address == "null_resource.t"
    fail = masked_command(mask, FailRun(actor="a", lease_id="l1", reason="x", message=value))
    assert isinstance(fail, FailRun) and fail.message == "***" and fail.reason == "x"
    now = datetime.now(UTC)
    step = FinishStep(actor="a", lease_id="l1", step="plan", ok=False, started_at=now, error=value)
    assert masked_command(mask, step).error == "***"  # type: ignore[union-attr]
    report = ReportResource(
        actor="a", lease_id="l1", address="x", action="create", state="failed", error=value
    )
    assert masked_command(mask, report).error == "***"  # type: ignore[union-attr]


# ---------------------------------------------------------------- the pipe


async def test_a_line_over_the_limit_is_left_out_whole_not_cut_in_two(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line longer than the reader's limit: nothing of it reaches the log (its tail
    would start in the middle of a secret, masked in neither half), the lines after it
    do, and the command's exit code is its own."""
    monkeypatch.setattr(process, "_LINE_LIMIT", 1024)
    secret = f"tail-{secrets.token_hex(6)}"
    script = (
        "import sys; w = sys.stdout.write; w('before\\n'); "
        f"w('x' * 5000 + {secret!r} * 20000 + '\\n'); w('after\\n'); sys.exit(3)"
    )
    step_log = StepLog(tmp_path / "s.log", Masker([secret]))
    code = await process.run(
        [sys.executable, "-c", script], cwd=tmp_path, env={}, step_log=step_log
    )
    step_log.close()
    assert code == 3
    lines = (tmp_path / "s.log").read_text().splitlines()
    assert lines[0] == "before" and lines[-1] == "after", lines[:3]
    assert len(lines) == 3 and "left out" in lines[1], [ln[:80] for ln in lines]


# ---------------------------------------------------------------- through the whole plane

# Nothing is declared sensitive: Terraform prints the value in clear everywhere it can.
LEAKY_TF = r"""
variable "s" { type = string }
resource "null_resource" "t" {
  triggers = { v = var.s }
  provisioner "local-exec" {
    command     = "printf '%s\\n' \"$S\""
    environment = { S = var.s }
  }
}
output "o" { value = var.s }
"""
# The plan fails with a diagnostic quoting the value (`cannot convert "..." to number`).
BROKEN_TF = """
variable "s" { type = string }
output "bad" { value = tonumber(var.s) }
"""
PRINTENV = {
    "steps": [
        {
            "number": 50,
            "kind": "custom",
            "name": "env",
            "command": 'printenv; printenv | grep -A1 "^TF_VAR_s="; echo "$TF_VAR_s" >&2; exit 4',
        }
    ]
}
RUN_PATHS = ("", "/events", "/steps", "/changes", "/resources", "/logs")


async def _workspace(plane: Plane, root: Path, name: str, tf: str, value: str) -> None:
    repo = root / f"repo-{name}"
    repo.mkdir()
    from tests.executor_support import git

    git(repo, "init", "-q", "-b", "main")
    commit(repo, {"main.tf": tf})
    await api_workspace(plane.http, repo, name, secret_variables={"s": value})


async def _get(plane: Plane, path: str) -> Any:
    seq = await plane.app.store.last_seq()
    a = await plane.http.get(path, headers={"RP-Min-Seq": str(seq)})
    assert a.status == 200, (path, a.body)
    return a.body


async def _answers(plane: Plane, runs: dict[str, str]) -> list[tuple[str, Any]]:
    """Every API answer about the runs (logs of every phase too) and their workspaces."""
    paths = [f"{V1}/runs", f"{V1}/workspaces", f"{V1}/runs?limit=100"]
    for run_id, ws in runs.items():
        paths += [f"{V1}/runs/{run_id}{p}" for p in RUN_PATHS]
        paths += [f"{V1}/runs/{run_id}/logs?phase={p}" for p in ("plan", "apply", "custom-50")]
        paths += [f"{V1}/workspaces/{ws}{p}" for p in ("", "/runs", "/state-versions")]
    return [(path, await _get(plane, path)) for path in sorted(set(paths))]


def _log_texts(answers: list[tuple[str, Any]], run_id: str, phase: str) -> list[str]:
    path = f"{V1}/runs/{run_id}/logs?phase={phase}"
    return [i["text"] for body in (b for p, b in answers if p == path) for i in body["items"]]


@pytest.mark.terraform
async def test_canaries_through_terraform_and_a_custom_step_are_found_nowhere(
    plane: Plane, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A two-line secret with `<>&"\\`, unicode and `${` is printed by a provisioner,
    shown in a plan's changes and an output, quoted in a plan's error, and printed by a
    custom step's `printenv`: afterwards neither line's core is in any stream message,
    file, API answer (logs of every phase included) or log line of this process; the
    masks are where the value was."""
    value, cores = canary()
    for name, tf in (("leaky", LEAKY_TF), ("broken", BROKEN_TF), ("custom", LEAKY_TF)):
        await _workspace(plane, tmp_path, name, tf, value)
    put = await plane.http.call("PUT", f"{V1}/templates/printenv", json=PRINTENV)
    assert put.status == 201, put.body
    await plane.executor("ex1")
    runs: dict[str, str] = {}

    applied = await plane.start("leaky")
    runs[applied] = "leaky"
    await plane.reaches("leaky", applied, "awaiting_approval")
    await plane.approve(applied)
    await plane.reaches("leaky", applied, "applied")
    state = await current_state(plane.nc, plane.keyring, "acme", "leaky")
    assert state is not None and state["outputs"]["o"]["value"] == value, "positive control"

    broken = await plane.start("broken", "plan")
    runs[broken] = "broken"
    failed = await plane.reaches("broken", broken, "failed")
    assert 'cannot convert "***" to number' in failed.error_message, failed.error_message

    created = await plane.http.post(
        f"{V1}/workspaces/custom/runs", json={"type": "apply", "template": "printenv"}
    )
    assert created.status == 201, created.body
    custom = str(created.body["id"])
    runs[custom] = "custom"
    stopped = await plane.reaches("custom", custom, "failed")
    assert "exited with code 4" in stopped.error_message
    assert "TF_VAR_s=***" in stopped.error_message, stopped.error_message

    needles = [c.encode() for c in cores]
    scanned = await assert_no_stream_holds(plane.nc.jetstream(), needles)
    assert scanned["RP_EVENTS"] and scanned["RP_LOGS"], scanned
    assert_no_file_holds(tmp_path, needles)
    answers = await _answers(plane, runs)
    for path, body in answers:
        raw = json.dumps(body, ensure_ascii=False)
        assert _clean(raw, cores), f"GET {path} holds the secret"
    out = capfd.readouterr()
    assert _clean(out.out + out.err, cores), "a log line of this process holds the secret"

    # Where the value was, the masks are (the tools did print it).
    changes = next(b for p, b in answers if p == f"{V1}/runs/{applied}/changes")
    assert "***" in json.dumps(changes), changes
    apply_log = _log_texts(answers, applied, "apply")
    assert sum("(local-exec): ***" in t for t in apply_log) == 2, apply_log
    custom_log = _log_texts(answers, custom, "custom-50")
    assert custom_log.count("TF_VAR_s=***") == 2 and custom_log.count("***") == 4, custom_log
