"""One way down: every import of the two packages, ``stagehand`` (the memory runtime, in
``runtime/``) and ``workbench`` (the rest, in ``backend/``), runs down the layer order, no import
closes a circle, and no source module is over 450 lines.

The rooms, bottom first: ``stagehand.config`` (the runtime's configuration and formats,
torch-free), the runtime's own rooms (``stagehand.common``, the runtimes, the strategy: a library
that reads without the workbench), then the workbench's: ``workbench.contract`` (what the worker,
the server, the planner and the browser agree on), ``workbench.worker`` (the training worker
process, ``workbench train``, with the model and data factory and the presets it loads by name),
``workbench.plan`` (VRAM and step time before launch, tune), ``workbench.bench`` (the benchmark
suite, which measures what the planner predicts) and ``workbench`` itself (the server: ``api``,
``services``, ``store``, ``executors``, ``cli``); the dashboard (``frontend/``) is JavaScript
over the server's API.

A *room* is a package directly under ``stagehand`` (``stagehand.weights``) or the library's own
``__init__`` (``stagehand``), one of the workbench's ``SUBPACKAGES`` (``workbench.plan``), or
the rest of ``workbench``; ``ORDER`` gives each room a rank. The rules, checked by walking the
source with ``ast`` (nothing is imported):

- An arrow is an ``import`` or ``from ... import`` of a project module, absolute or relative,
  wherever it stands: at module level, inside a function (a lazy import is the same dependency,
  paid later) or under ``if TYPE_CHECKING:`` (a type from a layer above is still knowledge of
  it). ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``;
  an arrow points at the module named, not at the packages above it.
- Order: an arrow between two rooms goes to a room of strictly lower rank. Rooms of one rank are
  peers and import nothing of each other (the Conductor sits beside the weight and activation
  runtimes: what ties them together is the strategy's). Since every arrow between rooms goes
  strictly down, the rooms cannot form a circle.
- Circles: no circle between modules through the imports that run (module level and lazy ones).
  ``if TYPE_CHECKING:`` imports never run, so a circle they alone would close is allowed (a
  runtime's hooks naming its runtime class in annotations).
- Lazy: a project import inside a function says why it is not at module level, with a comment
  ``# lazy: <reason>`` on the import's first line (the server starts without torch, an optional
  dependency such as ray, a CLI subcommand's startup, a child process's preload). Without a
  reason it belongs at the top of its module, where the dependency is seen.
- Size: no module of the packages or of ``frontend/js/`` over ``MAX_LINES`` lines.
- Floors: ``stagehand.config`` imports the standard library and pydantic only;
  ``workbench.contract`` those and ``stagehand.config``; both load without torch. ``stagehand``
  imports nothing of ``workbench``: the library reads alone, on third-party packages (torch,
  safetensors, psutil, pydantic, ...).

``python tests/test_layers.py`` prints the rooms, the arrows between them, the five largest
modules and every violation.
"""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The import packages, each with the folder it lives in.
PACKAGES = {"stagehand": "runtime", "workbench": "backend"}
#: The workbench's subpackages that are rooms of their own (the rest is the server's room).
SUBPACKAGES = ("contract", "worker", "plan", "bench")
MAX_LINES = 450

#: Rooms by rank, bottom first; each tuple holds peers. A new room fails the test until it is
#: placed here.
ORDER: list[tuple[str, tuple[str, ...]]] = [
    # The runtime's configuration, its telemetry wire and how it reads a user's folder: the
    # standard library and pydantic only, so the server and the planner read it without torch.
    ("config", ("stagehand.config",)),
    # The mechanisms every runtime shares: device, memory, telemetry, the saved-tensor router.
    ("common", ("stagehand.common",)),
    # SquareQ's formats, block images and cache (torch only): the weight runtime stages them.
    ("runtimes", ("stagehand.squareq",)),
    # The runtimes beside each other.
    ("runtimes", ("stagehand.weights", "stagehand.activations", "stagehand.conductor")),
    # Layer offload: a runtime built on the weight runtime's blocks and scheduler.
    ("runtimes", ("stagehand.layer_offload",)),
    # The strategy composes the runtimes into the one object a training loop drives.
    ("strategy", ("stagehand.strategy",)),
    # The library's front page (the call order, NOTE [ Exact numbers ]) and its one call,
    # ``stagehand.build_strategy``, loaded from the strategy on first use.
    ("front", ("stagehand",)),
    # What the worker, the server, the planner and the browser agree on, on the runtime's
    # configuration: torch-free.
    ("contract", ("workbench.contract",)),
    # The training worker, with the model and data factory, the demo build's status file (read
    # torch-free by the server) and the presets loaded by name.
    ("worker", ("workbench.worker",)),
    # The planner reads the worker's pipeline families; it defines the workload it calibrates on.
    ("plan", ("workbench.plan",)),
    # The bench measures strategies on the planner's workload, and records the planner's CPU
    # profile of the machine its rows ran on.
    ("bench", ("workbench.bench",)),
    # The server: its API, services, store, executors and command line.
    ("server", ("workbench",)),
]
RANK = {room: rank for rank, (_, rooms) in enumerate(ORDER) for room in rooms}
LAYER = {room: name for name, rooms in ORDER for room in rooms}


@dataclass(frozen=True)
class Arrow:
    source: str  # importing module
    target: str  # imported module
    path: str  # importing file, relative to the repository
    line: int
    runs: bool  # False under ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        how = "" if self.runs else " (TYPE_CHECKING)"
        return f"{self.path}:{self.line} {self.source} -> {self.target}{how}"


def package_files(package: str) -> list[Path]:
    """Every source file of ``package`` (``stagehand`` or ``workbench``)."""
    return sorted((ROOT / PACKAGES[package] / package).rglob("*.py"))


def modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's ``__init__``) for every module of ``PACKAGES``."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in package_files(package):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return found


def room(module: str) -> str:
    parts = module.split(".")
    split = parts[0] == "stagehand" or (
        parts[0] == "workbench" and parts[1:2] in [[s] for s in SUBPACKAGES]
    )
    return ".".join(parts[:2] if split else parts[:1])


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, runs: bool = True):
    """``(node, runs)`` for every import statement below ``tree``, functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, runs
        elif isinstance(node, ast.If) and _type_checking(node.test):
            yield from _imports(ast.Module(body=node.body, type_ignores=[]), False)
            yield from _imports(ast.Module(body=node.orelse, type_ignores=[]), runs)
        else:
            yield from _imports(node, runs)


def arrows() -> list[Arrow]:
    """Every import of a project module by a project module (see the module docstring)."""
    mods = modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for source, (path, is_init) in mods.items():
        rel = str(path.relative_to(ROOT))
        for node, runs in _imports(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            else:
                if node.level:
                    base = source.split(".")[: len(source.split(".")) + is_init - node.level]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [
                    f"{module}.{a.name}" if f"{module}.{a.name}" in mods else known(module)
                    for a in node.names
                ]
            for target in dict.fromkeys(targets):
                if target and target != source:
                    found.append(Arrow(source, target, rel, node.lineno, runs))
    return found


def order_violations(found: list[Arrow]) -> list[tuple[Arrow, str]]:
    """``(arrow, why)`` for the arrows between rooms that do not go strictly down ``ORDER``."""
    out = []
    for a in found:
        src, dst = room(a.source), room(a.target)
        if src == dst:
            continue
        if src not in RANK or dst not in RANK:
            out.append((a, f"room {src if src not in RANK else dst} is not placed in ORDER"))
        elif RANK[dst] >= RANK[src]:
            way = "sideways" if RANK[dst] == RANK[src] else "up"
            out.append((a, f"{LAYER[src]} ({src}) -> {LAYER[dst]} ({dst}), {way}"))
    return out


def circles(found: list[Arrow]) -> list[list[str]]:
    """The module circles (strongly connected components) of the arrows that run."""
    graph: dict[str, set[str]] = {}
    for a in found:
        if a.runs:
            graph.setdefault(a.source, set()).add(a.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


LAZY = re.compile(r"#\s*lazy:\s*\S")


def _function_imports(tree: ast.AST, inside: bool = False):
    """``(node, inside a function)`` for every import statement below ``tree``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, inside
        else:
            func = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _function_imports(node, inside or func)


def lazy_imports() -> tuple[list[str], list[str]]:
    """``(marked, unmarked)``: ``path:line`` of each import of a project package inside a
    function, with and without a ``# lazy: <reason>`` comment on its first line."""
    marked, unmarked = [], []
    for package in PACKAGES:
        for path in package_files(package):
            rel = str(path.relative_to(ROOT))
            text = path.read_text()
            lines = text.splitlines()
            for node, inside in _function_imports(ast.parse(text, rel)):
                if not inside:
                    continue
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    names = ["." if node.level else node.module or ""]
                if not any(n == "." or n.split(".")[0] in PACKAGES for n in names):
                    continue
                where = f"{rel}:{node.lineno}"
                if LAZY.search(lines[node.lineno - 1]):
                    marked.append(where)
                else:
                    unmarked.append(f"{where} {lines[node.lineno - 1].strip()}")
    return marked, unmarked


def long_modules() -> list[str]:
    files = [p for pkg in PACKAGES for p in package_files(pkg)]
    files += (ROOT / "frontend" / "js").rglob("*.js")
    sizes = {p: len(p.read_text().splitlines()) for p in files}
    return [
        f"{p.relative_to(ROOT)}: {n} lines (over {MAX_LINES})"
        for p, n in sorted(sizes.items())
        if n > MAX_LINES
    ]


def test_every_room_is_placed_and_the_walk_sees_the_known_arrows():
    found = arrows()
    rooms = {room(m) for m in modules()}
    assert rooms == set(RANK)
    pairs = {(a.source, a.target) for a in found}
    # Not vacuous: a top-level, a lazy and a TYPE_CHECKING import, absolute and relative.
    assert ("stagehand.strategy.layer_offload", "stagehand.layer_offload.manager") in pairs
    assert ("workbench.cli.serve", "workbench.executors") in pairs  # inside main()
    assert (
        "workbench.worker.assets",
        "workbench.worker.assets.cache",
    ) in pairs  # from .cache import ...
    assert any(not a.runs for a in found)
    assert len(found) > 500


def test_no_import_runs_against_the_layer_order():
    assert [f"{a}: {why}" for a, why in order_violations(arrows())] == []


def test_no_import_circle_between_modules():
    assert circles(arrows()) == []


def test_readme_draws_the_rooms_in_this_order():
    """README's layer drawing ("## Architecture") lists every room: a higher rank on an earlier
    line, peers on one line."""
    text = (ROOT / "README.md").read_text().split("\nImports run one way", 1)[1]
    drawing = text.split("```")[1].splitlines()

    def line_of(room: str) -> int:
        name = room.rpartition(".")[2]
        folder = ROOT / PACKAGES[room.split(".")[0]] / room.replace(".", "/")
        end = "/" if folder.is_dir() else r"\.py"
        found = [i for i, line in enumerate(drawing) if re.search(rf"(^|[\s/]){name}{end}", line)]
        assert found, f"README's layer drawing does not name {room}"
        return found[0]

    lines = {room: line_of(room) for room in RANK if room != "stagehand"}
    for a, b in itertools.combinations(lines, 2):
        if RANK[a] == RANK[b]:
            assert lines[a] == lines[b], (a, b)
        else:
            assert (lines[a] < lines[b]) == (RANK[a] > RANK[b]), (a, b)


#: Third-party packages the torch-free floors may import: the schemas' pydantic, and Pillow's
#: colour names for ``data.background`` (a lazy import in
#: ``backend/workbench/contract/preset/schema.py``).
FLOOR_MAY_IMPORT = ("pydantic", "pydantic_core", "PIL")
#: The torch-free rooms and the project modules each may import besides itself.
FLOORS = {"stagehand.config": (), "workbench.contract": ("stagehand.config",)}


def absolute_imports(room_name: str) -> list[tuple[str, int, str]]:
    """``(path, line, module)`` for each absolute import in the room's files (relative imports
    stay inside it), lazy and ``TYPE_CHECKING`` ones included."""
    out = []
    for module, (path, _) in sorted(modules().items()):
        if room(module) != room_name and not (
            room_name == "stagehand" and module.startswith("stagehand")
        ):
            continue
        rel = str(path.relative_to(ROOT))
        for node, _ in _imports(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                names = [] if node.level else [node.module or ""]
            out += [(rel, node.lineno, name) for name in names]
    return out


def floor_imports() -> list[str]:
    """``path:line module`` for each import in a torch-free floor (``FLOORS``) of anything but
    the standard library, ``FLOOR_MAY_IMPORT``, the floor itself and the rooms it builds on."""
    out = []
    for floor, below in FLOORS.items():
        allowed = (floor, *below)
        out += [
            f"{rel}:{line} {name}"
            for rel, line, name in absolute_imports(floor)
            if name.split(".")[0] not in {*FLOOR_MAY_IMPORT, *sys.stdlib_module_names}
            and not any(name == a or name.startswith(a + ".") for a in allowed)
        ]
    return out


def library_imports() -> list[str]:
    """``path:line module`` for each import in ``stagehand`` of the workbench (or the tests):
    the library never reaches into the application."""
    return [
        f"{rel}:{line} {name}"
        for rel, line, name in absolute_imports("stagehand")
        if name.split(".")[0] in {"workbench", "tests", "frontend"}
    ]


def test_the_floors_import_the_standard_library_and_pydantic_only():
    assert floor_imports() == []
    found = {(a.source, a.target) for a in arrows()}
    # Not vacuous: the server, the worker, the planner and the runtimes import them.
    assert ("workbench.services.supervisor", "workbench.contract.control") in found
    assert ("workbench.worker.run", "workbench.contract.control") in found
    assert ("workbench.plan.tune", "workbench.contract.preset.merge") in found
    assert ("workbench.contract.preset.schema", "stagehand.config.memory") in found
    assert ("stagehand.weights.runtime", "stagehand.config.memory") in found


def test_the_floors_load_without_torch():
    names = sorted(m for m in modules() if room(m) in FLOORS)
    code = (
        f"import importlib, sys\nfor name in {names!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'PIL') "
        "or (m.startswith('stagehand.') and not m.startswith('stagehand.config')) "
        "or (m.startswith('workbench.') and not m.startswith('workbench.contract'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert len(names) > 15 and out.stdout.strip() == "[]", out.stdout


def test_the_library_imports_nothing_of_the_application():
    assert library_imports() == []
    # Not vacuous: the walk sees the library's imports of itself and of its configuration.
    names = {name for _, _, name in absolute_imports("stagehand")}
    assert {"stagehand.weights.runtime", "stagehand.config.memory", "torch"} <= names


def test_every_lazy_project_import_says_why():
    marked, unmarked = lazy_imports()
    assert unmarked == [], "a function-level project import without '# lazy: <reason>'"
    # Not vacuous: the server's torch-free start and ray's optional executor are lazy.
    assert any(w.startswith("backend/workbench/api/plan.py:") for w in marked)
    assert any(w.startswith("backend/workbench/executors/factory.py:") for w in marked)


def test_the_lazy_check_names_an_unmarked_import(tmp_path, monkeypatch):
    (tmp_path / "backend" / "workbench" / "worker").mkdir(parents=True)
    (tmp_path / "backend" / "workbench" / "worker" / "x.py").write_text(
        "import os\n\n\ndef f():\n    from stagehand.config import memory\n"
        "    from workbench.plan import tune  # lazy: the server starts without torch\n"
        "    import json\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "runtime" / "stagehand").mkdir(parents=True)
    x = "backend/workbench/worker/x.py"
    assert lazy_imports() == ([f"{x}:6"], [f"{x}:5 from stagehand.config import memory"])


def test_no_source_module_over_the_line_limit():
    assert long_modules() == []


if __name__ == "__main__":
    found = arrows()
    rooms = sorted({room(m) for m in modules()}, key=lambda r: (RANK.get(r, -1), r))
    between = sorted({(room(a.source), room(a.target)) for a in found} - {(r, r) for r in rooms})
    print(f"{len(rooms)} rooms, bottom first: {' '.join(rooms)}")
    print(f"{len(found)} arrows between modules; {len(between)} between rooms:")
    for src in reversed(rooms):
        targets = [dst for s, dst in between if s == src]
        if targets:
            print(f"  {src} -> {' '.join(sorted(targets, key=lambda r: -RANK.get(r, -1)))}")
    files = [p for pkg in PACKAGES for p in package_files(pkg)]
    sizes = sorted(((len(p.read_text().splitlines()), p) for p in files), reverse=True)[:5]
    print("5 largest modules: " + ", ".join(f"{p.relative_to(ROOT)} {n}" for n, p in sizes))
    problems = order_violations(found)
    print(f"{len(problems)} arrows against the order:")
    print("\n".join(f"  {a}: {why}" for a, why in problems))
    loops = circles(found)
    print(f"{len(loops)} circles:")
    for loop in loops:
        inner = [a for a in found if a.runs and a.source in loop and a.target in loop]
        print(f"  {' '.join(loop)}")
        print("\n".join(f"    {a}" for a in inner))
    floor = floor_imports()
    print(
        f"{len(floor)} imports of the torch-free floors beyond the standard library and pydantic:"
    )
    print("\n".join(f"  {s}" for s in floor))
    library = library_imports()
    print(f"{len(library)} imports of the workbench by stagehand:")
    print("\n".join(f"  {s}" for s in library))
    marked, unmarked = lazy_imports()
    print(
        f"{len(marked) + len(unmarked)} project imports inside functions, {len(marked)} marked lazy:"
    )
    print("\n".join(f"  {s}" for s in unmarked))
    sizes = long_modules()
    print(f"{len(sizes)} modules over {MAX_LINES} lines:")
    print("\n".join(f"  {s}" for s in sizes))
    sys.exit(1 if problems or loops or floor or library or unmarked or sizes else 0)
