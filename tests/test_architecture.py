"""The house's floors, read from the code's own imports (every import statement, a function's
local ones and type-only ones too: each is a tie someone reading the code must follow).

Packages stand on floors, each allowed to import only the floors below it; no module takes
part in an import circle. Beside the floors, one wall: the SDK and the roles never import each
other (`APART`), not even downward: what both need sits on the transport floor beneath both. A
change that adds an upward import, a circle or a tie across the wall fails here, naming the
files and lines, so the structure docs/architecture.md draws stays the structure the code has.

Two floors hold for every file of the repo, not only the packages: no module is longer than one
reader can hold (`MAX_MODULE_LINES`), and no module imports another's private (underscore)
name."""

from __future__ import annotations

import ast
import subprocess
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A package may import its own floor's package and any lower one.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("models",),
    ("protocol",),
    ("envs",),
    ("transport",),
    ("actors",),
    ("master",),
    ("sdk",),
    ("workflows",),
    ("bench", "deploy"),
)
FLOOR = {pkg: i for i, names in enumerate(FLOORS) for pkg in names}
# Packages that import neither way although their floors would allow one of them to: the SDK
# talks to the roles over the bus only (and starts the supervisor as a process, by name).
APART: tuple[tuple[str, str], ...] = (("sdk", "actors"),)
# One package per role; a module of one may not import a module of another (the actors/ root
# beside them is the runtime every role stands on).
ROLE_ROOMS: tuple[str, ...] = ("actors.trainer", "actors.inferencer", "actors.env_worker", "actors.health",
                               "actors.monitor", "actors.supervisor", "master")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in FLOOR:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[_module(path)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The tree's module an import names (``a.b.c`` may be a module or a name in ``a.b``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _from_base(node: ast.ImportFrom, mod: str, path: Path) -> str:
    """The absolute module a ``from ... import`` reads from (relative ones resolved)."""
    base = node.module or ""
    if node.level:
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return base


def import_graph() -> dict[str, dict[str, list[int]]]:
    """module -> {imported module of this tree: [line, ...]}."""
    modules = _modules()
    graph: dict[str, dict[str, list[int]]] = {m: defaultdict(list) for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _from_base(node, mod, path)
                # `from pkg import mod` names a module; `from mod import name` a name in it.
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            for target in targets:
                hit = _resolve(target, modules)
                if hit is not None and hit != mod:
                    graph[mod][hit].append(node.lineno)
    return graph


def upward_imports(graph: dict[str, dict[str, list[int]]]) -> list[str]:
    out = []
    for mod, deps in graph.items():
        for dep, lines in deps.items():
            a, b = mod.split(".")[0], dep.split(".")[0]
            if FLOOR[b] > FLOOR[a]:
                out.append(f"{mod} (floor {FLOOR[a] + 1}) imports {dep} (floor {FLOOR[b] + 1}) at line(s) {lines}")
    return sorted(out)


def ties_across(graph: dict[str, dict[str, list[int]]]) -> list[str]:
    """Imports between two packages that `APART` keeps apart, in either direction."""
    walls = {frozenset(pair) for pair in APART}
    out = []
    for mod, deps in graph.items():
        for dep, lines in deps.items():
            a, b = mod.split(".")[0], dep.split(".")[0]
            if a != b and frozenset((a, b)) in walls:
                out.append(f"{mod} imports {dep} at line(s) {lines}")
    return sorted(out)


def room_of(mod: str) -> str | None:
    return next((room for room in ROLE_ROOMS if mod == room or mod.startswith(room + ".")), None)


def ties_between_rooms(graph: dict[str, dict[str, list[int]]]) -> list[str]:
    """Imports from one role's room into another's."""
    out = []
    for mod, deps in graph.items():
        here = room_of(mod)
        for dep, lines in deps.items():
            there = room_of(dep)
            if here is not None and there is not None and here != there:
                out.append(f"{mod} ({here}) imports {dep} ({there}) at line(s) {lines}")
    return sorted(out)


def circles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _describe(graph: dict[str, dict[str, list[int]]], comp: list[str]) -> str:
    members = set(comp)
    ties = [f"{a} -> {b} (line {graph[a][b][0]})" for a in comp for b in sorted(graph[a]) if b in members]
    return "circle: " + "; ".join(ties)


def test_the_graph_is_read():
    """The reader itself: known imports are found (a broken reader would pass everything)."""
    graph = import_graph()
    assert "protocol.messages" in graph["actors.trainer.trainer"]
    assert any(dep.startswith("models.") or dep == "models" for dep in graph["actors.trainer.step"])
    assert len(graph) > 150


def test_the_reader_finds_an_upward_import_and_a_circle():
    graph = {"models.a": {"actors.b": [3]}, "actors.b": {"models.a": [7]}}
    assert upward_imports(graph) == ["models.a (floor 1) imports actors.b (floor 5) at line(s) [3]"]
    assert circles(graph) == [["actors.b", "models.a"]]


def test_the_reader_finds_a_tie_across_the_wall():
    graph = {"sdk.a": {"actors.b": [4], "transport.c": [5]}, "actors.b": {"sdk.a": [9]}, "transport.c": {}}
    assert ties_across(graph) == ["actors.b imports sdk.a at line(s) [9]", "sdk.a imports actors.b at line(s) [4]"]
    assert upward_imports(graph) == ["actors.b (floor 5) imports sdk.a (floor 7) at line(s) [9]"]


def test_the_reader_finds_a_tie_between_rooms():
    graph = {"actors.trainer.a": {"actors.inferencer.b": [2], "actors.runtime": [3], "actors.trainer.c": [4]},
             "master.m": {"actors.monitor": [5], "actors.tq_read": [6]}}
    assert ties_between_rooms(graph) == [
        "actors.trainer.a (actors.trainer) imports actors.inferencer.b (actors.inferencer) at line(s) [2]",
        "master.m (master) imports actors.monitor (actors.monitor) at line(s) [5]"]


def test_every_role_has_its_room():
    """Each role `python -m actors.run` starts (and the supervisor) is a package of `ROLE_ROOMS`."""
    from actors.run import ROLE_CLASSES

    modules = _modules()
    for role, where in ROLE_CLASSES.items():
        assert room_of(where.partition(":")[0]) is not None, f"role {role} ({where}) is in no room"
    for room in ROLE_ROOMS:
        assert room in modules, f"{room} is no package"


def test_no_role_imports_another_role():
    ties = ties_between_rooms(import_graph())
    assert not ties, ("imports from one role's room into another's (move what both need to the actors/ root "
                      "runtime or to transport/; start a role as a process by its module name):\n  "
                      + "\n  ".join(ties))


def test_no_import_runs_up_a_floor():
    up = upward_imports(import_graph())
    assert not up, "imports that run from a lower floor to a higher one:\n  " + "\n  ".join(up)


def test_the_sdk_and_the_roles_never_import_each_other():
    ties = ties_across(import_graph())
    assert not ties, ("imports between the SDK and the roles (move what both need down to transport/ or "
                      "protocol/; start a role as a process by its module name):\n  " + "\n  ".join(ties))


def test_no_import_circles():
    graph = import_graph()
    found = [_describe(graph, comp) for comp in circles(graph)]
    assert not found, f"{len(found)} import circle(s):\n  " + "\n  ".join(found)


def tree_files() -> list[Path]:
    """Every .py file of the repo (tests, examples, bench, docs' scripts too): what git tracks plus
    new files it does not ignore; without git (an unpacked tarball), a walk that skips hidden
    folders and virtual environments."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "*.py"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    files = {ROOT / name for name in out.split("\0") if name}
    if not files:
        files = {p for p in ROOT.rglob("*.py")
                 if not any(part.startswith(".") or part in ("venv", "node_modules")
                            for part in p.relative_to(ROOT).parts[:-1])}
    return sorted(p for p in files if p.is_file())


# A module one reader can hold: past this, a file wants splitting by job (issue 28).
MAX_MODULE_LINES = 700


def test_the_file_list_is_the_whole_repo():
    """Not only the packages: the tests and this file itself are read (a reader that found the
    packages only would let a test support module grow without bound)."""
    files = {str(p.relative_to(ROOT)) for p in tree_files()}
    assert "tests/test_architecture.py" in files and "tests/support/__init__.py" in files
    assert {str(p.relative_to(ROOT)) for p in _modules().values()} <= files


def test_no_module_over_the_line_limit():
    long = sorted(f"{path.relative_to(ROOT)}: {n} lines"
                  for path in tree_files()
                  if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES)
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n  " + "\n  ".join(long)


# -- private names stay in their module -----------------------------------------------------
# A name with a leading underscore is its module's own: another module that needs it gets it
# public (underscore dropped), so a reader of the owner sees every name others lean on. Tests
# are exempt: a unit test may reach into the module it tests (`models.lora._buckets`).
PRIVATE_RULE_EXEMPT = ("tests",)


def private_imports(sources: dict[str, tuple[str, str]]) -> dict[str, list[str]]:
    """``sources``: module -> (file label, source text). Returns file label -> each
    ``from X import _name`` (X another module of ``sources``) as "line N: from X import _name".
    Aliasing a public name to a private one (``from a import doc as _doc``) is not one."""
    out: dict[str, list[str]] = defaultdict(list)
    for mod, (label, text) in sources.items():
        path = Path(label)
        for node in ast.walk(ast.parse(text, label)):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _from_base(node, mod, path)
            if base == mod or _resolve(base, sources) != base:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    out[label].append(f"line {node.lineno}: from {base} import {alias.name}")
    return dict(out)


def _tree_private_imports() -> dict[str, list[str]]:
    sources = {_module(p): (str(p.relative_to(ROOT)), p.read_text()) for p in tree_files()}
    found = private_imports(sources)
    return {label: hits for label, hits in found.items() if label.split("/")[0] not in PRIVATE_RULE_EXEMPT}


def test_the_reader_finds_a_private_import():
    sources = {"pkg.a": ("pkg/a.py", "from pkg.b import _hidden, shown\nfrom pkg.b import doc as _doc\n"
                                     "from .b import _rel\nfrom os.path import _joinrealpath\n"
                                     "def f():\n    from pkg import _b_private\n"),
               "pkg.b": ("pkg/b.py", "from pkg.b import _self_is_fine\n"),
               "pkg": ("pkg/__init__.py", "")}
    assert private_imports(sources) == {"pkg/a.py": ["line 1: from pkg.b import _hidden",
                                                     "line 3: from pkg.b import _rel",
                                                     "line 6: from pkg import _b_private"]}


def test_no_module_imports_another_modules_private_name():
    found = _tree_private_imports()
    lines = sorted(f"{label}: {hit}" for label, hits in found.items() for hit in hits)
    assert not lines, ("private (underscore) names imported from another module; make the name public in its "
                       "module (drop the underscore) and update its users:\n  " + "\n  ".join(lines))
