"""The house's floors: a module imports only from its own floor or below, and no modules import
each other in a circle. The import graph is read from the source (every import statement, those
inside functions too, and importlib.import_module of a literal name), not from what a run happens
to load."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "toolkit"
# From the ground up (the design's floors): a package's floor, by its first name under toolkit.
FLOORS = {
    "config": 0,  # the schema, composition, the caches' places
    "formats": 0,  # pure file formats: HF config.json and weight files, the dataset manifest, atomic writes
    "compat": 0,  # shims that must be in place before a dependency is imported
    "families": 0,  # model families: HF config in and out, weight names and their mappings, the pipeline cut
    "conf": 0,
    "plan": 1,  # pure arithmetic
    "data": 2,  # tokenizers, the bundled corpus, preparation
    "emit": 3,
    "train": 4,
    "interop": 5,  # Hugging Face in and out, export commands (they need the trainer)
    "report": 5,
    "reproduce": 6,
    "cli": 7,
}


def module_name(root: Path, path: Path) -> str:
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(root: Path, name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (root / relative).with_suffix(".py").is_file() or (root / relative / "__init__.py").is_file()


def import_edges(root: Path) -> set[tuple[str, str]]:
    """(importer, imported module) for every import of the package by itself in the tree at `root`."""
    top = root.name
    edges = set()
    for path in sorted(root.rglob("*.py")):
        source = module_name(root, path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import sub` imports the submodule; `from mod import name` the module
                targets = [
                    f"{node.module}.{alias.name}" if _is_module(root, f"{node.module}.{alias.name}") else node.module
                    for alias in node.names
                ]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                targets = [node.args[0].value]
            edges |= {(source, t) for t in targets if t == top or t.startswith(top + ".")}
    return {(a, b) for a, b in edges if a != b}


def floor(module: str, floors: dict[str, int]) -> int:
    parts = module.split(".")
    return floors[parts[1]] if len(parts) > 1 and parts[1] in floors else max(floors.values())


def upward(edges, floors) -> list[str]:
    return sorted(f"{a} -> {b}" for a, b in edges if floor(b, floors) > floor(a, floors))


def cycles(edges) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan 1972)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def edges():
    return import_edges(PACKAGE)


def test_every_package_has_a_floor(edges):
    packages = {m.split(".")[1] for edge in edges for m in edge if m.count(".")}
    assert packages <= set(FLOORS) | {"__main__"}, f"give these a floor: {sorted(packages - set(FLOORS))}"


def test_no_module_imports_from_a_floor_above_its_own(edges):
    assert upward(edges, FLOORS) == []


def test_no_import_cycle(edges):
    assert cycles(edges) == []


@pytest.mark.mutation
def test_the_checks_find_a_planted_upward_import_and_cycle(tmp_path):
    """A plan module that imports the trainer inside a function, and two data modules that import
    each other (one through importlib): both are found."""
    root = tmp_path / "toolkit"
    for package in ("plan", "train", "data"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "plan" / "perf.py").write_text("def f():\n    from toolkit.train import loop\n")
    (root / "train" / "loop.py").write_text("from toolkit.plan.perf import f\n")
    (root / "data" / "a.py").write_text("from toolkit.data import b\n")
    (root / "data" / "b.py").write_text("import importlib\nimportlib.import_module('toolkit.data.a')\n")
    planted = import_edges(root)
    assert upward(planted, FLOORS) == ["toolkit.plan.perf -> toolkit.train.loop"]
    assert sorted(map(tuple, cycles(planted))) == [
        ("toolkit.data.a", "toolkit.data.b"),
        ("toolkit.plan.perf", "toolkit.train.loop"),
    ]
