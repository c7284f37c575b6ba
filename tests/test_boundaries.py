"""The package's boundaries: the planner, the schema and the emitters run without torch, megatron
or deepspeed (a laptop plans a 16k-GPU layout with none of them); only the backend descriptions
test a backend's name; toolkit.train has no import cycles."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"

_BLOCK = """
import importlib, pkgutil, sys
BLOCKED = {blocked!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED or any(name.startswith(p) for p in BLOCKED if "." in p):
            raise ImportError(f"{{name}} must not be imported here")
sys.meta_path.insert(0, Block())
import toolkit
for package in {packages!r}:
    module = importlib.import_module(package)
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        importlib.import_module(info.name)
print("ok")
"""


@pytest.mark.parametrize(
    "packages, blocked",
    [
        (["toolkit.plan", "toolkit.config"], ["torch", "megatron", "deepspeed", "transformers"]),
        (["toolkit.emit"], ["torch", "megatron", "deepspeed", "transformers", "toolkit.train"]),
    ],
)
def test_packages_import_without(packages, blocked):
    """Every module of these packages imports with the blocked packages made unimportable."""
    code = _BLOCK.format(blocked=blocked, packages=packages)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_the_block_works():
    """The blocker itself refuses what it should (else the test above proves nothing)."""
    code = _BLOCK.format(blocked=["torch"], packages=["toolkit.train"])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "torch must not be imported here" in result.stderr


def test_only_the_backend_descriptions_name_a_backend():
    """No `backend.name ==` (or !=, in) tests outside toolkit/plan/backends.py: behaviour is read
    from the description."""
    pattern = re.compile(r"""backend\.name\s*(==|!=|in\b)|\bb\s*==\s*["'](megatron|deepspeed)["']""")
    hits = [
        f"{path.relative_to(TOOLKIT)}:{number}: {line.strip()}"
        for path in TOOLKIT.rglob("*.py")
        if path.name != "backends.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "\n".join(hits)


def _train_imports() -> dict[str, set[str]]:
    """toolkit.train module -> the toolkit.train modules it imports (anywhere in its body)."""
    graph = {}
    for path in (TOOLKIT / "train").glob("*.py"):
        name = path.stem
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "toolkit.train":
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("toolkit.train."):
                edges.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                edges |= {a.name.split(".")[2] for a in node.names if a.name.startswith("toolkit.train.")}
        graph[name] = edges - {name}
    return graph


def test_no_import_cycles_in_train():
    graph = _train_imports()
    assert graph["deepspeed_backend"] >= {"deepspeed_pipe", "deepspeed_engine"}  # the graph is read at all

    def cycle_from(start, node, seen):
        for nxt in graph.get(node, ()):
            if nxt == start:
                return seen + [nxt]
            if nxt not in seen:
                found = cycle_from(start, nxt, seen + [nxt])
                if found:
                    return found
        return None

    cycles = [[m, *c] for m in graph if (c := cycle_from(m, m, []))]
    assert not cycles, cycles


def test_launch_does_not_import_the_worker_entry():
    assert "__main__" not in _train_imports()["launch"]


def test_every_backend_choice_has_a_description():
    """The schema's backend choices and the backend descriptions name the same backends."""
    from toolkit.config.schema import BackendName
    from toolkit.plan.backends import BACKENDS

    assert {str(b) for b in BackendName} == set(BACKENDS)
