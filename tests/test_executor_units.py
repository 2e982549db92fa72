"""The executor's pure pieces: output parsing, masking, Terraform arguments and config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from events.run import PlanSummary
from executor import terraform as tf
from executor.errors import SetupError
from executor.output import Masker, Output, drift_summary
from executor.worker import parse_dispatch

DIAGNOSTIC = {
    "@level": "error",
    "@message": "Error: Reference to undeclared input variable",
    "type": "diagnostic",
    "diagnostic": {
        "severity": "error",
        "summary": "Reference to undeclared input variable",
        "detail": 'An input variable with the name "missing" has not been declared.',
        "range": {"filename": "main.tf", "start": {"line": 2}},
        "snippet": {"code": "  triggers = { n = var.missing }"},
    },
}


def test_json_diagnostics_become_the_error_text() -> None:
    """Error diagnostics are rendered like Terraform's own text: summary, where, detail."""
    out = Output()
    out.feed('{"@level":"info","@message":"Terraform 1.0.3","type":"version"}\n')
    out.feed(json.dumps(DIAGNOSTIC) + "\n")
    assert out.error_text() == (
        "Error: Reference to undeclared input variable\n"
        "  on main.tf line 2: triggers = { n = var.missing }\n"
        'An input variable with the name "missing" has not been declared.'
    )


def test_warnings_are_not_errors() -> None:
    """A warning diagnostic does not make the error text; the readable tail does."""
    out = Output()
    out.feed(json.dumps({**DIAGNOSTIC, "@level": "warn", "@message": "Warning: x"}))
    assert out.diagnostics == []
    assert out.error_text() == "Warning: x"


def test_text_output_error_starts_at_the_first_error_line() -> None:
    """Without -json (init), the error text is everything from the first `Error:` line."""
    out = Output()
    for line in ["Initializing...", "", "Error: Failed to query", "  detail here"]:
        out.feed(line + "\n")
    assert out.error_text() == "Error: Failed to query\n  detail here"


def test_change_summary_maps_remove_to_destroy() -> None:
    out = Output()
    out.feed('{"type":"change_summary","changes":{"add":2,"change":1,"remove":3}}')
    assert out.summary() == PlanSummary(add=2, change=1, destroy=3)
    assert Output().summary() == PlanSummary()


def test_error_text_is_bounded() -> None:
    """A huge error does not make a huge event."""
    out = Output()
    out.feed(json.dumps({**DIAGNOSTIC, "diagnostic": {"summary": "x", "detail": "y" * 100_000}}))
    assert len(out.error_text()) <= 8000


def test_masker_hides_url_credentials_and_secrets() -> None:
    mask = Masker(["hunter2"])
    line = "fatal: https://bob:tok3n@git.example.com/r.git failed, pw hunter2"
    assert mask(line) == "fatal: https://***@git.example.com/r.git failed, pw ***"


def test_drift_summary_counts_resource_drift_by_action() -> None:
    show = {
        "resource_drift": [
            {"change": {"actions": ["update"]}},
            {"change": {"actions": ["delete"]}},
        ]
    }
    assert drift_summary(show) == PlanSummary(change=1, destroy=1)
    assert drift_summary({}) == PlanSummary()


@pytest.mark.parametrize(
    ("run_type", "flag"),
    [("plan", None), ("apply", None), ("destroy", "-destroy"), ("drift", "-refresh-only")],
)
def test_plan_flags_follow_the_run_type(run_type: str, flag: str | None) -> None:
    args = tf.plan_args(run_type)
    assert args[:5] == ["plan", "-input=false", "-no-color", "-out=plan.tfplan", "-json"]
    assert args[-1] == "-var-file=runplane.auto.tfvars.json"  # variables never on argv
    modes = {"-destroy", "-refresh-only"} & set(args)
    assert modes == ({flag} if flag else set())


def test_cli_config_has_a_mirror_per_dir_and_no_registry(tmp_path: Path) -> None:
    text = tf.cli_config_text([tmp_path / "a", Path('/x/"q"')])
    assert text.count("filesystem_mirror {") == 2
    assert json.dumps(str(tmp_path / "a")) in text
    assert 'path    = "/x/\\"q\\""' in text
    assert 'direct {\n    exclude = ["registry.terraform.io/*/*"]' in text


def test_prepare_builds_the_mirror_and_env(tmp_path: Path) -> None:
    """The bundled null provider is linked in the registry layout; env points at the config."""
    ready = tf.prepare(tf.TerraformConfig(provider_mirrors=[tmp_path / "m"]), tmp_path / "d")
    link = (
        tmp_path
        / "d"
        / "providers"
        / "registry.terraform.io"
        / "hashicorp"
        / "null"
        / "2.1.2"
        / "linux_amd64"
        / tf.NULL_PROVIDER_FILE
    )
    assert link.resolve() == tf.bundled_null_provider().resolve()
    env = ready.env()
    assert env["TF_CLI_CONFIG_FILE"] == str(ready.cli_config)
    assert (env["TF_IN_AUTOMATION"], env["TF_INPUT"], env["CHECKPOINT_DISABLE"]) == ("1", "0", "1")
    assert ready.cli_config.read_text().count("filesystem_mirror") == 2


def test_prepare_refuses_a_missing_binary(tmp_path: Path) -> None:
    with pytest.raises(SetupError, match="missing or not executable"):
        tf.prepare(tf.TerraformConfig(binary=tmp_path / "nope"), tmp_path)


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'{"org":"a","workspace":"b","run_id":"c"}',
        b'{"org":"A.B","workspace":"b","run_id":"c","phase":"plan"}',
        b'{"org":"a","workspace":"b","run_id":"c","phase":"destroy"}',
    ],
)
def test_malformed_dispatch_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_dispatch(body)


def test_dispatch_tolerates_new_fields() -> None:
    """A newer scheduler may add fields; an older executor still takes the work."""
    d = parse_dispatch(b'{"org":"a","workspace":"b","run_id":"c","phase":"apply","x":1}')
    assert (d.org, d.workspace, d.run_id, d.phase) == ("a", "b", "c", "apply")
