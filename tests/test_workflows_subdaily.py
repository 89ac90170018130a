"""Schedules more often than daily: {{ run_time }} / {{ run_id }}, a fire with nothing new
to do recorded `skipped (up to date)`, an input that changed between two fires of a day,
and `schedule --overwrite`. Transform-only workflows on a fake clock (no model, no sleep)."""
import os
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

import fusegen.workflows.steps as wf_steps
from fusegen.jobs.cli import main
from fusegen.workflows.daemon import CronDaemon
from fusegen.workflows.errors import ValidationError, WorkflowError
from fusegen.workflows.run import run_workflow
from fusegen.workflows.spec import load_workflow, parse_workflow
from fusegen.workflows.store import open_store


def utc(hour, minute=0, second=0):
    return datetime(2024, 5, 1, hour, minute, second, tzinfo=timezone.utc)


class Clock:
    def __init__(self, now):
        self.now = now

    def __call__(self):
        return self.now


def _write_input(tmp_path, values):
    pq.write_table(pa.table({"n": values}), tmp_path / "in.parquet")


def _workflow(tmp_path, output="{{ out }}/{{ run_date }}", cron="0 * * * *"):
    doc = {"name": "hourly", "params": {"src": str(tmp_path / "in.parquet"),
                                        "out": str(tmp_path / "out")},
           "schedule": {"cron": cron, "timezone": "UTC", "missed": "skip"},
           "workdir": str(tmp_path / "work" / "{{ run_date }}"),
           "steps": {"keep": {"input": "{{ src }}", "filter": "n > 0"},
                     "final": {"from": "keep", "output": output, "select": ["n"]}}}
    path = tmp_path / "hourly.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_workflow(str(path))


def _fire(sched, clock, when):
    clock.now = when
    [ticket] = sched.tick()
    sched.run_next()
    return sched.store.run(ticket.run_id)


def _rows(path):
    return sorted(pq.read_table(path).column("n").to_pylist())


@pytest.fixture
def store(tmp_path):
    return open_store(tmp_path / "runs.db")


def test_each_fire_sees_its_fire_time_as_run_time(tmp_path, store):
    _write_input(tmp_path, [1, 2, 0])
    wf = _workflow(tmp_path, output="{{ out }}/{{ run_time }}")
    clock = Clock(utc(0, 30))
    sched = CronDaemon([wf], store, clock=clock)
    first, second = _fire(sched, clock, utc(1, 0, 2)), _fire(sched, clock, utc(2, 0, 5))
    assert sorted(os.listdir(tmp_path / "out")) == ["2024-05-01T01:00:00Z",
                                                    "2024-05-01T02:00:00Z"]
    assert _rows(tmp_path / "out" / "2024-05-01T02:00:00Z") == [1, 2]
    # each fire has its own output: both computed
    assert (first.status, second.status) == ("succeeded", "succeeded")
    assert (first.run_time, second.run_time) == ("2024-05-01T01:00:00Z", "2024-05-01T02:00:00Z")


def test_a_fire_with_nothing_new_to_do_is_skipped_up_to_date(tmp_path, store):
    _write_input(tmp_path, [1, 2, 0])
    wf = _workflow(tmp_path)  # outputs by run_date: every fire of the day shares them
    clock = Clock(utc(0, 30))
    sched = CronDaemon([wf], store, clock=clock)
    assert _fire(sched, clock, utc(1, 0, 2)).status == "succeeded"
    second = _fire(sched, clock, utc(2, 0, 2))
    assert second.status == "skipped" and second.error is None
    assert [(s.step, s.num_parts, s.num_parts_kept) for s in store.steps(second.run_id)] == \
        [("keep", 1, 1), ("final", 1, 1)]
    db = f"sqlite:///{tmp_path}/runs.db"
    history = CliRunner().invoke(main, ["workflow", "history", "--store", db])
    assert history.exit_code == 0, history.output
    lines = history.output.splitlines()
    assert lines[1].split()[:4] == ["2", "hourly", "skipped", "(up"] and "(up to date)" in lines[1]
    assert lines[2].split()[:3] == ["1", "hourly", "succeeded"]
    status = CliRunner().invoke(main, ["workflow", "status", str(wf.path), "--store", db])
    assert status.exit_code == 0, status.output
    assert status.output.splitlines()[1].split()[:8] == [
        "hourly", "2", "skipped", "(up", "to", "date)", "schedule", "2024-05-01"]
    assert "2024-05-01T02:00:00Z" in status.output
    show = CliRunner().invoke(main, ["workflow", "show", str(second.run_id), "--store", db])
    assert "status: skipped (up to date)" in show.output
    assert "trigger: schedule, fire 2024-05-01T02:00:00+00:00, run time " \
           "2024-05-01T02:00:00Z" in show.output


def test_a_changed_input_fails_the_next_fire_with_the_command_then_overwrite_runs_it(
        tmp_path, store):
    _write_input(tmp_path, [1, 2, 0])
    wf = _workflow(tmp_path)
    clock = Clock(utc(0, 30))
    sched = CronDaemon([wf], store, clock=clock,
                       command=f"fusegen workflow schedule {wf.path} --store x.db")
    assert _fire(sched, clock, utc(1, 0, 2)).status == "succeeded"
    _write_input(tmp_path, [5, 6, 7, -1])
    failed = _fire(sched, clock, utc(2, 0, 2))
    assert failed.status == "failed"
    # the workflow's own output (keep) was recomputed from the new input; the explicit
    # output (final) is not replaced without --overwrite, and the error says how
    assert f"output {tmp_path}/out/2024-05-01 holds parts made from an earlier version of " \
           "its input (step 'keep' was recomputed in this run); to recompute it from the " \
           "new version on the next fire, restart the scheduler with --overwrite: fusegen " \
           f"workflow schedule {wf.path} --store x.db --overwrite" in failed.error
    assert _rows(tmp_path / "out" / "2024-05-01") == [1, 2]
    restarted = CronDaemon([wf], store, clock=clock, overwrite=True)
    third = _fire(restarted, clock, utc(3, 0, 2))
    assert third.status == "succeeded"
    assert _rows(tmp_path / "out" / "2024-05-01") == [5, 6, 7]
    # up to date again: --overwrite recomputes only what changed
    assert _fire(restarted, clock, utc(4, 0, 2)).status == "skipped"


def test_an_input_read_by_an_explicit_output_changed_names_the_command(tmp_path, store):
    """The first step's own output is explicit: the job layer's refusal gains the
    scheduler's command."""
    _write_input(tmp_path, [1, 2])
    doc = {"name": "direct", "params": {"src": str(tmp_path / "in.parquet")},
           "schedule": {"cron": "*/15 * * * *"},
           "steps": {"only": {"input": "{{ src }}", "filter": "n > 0",
                              "output": str(tmp_path / "out" / "{{ run_date }}")}}}
    path = tmp_path / "direct.yaml"
    path.write_text(yaml.safe_dump(doc))
    wf = load_workflow(str(path))
    clock = Clock(utc(0, 1))
    sched = CronDaemon([wf], store, clock=clock)
    assert _fire(sched, clock, utc(0, 15, 1)).status == "succeeded"
    assert _fire(sched, clock, utc(0, 30, 1)).status == "skipped"
    _write_input(tmp_path, [3, 4, 5])
    failed = _fire(sched, clock, utc(0, 45, 1))
    assert failed.status == "failed"
    assert "holds a different job" in failed.error
    assert failed.error.endswith("restart the scheduler with --overwrite: fusegen workflow "
                                 f"schedule {path} --overwrite (or give the step an "
                                 "`output:` with {{ run_time }} in it, one per fire)")
    sched.overwrite = True
    assert _fire(sched, clock, utc(1, 0, 1)).status == "succeeded"
    assert _rows(tmp_path / "out" / "2024-05-01") == [3, 4, 5]


def test_schedule_takes_overwrite_as_run_does():
    for command in ("run", "schedule"):
        result = CliRunner().invoke(main, ["workflow", command, "--help"])
        assert "--overwrite" in result.output, command


def test_run_id_is_the_first_attempts_so_a_resume_continues_in_its_output(tmp_path, store,
                                                                         monkeypatch):
    _write_input(tmp_path, [1, 2, 0])
    wf = _workflow(tmp_path, output="{{ out }}/run-{{ run_id }}-{{ run_time }}")
    real = wf_steps._transform_part
    calls = []

    def fail_final(step, *args):
        if step.name == "final" and not calls:
            calls.append(step.output)
            raise OSError("bucket unreachable (injected)")
        return real(step, *args)

    monkeypatch.setattr(wf_steps, "_transform_part", fail_final)
    with pytest.raises(WorkflowError):
        run_workflow(wf, store, run_date="2024-05-01", run_time="2024-05-01T10:15:00+02:00")
    assert calls == [f"{tmp_path}/out/run-1-2024-05-01T08:15:00Z"]
    again = run_workflow(wf, store, run_date="2024-05-01", run_time="2024-05-01T08:15:00")
    assert (again.run_id, again.status) == (2, "succeeded")  # it finished run 1's work
    assert store.run(2).resumes == 1 and store.run(2).run_time == "2024-05-01T08:15:00Z"
    assert _rows(tmp_path / "out" / "run-1-2024-05-01T08:15:00Z") == [1, 2]
    # a new run (not a resume) has its own run_id, so its own output
    assert run_workflow(wf, store, run_date="2024-05-01",
                        run_time="2024-05-01T08:15:00Z").run_id == 3
    assert sorted(os.listdir(tmp_path / "out")) == ["run-1-2024-05-01T08:15:00Z",
                                                    "run-3-2024-05-01T08:15:00Z"]


def test_run_variables_are_reserved_and_usable_in_params(tmp_path):
    base = {"name": "wf", "workdir": "/tmp/w", "steps": {"s": {"input": "{{ src }}",
                                                               "filter": "n > 0"}}}
    for name in ("run_time", "run_id"):
        with pytest.raises(ValidationError, match=f"{name} is set by each run"):
            parse_workflow({**base, "params": {"src": "x", name: 1}}, "wf.yaml")
    wf = parse_workflow({**base, "params": {"src": "in/{{ run_time }}-{{ run_id }}.parquet"}},
                        "wf.yaml")
    assert wf.params["src"] == "in/{{ run_time }}-{{ run_id }}.parquet"
    with pytest.raises(ValidationError, match="put \\{\\{ run_date \\}\\} in it .* or "
                                              "\\{\\{ run_time \\}\\} for one output per fire"):
        _workflow(tmp_path, output=str(tmp_path / "same-every-time"))
    with pytest.raises(WorkflowError, match="run time 'noon' is not an ISO 8601 time"):
        run_workflow(_workflow(tmp_path), open_store(tmp_path / "r.db"), run_date="2024-05-01",
                     run_time="noon")


def test_the_hourly_example_is_valid(tmp_path):
    from pathlib import Path

    from fusegen.workflows.resolve import resolve

    example = Path(__file__).resolve().parent.parent / "workflows" / "examples" / \
        "hourly_labels.yaml"
    wf = load_workflow(str(example))
    assert wf.order == ["label", "confident"] and wf.schedule.cron == "0 * * * *"
    pq.write_table(pa.table({"review": ["great", "bad"]}), tmp_path / "reviews.parquet")
    resolved = resolve(wf, {"reviews": str(tmp_path / "reviews.parquet"),
                            "model": str(tmp_path / "model"), "out": str(tmp_path / "out")},
                       "2024-05-01", run_time="2024-05-01T03:00:00Z")
    assert resolved.steps[1].output == f"{tmp_path}/out/2024-05-01/confident"
    assert resolved.steps[1].schema.names == ["review", "generated_text"]
    assert resolved.steps[1].transform.filter.columns == {"generated_text"}
