"""No import circles inside a folder: within each package folder the modules import one
another in one direction only. Module-level and function-level imports both count (a
function-level import is a circle deferred, not removed). Imports under
`if TYPE_CHECKING:` never run, so they cannot fail an import; they are checked apart, as
annotation circles (two modules that each name the other's types still depend on each
other for a reader)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_TOP = {"tests", "build", "dist", "docs"}
# Circles in folders whose modules are being reshaped by their own changes: each must
# go, and its entry with it (the test fails on any circle not listed and on any listed
# one that is gone).
KNOWN: set[frozenset[str]] = set()
# Circles that close only through `if TYPE_CHECKING:` imports, in folders being reshaped
# by their own changes; the same rules as KNOWN.
KNOWN_ANNOTATION: set[frozenset[str]] = set()


def package_modules(root: Path, package: str = "fusegen") -> dict[str, Path]:
    """Every module of the package under `root`, by its dotted name."""
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] in SKIP_TOP or parts == ("setup",) or any(
                p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info")
                for p in parts):
            continue
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        found[".".join((package, *parts))] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported(name: str, path: Path, modules: dict[str, Path],
             type_checking: bool = False) -> set[str]:
    """The package's modules `name` imports, at any depth; under `if TYPE_CHECKING:` only
    with `type_checking`."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if not type_checking and isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.rsplit(".", child.level - 1)[0]
                    base = f"{anchor}.{base}" if base else anchor
                for alias in child.names:
                    if f"{base}.{alias.name}" in modules:  # a submodule
                        found.add(f"{base}.{alias.name}")
                    elif base in modules:
                        found.add(base)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name in modules)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(name)
    return found


def folder_circles(modules: dict[str, Path], type_checking: bool = False
                   ) -> set[frozenset[str]]:
    """Each set of modules of one folder that import one another in a circle (Tarjan's
    strongly connected components over the edges within a folder); `type_checking`
    counts the imports under `if TYPE_CHECKING:` too."""
    edges = {name: {m for m in imported(name, path, modules, type_checking)
                    if modules[m].parent == path.parent}
             for name, path in modules.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), set()

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.add(frozenset(component))

    for name in sorted(modules):
        if name not in index:
            strong(name)
    return circles


def test_no_import_circle_inside_a_folder():
    circles = folder_circles(package_modules(ROOT))
    new = [sorted(c) for c in circles - KNOWN]
    assert not new, f"import circles inside a folder: {new}"
    gone = [sorted(c) for c in KNOWN - circles]
    assert not gone, f"these circles are gone: take them off KNOWN: {gone}"


def test_no_annotation_circle_inside_a_folder():
    circles = folder_circles(package_modules(ROOT), type_checking=True)
    new = [sorted(c) for c in circles - KNOWN - KNOWN_ANNOTATION]
    assert not new, f"import circles inside a folder, TYPE_CHECKING imports counted: {new}"
    gone = [sorted(c) for c in KNOWN_ANNOTATION - circles]
    assert not gone, f"these circles are gone: take them off KNOWN_ANNOTATION: {gone}"


def test_the_engine_runner_graphs_and_request_modules_import_one_way():
    modules = package_modules(ROOT)
    uses = {name: imported(name, modules[name], modules) for name in modules}
    e = "fusegen.engine."
    assert e + "model_runner" not in uses[e + "graphs"]
    # request.py is read by these for its types and names none of theirs, not even in an
    # annotation
    request_names = imported(e + "request", modules[e + "request"], modules,
                             type_checking=True)
    for module in ("logits_processors", "logprobs", "outputs"):
        assert e + module not in request_names
    # the registry imports no family module (they import it), only the config it fills
    assert not any(name.startswith(e + "models.") and name not in (e + "models",
                                                                   e + "models.config")
                   for name in uses[e + "models.registry"])


def test_function_level_imports_count_and_type_checking_ones_do_not(tmp_path):
    pkg = tmp_path / "a"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("from fusegen.a.y import f\n")
    (pkg / "y.py").write_text("def f():\n    from fusegen.a import x\n")
    (pkg / "z.py").write_text("from typing import TYPE_CHECKING\nfrom fusegen.a import x\n"
                              "if TYPE_CHECKING:\n    from fusegen.a.w import W\n")
    (pkg / "w.py").write_text("from fusegen.a.z import *\n")
    other = tmp_path / "b"
    other.mkdir()
    (other / "v.py").write_text("from fusegen.a import u\n")
    (pkg / "u.py").write_text("from fusegen.b import v\n")  # across folders: not counted
    modules = package_modules(tmp_path)
    assert set(modules) >= {"fusegen.a", "fusegen.a.x", "fusegen.a.y", "fusegen.b.v"}
    assert folder_circles(modules) == {frozenset({"fusegen.a.x", "fusegen.a.y"})}
    assert folder_circles(modules, type_checking=True) == {
        frozenset({"fusegen.a.x", "fusegen.a.y"}), frozenset({"fusegen.a.z", "fusegen.a.w"})}
