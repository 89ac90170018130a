"""`fusegen workflow check`: every problem of a workflow file in one pass.

The file's keys (spec.py), then, for the given params and run date, every step that can
be built: its variables, job options, columns (resolve.py) and model folder
(preflight.py). A broken step leaves out only the steps that read it (named in a note);
every other step is still checked, so one pass lists what a user has to fix.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fusegen.workflows.errors import Problem, ValidationError
from fusegen.workflows.preflight import model_problems
from fusegen.workflows.resolve import ResolvedWorkflow, resolve_all
from fusegen.workflows.run import default_run_date
from fusegen.workflows.spec import Workflow, load_checked

# Top-level keys whose problems leave nothing to resolve the steps with
_BLOCKING_KEYS = ("params", "defaults", "workdir", "steps")


@dataclass(slots=True)
class CheckReport:
    source: str
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    resolved: ResolvedWorkflow | None = None

    def error(self) -> ValidationError | None:
        return ValidationError(self.source, self.problems) if self.problems else None


def check_file(path: str, overrides: dict | None, run_date: str | None) -> CheckReport:
    """Every problem of the file at `path` for these params and run date (default: today
    on the schedule's clock); never raises for a problem of the file."""
    workflow, problems = load_checked(path)
    report = CheckReport(path, list(problems))
    if workflow is None or any(p.step is None and (p.key or "").split(".")[0]
                               in _BLOCKING_KEYS for p in problems):
        return report
    # A step whose wrong keys are job options (an unknown one, no model) is still built,
    # so the steps after it are checked against its columns; any other is left out.
    broken = {p.step for p in problems if p.step is not None}
    soft = {p.step for p in problems if p.step is not None
            and (p.key or "").startswith("generate.")}
    hard = {p.step for p in problems if p.step is not None
            and not (p.key or "").startswith("generate.")}
    if run_date is None:
        run_date = default_run_date(workflow)
    resolved, found = resolve_all(_without(workflow, hard), overrides, run_date,
                                  frozenset(soft - hard))
    seen = {(p.step, p.key) for p in problems}
    report.problems += [p for p in found if (p.step, p.key) not in seen]
    models, report.notes = model_problems(resolved)
    report.problems += models
    report.resolved = resolved
    built = {s.name: s for s in resolved.steps}
    after_python: set[str] = set()  # their columns are known only as the run goes
    for step in resolved.steps:
        parent = built.get(step.parents[0]) if step.parents else None
        if parent is not None and (parent.python is not None or parent.name in after_python):
            after_python.add(step.name)
            what = "is a python step" if parent.python is not None else "follows a python step"
            report.notes.append(f"{step.name}: columns checked as the run goes: step "
                                f"{parent.name!r} {what}, whose columns are known from what "
                                "its function returns")
        elif parent is not None and parent.schema is None:
            report.notes.append(f"{step.name}: columns not checked: step {parent.name!r}, "
                                "which it reads, has problems")
    with_problem = {p.step for p in report.problems} | broken
    for name in workflow.order:
        step = workflow.steps[name]
        if name not in built and name not in with_problem:
            report.notes.append(f"{name}: not checked further: it reads step "
                                f"{step.from_step!r}, which has problems")
    return report


def _without(workflow: Workflow, broken: set[str]) -> Workflow:
    """The workflow less the steps whose keys are wrong (resolving them could only
    repeat those problems)."""
    if not broken:
        return workflow
    return dataclasses.replace(
        workflow, steps={n: s for n, s in workflow.steps.items() if n not in broken},
        order=[n for n in workflow.order if n not in broken])
