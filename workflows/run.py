"""One run of a workflow: resolve and check it, take its lock, run the steps in DAG order,
record every step in the run store.

Each step is a resumable job, and step outputs do not depend on the attempt: rerunning a
failed run (same file, params and run date) keeps every committed part and continues
where it stopped. An output never mixes parts made from two versions of its input or of
the file: an intermediate output (no `output:`, so the workflow's own) is recomputed when
either changed; an explicit `output:` is refused instead, until --overwrite.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from typing import Callable

from fusegen.jobs import JobError, redact_url
from fusegen.workflows.errors import WorkflowError
from fusegen.workflows.preflight import check_models
from fusegen.workflows.render import RUN_ID
from fusegen.workflows.resolve import ResolvedWorkflow, check_late, resolve, uses_variable
from fusegen.workflows.spec import Workflow
from fusegen.workflows.steps import RERUN_HINT, Clients, StepCounts, run_step
from fusegen.workflows.store import HEARTBEAT_SECONDS, SKIPPED, RunStore, new_owner

log = logging.getLogger("fusegen.workflows")
Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(slots=True)
class StepOutcome:
    name: str
    kind: str
    output: str
    counts: StepCounts


@dataclass(slots=True)
class RunOutcome:
    run_id: int
    run_date: str
    steps: list[StepOutcome] = field(default_factory=list)
    status: str = "succeeded"  # or "skipped": see `up_to_date`

    @property
    def up_to_date(self) -> bool:
        """Every step found its output committed for the same inputs: nothing computed."""
        return all(s.counts.num_parts_computed == 0 for s in self.steps)


def utc_text(when: datetime) -> str:
    """A time as {{ run_time }} shows it: ISO 8601 in UTC, to the second (…T14:30:00Z)."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def finished_status(store: RunStore, run_id: int, outcome: RunOutcome) -> str:
    """`skipped` for a run with nothing to do, unless it continues an unfinished attempt
    (then it finished that attempt's work: `succeeded`)."""
    run = store.run(run_id)
    return SKIPPED if outcome.up_to_date and run is not None and run.resumes is None \
        else "succeeded"


def resolve_recorded(workflow: Workflow, store: RunStore, run_id: int, params: dict | None,
                     run_date: str, run_time: str) -> ResolvedWorkflow:
    """The workflow for a recorded run, {{ run_id }} filled in (its first attempt's id)."""
    return resolve(workflow, params, run_date, run_time=run_time,
                   run_id=store.first_attempt(run_id))


def default_run_date(workflow: Workflow, clock: Clock = utc_now) -> str:
    """Today: on the schedule's time zone, or the machine's without a schedule."""
    now = clock()
    if workflow.schedule is not None:
        return now.astimezone(workflow.schedule.tz).date().isoformat()
    return now.astimezone().date().isoformat()


def run_workflow(workflow: Workflow, store: RunStore, *, params: dict | None = None,
                 run_date: str | None = None, run_time: str | None = None,
                 overwrite: bool = False, clock: Clock = utc_now,
                 echo: Callable[[str], None] | None = None) -> RunOutcome:
    """Run the workflow once (a manual run). The file is checked first: a bad file raises
    ValidationError before anything is recorded or run. `run_time` (ISO 8601): its
    {{ run_time }}, by default now. A run that finds every output up to date is recorded
    `skipped`."""
    run_date = _check_date(run_date or default_run_date(workflow, clock))
    run_time = check_time(run_time) if run_time else utc_text(clock())
    resolved = resolve(workflow, params, run_date, run_time=run_time)
    check_models(resolved)
    run_id = store.start_run(workflow.name, source=workflow.path or workflow.source,
                             run_date=run_date, params=resolved.public_params,
                             owner=new_owner(), now=clock(), run_time=run_time)
    with _Heartbeat(store, run_id, clock):
        try:
            if uses_variable(workflow, RUN_ID):
                resolved = resolve_recorded(workflow, store, run_id, params, run_date, run_time)
            outcome = execute_run(resolved, store, run_id, overwrite=overwrite, clock=clock,
                                  echo=echo)
        except BaseException as exc:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            store.finish_run(run_id, status, clock(), resolved.redactor()(_message(exc)))
            if isinstance(exc, WorkflowError):
                exc.run_id = run_id  # for the hint that resumes it
            raise
    outcome.status = finished_status(store, run_id, outcome)
    store.finish_run(run_id, outcome.status, clock())
    return outcome


def execute_run(resolved: ResolvedWorkflow, store: RunStore, run_id: int, *,
                overwrite: bool = False, clock: Clock = utc_now,
                echo: Callable[[str], None] | None = None, replace_stale: bool = False,
                stale_hint: str = RERUN_HINT) -> RunOutcome:
    """Run the steps of an already recorded run; each step's start, counts or error go to
    the store as they happen. Raises on the first failed step. `replace_stale` and
    `stale_hint`: for an output made from another version of its input (run_step)."""
    echo = echo or (lambda text: log.info("%s", text))
    store.add_steps(run_id, [(s.name, s.kind, redact_url(s.output)) for s in resolved.steps])
    outcome = RunOutcome(run_id, resolved.run_date)
    recomputed: set[str] = set()
    clients = Clients()
    try:
        for step in resolved.steps:
            store.step_started(run_id, step.name, clock())
            echo(f"step {step.name} ({step.kind}): {redact_url(step.input)} -> "
                 f"{redact_url(step.output)}")
            input_changed = any(p in recomputed for p in step.parents)
            try:
                if step.parents and step.schema is None and step.python is None:
                    # after a python step: its columns are known now that its input exists
                    check_late(step, resolved.workflow.source)
                counts = run_step(step, clients, overwrite, input_changed, replace_stale,
                                  stale_hint)
            except BaseException as exc:
                message = resolved.redactor(step)(_message(exc))
                store.step_failed(run_id, step.name, clock(), message)
                if isinstance(exc, Exception):
                    raise WorkflowError(f"step {step.name!r} failed: {message}") from None
                raise
            store.step_finished(run_id, step.name, clock(), counts.as_dict())
            if counts.num_parts_computed:
                recomputed.add(step.name)
            echo(_summary(step.name, counts))
            outcome.steps.append(StepOutcome(step.name, step.kind, step.output, counts))
    finally:
        clients.close()
    return outcome


def _summary(name: str, c: StepCounts) -> str:
    kept = f", {c.num_parts_kept} kept from an earlier attempt" if c.num_parts_kept else ""
    text = f"step {name}: {c.num_input_rows} rows in, {c.num_rows} out ({c.num_parts} parts{kept})"
    if c.num_errors:
        text += f", {c.num_errors} error rows"
    if c.num_generated_tokens:
        text += f", {c.num_prompt_tokens} prompt / {c.num_generated_tokens} generated tokens"
    return text


def _message(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (SIGINT)"
    if isinstance(exc, (WorkflowError, JobError)):  # already say what to fix
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def check_time(text: str) -> str:
    """--run-time as {{ run_time }} shows it; a time without a zone is read as UTC."""
    try:
        when = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise WorkflowError(f"run time {text!r} is not an ISO 8601 time; use "
                            "YYYY-MM-DDTHH:MM:SSZ (e.g. 2026-11-26T14:30:00Z)") from None
    return utc_text(when if when.tzinfo else when.replace(tzinfo=timezone.utc))


def _check_date(text: str) -> str:
    try:
        return date.fromisoformat(text).isoformat()
    except (TypeError, ValueError):
        raise WorkflowError(f"run date {text!r} is not a date; use YYYY-MM-DD") from None


class _Heartbeat:
    """Refreshes the run's lock while it runs, so other processes see it is alive."""

    def __init__(self, store: RunStore, run_id: int, clock: Clock,
                 interval: float = HEARTBEAT_SECONDS):
        self.store, self.run_id, self.clock, self.interval = store, run_id, clock, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name=f"fusegen-heartbeat-{run_id}")

    def _beat(self):
        while not self._stop.wait(self.interval):
            try:
                self.store.heartbeat(self.run_id, self.clock())
            except Exception as exc:  # noqa: BLE001 - a missed beat is not fatal
                log.warning("run %s: heartbeat failed: %s", self.run_id, exc)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
