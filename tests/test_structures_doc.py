"""docs/structures.md maps every module: each of the package's .py files (and the C
kernels) has a row, and every path a row names exists.

Rows are read from the tables under the `## <folder>/` headings: the first cell's
backticked names are paths relative to that folder (under any other heading, relative
to the repository root)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "structures.md"
# Not modules of the installed package: the tests, the build script, build outputs.
SKIP_TOP = {"tests", "build", "dist", "docs"}
LISTED_SUFFIXES = (".py", ".c", ".h")


def package_modules() -> set[str]:
    """Every .py module of the package and every C source, as repository-relative paths."""
    found = set()
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        parts = rel.parts
        if path.suffix not in LISTED_SUFFIXES or not path.is_file():
            continue
        if parts[0] in SKIP_TOP or rel.as_posix() == "setup.py":
            continue
        if any(p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info")
               for p in parts):
            continue
        found.add(rel.as_posix())
    return found


def documented_paths(text: str) -> dict[str, int]:
    """Repository-relative path -> line number of each path a table row's first cell names."""
    listed, folder = {}, ""
    for number, line in enumerate(text.splitlines(), 1):
        heading = re.match(r"^##\s+(\S+)", line)
        if heading:
            name = heading.group(1)
            folder = name if name.endswith("/") else ""
            continue
        if not line.startswith("|"):
            continue
        cells = line.split("|")
        if len(cells) < 3:
            continue
        for name in re.findall(r"`([^`]+)`", cells[1]):
            if name.endswith(LISTED_SUFFIXES):
                listed[folder + name] = number
    return listed


def test_documented_paths_parse():
    listed = documented_paths("## engine/ (alone)\n| file | what |\n| --- | --- |\n"
                              "| `a.py`, `models/b.py` | x `c.py` |\n## Other\n| `d.py` | y |\n")
    assert listed == {"engine/a.py": 4, "engine/models/b.py": 4, "d.py": 6}


def test_every_module_is_in_structures_md():
    modules = package_modules()
    assert {"engine/llm.py", "jobs/flags.py", "kernels/csrc/gemm.c"} <= modules  # the walk works
    listed = documented_paths(DOC.read_text())
    missing = sorted(modules - set(listed))
    stale = sorted(f"{path} (docs/structures.md line {line})"
                   for path, line in listed.items() if not (ROOT / path).is_file())
    problems = ([f"missing from docs/structures.md: {p}" for p in missing]
                + [f"listed in docs/structures.md but not in the tree: {p}" for p in stale])
    assert not problems, "\n".join(problems)
