"""The packages are floors (docs/architecture.md, "Floors"): `engine` at the ground (wire, config,
errors, the SDK, model files), the three process packages above it, `mlx_engine` on top (CLI,
launcher, in-process and offline engines, bench). No module imports a floor above its own, the
process packages do not import each other, and no modules import each other in a circle.

Every import counts, at module level or inside a function (a lazy import still ties the floors),
except those under `if TYPE_CHECKING:` (annotations only).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOOR = {
    "engine": 0,
    "tokenizer_proc": 1,
    "scheduler_proc": 1,
    "detokenizer_proc": 1,
    "mlx_engine": 2,
}


def modules() -> dict[str, Path]:
    out = {}
    for package in FLOOR:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports (a `from a import b` of a submodule counts b)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found |= {_known(a.name, known) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = _known(node.module, known)
            found.add(base)
            found |= {f"{node.module}.{a.name}" for a in node.names} & known
    return found - {""}


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node but those in `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack += node.orelse
            continue
        yield node
        stack += list(ast.iter_child_nodes(node))


def _known(name: str, known: set[str]) -> str:
    """`name` or its nearest enclosing project module; "" outside the project."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, known) - {name} for name, path in mods.items()}


def violations(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, targets in edges.items():
        mine = mod.split(".")[0]
        for target in sorted(targets):
            theirs = target.split(".")[0]
            if FLOOR[theirs] > FLOOR[mine]:
                out.append(f"{mod} imports {target}, a floor above")
            elif FLOOR[theirs] == FLOOR[mine] == 1 and theirs != mine:
                out.append(f"{mod} imports {target}, another process's package")
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_a_floor_above_its_own():
    assert violations(graph()) == []


def test_no_modules_import_each_other_in_a_circle():
    # NOTE: a package's __init__ runs before its modules; it and its modules are not a circle.
    found = [c for c in cycles(graph()) if not all(m in FLOOR or "." not in m for m in c)]
    assert found == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from mlx_engine.offline import OfflineEngine\n", "a floor above"),
        ("def f():\n    import scheduler_proc.scheduler\n", "another process's package"),
    ],
)
def test_the_rule_sees_a_planted_import(tmp_path, source, expected):
    """The check itself: a ground module importing the top, a lazy cross-process import."""
    path = tmp_path / "planted.py"
    path.write_text(source)
    known = set(modules())
    mod = "engine.planted" if "mlx_engine" in source else "tokenizer_proc.planted"
    edges = {mod: imports_of(path, known)}
    assert any(expected in v for v in violations(edges)), violations(edges)


def test_the_circle_finder_sees_a_planted_circle():
    edges = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert cycles(edges) == [["a.x", "a.y", "a.z"]]
