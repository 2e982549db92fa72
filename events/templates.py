"""Run templates: the numbered steps a run goes through (Terrakube style). Pure.

A template is a list of steps ordered by number (plan 100, policy 125, approval 150,
apply 200): `plan`, `policy`, `approval`, `apply`, `destroy` and `custom` (a command run
in the checked-out repository, with its own log and status). Each run type has a
built-in template; an organization defines its own (`org.template_set`), a workspace
picks a default per run type (the `templates` setting), and a run may name one. The run
records the steps it was created with, so a template changed later changes no run.

The rules a template must follow, each refused with its reason:

- numbers are whole, from 1 to 99999, and unique; steps run in number order;
- at most one `plan`, and at most one `apply` or `destroy` (not both);
- `policy`, `approval`, `apply` and `destroy` come after the plan: they act on it;
- an `apply` or `destroy` needs an `approval` between the plan and it (the
  `require_approval` setting and soft-mandatory policies decide whether it waits);
- the policy check runs with the plan, so a `policy` step directly follows it; a run of
  a template with a plan and no `policy` step gets one (`with_policy`): no template skips
  the organization's policies;
- a `custom` step has a command (one shell line, at most 4096 characters); only a
  custom step may say `always`;
- a template with a plan and no `policy` step leaves the number after its plan's free:
  the implied policy step takes it, so that no two steps a run shows share a number.

A custom step after the apply (or destroy) step runs only if that step ran: after a plan
with no changes it is skipped, as the apply is, unless it says `always` (then
`RUNPLANE_APPLIED` tells its command whether anything was applied).

Which templates suit which run type: a `plan` or `drift` run changes nothing (no
approval, apply or destroy) and a drift run needs its plan; an `apply` run may not
destroy, and a `destroy` run's changes step is `destroy`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import msgspec

from events.base import Command, Event
from events.errors import Invalid, NotFound

KINDS = ("plan", "policy", "approval", "apply", "destroy", "custom")
CHANGES = frozenset({"apply", "destroy"})
MAX_STEPS = 50
MAX_COMMAND = 4096
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class TemplateStep(msgspec.Struct, frozen=True, kw_only=True):
    number: int
    kind: str
    name: str = ""  # shown in the run; defaults to the kind
    command: str = ""  # custom steps only
    always: bool = False  # custom steps only: run even after an apply that did not run

    @property
    def label(self) -> str:
        return self.name or self.kind


class Template(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    steps: list[TemplateStep]
    builtin: bool = False

    def kinds(self) -> list[str]:
        return [s.kind for s in self.steps]


class TemplateSaved(Event, frozen=True, kw_only=True, tag="org.template_set"):
    template: Template


class TemplateDeleted(Event, frozen=True, kw_only=True, tag="org.template_deleted"):
    name: str


class SaveTemplate(Command, frozen=True, kw_only=True):
    name: str
    steps: list[TemplateStep]


class DeleteTemplate(Command, frozen=True, kw_only=True):
    name: str


def save(saved: Mapping[str, Template], cmd: SaveTemplate, now: datetime) -> list[TemplateSaved]:
    template = validate(cmd.name, cmd.steps)
    if saved.get(cmd.name) == template:
        return []
    return [TemplateSaved(at=now, actor=cmd.actor, template=template)]


def delete(
    saved: Mapping[str, Template], cmd: DeleteTemplate, now: datetime
) -> list[TemplateDeleted]:
    if cmd.name not in saved:
        raise NotFound(f"template {cmd.name} does not exist")
    return [TemplateDeleted(at=now, actor=cmd.actor, name=cmd.name)]


def applied(
    saved: Mapping[str, Template], event: TemplateSaved | TemplateDeleted
) -> dict[str, Template]:
    out = dict(saved)
    if isinstance(event, TemplateSaved):
        out[event.template.name] = event.template
    else:
        out.pop(event.name, None)
    return out


def _builtin(name: str, *kinds: tuple[int, str]) -> Template:
    return Template(
        name=name, steps=[TemplateStep(number=n, kind=k) for n, k in kinds], builtin=True
    )


BUILTIN: dict[str, Template] = {
    "plan": _builtin("plan", (100, "plan"), (125, "policy")),
    "apply": _builtin("apply", (100, "plan"), (125, "policy"), (150, "approval"), (200, "apply")),
    "destroy": _builtin(
        "destroy", (100, "plan"), (125, "policy"), (150, "approval"), (200, "destroy")
    ),
    "drift": _builtin("drift", (100, "plan"), (125, "policy")),
}


def valid_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name))


def parse_steps(raw: Any) -> list[TemplateStep]:
    """Steps from a JSON body: a list of {number, kind, name?, command?}; Invalid if not."""
    if not isinstance(raw, list) or not raw:
        raise Invalid("steps must be a non-empty list")
    if len(raw) > MAX_STEPS:
        raise Invalid(f"a template has at most {MAX_STEPS} steps")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise Invalid(f"step {i + 1} must be an object with number and kind")
        unknown = set(item) - {"number", "kind", "name", "command", "always"}
        if unknown:
            raise Invalid(f"step {i + 1} has unknown field(s): {', '.join(sorted(unknown))}")
        number, kind = item.get("number"), item.get("kind")
        name, command = item.get("name", ""), item.get("command", "")
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= 99999:
            raise Invalid(f"step {i + 1}: number must be a whole number from 1 to 99999")
        if kind not in KINDS:
            raise Invalid(f"step {number}: kind must be one of {', '.join(KINDS)}")
        if not isinstance(name, str) or len(name) > 100 or any(ord(c) < 32 for c in name):
            raise Invalid(f"step {number}: name must be a line of at most 100 characters")
        if not isinstance(command, str):
            raise Invalid(f"step {number}: command must be a string")
        always = item.get("always", False)
        if not isinstance(always, bool):
            raise Invalid(f"step {number}: always must be true or false")
        step = TemplateStep(number=number, kind=kind, name=name, command=command, always=always)
        out.append(step)
    return out


def validate(name: str, steps: Sequence[TemplateStep]) -> Template:
    """The template, its steps in number order and its policy step in place; Invalid
    saying why if it breaks a rule (see the module's docstring)."""
    if not valid_name(name):
        raise Invalid("a template name is 1-63 lowercase letters, digits and dashes")
    if name in BUILTIN:
        raise Invalid(f"{name!r} is a built-in template; pick another name")
    if not steps:
        raise Invalid("a template has at least one step")
    if len(steps) > MAX_STEPS:
        raise Invalid(f"a template has at most {MAX_STEPS} steps")
    numbers = [s.number for s in steps]
    dupes = sorted({n for n in numbers if numbers.count(n) > 1})
    if dupes:
        raise Invalid(f"step numbers must be unique; {dupes[0]} is used twice")
    ordered = sorted(steps, key=lambda s: s.number)
    for s in ordered:
        _check_step(s)
    kinds = [s.kind for s in ordered]
    for kind in ("plan", "policy", "approval"):
        if kinds.count(kind) > 1:
            raise Invalid(f"a template has at most one {kind} step")
    changes = [s for s in ordered if s.kind in CHANGES]
    if len(changes) > 1:
        raise Invalid("a template has at most one apply or destroy step")
    plan_at = kinds.index("plan") if "plan" in kinds else -1
    for i, s in enumerate(ordered):
        if s.kind in ("policy", "approval", *CHANGES) and (plan_at < 0 or i < plan_at):
            raise Invalid(f"step {s.number} ({s.kind}) must come after a plan step")
    if "policy" in kinds and kinds.index("policy") != plan_at + 1:
        raise Invalid("the policy step must directly follow the plan step: it checks the plan")
    if plan_at >= 0 and "policy" not in kinds and _policy_number(ordered, plan_at) is None:
        n = ordered[plan_at].number
        raise Invalid(
            f"the policy step every plan gets takes the number after the plan's ({n}): "
            f"leave {n + 1} free, or add a policy step"
            if n < 99999
            else "a plan numbered 99999 leaves no number for its policy step"
        )
    if changes:
        change_at = ordered.index(changes[0])
        if "approval" not in kinds[plan_at:change_at]:
            raise Invalid(
                f"step {changes[0].number} ({changes[0].kind}) needs an approval step between "
                "the plan and it (require_approval decides whether it waits)"
            )
    return Template(name=name, steps=ordered)


def with_policy(template: Template) -> Template:
    """The steps a run records: a plan with no policy step gets one right after it."""
    kinds = template.kinds()
    if "plan" not in kinds or "policy" in kinds:
        return template
    at = kinds.index("plan")
    steps = list(template.steps)
    steps.insert(at + 1, _implied_policy(steps, at))
    return msgspec.structs.replace(template, steps=steps)


def _check_step(s: TemplateStep) -> None:
    if s.kind == "custom":
        if not s.command.strip():
            raise Invalid(f"step {s.number}: a custom step needs a command")
        if len(s.command) > MAX_COMMAND or "\0" in s.command:
            raise Invalid(f"step {s.number}: command is at most {MAX_COMMAND} characters")
    elif s.command:
        raise Invalid(f"step {s.number}: only custom steps have a command")
    elif s.always:
        raise Invalid(f"step {s.number}: only custom steps say always")


def _policy_number(ordered: Sequence[TemplateStep], plan_at: int) -> int | None:
    """The number after the plan's, if no step has it: the implied policy step's."""
    n = ordered[plan_at].number + 1
    taken = plan_at + 1 < len(ordered) and ordered[plan_at + 1].number <= n
    return None if taken or n > 99999 else n


def _implied_policy(ordered: Sequence[TemplateStep], plan_at: int) -> TemplateStep:
    """The policy step a template without one gets, right after its plan, numbered the
    plan's number + 1 (steps are tracked by position; it runs with the plan). A template
    saved before that number had to be free may have no room: its policy step then
    shares the plan's number, as every run's did before."""
    number = _policy_number(ordered, plan_at) or ordered[plan_at].number
    return TemplateStep(number=number, kind="policy", name="policy (implied)")


def after_changes(steps: Sequence[TemplateStep], at: int) -> bool:
    """Whether step `at` comes after the template's apply or destroy step."""
    return any(s.kind in CHANGES for s in steps[:at])


def compatible(template: Template, run_type: str) -> str:
    """Why the template cannot serve a run of that type, or ""."""
    kinds = template.kinds()
    if run_type in ("plan", "drift"):
        bad = [k for k in kinds if k in ("approval", *CHANGES)]
        if bad:
            return f"a {run_type} run changes nothing; template {template.name} has {bad[0]}"
        if run_type == "drift" and "plan" not in kinds:
            return f"a drift run needs a plan step; template {template.name} has none"
    if run_type == "apply" and "destroy" in kinds:
        return f"template {template.name} destroys; start a destroy run with it"
    if run_type == "destroy" and "apply" in kinds:
        return f"a destroy run's changes step is destroy; template {template.name} applies"
    if run_type == "destroy" and "plan" not in kinds:
        return f"a destroy run needs a plan step; template {template.name} has none"
    return ""


def resolve(
    run_type: str,
    requested: str,
    saved: Mapping[str, Template],
    defaults: Mapping[str, str],
) -> Template:
    """The template a new run executes: the one it names, else the workspace's default
    for its run type (the `templates` setting), else the built-in; Invalid if that
    template does not exist or does not suit the run type."""
    name = requested or defaults.get(run_type, "") or run_type
    template = BUILTIN.get(name) or saved.get(name)
    if template is None:
        how = "named by the run" if requested else f"the workspace's default for {run_type} runs"
        raise Invalid(f"template {name!r} ({how}) does not exist")
    problem = compatible(template, run_type)
    if problem:
        raise Invalid(problem)
    return with_policy(template)


def phase_of(step: TemplateStep) -> str:
    """The phase an executor claims for a step: plan, apply (apply or destroy), or
    custom-<number>. Policy and approval steps are not executed by an executor."""
    if step.kind == "plan":
        return "plan"
    if step.kind in CHANGES:
        return "apply"
    if step.kind == "custom":
        return f"custom-{step.number}"
    return ""


_CUSTOM_PHASE = re.compile(r"^custom-[1-9][0-9]{0,4}$")


def valid_phase(phase: str) -> bool:
    return phase in ("plan", "apply") or bool(_CUSTOM_PHASE.fullmatch(phase))
