"""Layers point one way: no import circle among the modules of ``medusa/`` and ``train/``, counting imports made
inside functions (a lazy import is still an arrow), and the machine-profile store at the bottom.

The graph is read from the source with ``ast`` (nothing is imported): ``import a.b``, ``from a import b`` (resolved
to the module ``a.b`` where there is one, else to the package ``a``) and relative imports, wherever they sit in the
file, under ``if TYPE_CHECKING:`` too (an annotation's import still says which layer knows which). A module's
package ``__init__`` running before it is Python's, not an arrow of the module's own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("medusa", "train")


def module_files(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """``{module name: (file, is a package __init__)}`` for every ``.py`` file of :data:`PACKAGES`."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def imports_of(name: str, path: Path, is_package: bool, modules) -> set[str]:
    """The modules of ``modules`` that module ``name`` (its source at ``path``) imports, anywhere in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = set()

    def nearest(dotted: str) -> str | None:  # a name inside a module counts as that module
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {m for alias in node.names if (m := nearest(alias.name))}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module
            for alias in node.names:
                target = f"{source}.{alias.name}"
                module = target if target in modules else nearest(source)
                if module:
                    found.add(module)
    found.discard(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over :data:`PACKAGES`."""
    modules = module_files(root)
    return {name: imports_of(name, path, is_package, modules) for name, (path, is_package) in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or ``None`` when the graph has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_checker_finds_circles_through_lazy_relative_and_from_imports(tmp_path):
    pkg = tmp_path / "medusa"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "train").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "bottom.py").write_text("def f():\n    from medusa.sub import top  # lazy, still an arrow\n")
    (pkg / "sub" / "middle.py").write_text("from ..bottom import f\n")
    (pkg / "sub" / "top.py").write_text("from . import middle\n")
    typed = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from medusa import bottom\n"
    (pkg / "typed.py").write_text(typed)
    graph = import_graph(tmp_path)
    assert graph["medusa.sub.top"] == {"medusa.sub.middle"} and graph["medusa.sub.middle"] == {"medusa.bottom"}
    assert graph["medusa.typed"] == {"medusa.bottom"}  # an annotation's import is an arrow too
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"medusa.bottom", "medusa.sub.top", "medusa.sub.middle"}
    (pkg / "bottom.py").write_text("def f():\n    pass\n")
    assert find_cycle(import_graph(tmp_path)) is None


def test_medusa_and_train_have_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and "medusa.tools.measure" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("module", ["medusa.profile", "medusa.registry"])
def test_the_stored_data_sits_at_the_bottom(module):
    """The profile store and the registry rule import nothing of the package but leaf helpers."""
    graph = import_graph()
    assert _reachable(graph, module) <= {"medusa.io.files"}


def test_no_engine_or_drafter_imports_the_measurer():
    graph = import_graph()
    below = [m for m in graph if m.startswith(("medusa.engines", "medusa.drafters", "medusa.decode"))]
    assert below and not [m for m in below if "medusa.tools.measure" in _reachable(graph, m)]
    assert {"medusa.engines", "medusa.decode.loop"} <= graph["medusa.tools.measure"]
