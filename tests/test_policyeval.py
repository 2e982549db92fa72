"""infra/policy/evaluate.py on its own: compiling Rego with regopy, and each set's verdict on
a plan's JSON, in this process (what the policy sandbox's child runs), and the same
answers through the sandbox (infra/policy/sandbox.py). No NATS, no Terraform."""

from __future__ import annotations

import time
from typing import Any

import pytest

from events.errors import Invalid
from events.policies import PolicySet
from executor.policy import sensitive_strings
from infra.policy.evaluate import InvalidPolicy, compile_check, evaluate, package_of
from infra.policy.sandbox import PolicySandbox

NO_DELETES = """package terraform.deletes
import rego.v1

deny contains msg if {
  some rc in input.resource_changes
  "delete" in rc.change.actions
  msg := sprintf("%s would be deleted", [rc.address])
}
"""
# The Rego v0 form: a partial set written `deny[msg] { ... }`.
V0 = """package v0
deny[msg] {
  rc := input.resource_changes[_]
  rc.change.actions[_] == "create"
  msg := sprintf("%s is new", [rc.address])
}
"""


def _plan(*changes: tuple[str, list[str]]) -> dict[str, Any]:
    return {
        "format_version": "0.2",
        "resource_changes": [
            {"address": address, "type": "null_resource", "change": {"actions": actions}}
            for address, actions in changes
        ],
    }


def _set(source: str, name: str = "p", enforcement: str = "advisory") -> PolicySet:
    return PolicySet(name=name, enforcement=enforcement, source=source)


def test_a_policy_that_compiles_is_accepted_and_its_package_is_read() -> None:
    compile_check("no-deletes", NO_DELETES)
    compile_check("v0", V0)
    assert package_of(NO_DELETES) == "terraform.deletes"
    assert package_of("# package not.this\npackage a.b_c  # trailing\n") == "a.b_c"


def test_a_syntax_error_is_refused_with_the_compilers_message_and_position() -> None:
    source = "package broken\ndeny contains msg if {\n  msg := \n"
    with pytest.raises(InvalidPolicy) as caught:
        compile_check("broken", source)
    message = str(caught.value)
    assert message.startswith("the policy does not compile: ")
    assert "broken.rego:2:22: this is unclosed" in message
    assert isinstance(caught.value, Invalid) and caught.value.code == "invalid-policy"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("deny contains m if { m := 1 }\n", "no `package`"),
        ("package p\nallow := true\n", "no `deny` rule"),
        ("package p\ndeny contains m if { m := nosuchfn(1) }\n", "Function not found: nosuchfn"),
        ("package p\ndeny := 1\ndeny := 2\n", "must not produce multiple outputs"),
    ],
)
def test_a_policy_without_package_or_deny_or_that_fails_at_once_is_refused(
    source: str, expected: str
) -> None:
    with pytest.raises(InvalidPolicy, match=expected):
        compile_check("p", source)


def test_deny_messages_fail_a_set_and_an_empty_deny_passes_it() -> None:
    plan = _plan(("null_resource.a", ["delete"]), ("null_resource.b", ["create"]))
    sets = [
        _set(NO_DELETES, "no-deletes", "hard-mandatory"),
        _set(V0, "v0", "soft-mandatory"),
        _set("package quiet\ndeny contains m if { input.nothing; m := 1 }\n", "quiet"),
    ]
    results = evaluate(sets, plan)
    assert [(r.name, r.enforcement, r.scope, r.passed, r.messages) for r in results] == [
        ("no-deletes", "hard-mandatory", "org", False, ["null_resource.a would be deleted"]),
        ("v0", "soft-mandatory", "org", False, ["null_resource.b is new"]),
        ("quiet", "advisory", "org", True, []),
    ]
    assert all(r.passed for r in evaluate(sets[:1], _plan(("null_resource.b", ["create"]))))
    assert evaluate([], plan) == []


def test_a_boolean_or_string_deny_and_non_string_messages() -> None:
    plan = _plan(("null_resource.a", ["create"]))
    results = evaluate(
        [
            _set("package b\ndeny if { count(input.resource_changes) > 0 }\n", "boolean"),
            _set('package s\ndeny := "too many"\n', "string"),
            _set("package n\ndeny contains n if { n := count(input.resource_changes) }\n", "n"),
            _set("package f\ndefault deny := false\n", "false"),
        ],
        plan,
    )
    assert [(r.passed, r.messages) for r in results] == [
        (False, ["denied"]),
        (False, ["too many"]),
        (False, ["1"]),
        (True, []),
    ]


def test_an_evaluation_error_is_a_failure_that_says_so() -> None:
    source = "package e\ndeny contains m if { input.resource_changes; m := nosuch(1) }\n"
    compile_check("e", source)  # nothing fails on an empty plan
    [result] = evaluate([_set(source, "e", "hard-mandatory")], _plan(("x.a", ["create"])))
    assert not result.passed
    assert result.messages == [
        "policy error: evaluating the policy failed: Function not found: nosuch (wellformed_error)"
    ]


def test_each_set_has_its_own_interpreter() -> None:
    """Two sets declaring the same package do not merge their rules."""
    one = _set('package same\ndeny contains "one" if { true }\n', "one")
    two = _set('package same\ndeny contains "two" if { true }\n', "two")
    assert [r.messages for r in evaluate([one, two], {})] == [["one"], ["two"]]


def test_messages_are_bounded() -> None:
    source = 'package many\ndeny contains m if { some i in numbers.range(1, 80); m := sprintf("%d %s", [i, concat("", array.concat(["x"], [y | some _ in numbers.range(1, 1500); y := "x"]))]) }\n'  # noqa: E501
    [result] = evaluate([_set(source)], {})
    assert len(result.messages) == 51 and result.messages[-1] == "... and 30 more"
    assert all(len(m) <= 1000 for m in result.messages)


def test_an_integer_too_large_for_regopy_still_evaluates() -> None:
    plan = {"big": 2**70, "resource_changes": []}
    [result] = evaluate([_set('package big\ndeny contains "big" if { input.big > 1 }\n')], plan)
    assert result.messages == ["big"]


def test_sensitive_values_of_a_plan_are_found_for_masking() -> None:
    show = {
        "resource_changes": [
            {
                "change": {
                    "before": None,
                    "after": {"password": "hunter2-secret", "name": "visible", "n": ["abcd1"]},
                    "after_sensitive": {"password": True, "n": [True]},
                    "before_sensitive": False,
                }
            }
        ],
        "output_changes": {"token": {"after": "tok-12345", "after_sensitive": True}},
    }
    assert sorted(sensitive_strings(show)) == ["abcd1", "hunter2-secret", "tok-12345"]


async def test_the_sandbox_answers_what_the_evaluator_answers() -> None:
    """The same verdicts through the child (an integer past 64 bits included), and the
    same refusal of a source that does not compile."""
    plan = {**_plan(("null_resource.a", ["delete"]), ("null_resource.b", ["create"])), "n": 2**70}
    sets = [
        _set(NO_DELETES, "no-deletes", "hard-mandatory"),
        _set(V0, "v0", "soft-mandatory"),
        _set('package big\ndeny contains "big" if { input.n > 1 }\n', "big"),
        _set("package e\ndeny contains m if { input.n; m := nosuch(1) }\n", "e"),
    ]
    sandbox = PolicySandbox()
    assert await sandbox.evaluate(sets, plan) == evaluate(sets, plan)
    assert await sandbox.evaluate([], plan) == []
    source = "package broken\ndeny contains msg if {\n  msg := \n"
    with pytest.raises(InvalidPolicy) as in_process:
        compile_check("broken", source)
    with pytest.raises(InvalidPolicy) as sandboxed:
        await sandbox.compile_check("broken", source)
    assert str(sandboxed.value) == str(in_process.value)
    await sandbox.compile_check("v0", V0)


def test_evaluation_time_on_a_realistic_plan() -> None:
    """Three sets on a 200-resource plan: well under a second (measured about 0.1 s; the
    sandbox adds about 0.1 s, one child for all three)."""
    changes = [
        {
            "address": f"null_resource.r[{i}]",
            "type": "null_resource",
            "change": {
                "actions": ["delete"] if i % 50 == 0 else ["create"],
                "before": None,
                "after": {"triggers": {"v": str(i), "tags": {"env": "prod"}}},
                "after_unknown": {"id": True},
            },
        }
        for i in range(200)
    ]
    plan = {"format_version": "0.2", "resource_changes": changes}
    tags = (
        "package tags\nimport rego.v1\ndeny contains m if {\n  some rc in input.resource_changes\n"
        '  rc.change.after.triggers.tags.env != "prod"\n  m := rc.address\n}\n'
    )
    sets = [_set(NO_DELETES, "a"), _set(V0, "b"), _set(tags, "c")]
    started = time.perf_counter()
    results = evaluate(sets, plan)
    took = time.perf_counter() - started
    assert [len(r.messages) for r in results] == [4, 51, 0]
    assert took < 5, took
