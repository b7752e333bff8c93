"""House rules for the whole tree, read from the source (AST) rather than by importing distload, so a rule
broken anywhere is reported even where importing that code would fail: no import circles, no private names
used across modules, modules and functions of a readable size, and a package face that leaves the transfer
engine and the process group out of `import distload.rules.names` (tests/jobs/test_package_face.py, in a fresh
interpreter), and tests by kind: each in its kind's folder, none importing another test module."""

from __future__ import annotations

import ast
import tomllib

from source_tree import (FACE_MODULES, ROOT, SUPPORT, TEST_KINDS, folder_cycles, import_cycles, import_edges, modules,
                         package_modules, package_roots, parsed, private_uses, test_modules, where)

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles (function-local imports included):\n" + "\n".join(cycles)


def test_no_folder_level_import_loops():
    """The wings (distload/<folder>/), the root's pipeline modules (one node) and each of its BASE modules (the job's
    inputs) import each other without a loop, function-local imports included: a wing that imports what imports it
    is one concern spread over two folders (plan/ must be handed quantization, never import quant/)."""
    cycles = folder_cycles()
    assert not cycles, "folder-level import loops:\n" + "\n".join(cycles)


def test_nothing_below_the_faces_imports_them():
    """The API and the command line (source_tree.FACE_MODULES) sit on top: a module under them that imports one
    would loop through them unseen by the folder graph."""
    names = package_modules()
    uses = [f"{where(path, node)}: {name} imports {target}" for name, path in names.items() if name not in FACE_MODULES
            for target, node in import_edges(name) if target in FACE_MODULES]
    assert not uses, "modules importing the API or the command line:\n" + "\n".join(uses)


# quant_method values (and compressed-tensors' format names) that only the quantization wing may compare.
QUANT_METHODS = ("fp8", "gptq", "awq", "modelopt", "bitsandbytes", "mxfp4", "compressed-tensors", "pack-quantized")
QUANT_WING = ROOT / "distload" / "quant"


def _registry_names() -> set[str]:
    """Every format's registry name: the `name: ClassVar[str] = "..."` of the format classes in quant/ (read from
    the source, as the other rules are)."""
    found = set()
    for path in QUANT_WING.glob("*.py"):
        for node in ast.walk(parsed(path)):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "name"
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                    and node.value.value):
                found.add(node.value.value)
    return found


def _named_formats(node: ast.AST, formats: set[str]) -> list[str]:
    """The format names a comparison operand spells: a string, or strings in a tuple, list or set display."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and i.value in formats]


def _format_comparisons(tree: ast.AST, formats: set[str]) -> list[tuple[ast.AST, list[str]]]:
    """(node, names) of every ==, !=, in, not in or case pattern in `tree` that spells a format name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn)
                                                 for op in node.ops):
            named = [n for operand in (node.left, *node.comparators) for n in _named_formats(operand, formats)]
        elif isinstance(node, ast.MatchValue):
            named = _named_formats(node.value, formats)
        else:
            continue
        if named:
            out.append((node, named))
    return out


BRANCHING = """
if method == "gptq" or "awq" != kind or name in ("fp8", "fp8-block"):
    match fmt:
        case "mxfp4":
            pass
"""


def test_no_format_name_compared_outside_the_quantization_wing():
    """Picking a format by its name (`method == "gptq"`, `name in ("fp8", ...)`, `case "awq":`) belongs to the format's
    own module: anywhere else it is the branching a registry replaces (quant/__init__.py)."""
    formats = _registry_names() | set(QUANT_METHODS)
    assert {"fp8", "fp8-block", "gptq", "mxfp4"} <= formats, sorted(formats)   # the names are found at all
    assert [names for _, names in _format_comparisons(ast.parse(BRANCHING), formats)] == \
        [["gptq"], ["awq"], ["fp8", "fp8-block"], ["mxfp4"]]                     # and every kind of comparison
    kernels = package_roots()["distload.kernels"]
    found = [f"{where(path, node)}: compares {', '.join(map(repr, named))}"
             for path in package_modules().values() if QUANT_WING not in path.parents and kernels not in path.parents
             for node, named in _format_comparisons(parsed(path), formats)]
    assert not found, ("format names compared outside distload/quant/ (ask the format object instead):\n"
                       + "\n".join(found))


def test_no_private_names_across_modules():
    uses = [use for name in sorted(modules()) for use in private_uses(name)]
    assert not uses, "private names used outside their module (make them public or move them):\n" + "\n".join(uses)


def test_modules_are_at_most_400_lines():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in package_modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_functions_are_at_most_80_lines_outside_scripts():
    long = []
    for path in modules().values():
        if path.parent.name == "scripts":
            continue
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long.append(f"{where(path, node)}: {node.name} {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_every_package_folder_is_packaged():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in package_modules().items() if path.name == "__init__.py"}
    assert folders <= listed, f"packages missing from pyproject.toml [tool.setuptools] packages: {sorted(folders - listed)}"


def test_only_kernels_import_triton():
    kernels = package_roots()["distload.kernels"]
    importers = []
    for path in modules().values():
        for node in ast.walk(parsed(path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [getattr(node, "module", None)]
            if isinstance(node, ast.Import | ast.ImportFrom) and any((n or "").split(".")[0] == "triton" for n in names):
                if kernels not in path.parents:
                    importers.append(where(path, node))
    assert not importers, "triton imported outside kernels/ (call a kernel instead):\n" + "\n".join(importers)




def test_no_test_module_imports_another():
    """Shared helpers live in tests/support/; a test module importing another drags its fixtures and its
    collection along, and hides which helpers are shared."""
    tests = test_modules()
    uses = [f"{where(path, node)}: {name} imports {target}" for name, path in tests.items()
            for target, node in import_edges(name) if target in tests]
    assert not uses, "test modules importing test modules (move the helper to tests/support/):\n" + "\n".join(uses)


def test_tests_sit_in_the_folder_of_their_kind():
    """tests/<kind>/test_*.py for the kinds tests/conftest.py names; tests/support/ holds no test; nothing else."""
    tests_dir = ROOT / "tests"
    misplaced = [str(p.relative_to(ROOT)) for p in tests_dir.rglob("test_*.py")
                 if p.parent.parent != tests_dir or p.parent.name not in TEST_KINDS]
    assert not misplaced, f"test modules outside tests/{{{','.join(TEST_KINDS)}}}/:\n" + "\n".join(misplaced)
    loose = [p.name for p in tests_dir.glob("*.py") if p.name != "conftest.py"]
    assert not loose, f"modules directly in tests/ (helpers go to tests/{SUPPORT}/): {loose}"


def test_test_module_basenames_are_unique():
    """pytest imports tests/<kind>/ modules by basename (rootdir-relative, no packages): two test_x.py in two kinds
    stop collection with 'import file mismatch' on a clean clone."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    twins = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twins, f"test modules sharing a basename (rename one): {twins}"
