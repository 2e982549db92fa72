"""The house's layers hold: arrows point down, no import circle, and no piece grows past
the sizes docs/internals.md names.

The layers, lowest first (docs/internals.md has the map): events/ (the pure core),
infra/ (adapters), services/app/ (the application layer), projections/ and executor/,
services/processes/, services/surfaces/, services/root/ (the composition root). A module
may import its own layer and any below it, never one above; projections/ and executor/
share a rank and never import each other.

The import graph is read from the syntax tree, every import counted: at module level,
inside a function, or under `if TYPE_CHECKING:`, so neither hides an arrow or a circle.

The tests have one harness: helpers live in support modules (tests/*_support.py,
tests/builders.py, ...), never in a test module another imports; and only the unit
tests of the Scheduler, Reaper, Projector and App construct them themselves, the rest
take them from the composition root (tests/bootstrap_support.py).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("events", "infra", "services", "projections", "executor")
# (prefix, rank); the longest prefix names a module's layer.
LAYERS = (
    ("events", 0),
    ("infra", 1),
    ("services.app", 2),
    ("projections", 3),
    ("executor", 3),
    ("services.processes", 4),
    ("services.surfaces", 5),
    ("services.root", 6),
)
MAX_FILE_LINES = 500
MAX_CLASS_METHODS = 20
MAX_FUNCTION_LINES = 60

# What is still over a limit, with its size today: each may only shrink, and goes from
# this list when it is within the limit (the test fails on a stale entry too).
OVER_LIMIT: dict[str, int] = {}
# Import circles still open (each a sorted tuple of its modules): may only go.
OPEN_CIRCLES: set[tuple[str, ...]] = set()


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the product modules it imports (a name imported from a package counts as
    its submodule when there is one)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for target in targets:
                found = resolve(target)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def _layer(module: str) -> tuple[str, int]:
    return max(
        ((p, r) for p, r in LAYERS if module == p or module.startswith(p + ".")),
        key=lambda pr: len(pr[0]),
    )


def _circles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.add(tuple(sorted(members)))
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in _modules() if m not in ("services",) and not _layered(m)]
    assert unplaced == []


def _layered(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p, _ in LAYERS)


def test_arrows_point_down() -> None:
    graph = _imports(_modules())
    upward = []
    for source, targets in sorted(graph.items()):
        if not _layered(source):
            continue
        own_prefix, own_rank = _layer(source)
        for target in sorted(targets):
            prefix, rank = _layer(target)
            if rank > own_rank or (rank == own_rank and prefix != own_prefix):
                upward.append(f"{source} -> {target}")
    assert upward == []


def test_no_import_circle_but_those_still_open() -> None:
    circles = _circles(_imports(_modules()))
    assert circles - OPEN_CIRCLES == set(), "a new import circle"
    assert OPEN_CIRCLES - circles == set(), "a circle closed: take it from OPEN_CIRCLES"


def _sizes() -> dict[str, int]:
    sizes: dict[str, int] = {}
    for path in _modules().values():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        sizes[f"file {rel}"] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [
                    n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                sizes[f"class {rel}:{node.name}"] = len(methods)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                key = f"function {rel}:{node.name}"
                sizes[key] = max(sizes.get(key, 0), length)
    return sizes


def _limit(key: str) -> int:
    kind = key.split(" ", 1)[0]
    return {"file": MAX_FILE_LINES, "class": MAX_CLASS_METHODS}.get(kind, MAX_FUNCTION_LINES)


def test_nothing_grows_past_the_size_limits() -> None:
    sizes = _sizes()
    over = {k: v for k, v in sizes.items() if v > _limit(k)}
    new = {k: v for k, v in over.items() if k not in OVER_LIMIT}
    grown = {
        k: (OVER_LIMIT[k], v) for k, v in over.items() if k in OVER_LIMIT and v > OVER_LIMIT[k]
    }
    assert new == {}, "over a limit (file 500 lines, class 20 methods, function 60 lines)"
    assert grown == {}, "grew past its recorded size"
    stale = sorted(k for k in OVER_LIMIT if k not in over)
    assert stale == [], "within the limit now: take it from OVER_LIMIT"


def test_the_checker_sees_a_circle_and_an_upward_arrow() -> None:
    """The graph functions themselves, on a made-up graph: a test that could not fail
    would let a circle through."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(defaultdict(set, graph)) == {("a", "b", "c")}
    assert _layer("services.surfaces.api.app") == ("services.surfaces", 5)
    assert _layer("services.app.commands") == ("services.app", 2)


def test_the_executor_reaches_the_application_only_through_its_ports() -> None:
    """executor/ imports nothing of services/ (not even the application layer below it):
    what it needs of the App and the repository rules are the protocols of
    executor/ports.py, which the composition root fills."""
    graph = _imports(_modules())
    reaching = sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        if source == "executor" or source.startswith("executor.")
        for target in targets
        if target.startswith("services")
    )
    assert reaching == []


# ---------------------------------------------------------------- the tests' own harness

TESTS = ROOT / "tests"
# Components the composition root builds (tests/bootstrap_support.py: the `system` and
# `process` fixtures). A test module that constructs one itself, and which, with why;
# nothing else may, and an entry that no longer holds fails too (take it out).
CONSTRUCTED = frozenset({"Scheduler", "Reaper", "Projector", "App"})
BUILT_BY_HAND: dict[str, set[str]] = {
    # the unit tests of each class: the instance under test, with its own knobs
    "tests/test_scheduler.py": {"Scheduler"},
    "tests/test_reaper.py": {"Reaper"},
    "tests/test_reaper_dispatch.py": {"Reaper"},
    "tests/test_reaper_processes.py": {"Reaper"},  # in the test's process, with quick rounds
    "tests/test_projection.py": {"Projector"},
    "tests/test_projection_replay.py": {"Projector"},  # a live one to replay against
    "tests/test_retention.py": {"Projector"},  # a live one to replay against after a pass
    "tests/test_record_retention.py": {"Projector"},  # as test_retention's
    "tests/test_known_runs.py": {"App"},  # Apps as two writers of one run, reads counted
    # an App whose reads go through the follower that is behind (the read under test)
    "tests/test_stale_reads.py": {"App"},
    # an App on the leader of a three-server cluster, one server of which is stopped
    "tests/test_as_of_cluster.py": {"App"},
}


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def _dotted(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_test_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "tests" or not parts[-1].startswith("test_"):
        return False
    return ROOT.joinpath(*parts).with_suffix(".py").is_file()


def _test_modules_imported(source: str, module: str) -> set[str]:
    """The test modules (tests/**/test_*.py) that `source`, the module `module`, imports:
    `import tests.test_x`, `from tests.test_x import y`, `from tests import test_x`, a
    relative import, `importlib.import_module("tests.test_x")`; anywhere in the module."""
    package = module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and _called(node) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return {n for n in names if n != module and _is_test_module(n)}


def _called(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def _constructed(source: str) -> set[str]:
    """Which of CONSTRUCTED `source` calls by name (`App(...)`, `reaper.Reaper(...)`)."""
    calls = (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call))
    return {name for name in map(_called, calls) if name in CONSTRUCTED}


def test_no_module_of_the_tests_imports_a_test_module() -> None:
    """A helper another module needs lives in a support module, never in a test module
    (whose helpers are edited, and merged, for its own tests). Support modules are held
    to it too: in a function or at module level, no module under tests/ imports one."""
    found: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        if imported := _test_modules_imported(path.read_text(), _dotted(path)):
            found[path.relative_to(ROOT).as_posix()] = sorted(imported)
    assert found == {}, "move what these import to a support module"


def test_only_the_unit_tests_construct_the_scheduler_reaper_projector_and_app() -> None:
    constructed: dict[str, set[str]] = {}
    for path in _test_files():
        if names := _constructed(path.read_text()):
            constructed[path.relative_to(ROOT).as_posix()] = names
    by_hand = {k: v for k, v in constructed.items() if v - BUILT_BY_HAND.get(k, set())}
    assert by_hand == {}, "take these from tests/bootstrap_support.py (`system`, `process`)"
    stale = {k: v for k, v in BUILT_BY_HAND.items() if constructed.get(k, set()) != v}
    assert stale == {}, "no longer constructs what BUILT_BY_HAND says: update the entry"


def test_the_harness_checks_see_a_test_module_imported_and_a_component_constructed() -> None:
    """Both checks on made-up sources: a check that could not fail would let one through."""
    here = "tests.test_made_up"
    for source in (
        "from tests.test_layers import ROOT",
        "import tests.test_layers as layers",
        "from tests import test_layers",
        "from . import test_layers",
        "from .test_layers import ROOT",
        "def f():\n    from tests.test_layers import ROOT",
        "import importlib\nimportlib.import_module('tests.test_layers')",
    ):
        assert _test_modules_imported(source, here) == {"tests.test_layers"}, source
    for source in (
        "from tests.api_support import Http",
        "from tests import builders",
        "from tests.test_layers import ROOT",  # itself
    ):
        assert _test_modules_imported(source, "tests.test_layers") == set(), source
    made = "App(store)\nasync def f():\n    async with reaper.Reaper(nc, app):\n        pass"
    assert _constructed(made) == {"App", "Reaper"}
    assert _constructed("system.scheduler()\nprocess().app\nProjectorish(nc)") == set()
