"""The source tree read as code (AST), for the house rules (tests/pure/test_structure.py) and the package-face
check (tests/jobs/test_package_face.py): modules by name, their imports, private names, test modules."""

from __future__ import annotations

import ast
from collections import deque
from functools import cache
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]

LOCAL_DIRS = ("tests", "scripts")  # their files import each other as top-level modules (sys.path)


@cache
def package_roots() -> dict[str, Path]:
    """Top-level package name -> directory: distload/, plus pyproject's remaps (kernels/ is distload.kernels)."""
    remaps = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-dir", {})
    return {"distload": ROOT / "distload", **{pkg: ROOT / folder for pkg, folder in remaps.items()}}


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for the packages and for the local modules of tests/ and scripts/."""
    found = {}
    for pkg, folder in package_roots().items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            found[".".join((pkg, *parts[:-1]) if parts[-1] == "__init__" else (pkg, *parts))] = path
    for folder in LOCAL_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[local_name(path)] = path
    return found


TEST_KINDS = ("pure", "checkpoints", "ranks", "jobs")   # tests/<kind>/: one folder per kind of test
SUPPORT = "support"                                    # tests/support/: helpers, no tests


def local_name(path: Path) -> str:
    """The name a file of tests/ or scripts/ is imported by: each test folder and tests/support/ is on sys.path
    (a package there, like support/hostile/, by its dotted path); a conftest.py by its folder (pytest's own)."""
    rel = path.relative_to(ROOT)
    if rel.name == "conftest.py":
        return "conftest@" + "/".join(rel.parts[:-1])
    parts = list(rel.with_suffix("").parts)
    top = 2 if parts[0] == "tests" and len(parts) > 2 and parts[1] in (*TEST_KINDS, SUPPORT) else 1
    parts = parts[top:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_modules() -> dict[str, Path]:
    """The test modules (tests/<kind>/test_*.py) by the name they are imported by."""
    return {name: path for name, path in modules().items()
            if path.name.startswith("test_") and path.parent.parent == ROOT / "tests"}


def package_modules() -> dict[str, Path]:
    local = tuple(ROOT / folder for folder in LOCAL_DIRS)
    return {name: path for name, path in modules().items() if not any(d in path.parents for d in local)}


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def from_base(name: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` statement in module `name` reads from."""
    if not node.level:
        return node.module or ""
    package = name if modules()[name].name == "__init__.py" else name.rpartition(".")[0]
    package = ".".join(package.split(".")[: len(package.split(".")) - (node.level - 1)])
    return f"{package}.{node.module}" if node.module else package


def import_edges(name: str) -> list[tuple[str, ast.AST]]:
    """(module imported, statement) for every import in the module, function-local ones included."""
    known, edges = modules(), []
    for node in ast.walk(parsed(known[name])):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                target = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in known), None)
                if target:
                    edges.append((target, node))
        elif isinstance(node, ast.ImportFrom):
            base = from_base(name, node)
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                if target in known and target != name:
                    edges.append((target, node))
    return edges


def import_cycles() -> list[str]:
    """One shortest cycle per strongly connected group of package modules, each edge with its file:line."""
    names = package_modules()
    graph = {name: {} for name in names}
    for name in names:
        for target, node in import_edges(name):
            if target in names:
                graph[name].setdefault(target, where(names[name], node))
    return cycles_of(graph)


def cycles_of(graph: dict[str, dict[str, str]]) -> list[str]:
    """One shortest cycle per group of nodes of `graph` (node -> {node: 'file:line'}) that reach each other."""
    cycles, seen = [], set()
    for start in sorted(graph):
        if start in seen:
            continue
        path = shortest_path_back(graph, start)
        if path:
            seen.update(path)
            hops = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(path, path[1:] + path[:1])]
            cycles.append("; ".join(hops))
    return cycles


def shortest_path_back(graph: dict[str, dict[str, str]], start: str) -> list[str] | None:
    """The modules of a shortest import path from `start` back to itself (breadth first), or None."""
    came_from, queue = {start: None}, deque([start])
    while queue:
        here = queue.popleft()
        for there in sorted(graph[here]):
            if there == start:
                path = [here]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return path[::-1]
            if there not in came_from:
                came_from[there] = here
                queue.append(there)
    return None


def module_aliases(name: str) -> dict[str, str]:
    """Local name -> our module it is bound to, from every import statement of the module."""
    known, aliases = modules(), {}
    for node in ast.walk(parsed(known[name])):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in known:
                    aliases[alias.asname] = alias.name
                elif not alias.asname and alias.name.split(".")[0] in known:
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = from_base(name, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            call = node.value  # m = importlib.import_module("distload.x")
            if isinstance(call, ast.Call) and dotted(call.func) in (["importlib", "import_module"], ["import_module"]):
                if call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value in known:
                    aliases[node.targets[0].id] = call.args[0].value
    return aliases


def dotted(node: ast.AST) -> list[str] | None:
    """['a', 'b', 'c'] for the expression a.b.c, None for anything that is not a plain dotted name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *parts[::-1]] if isinstance(node, ast.Name) else None


def private_reach(module: str, attrs: list[str]) -> tuple[str, str] | None:
    """(owner, private name) when `module.attrs...` walks through our submodules to a private name."""
    known = modules()
    for attr in attrs:
        if f"{module}.{attr}" in known:
            module = f"{module}.{attr}"
        else:
            return (module, attr) if is_private(attr) else None
    return None


def private_uses(name: str) -> list[str]:
    """Every use in module `name` of another of our modules' private names, as 'file:line: text'."""
    known, path, found = modules(), modules()[name], set()
    aliases = module_aliases(name)

    def note(node: ast.AST, owner: str, attr: str) -> None:
        if owner != name:
            found.add(f"{where(path, node)}: {owner}.{attr}")

    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ImportFrom):
            base = from_base(name, node)
            for alias in node.names:
                if base in known and is_private(alias.name):
                    note(node, base, alias.name)
        elif isinstance(node, ast.Attribute) and (chain := dotted(node)) and chain[0] in aliases:
            if hit := private_reach(aliases[chain[0]], chain[1:]):
                note(node, *hit)
        elif isinstance(node, ast.Call) and len(node.args) >= 2:  # setattr(mod, "_x", ...), monkeypatch.setattr
            target, attr = node.args[0], node.args[1]
            chain = dotted(target)
            if chain and chain[0] in aliases and isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                if hit := private_reach(aliases[chain[0]], [*chain[1:], attr.value]):
                    note(node, *hit)
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            spelled = node.args[0].value  # monkeypatch.setattr("distload.loader._x", ...)
            if isinstance(spelled, str) and spelled.split(".")[0] in package_roots():
                if hit := private_reach(spelled.split(".")[0], spelled.split(".")[1:]):
                    note(node, *hit)
    return sorted(found)


def imports_process_group_at_load(path: Path) -> bool:
    """Whether the module imports torch.distributed at module level (not inside a function)."""
    for node in parsed(path).body:
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            return True
    return False


# The root's BASE modules: the job's inputs every layer may import (each its own node of the folder graph).
BASE_MODULES = ("errors", "dtypes", "faults", "gc_freeze", "deadline", "topology", "options", "validate", "stages")
ROOT_NODE = "root"   # the root's pipeline modules (loader, postprocess, report, ...), one node
# The faces: the Python API (distload/__init__.py) and the command line, on top of everything (engines/ included);
# no graph node of their own, and nothing below them may import them (test_structure checks).
FACE_MODULES = ("distload", "distload.__main__", "distload.cli", "distload.rules_cmd")


def folder_of(name: str) -> str | None:
    """The folder-graph node of package module `name`: its wing folder (distload/<folder>/, distload.kernels),
    a BASE module by itself, or ROOT_NODE; None for the faces (FACE_MODULES: the API and the command line)."""
    parts = name.split(".")
    if parts[0] != "distload" or name in FACE_MODULES:
        return None
    if len(parts) > 2 or modules()[name].name == "__init__.py":
        return parts[1]
    return parts[1] if parts[1] in BASE_MODULES else ROOT_NODE


def folder_graph() -> dict[str, dict[str, str]]:
    """node -> {node it imports: 'file:line' of the first such import} over the package's modules (function-local
    imports included)."""
    names = package_modules()
    graph: dict[str, dict[str, str]] = {}
    for name in sorted(names):
        here = folder_of(name)
        if here is None:
            continue
        graph.setdefault(here, {})
        for target, node in import_edges(name):
            there = folder_of(target) if target in names else None
            if there is not None and there != here:
                graph[here].setdefault(there, where(names[name], node))
                graph.setdefault(there, {})
    return graph


def folder_cycles() -> list[str]:
    """One shortest cycle per group of folder-graph nodes that import each other, each edge with its file:line."""
    return cycles_of(folder_graph())
