"""workflows/ uses jobs/ only through what `fusegen.jobs` exports (`jobs/__init__.py`)."""
import ast
import importlib
from pathlib import Path

import fusegen.jobs

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"


def _jobs_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import of fusegen.jobs or below, however nested."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("fusegen.jobs"):
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names
                      if a.name.startswith("fusegen.jobs")]
    return found


def test_workflows_import_only_what_jobs_exports():
    modules = sorted(WORKFLOWS.glob("*.py"))
    assert len(modules) > 10
    problems, used = [], set()
    for path in modules:
        for line, module, names in _jobs_imports(path):
            if module != "fusegen.jobs" or not names:
                problems.append(f"workflows/{path.name}:{line}: imports {module}; import "
                                "from fusegen.jobs (add the name to jobs/__init__.py)")
            problems += [f"workflows/{path.name}:{line}: {n} is not in fusegen.jobs.__all__"
                         for n in names if n not in fusegen.jobs.__all__]
            used.update(names)
    assert not problems, "\n".join(problems)
    assert {"run_job", "Output", "JobError"} <= used  # the walk did see the imports


def test_every_export_resolves():
    jobs = importlib.import_module("fusegen.jobs")
    for name in jobs.__all__:
        assert getattr(jobs, name) is not None, name
    assert jobs.Output is importlib.import_module("fusegen.jobs.output").Output
