"""`fusegen workflow run|resume|schedule|status|history|show|check`."""
from __future__ import annotations

import os
import signal
from datetime import datetime

import click

from fusegen.jobs import JobError
from fusegen.workflows.errors import ValidationError, WorkflowError

_STORE = click.option("--store", "store_url", default=None, metavar="URL",
                      help="Run store: sqlite:///path/runs.db.  [default: "
                      "$FUSEGEN_STATE_DIR/runs.db, else ~/.fusegen/state/runs.db]")
_PARAM = click.option("--param", "params", multiple=True, metavar="KEY=VALUE",
                      help="Override a parameter's default (repeatable); the value is read "
                      "as YAML, so 3 is a number and [a, b] a list.")


class _Invalid(click.ClickException):
    exit_code = 2


def _fail(exc: Exception):
    if isinstance(exc, ValidationError):
        raise _Invalid(str(exc)) from None
    raise click.ClickException(str(exc)) from None


@click.group()
def workflow():
    """Multi-step dataset-to-dataset pipelines, run once or on a schedule.

    A workflow file (YAML) names steps: generation jobs (every `fusegen run` option),
    light transforms (filter rows, select/rename columns, drop error rows) and python
    steps (`python: module:function` over each partition), each reading a dataset URL or
    another step's output."""


@workflow.command()
@click.argument("file", type=click.Path(dir_okay=False))
@_PARAM
@click.option("--run-date", default=None, metavar="YYYY-MM-DD",
              help="The run's {{ run_date }}.  [default: today, in the schedule's time zone]")
@click.option("--run-time", default=None, metavar="ISO-8601",
              help="The run's {{ run_time }}, e.g. 2026-11-26T14:00:00Z (no zone: UTC).  "
              "[default: now]")
@click.option("--overwrite", is_flag=True, help="Recompute every step from scratch instead "
              "of keeping parts committed by an earlier attempt.")
@_STORE
def run(file, params, run_date, run_time, overwrite, store_url):
    """Run the workflow FILE once, steps in DAG order.

    Every step is a resumable job: if a run fails or is killed, the same command (same
    --param values, --run-date and --run-time) continues where it stopped. A run that
    finds every step's output committed for the same inputs is `skipped (up to date)`."""
    from fusegen.jobs import setup_logging
    from fusegen.workflows.run import check_time, default_run_date, run_workflow, utc_now, utc_text
    from fusegen.workflows.spec import load_workflow
    from fusegen.workflows.store import open_store

    try:
        wf = load_workflow(file)
        overrides = _params(params)
        store = open_store(store_url)
        setup_logging()
        run_date = run_date or default_run_date(wf)
        run_time = check_time(run_time) if run_time else utc_text(utc_now())
        outcome = run_workflow(wf, store, params=overrides, run_date=run_date,
                               run_time=run_time, overwrite=overwrite, echo=click.echo)
    except (WorkflowError, JobError) as exc:
        if getattr(exc, "run_id", None) is not None:
            from fusegen.workflows.render import RUN_TIME
            from fusegen.workflows.resolve import uses_variable

            # the same {{ run_time }} continues in the same outputs
            _retry_hint(store, exc.run_id, store_url, file, params, run_date,
                        run_time if uses_variable(wf, RUN_TIME) else None)
        _fail(exc)
    _finished(wf, outcome)


def _finished(wf, outcome) -> None:
    from fusegen.workflows.store import SHOWN_STATUS

    click.echo(f"run {outcome.run_id} of {wf.name} ({outcome.run_date}) "
               f"{SHOWN_STATUS.get(outcome.status, outcome.status)}: {len(outcome.steps)} "
               f"steps; `fusegen workflow show {outcome.run_id}` for details")


def _retry_hint(store, run_id: int, store_url, file=None, params=(), run_date=None,
                run_time=None):
    """The commands that continue a failed run: the same `workflow run` (when it was one)
    or `workflow resume`. Credential params show as MASK: the store does not keep them."""
    from fusegen.workflows.credentials import MASK

    run = store.run(run_id)
    secret = sorted(k for k, v in (run.params if run else {}).items() if v == MASK)
    store_args = [f"--store {store_url}"] if store_url else []
    resume = " ".join([f"fusegen workflow resume {run_id}",
                       *[f"--param {k}={MASK}" for k in secret], *store_args])
    note = f"; {MASK} stands for the value you gave, which is not shown" if secret else ""
    if file is None:
        click.echo(f"to continue where it stopped: {resume}{note}", err=True)
        return
    args = [f"--param {key}={MASK}" if key in secret else f"--param {item}"
            for item, key in ((p, p.partition("=")[0].strip()) for p in params)]
    args += [f"--run-date {run_date}", *([f"--run-time {run_time}"] if run_time else []),
             *store_args]
    click.echo(f"to continue where it stopped: fusegen workflow run {file} {' '.join(args)} "
               f"(or {resume}){note}", err=True)


@workflow.command()
@click.argument("run_id", type=int)
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE",
              help="A credential parameter of the run, which the run store does not keep "
              "(repeatable); the run's other parameters are reused as recorded.")
@click.option("--overwrite", is_flag=True, help="Recompute every step from scratch.")
@_STORE
def resume(run_id, params, overwrite, store_url):
    """Run again the failed or interrupted run RUN_ID: same file, params and run date, so
    every step keeps what it committed and continues where it stopped. A run left
    running by a process that is gone (killed) is taken over."""
    from fusegen.jobs import setup_logging
    from fusegen.workflows.run import run_workflow, utc_now
    from fusegen.workflows.credentials import restore_params
    from fusegen.workflows.spec import load_workflow
    from fusegen.workflows.store import open_store

    try:
        store = open_store(store_url)
        old = store.take_over(run_id, utc_now())
        if old is None:
            raise WorkflowError(f"no run {run_id} in the run store; `fusegen workflow "
                                "history` lists them")
        run_params = restore_params(run_id, old.params, _params(params))
        wf = load_workflow(old.source)
        setup_logging()
        outcome = run_workflow(wf, store, params=run_params, run_date=old.run_date,
                               run_time=old.run_time or old.scheduled_for,
                               overwrite=overwrite, echo=click.echo)
    except (WorkflowError, JobError) as exc:
        if getattr(exc, "run_id", None) is not None:
            _retry_hint(store, exc.run_id, store_url)
        _fail(exc)
    _finished(wf, outcome)


@workflow.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@_PARAM
@click.option("--run-date", default=None, metavar="YYYY-MM-DD", help="The run date to check "
              "with.  [default: today]")
def check(files, params, run_date):
    """Validate each workflow FILE without running it: keys, DAG, schedule, and (for the
    given params and run date) the columns every step reads, from its inputs' Parquet
    schemas, and each generate step's model folder (unless the workers of a --scheduler
    read it). Every problem of every file is listed, one a line; exit 2 if any."""
    from fusegen.jobs import redact_url
    from fusegen.workflows.check import check_file

    try:
        overrides = _params(params)
    except WorkflowError as exc:
        _fail(exc)
    num_problems = 0
    for file in files:
        report = check_file(file, overrides, run_date)
        resolved = report.resolved
        redact = resolved.redactor() if resolved is not None else (lambda text: text)
        if not report.problems:
            for step in resolved.steps:
                columns = ", ".join(step.schema.names) if step.schema is not None else \
                    "what its function returns" if step.python is not None else \
                    "known when it runs (after a python step)"
                click.echo(redact(f"{step.name} ({step.kind}): {redact_url(step.input)} -> "
                                  f"{redact_url(step.output)}\n  columns: {columns}"))
        for note in report.notes:
            click.echo(redact(note))
        for problem in report.problems:
            click.echo(redact(f"{file}: {problem}"), err=True)
        num_problems += len(report.problems)
        click.echo(f"{file}: valid" if not report.problems else
                   f"{file}: not valid: {len(report.problems)} problem(s)")
    if num_problems:
        raise _Invalid(f"{num_problems} problem(s) in {len(files)} file(s); each is listed "
                       "above with its step and key")


@workflow.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@_PARAM
@click.option("--poll-seconds", default=30.0, show_default=True, type=float,
              help="How often to look again at runs and locks between fires.")
@click.option("--overwrite", is_flag=True, help="Recompute a step's output when it was made "
              "from another version of its input or step (without it such a fire fails and "
              "says so); outputs that are up to date are kept, and a fire with nothing new "
              "to do is recorded `skipped (up to date)`.")
@_STORE
def schedule(files, params, poll_seconds, overwrite, store_url):
    """Run workflows on their `schedule:` until SIGINT/SIGTERM.

    Each run sees its fire time as {{ run_time }} (ISO 8601, UTC) and its date as
    {{ run_date }}. State lives in the run store: after a restart, fires missed while down
    follow each file's `missed:` policy and an interrupted run resumes. The first signal
    stops firing and waits for the run in progress; a second gives it up (it resumes next
    start)."""
    from fusegen.jobs import setup_logging
    from fusegen.workflows.fire_times import next_fire
    from fusegen.workflows.daemon import CronDaemon
    from fusegen.workflows.spec import load_workflow
    from fusegen.workflows.store import open_store

    try:
        workflows = [load_workflow(f) for f in files]
        store = open_store(store_url)
        command = " ".join(["fusegen workflow schedule", *files,
                            *[f"--param {p}" for p in params],
                            *([f"--store {store_url}"] if store_url else []), "--overwrite"])
        sched = CronDaemon(workflows, store, params=_params(params), overwrite=overwrite,
                           command=command)
    except (WorkflowError, JobError) as exc:
        _fail(exc)
    setup_logging()
    signals = []

    def on_signal(signum, frame):
        signals.append(signum)
        if len(signals) == 1:
            click.echo("stopping: no new runs; waiting for the run in progress (signal "
                       "again to stop now: it resumes on the next start)", err=True)
            sched.stop()
        else:
            sched.abandon()
            os._exit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        now = sched.clock()
        for wf in workflows:
            last = store.last_fire(wf.name) or now
            click.echo(f"{wf.name}: cron {wf.schedule.cron!r} ({wf.schedule.timezone}), "
                       f"missed: {wf.schedule.missed}, next fire "
                       f"{next_fire(wf.schedule, max(last, now)).isoformat()}")
        sched.serve(poll_seconds)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    click.echo("scheduler stopped")


def _recorded_runs(file_or_name, store_url, pick):
    """The run store and the runs `pick(store, workflow name or None)` returns from it;
    where there are none, says so and gives no runs."""
    from fusegen.workflows.store import open_store

    try:
        name = _workflow_name(file_or_name) if file_or_name else None
        store = open_store(store_url)
        runs = pick(store, name)
    except (WorkflowError, JobError) as exc:
        _fail(exc)
    if not runs:
        click.echo("no runs recorded" + (f" for {name}" if name else ""))
    return store, runs


@workflow.command()
@click.argument("file_or_name", required=False)
@click.option("--limit", default=20, show_default=True, help="Newest runs to list.")
@_STORE
def history(file_or_name, limit, store_url):
    """Runs, newest first: status, start/end, rows, tokens, errors. With FILE (or a
    workflow name), that workflow's runs only. A run that found every output up to date
    shows `skipped (up to date)`."""
    from fusegen.workflows.store import SHOWN_STATUS

    store, runs = _recorded_runs(file_or_name, store_url, lambda st, name: st.runs(name, limit))
    if not runs:
        return
    rows = [("RUN", "WORKFLOW", "STATUS", "TRIGGER", "RUN DATE", "STARTED (UTC)", "FINISHED",
             "ROWS", "TOKENS", "ERRORS")]
    for r in runs:
        steps = store.steps(r.run_id)
        done = [s for s in steps if s.num_rows is not None]
        gen = [s for s in done if s.kind == "generate"]
        rows.append((str(r.run_id), r.workflow, SHOWN_STATUS.get(r.status, r.status),
                     r.trigger, r.run_date,
                     _time(r.started), _time(r.finished),
                     str(done[-1].num_rows) if done and len(done) == len(steps) else "-",
                     str(sum(s.num_generated_tokens or 0 for s in gen)),
                     str(sum(s.num_errors or 0 for s in gen))))
    click.echo(_table(rows))


@workflow.command()
@click.argument("file_or_name", required=False)
@_STORE
def status(file_or_name, store_url):
    """Each workflow's latest run: its status (`skipped (up to date)` when a fire found
    nothing new to do), run date and time, when it ended, and its error. With FILE (or a
    workflow name), that workflow only."""
    from fusegen.workflows.store import SHOWN_STATUS

    _, runs = _recorded_runs(file_or_name, store_url, lambda st, name: [
        r for r in st.latest_runs() if name is None or r.workflow == name])
    if not runs:
        return
    rows = [("WORKFLOW", "RUN", "STATUS", "TRIGGER", "RUN DATE", "RUN TIME", "FINISHED (UTC)",
             "ERROR")]
    for r in runs:
        rows.append((r.workflow, str(r.run_id), SHOWN_STATUS.get(r.status, r.status),
                     r.trigger, r.run_date, r.run_time or "-", _time(r.finished),
                     (r.error or "-").splitlines()[0][:80]))
    click.echo(_table(rows))


@workflow.command()
@click.argument("run_id", type=int)
@_STORE
def show(run_id, store_url):
    """One run in detail: status, params, and per step its status, start/end, rows in and
    out, tokens, error rows by code, and the error that stopped it."""
    from fusegen.workflows.credentials import shown_params
    from fusegen.workflows.store import SHOWN_STATUS, open_store

    try:
        store = open_store(store_url)
        run = store.run(run_id)
    except (WorkflowError, JobError) as exc:
        _fail(exc)
    if run is None:
        raise click.ClickException(f"no run {run_id} in the run store; "
                                   "`fusegen workflow history` lists them")
    lines = [f"run {run.run_id}: {run.workflow} ({run.source})",
             f"status: {SHOWN_STATUS.get(run.status, run.status)}",
             f"trigger: {run.trigger}"
             + (f", fire {run.scheduled_for}" if run.scheduled_for else "")
             + (f", run time {run.run_time}" if run.run_time else ""),
             f"run date: {run.run_date}   params: {shown_params(run.params)}",
             f"started: {_time(run.started)}   finished: {_time(run.finished)} (UTC)"]
    if run.resumes:
        lines.append(f"continues run {run.resumes}")
    if run.error:
        lines.append(f"error: {run.error}")
    click.echo("\n".join(lines) + "\n")
    rows = [("STEP", "KIND", "STATUS", "STARTED", "FINISHED", "ROWS IN", "ROWS OUT", "ERRORS",
             "PROMPT TOK", "GEN TOK", "PARTS (KEPT)")]
    for s in store.steps(run_id):
        rows.append((s.step, s.kind, s.status, _time(s.started), _time(s.finished),
                     _num(s.num_input_rows), _num(s.num_rows), _num(s.num_errors),
                     _num(s.num_prompt_tokens), _num(s.num_generated_tokens),
                     "-" if s.num_parts is None else f"{s.num_parts} ({s.num_parts_kept})"))
    click.echo(_table(rows))
    for s in store.steps(run_id):
        if s.errors_by_code:
            codes = ", ".join(f"{k} {v}" for k, v in sorted(s.errors_by_code.items()))
            click.echo(f"{s.step}: error rows: {codes}")
        if s.error:
            click.echo(f"{s.step}: failed: {s.error}")
        click.echo(f"{s.step}: output {s.output}")


def _params(items) -> dict:
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise WorkflowError(f"--param expects KEY=VALUE, got {item!r}")
        out[key.strip()] = yaml.safe_load(value) if value else ""
    return out


def _workflow_name(file_or_name: str) -> str:
    if os.path.exists(file_or_name):
        from fusegen.workflows.spec import load_workflow

        return load_workflow(file_or_name).name
    return file_or_name


def _time(text: str | None) -> str:
    if not text:
        return "-"
    return datetime.fromisoformat(text).strftime("%Y-%m-%d %H:%M:%S")


def _num(value) -> str:
    return "-" if value is None else str(value)


def _table(rows: list[tuple]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
