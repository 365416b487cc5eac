"""The package's layout: its rooms on floors with imports running only down, no import cycles between
its modules, no private names across files."""

from __future__ import annotations

import ast
from pathlib import Path

import verispec

ROOT = Path(verispec.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import of verispec modules, lazy ones (inside functions, under
    TYPE_CHECKING) included: a lazy import hides a cycle from Python, not from a reader."""
    tree = ast.parse(path.read_text())
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("verispec"):
                names = [a.name for a in node.names]
                # `from . import x` imports the submodule x
                submodules = [f"{module}.{n}" for n in names if (ROOT.parent / f"{module}.{n}".replace(".", "/")).exists()
                              or (ROOT.parent / (f"{module}.{n}".replace(".", "/") + ".py")).exists()]
                found += [(m, []) for m in submodules] or [(module, names)]
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("verispec")]
    return found


FILES = sorted(ROOT.rglob("*.py"))


def test_no_private_names_are_imported_across_files() -> None:
    private = [(_module(path), module, name) for path in FILES for module, names in _imports(path)
               for name in names if name.startswith("_")]
    assert private == []


def test_the_modules_import_each_other_without_cycles() -> None:
    graph = {_module(path): {m for m, _ in _imports(path)} for path in FILES}
    for module in graph:
        graph[module] = {m for m in graph[module] if m in graph and m != module}
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                cycle = stack[stack.index(other):] + [other]
                if not all(a.startswith(b + ".") or b.startswith(a + ".") for a, b in zip(cycle, cycle[1:])):
                    cycles.append(" -> ".join(cycle))
            elif other not in state:
                visit(other, stack + [other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


# The package's rooms (a subpackage, or a module at the top) from the bottom floor up. A room
# imports only rooms on floors below its own: the drafters (spec_decode) run their models with
# runtime/, never with the engine that drives them, and nothing below the CLI knows it exists.
FLOORS: tuple[frozenset[str], ...] = (
    frozenset({"config", "files", "cluster", "heads"}),
    frozenset({"model", "structured"}),
    frozenset({"runtime", "sampling_params", "tools"}),
    frozenset({"sample"}),
    frozenset({"spec_decode"}),
    frozenset({"engine"}),
    frozenset({"serve", "train", ""}),
    frozenset({"batch"}),
    frozenset({"cli"}),
    frozenset({"demo"}),
)


def _room(module: str) -> str:
    """`verispec.engine.llm` -> `engine`; the package's own __init__ is the room ``""``."""
    return module.split(".")[1] if "." in module else ""


def test_every_room_has_a_floor() -> None:
    rooms = {_room(_module(path)) for path in FILES}
    assert rooms == set().union(*FLOORS)


def test_imports_run_only_down_the_floors() -> None:
    floor = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
    # The compiled extension (verispec.cpu_kernels) imports nothing of the package: no room.
    upward = sorted(
        f"{_module(path)} -> {module}"
        for path in FILES for module, _ in _imports(path)
        if _room(module) in floor and _room(_module(path)) != _room(module)
        and floor[_room(module)] >= floor[_room(_module(path))]
    )
    assert upward == []
