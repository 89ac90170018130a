"""What a workflow can fail with. Every message names the step and the key to fix."""
from __future__ import annotations

from dataclasses import dataclass


class WorkflowError(Exception):
    """A workflow cannot start or go on; the message says what to fix."""
    run_id: int | None = None  # the recorded run it stopped, when one had started


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a workflow file: where (step, key) and what."""
    step: str | None  # None: a top-level key
    key: str | None
    message: str

    def __str__(self) -> str:
        where = []
        if self.step is not None:
            where.append(f"step {self.step!r}")
        if self.key is not None:
            where.append(f"key {self.key!r}")
        return f"{', '.join(where)}: {self.message}" if where else self.message


class ValidationError(WorkflowError):
    """The workflow file is wrong; raised before anything runs, with every problem found."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"workflow {source} is not valid:\n{lines}")


class WorkflowBusy(WorkflowError):
    """Another run of the same workflow holds its lock (overlap is never allowed)."""
