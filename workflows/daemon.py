"""The cron daemon (`fusegen workflow schedule`): fires workflow runs on their cron
schedules, one run at a time.

Plain Python over an injectable clock: `tick()` starts what is due at `clock()`,
`run_next()` executes one started run, and `serve()` loops the two in real time. Tests
drive `tick`/`run_next` with a fake clock and never sleep.

- Never two runs of one workflow at once: a workflow with a run queued or running here
  is not considered, and the run store's lock keeps out other processes (a manual
  `fusegen workflow run`, another scheduler).
- Runs execute one after another in this process (its engine cache holds one model); a
  fire waiting behind another workflow's run was started on time, so it is not "missed".
- Restarts: the last fire time of each workflow is in the store, so fires missed while
  down follow the `missed` policy; a scheduled run left queued or running by a stopped
  or killed scheduler is resumed first (its steps keep their committed parts).
- Schedules more often than daily: each run sees its fire time as {{ run_time }}. A fire
  whose steps all find their outputs committed for the same inputs (a second fire of the
  day writing under {{ run_date }}) computes nothing and is recorded `skipped`. When an
  input changed, the workflow's own outputs are recomputed; an explicit `output:` made
  from the old version fails the fire with the command that recomputes it (the same
  scheduler with --overwrite, which recomputes such outputs, and only those).
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Callable

from fusegen.workflows.errors import WorkflowBusy, WorkflowError
from fusegen.workflows.preflight import check_models
from fusegen.workflows.resolve import effective_params
from fusegen.workflows.render import RUN_TIME
from fusegen.workflows.run import (Clock, RunOutcome, _message, execute_run, finished_status,
                                   resolve_recorded, utc_now, utc_text)
from fusegen.workflows.fire_times import decide, next_fire, run_date
from fusegen.workflows.credentials import MASK, public_params, secret_params
from fusegen.workflows.spec import Workflow
from fusegen.workflows.store import LEASE_SECONDS, RunStore, new_owner

log = logging.getLogger("fusegen.workflows")


@dataclass(slots=True)
class Ticket:
    """A started scheduled run: recorded in the store, holding the workflow's lock."""
    run_id: int
    workflow: Workflow
    fire: datetime  # the cron time it is for
    run_date: str
    params: dict
    resumes: int | None = None  # the interrupted run it continues

    @property
    def run_time(self) -> str:
        return utc_text(self.fire)


class CronDaemon:
    def __init__(self, workflows: list[Workflow], store: RunStore, *,
                 params: dict | None = None, clock: Clock = utc_now,
                 execute: Callable[[Ticket], RunOutcome | None] | None = None,
                 lease_seconds: float = LEASE_SECONDS, overwrite: bool = False,
                 command: str | None = None):
        """`params`: --param overrides for every run; `execute` runs one ticket (default:
        the workflow's steps). `overwrite`: recompute an explicit output made from another
        version of its input or step (otherwise the fire fails, naming `command` with
        --overwrite: the command line that started this scheduler)."""
        names = [w.name for w in workflows]
        for w in workflows:
            if w.schedule is None:
                raise WorkflowError(f"workflow {w.source} has no `schedule:`; add one "
                                    "(cron: \"0 2 * * *\") or run it with `fusegen workflow run`")
            if names.count(w.name) > 1:
                raise WorkflowError(f"two workflow files are named {w.name!r}; give each a "
                                    "distinct `name:`")
        unknown = sorted(set(params or {}) - {p for w in workflows for p in w.params})
        if unknown:
            raise WorkflowError(f"--param {', '.join(unknown)}: no workflow file declares it "
                                "under `params:`")
        self.workflows = workflows
        self.params = {w.name: effective_params(w, {k: v for k, v in (params or {}).items()
                                                    if k in w.params}) for w in workflows}
        self.store, self.clock, self.lease_seconds = store, clock, lease_seconds
        self.overwrite, self.command = overwrite, command
        self.execute = execute or self._execute
        self.owner = new_owner()
        self._queue: queue.Queue = queue.Queue()
        self._in_flight: dict[str, Ticket] = {}
        self._running: Ticket | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        now = clock()
        for w in workflows:  # first start: fire from now on, never backfill history
            if store.last_fire(w.name) is None:
                store.set_last_fire(w.name, now)

    # -- policy: what to start now ----------------------------------------------------------

    def tick(self) -> list[Ticket]:
        """Start every run due at clock(); returns the tickets started (queued)."""
        now = self.clock()
        started = []
        for workflow in self.workflows:
            with self._lock:
                ticket = self._in_flight.get(workflow.name)
            if ticket is not None:  # never overlap: its next fire waits for it
                self.store.heartbeat(ticket.run_id, now)
                continue
            try:
                ticket = self._resume(workflow, now) or self._fire(workflow, now)
            except WorkflowBusy as exc:
                log.info("%s: not firing: %s", workflow.name, exc)
                continue
            if ticket is not None:
                started.append(ticket)
        return started

    def _resume(self, workflow: Workflow, now: datetime) -> Ticket | None:
        """The workflow's last run, if it is a scheduled run that never finished."""
        self.store.release_stale(workflow.name, now, self.lease_seconds)
        last = self.store.runs(workflow.name, limit=1)
        if not last or last[0].trigger != "schedule" or last[0].status != "interrupted":
            return None
        old = last[0]
        log.info("%s: resuming interrupted run %s (fire %s)", workflow.name, old.run_id,
                 old.scheduled_for)
        # The store keeps credential params masked: this scheduler's own values stand in
        current = self.params[workflow.name]
        params = {k: current.get(k, v) if v == MASK else v for k, v in old.params.items()}
        return self._start(workflow, datetime.fromisoformat(old.scheduled_for), now,
                           old.run_date, params, old.run_id)

    def _fire(self, workflow: Workflow, now: datetime) -> Ticket | None:
        schedule = workflow.schedule
        last = self.store.last_fire(workflow.name)
        decision = decide(schedule, last, now)
        if decision.num_skipped:
            log.warning("%s: skipped %d missed fire(s) up to %s (missed: skip)", workflow.name,
                        decision.num_skipped, decision.last_fire.isoformat())
        if decision.fire is None:
            if decision.last_fire != last:
                self.store.set_last_fire(workflow.name, decision.last_fire)
            return None
        return self._start(workflow, decision.fire, now, run_date(schedule, decision.fire),
                           self.params[workflow.name])

    def _start(self, workflow, fire, now, date, params, resumes=None) -> Ticket:
        secret = secret_params(workflow, params, date, {RUN_TIME: utc_text(fire)})
        run_id = self.store.start_run(
            workflow.name, source=workflow.path or workflow.source,
            run_date=date, params=public_params(params, secret), owner=self.owner, now=now,
            trigger="schedule", scheduled_for=fire, status="queued",
            lease_seconds=self.lease_seconds, run_time=utc_text(fire))
        ticket = Ticket(run_id, workflow, fire, date, params, resumes)
        with self._lock:
            self._in_flight[workflow.name] = ticket
        self._queue.put(ticket)
        log.info("%s: run %s queued for fire %s (run_date %s)", workflow.name, run_id,
                 ticket.run_time, date)
        return ticket

    # -- mechanism: running what was started ------------------------------------------------

    def run_next(self, block: bool = False) -> Ticket | None:
        """Execute the oldest started run to its end (None when there is none)."""
        try:
            ticket = self._queue.get(block=block)
        except queue.Empty:
            return None
        if ticket is None:  # serve()'s stop sentinel
            return None
        with self._lock:
            self._running = ticket
        self.store.mark_running(ticket.run_id, self.clock())
        status, error = "interrupted", "the scheduler stopped during the run"
        try:
            outcome = self.execute(ticket)
            status, error = "succeeded", None
            if isinstance(outcome, RunOutcome):
                status = finished_status(self.store, ticket.run_id, outcome)
                if outcome.up_to_date:
                    log.info("%s: run %s (fire %s): %s", ticket.workflow.name, ticket.run_id,
                             ticket.run_time, "every output is up to date; skipped"
                             if status != "succeeded" else "finished")
        except Exception as exc:  # noqa: BLE001 - recorded; the scheduler goes on
            status, error = "failed", _message(exc)
            log.error("%s: run %s failed: %s", ticket.workflow.name, ticket.run_id, error)
        finally:
            self.store.finish_run(ticket.run_id, status, self.clock(), error)
            with self._lock:
                self._running = None
                self._in_flight.pop(ticket.workflow.name, None)
            self._wake.set()
        return ticket

    def _execute(self, ticket: Ticket) -> RunOutcome:
        resolved = resolve_recorded(ticket.workflow, self.store, ticket.run_id, ticket.params,
                                    ticket.run_date, ticket.run_time)
        check_models(resolved)
        return execute_run(resolved, self.store, ticket.run_id, replace_stale=self.overwrite,
                           stale_hint=self._stale_hint(ticket.workflow))

    def _stale_hint(self, workflow: Workflow) -> str:
        command = self.command or f"fusegen workflow schedule {workflow.path or workflow.source}"
        if "--overwrite" not in command.split():
            command += " --overwrite"
        return (f"to recompute it from the new version on the next fire, restart the "
                f"scheduler with --overwrite: {command} (or give the step an `output:` with "
                "{{ run_time }} in it, one per fire)")

    # -- the real-time loop ------------------------------------------------------------------

    def serve(self, poll_seconds: float = 30.0) -> None:
        """Fire runs until stop() is called; then finish the run in progress, mark queued
        ones interrupted (the next start resumes them) and return."""
        worker = threading.Thread(target=self._work, daemon=True, name="fusegen-workflow-runs")
        worker.start()
        try:
            while not self._stopping:
                self._wake.clear()  # before tick: a run ending during it wakes the wait
                self.tick()
                self._wake.wait(self._seconds_to_next(poll_seconds))
        finally:
            self._drop_queued()
            self._queue.put(None)
            worker.join()

    def stop(self) -> None:
        """Stop firing (safe from a signal handler); serve() returns once the run in
        progress ends."""
        self._stopping = True
        self._wake.set()

    def abandon(self) -> None:
        """Give up the run in progress: record it interrupted and free its lock, so the
        next start resumes it (for a second Ctrl-C; the process exits next)."""
        with self._lock:
            ticket = self._running
        if ticket is not None:
            self.store.finish_run(ticket.run_id, "interrupted", self.clock(),
                                  "the scheduler was stopped during the run")

    def _work(self) -> None:
        while not self._stopping or not self._queue.empty():
            if self.run_next(block=True) is None and self._stopping:
                return

    def _drop_queued(self) -> None:
        while True:
            try:
                ticket = self._queue.get_nowait()
            except queue.Empty:
                return
            if ticket is not None:
                self.store.finish_run(ticket.run_id, "interrupted", self.clock(),
                                      "the scheduler stopped before the run started")

    def _seconds_to_next(self, poll_seconds: float) -> float:
        now = self.clock()
        waits = [poll_seconds]
        for w in self.workflows:
            last = self.store.last_fire(w.name) or now
            waits.append((next_fire(w.schedule, max(last, now)) - now).total_seconds())
        return max(0.05, min(waits))
