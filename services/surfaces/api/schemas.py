"""Schemas of the API's answers, for the OpenAPI document: written out as data.

Resources have the read model's shape (`projections.readmodel`); "not set" is null.
"""

from __future__ import annotations

from typing import Any

from events.codec import ID_RE
from events.org import ROLES
from events.run import CAUSE_KINDS, RUN_TYPES, Status
from services.surfaces.api.problems import BASE, KINDS

Doc = dict[str, Any]

REF = "#/components/schemas/{name}"


def ref(name: str) -> Doc:
    return {"$ref": REF.format(name=name)}


def _obj(required: list[str], **props: Any) -> Doc:
    return {"type": "object", "required": required, "properties": props}


def _nullable(schema: Doc) -> Doc:
    return {"anyOf": [schema, {"type": "null"}]}


STR: Doc = {"type": "string"}
INT: Doc = {"type": "integer"}
BOOL: Doc = {"type": "boolean"}
TIME: Doc = {"type": "string", "format": "date-time"}
ID: Doc = {"type": "string", "pattern": ID_RE.pattern}


SEQ_DOC: Doc = {
    "description": "stream sequence of the write's last event; send it as RP-Min-Seq",
    "schema": INT,
}


def json_content(schema: str) -> Doc:
    return {"application/json": {"schema": ref(schema)}}


def problems(*codes: int) -> dict[str, Doc]:
    """References to the problem responses of `codes`, with 401 and 503 every route has."""
    return {str(c): {"$ref": f"#/components/responses/{c}"} for c in (401, *codes, 503)}


def ok(schema: str, *, seq: bool = False) -> Doc:
    """A JSON answer; a command's carries the RP-Seq header."""
    answer: Doc = {"description": schema, "content": json_content(schema)}
    if seq:
        answer["headers"] = {"RP-Seq": SEQ_DOC}
    return answer


def operation(
    op_id: str,
    summary: str,
    answer: tuple[int, str],
    *,
    params: tuple[str, ...] = (),
    body: str = "",
    body_required: bool = True,
    errors: tuple[int, ...] = (),
) -> Doc:
    """One operation; a body makes it a command, which answers with RP-Seq."""
    code, schema = answer
    op: Doc = {
        "operationId": op_id,
        "summary": summary,
        "parameters": [{"$ref": f"#/components/parameters/{p}"} for p in params],
        "responses": {str(code): ok(schema, seq=bool(body)), **problems(*errors)},
    }
    if body:
        op["requestBody"] = {"required": body_required, "content": json_content(body)}
    return op


def path_param(name: str, what: str) -> Doc:
    """A path parameter that is a name: a subject-safe token."""
    return {"name": name, "in": "path", "required": True, "description": what, "schema": ID}


# ------------------------------------------------------------ schemas of answers

SCHEMAS: dict[str, Doc] = {
    "Problem": {
        **_obj(
            ["type", "title", "status", "detail"],
            type={"type": "string", "format": "uri", "examples": [BASE + "not-found"]},
            title=STR,
            status=INT,
            detail=STR,
            current_status={**STR, "description": "with a `conflict`: the run's status"},
            reasons={
                "type": "array",
                "items": STR,
                "description": "with an `invalid-command` of a settings patch: each problem",
            },
        ),
        "description": "RFC 9457 problem details; `type` is "
        + BASE
        + "<slug>, one of: "
        + ", ".join(KINDS),
    },
    "Health": _obj(["status"], status={"const": "ok"}),
    "Ready": _obj(["status"], status={"const": "ready"}),
    "Org": _obj(["name"], name=ID, created_at=TIME, created_by=STR),
    "Token": _obj(
        ["token", "token_id", "user", "role", "org"],
        token={**STR, "description": "shown only in this answer; store it now"},
        token_id=STR,
        user=STR,
        role={"enum": list(ROLES)},
        org=ID,
        expires_at={**_nullable(TIME), "description": "null: never expires"},
    ),
    "TokenInfo": _obj(
        ["token_id", "user", "role", "created_at", "expires_at", "last_used_at", "expired"],
        token_id=ID,
        user=STR,
        role={"enum": list(ROLES)},
        created_at=TIME,
        created_by=STR,
        expires_at={**_nullable(TIME), "description": "null: never expires"},
        last_used_at={
            **_nullable(TIME),
            "description": "recorded at most once per 15 minutes: exact to within that",
        },
        expired=BOOL,
        name={**_nullable(STR), "description": "a personal or team token's name, if given"},
    ),
    "Workspace": _obj(
        ["org", "name", "repository", "branch", "directory", "variables"],
        org=ID,
        name=ID,
        repository=STR,
        branch=STR,
        directory=STR,
        variables={"type": "object", "additionalProperties": STR},
        created_at=TIME,
        created_by=STR,
        active_run=_nullable(STR),
        heartbeat_timeout=INT,
        dispatch_timeout=INT,
        managed_state={**BOOL, "description": "false: the workspace brings its own backend"},
        lock={
            **_nullable(
                _obj(["holder", "reason", "locked_at"], holder=STR, reason=STR, locked_at=TIME)
            ),
            "description": "while locked runs queue but none is admitted; null when unlocked",
        },
        secret_variables={
            "type": "object",
            "additionalProperties": {"const": "(sensitive)"},
            "description": "secret variables by name; their values are never shown",
        },
        queue={"type": "array", "items": STR},
        vcs_connection={**STR, "description": "the VCS connection whose webhooks start its runs"},
        trigger_paths={
            "type": "array",
            "items": STR,
            "description": "globs whose change starts a run; empty: anything under directory",
        },
        trigger_any_change=BOOL,
        trigger_tags={"type": "array", "items": STR},
        vcs_run_type={"enum": ["plan", "apply"]},
        deleted_at={**_nullable(TIME), "description": "set once deleted (DELETE)"},
    ),
    "RunTemplateStep": _obj(
        ["number", "kind", "name", "status"],
        number=INT,
        kind={"enum": ["plan", "policy", "approval", "apply", "destroy", "custom"]},
        name=STR,
        command={**_nullable(STR), "description": "custom steps: the shell line"},
        phase={
            **_nullable(STR),
            "description": "the phase an executor runs it in: plan, apply or custom-<number>",
        },
        status={
            "enum": ["done", "skipped", "current", "pending", "failed", "canceled", "discarded"],
            "description": "skipped: passed over (no approval needed, no changes) or never "
            "reached; failed/canceled/discarded: the step the run ended at",
        },
    ),
    "PlanSummary": _obj(["add", "change", "destroy"], add=INT, change=INT, destroy=INT),
    "RunCause": {
        **_obj(
            ["kind"],
            kind={"enum": list(CAUSE_KINDS)},
            user={**STR, "description": "the runplane user behind it (none for vcs, schedule)"},
            provider={"enum": ["github", "gitlab"]},
            connection={**STR, "description": "vcs: the VCS connection's id"},
            delivery={**STR, "description": "vcs: the webhook's delivery id"},
            event={"enum": ["push", "tag", "pull_request"]},
            ref={**STR, "description": "vcs: refs/heads/<branch> or refs/tags/<tag>"},
            commit={**STR, "description": "vcs: the commit the webhook named (the run plans it)"},
            repository={**STR, "description": "vcs: the repository's full name at the VCS"},
            pull_request={**INT, "description": "vcs: the pull (merge) request's number"},
            schedule={**STR, "description": "schedule: the schedule's id"},
            fire_time={**TIME, "description": "schedule: the fire time it ran for"},
            source_workspace={**STR, "description": "run_trigger: the followed workspace"},
            source_run={**STR, "description": "run_trigger: its run that changed something"},
            rerun_of={**STR, "description": "rerun: the run it reran"},
            stack={**STR, "description": "stack_run: the stack"},
            stack_run={**STR, "description": "stack_run: the stack run that made it"},
            attempt={**INT, "description": "stack_run: the node's attempt (a resume's is 2+)"},
        ),
        "description": "members that do not apply to the kind are left out",
    },
    "Run": _obj(
        ["id", "org", "workspace", "type", "status"],
        id=ID,
        org=ID,
        workspace=ID,
        type={"enum": list(RUN_TYPES)},
        status={"enum": [s.value for s in Status]},
        created_by=STR,
        created_at=TIME,
        updated_at=TIME,
        message=STR,
        commit=_nullable(STR),
        has_changes={**_nullable(BOOL), "description": "null until the plan finished"},
        plan_summary=_nullable(ref("PlanSummary")),
        apply_summary=_nullable(ref("PlanSummary")),
        plan_digest=_nullable(STR),
        approved_by=_nullable(STR),
        acknowledged={"type": "array", "items": STR},
        reason=_nullable(STR),
        error_message=_nullable(STR),
        phase=_nullable(STR),
        executor_id=_nullable(STR),
        seq={**INT, "description": "stream sequence of the run's last projected event"},
        cause={
            **_nullable(ref("RunCause")),
            "description": "why the run exists; null for runs created before causes were",
        },
        log_removed_at={
            **_nullable(TIME),
            "description": "when retention removed the run's stored logs (its row, steps, "
            "changes and events remain); null while they are kept",
        },
        snapshot={
            **_nullable({"type": "object"}),
            "description": "what admission pinned the run to: commit, variables (names and "
            "origins, never secret values), settings; null before admission",
        },
        commit_author=_nullable(STR),
        commit_message={**_nullable(STR), "description": "the first line"},
        usage={
            **_nullable({"type": "object"}),
            "description": "what its executor steps used (from the phase's control group): "
            "`cpu_seconds` and `wall_seconds` summed, the highest `peak_memory_bytes`, and "
            "`steps`, each step's; null while no step was measured",
        },
        template={**_nullable(STR), "description": "the name of the template the run executes"},
        steps={
            "type": "array",
            "items": ref("RunTemplateStep"),
            "description": "the template's steps as recorded when the run was created",
        },
        current_step={
            **_nullable(ref("RunTemplateStep")),
            "description": "the step the run is at (waiting or running); null once it ended",
        },
        speculative={
            **BOOL,
            "description": "a plan-only run of a workspace with `speculative_plans` on: "
            "admitted at once, outside the workspace's queue, planned without a state lock",
        },
        policies={
            "type": "array",
            "items": ref("PolicyResult"),
            "description": "each pinned policy set's result on the plan (empty before the "
            "plan, or with no policy sets); a failed hard-mandatory one fails the run "
            "`policy_failed`, a failed soft-mandatory one needs an approval",
        },
        overridden={
            "type": "array",
            "items": STR,
            "description": "the failed soft-mandatory policy sets the approval overrode "
            "(`approved_by` is who; `run.approved` in the events records when)",
        },
        owner={
            **_nullable(
                _obj(
                    ["executor_id", "lease_id", "last_beat_at"],
                    executor_id=_nullable(STR),
                    lease_id=STR,
                    last_beat_at=TIME,
                )
            ),
            "description": "while a phase runs: the executor whose heartbeats hold its "
            "lease, and its last beat (server time); null otherwise and once the run ended",
        },
        deadline={
            **_nullable(
                _obj(
                    ["kind", "at"],
                    kind={
                        "enum": [
                            "run_timeout",
                            "approval_timeout",
                            "dispatch_timeout",
                            "dispatch_check",
                        ]
                    },
                    at=TIME,
                )
            ),
            "description": "the earliest limit that will close the run if nothing moves it: "
            "`run_timeout`, `approval_timeout` (awaiting approval) or `dispatch_timeout` (a "
            "phase waiting for an executor); with none of them, a phase waiting for an "
            "executor shows `dispatch_check`: when the reaper next makes sure it is in its "
            "pool's work queue (dispatching it again if it was lost); null once the run ended",
        },
    ),
    "RunEvent": _obj(
        ["seq", "type", "at", "actor", "data"],
        seq=INT,
        type={**STR, "examples": ["run.created", "run.approved"]},
        at=TIME,
        actor=STR,
        data={"type": "object", "description": "the event's own fields"},
    ),
    "Step": _obj(
        ["phase", "step", "status"],
        phase={"type": "string", "pattern": "^(plan|apply|custom-[1-9][0-9]{0,4})$"},
        step={**STR, "examples": ["checkout", "init", "plan", "apply"]},
        status={"enum": ["running", "ok", "failed"]},
        started_at=_nullable(TIME),
        ended_at=_nullable(TIME),
        duration_ms=_nullable(INT),
        error=_nullable(STR),
        log_object=_nullable(STR),
        metrics={
            "type": "object",
            "additionalProperties": {"type": "number"},
            "description": "from the executor: duration_ms, stdout_lines, stderr_lines; "
            "add, change, destroy when Terraform printed a change summary; what the step's "
            "processes used where measured (the phase's control group): cpu_seconds, "
            "peak_memory_bytes, wall_seconds",
        },
    ),
}


def list_of(name: str) -> Doc:
    """A list answer: `{"items": [<name>, ...]}`."""
    return _obj(["items"], items={"type": "array", "items": ref(name)})


for _name in ("Workspace", "RunEvent", "Step", "TokenInfo"):
    SCHEMAS[f"{_name}List"] = list_of(_name)
_SUMMARY = (
    "id org workspace type status created_by created_at updated_at message commit has_changes "
    "plan_summary apply_summary plan_digest approved_by acknowledged reason error_message "
    "phase executor_id seq cause log_removed_at"
).split()
SCHEMAS["RunSummary"] = {
    **_obj(
        SCHEMAS["Run"]["required"],
        **{k: v for k, v in SCHEMAS["Run"]["properties"].items() if k in _SUMMARY},
    ),
    "description": "a listed run with `fields=summary`: the fields of Run it names",
}
SCHEMAS["RunList"] = _obj(
    ["items"],
    items={
        "type": "array",
        "items": {"anyOf": [ref("Run"), ref("RunSummary")]},
        "description": "each a Run (`fields=full`, the default) or a RunSummary",
    },
)
SCHEMAS["RunList"]["properties"]["next"] = {
    **_nullable(ID),
    "description": "on a full page: pass as `before` for the next page",
}
