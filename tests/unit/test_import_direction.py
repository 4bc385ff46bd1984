"""Imports run one way: every module under src/kiln imports only its own rank or lower.

Ranks, bottom to top (docs/architecture.md, "Layers"):
  0 kernels, platform        1 models        2 runner        3 engine
  4 features: speculative, structured, quant, and the composition root kiln.assembly
  5 cluster                  6 serve
  7 entry points: kiln (its __init__), kiln.cli, kiln.llm, kiln.config_cli, every `*.cli`, kiln.bench, kiln.testing
Shared leaves (kiln.config, kiln.sampling_params, kiln.outputs, kiln.version) and the contract modules
(kiln.engine.contract, kiln.models.layers.attention) may be imported by anyone and import only
leaves. Every import counts: top-level, inside functions, under TYPE_CHECKING. No import
cycles between modules either.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

LEAVES = frozenset({
    "kiln.config", "kiln.config_fields", "kiln.config_parallel", "kiln.config_speculative",
    "kiln.sampling_params", "kiln.outputs", "kiln.version",
    "kiln.engine.contract", "kiln.models.layers.attention",
})
ENTRY_POINTS = frozenset({"kiln", "kiln.cli", "kiln.llm", "kiln.config_cli"})
ENTRY_PACKAGES = ("kiln.bench", "kiln.testing")
RANK_OF_PACKAGE = {
    "kiln.kernels": 0, "kiln.distributed": 0, "kiln.platform": 0,
    "kiln.models": 1,
    "kiln.runner": 2,
    "kiln.engine": 3,
    "kiln.speculative": 4, "kiln.structured": 4, "kiln.quant": 4, "kiln.assembly": 4,
    "kiln.cluster": 5,
    "kiln.serve": 6,
}
ENTRY_RANK = 7

# Imports that run against the rule, if one must be tolerated for a while: the test fails on
# any violation not listed here and on any listed one that no longer occurs, so the set only
# shrinks. Empty: every import follows the rule.
KNOWN_VIOLATIONS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str


def rank(module: str) -> int | None:
    """The module's rank; None for a shared leaf or contract module (any rank may import it)
    and for a module no rank covers (reported as such)."""
    if module in LEAVES:
        return None
    if module in ENTRY_POINTS or module.endswith(".cli") or _under(module, ENTRY_PACKAGES):
        return ENTRY_RANK
    for package, package_rank in RANK_OF_PACKAGE.items():
        if _under(module, (package,)):
            return package_rank
    return None


def _under(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def describe(module: str) -> str:
    if module in LEAVES:
        return "leaf"
    module_rank = rank(module)
    return "unranked" if module_rank is None else f"rank {module_rank}"


def rank_violations(edges: Iterable[Edge]) -> set[str]:
    """`importer -> imported (rank a -> rank b)` for each import against the rule."""
    found = set()
    for edge in edges:
        if _allowed(edge):
            continue
        found.add(f"{edge.importer} -> {edge.imported} "
                  f"({describe(edge.importer)} -> {describe(edge.imported)})")
    return found


def _allowed(edge: Edge) -> bool:
    if edge.imported in LEAVES:
        return True
    if edge.importer in LEAVES:
        return False  # a leaf imports only leaves
    low, high = rank(edge.imported), rank(edge.importer)
    return low is not None and high is not None and low <= high


def cycles(edges: Iterable[Edge]) -> set[str]:
    """One path per strongly connected component of more than one module (or a module that
    imports itself): `a -> b -> ... -> a`, starting at the component's first module by name."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    reach = {module: _reachable(graph, module) for module in graph}  # ~200 modules: cheap
    found = set()
    for module in graph:
        component = {m for m in reach[module] if module in reach[m]}
        if module in reach[module] and module == min(component):
            found.add("cycle: " + " -> ".join(_shortest_cycle(graph, module, component)))
    return found


def _reachable(graph: Mapping[str, set[str]], start: str) -> set[str]:
    """Every module `start` reaches through one import or more."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for child in graph[todo.pop()] - seen:
            seen.add(child)
            todo.append(child)
    return seen


def _shortest_cycle(graph: Mapping[str, set[str]], start: str, within: set[str]) -> list[str]:
    """Breadth-first from `start` back to it inside its component (neighbours by name)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & within):
                if child == start:
                    return [*_path_back(came_from, start, node), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def _path_back(came_from: Mapping[str, str], start: str, node: str) -> list[str]:
    path = [node]
    while path[-1] != start:
        path.append(came_from[path[-1]])
    return path[::-1]


# -- reading the source ------------------------------------------------------------------------

def module_names(src: Path) -> dict[str, Path]:
    """Every module under src/kiln by dotted name (a package by its own name)."""
    names = {}
    for path in sorted((src / "kiln").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(module: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """Every kiln module `module` imports, wherever the import sits in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
    return {name for name in found if name == "kiln" or name.startswith("kiln.")}


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[:len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def import_edges(src: Path) -> set[Edge]:
    known = module_names(src)
    return {Edge(module, imported) for module, path in known.items()
            for imported in imports_of(module, path, known) if imported != module}


# -- the tests -----------------------------------------------------------------------------------

def ratchet(found: set[str], known: frozenset[str]) -> list[str]:
    """What fails: violations not in `known`, and known ones that no longer occur."""
    message = []
    if new := sorted(found - known):
        message.append("imports against the dependency rule:\n  " + "\n  ".join(new))
    if fixed := sorted(known - found):
        message.append("fixed, so remove them from KNOWN_VIOLATIONS:\n  " + "\n  ".join(fixed))
    return message


def test_imports_follow_the_ranks_and_form_no_cycle():
    edges = import_edges(SRC)
    message = ratchet(rank_violations(edges) | cycles(edges), KNOWN_VIOLATIONS)
    assert not message, "\n".join(message)


def test_every_module_has_a_rank():
    unranked = sorted(m for m in module_names(SRC) if m not in LEAVES and rank(m) is None)
    assert not unranked, f"modules no rank covers (add their package to RANK_OF_PACKAGE): {unranked}"


def test_the_rule_on_a_made_up_graph():
    edges = {
        Edge("kiln.engine.core", "kiln.runner.model_runner"),  # down: fine
        Edge("kiln.runner.batch", "kiln.engine.contract"),  # a contract module: fine
        Edge("kiln.runner.batch", "kiln.engine.scheduler"),  # up
        Edge("kiln.engine.contract", "kiln.engine.request"),  # a leaf importing a non-leaf
        Edge("kiln.quant.cli", "kiln.serve.app"),  # an entry point: fine
        Edge("kiln.structured.hooks", "kiln.speculative.proposer"),  # the same rank: fine
        Edge("kiln.engine.a", "kiln.engine.b"),
        Edge("kiln.engine.b", "kiln.engine.c"),
        Edge("kiln.engine.c", "kiln.engine.a"),
        Edge("kiln.engine.c", "kiln.engine.d"),
        Edge("kiln.serve.app", "kiln.serve.app"),
    }
    assert rank_violations(edges) == {
        "kiln.runner.batch -> kiln.engine.scheduler (rank 2 -> rank 3)",
        "kiln.engine.contract -> kiln.engine.request (leaf -> rank 3)",
    }
    assert cycles(edges) == {
        "cycle: kiln.engine.a -> kiln.engine.b -> kiln.engine.c -> kiln.engine.a",
        "cycle: kiln.serve.app -> kiln.serve.app"}
    assert ratchet({"x", "y"}, frozenset({"x", "y"})) == []
    assert ratchet({"x", "new"}, frozenset({"x", "gone"})) == [
        "imports against the dependency rule:\n  new",
        "fixed, so remove them from KNOWN_VIOLATIONS:\n  gone"]


def test_relative_and_submodule_imports_resolve(tmp_path):
    package = tmp_path / "kiln" / "engine"
    package.mkdir(parents=True)
    for name in ("__init__", "core", "scheduler"):
        (package / f"{name}.py").write_text("")
    (tmp_path / "kiln" / "__init__.py").write_text("")
    (package / "core.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import scheduler\n"
        "from kiln import engine\n"
        "if TYPE_CHECKING:\n    from ..engine.scheduler import Scheduler\n"
        "def f():\n    import kiln.serve.app\n    from kiln.config import EngineConfig\n")
    known = module_names(tmp_path)
    assert imports_of("kiln.engine.core", package / "core.py", known) == {
        "kiln.engine.scheduler", "kiln.engine", "kiln.serve.app", "kiln.config"}
