"""The cron daemon on an injected clock: cron times, missed windows under skip and catch_up,
no overlap, and a restart (a new CronDaemon on the same store) that picks up. No sleeping:
the fake clock is moved by hand and runs are executed with run_next()."""
import os
import signal
import threading
import time
from datetime import datetime, timezone
import pytest
import yaml
from click.testing import CliRunner

from fusegen.jobs.cli import main

from fusegen.workflows.errors import WorkflowError
from fusegen.workflows.fire_times import decide, latest_fire, next_fire
from fusegen.workflows.daemon import CronDaemon
from fusegen.workflows.spec import Schedule, parse_workflow
from fusegen.workflows.store import new_owner, open_store


def utc(hour, minute=0, second=0, day=1):
    return datetime(2024, 5, day, hour, minute, second, tzinfo=timezone.utc)


class Clock:
    def __init__(self, now):
        self.now = now

    def __call__(self):
        return self.now


def _workflow(missed="catch_up", cron="0 * * * *", tz="UTC", name="hourly"):
    return parse_workflow({
        "name": name, "params": {"n": 1},
        "schedule": {"cron": cron, "timezone": tz, "missed": missed},
        "workdir": "/tmp/never-used/{{ run_date }}",
        "steps": {"only": {"input": "in.parquet", "filter": "n > 0"}},
    }, f"{name}.yaml")


class Recorder:
    """The injected `execute`: records each run's fire time and run date."""

    def __init__(self):
        self.fired = []

    def __call__(self, ticket):
        self.fired.append((ticket.fire.astimezone(timezone.utc).strftime("%d %H:%M"),
                           ticket.run_date))


def _scheduler(store, clock, missed="catch_up", **kw):
    rec = Recorder()
    return CronDaemon([_workflow(missed, **kw)], store, clock=clock, execute=rec), rec


def _drain(sched):
    """tick + run until nothing is due at the current time; at most one run in flight."""
    while sched.tick():
        assert sched.tick() == [], "a second run of the same workflow started: overlap"
        sched.run_next()


@pytest.fixture
def store(tmp_path):
    return open_store(tmp_path / "runs.db")


def test_fires_at_cron_times_only(store):
    clock = Clock(utc(0, 30))
    sched, rec = _scheduler(store, clock)
    for now in (utc(0, 30), utc(0, 59, 59)):
        clock.now = now
        assert sched.tick() == []
    clock.now = utc(1, 0, 2)
    [ticket] = sched.tick()
    assert ticket.fire == utc(1) and ticket.run_date == "2024-05-01"
    sched.run_next()
    clock.now = utc(1, 59)
    assert sched.tick() == []
    clock.now = utc(2)
    _drain(sched)
    assert rec.fired == [("01 01:00", "2024-05-01"), ("01 02:00", "2024-05-01")]
    runs = store.runs("hourly")
    assert [(r.status, r.trigger, r.scheduled_for) for r in runs] == [
        ("succeeded", "schedule", "2024-05-01T02:00:00+00:00"),
        ("succeeded", "schedule", "2024-05-01T01:00:00+00:00")]


def test_catch_up_runs_every_missed_fire_in_order(store):
    clock = Clock(utc(0, 30))
    sched, rec = _scheduler(store, clock, "catch_up")
    clock.now = utc(4, 10)  # down (or busy) from 00:30 to 04:10
    _drain(sched)
    assert [f for f, _ in rec.fired] == ["01 01:00", "01 02:00", "01 03:00", "01 04:00"]
    clock.now = utc(4, 59)
    assert sched.tick() == []
    clock.now = utc(5, 0, 1)
    _drain(sched)
    assert rec.fired[-1] == ("01 05:00", "2024-05-01")


def test_skip_drops_missed_fires_but_runs_one_on_time(store):
    clock = Clock(utc(0, 30))
    sched, rec = _scheduler(store, clock, "skip")
    clock.now = utc(4, 10)  # 04:00 is 10 min late: beyond the 60 s grace
    _drain(sched)
    assert rec.fired == []
    clock.now = utc(7, 0, 30)  # 05:00 and 06:00 missed; 07:00 is 30 s late: on time
    _drain(sched)
    assert [f for f, _ in rec.fired] == ["01 07:00"]
    clock.now = utc(8, 0, 1)
    _drain(sched)
    assert [f for f, _ in rec.fired] == ["01 07:00", "01 08:00"]


@pytest.mark.parametrize("missed, expect", [("catch_up", ["01 01:00", "01 02:00"]),
                                            ("skip", ["01 01:00"])])
def test_never_overlaps_a_run_in_progress(store, missed, expect):
    clock = Clock(utc(0, 30))
    sched, rec = _scheduler(store, clock, missed)
    clock.now = utc(1)
    assert len(sched.tick()) == 1  # started, still running (not executed yet)
    clock.now = utc(2, 5)  # 02:00 came due while 01:00 is still running
    assert sched.tick() == []
    assert store.lock("hourly").run_id == store.runs("hourly")[0].run_id
    sched.run_next()  # 01:00 finishes at 02:05
    _drain(sched)  # catch_up runs 02:00 now; skip drops it (5 min late)
    assert [f for f, _ in rec.fired] == expect


def test_a_manual_run_holding_the_lock_delays_the_fire(store):
    clock = Clock(utc(0, 30))
    sched, rec = _scheduler(store, clock, "catch_up")
    manual = store.start_run("hourly", source="x", run_date="2024-05-01", params={},
                             owner=new_owner(), now=utc(0, 58))
    clock.now = utc(1, 0, 5)
    assert sched.tick() == []
    assert store.last_fire("hourly") == utc(0, 30)  # the fire is still due
    store.finish_run(manual, "succeeded", utc(1, 20))
    clock.now = utc(1, 20)
    _drain(sched)
    assert [f for f, _ in rec.fired] == ["01 01:00"]


def test_restart_picks_up_an_interrupted_run_then_missed_fires(store):
    clock = Clock(utc(0, 30))
    first, rec1 = _scheduler(store, clock, "catch_up")
    clock.now = utc(1)
    _drain(first)
    clock.now = utc(2)
    [lost] = first.tick()  # started, then the scheduler dies before running it
    del first

    clock.now = utc(3, 30)  # the lost run's lock is 90 min old: its owner is gone
    second, rec2 = _scheduler(store, clock, "catch_up")
    [resumed] = second.tick()
    assert (resumed.fire, resumed.run_date, resumed.resumes) == (utc(2), "2024-05-01", lost.run_id)
    assert store.run(lost.run_id).status == "interrupted"
    assert store.run(resumed.run_id).resumes == lost.run_id
    second.run_next()
    _drain(second)
    assert rec1.fired == [("01 01:00", "2024-05-01")]
    assert [f for f, _ in rec2.fired] == ["01 02:00", "01 03:00"]
    assert [r.status for r in store.runs("hourly")] == \
        ["succeeded", "succeeded", "interrupted", "succeeded"]


def test_restart_under_skip_does_not_replay_the_downtime(store):
    clock = Clock(utc(0, 30))
    first, _ = _scheduler(store, clock, "skip")
    clock.now = utc(1)
    _drain(first)
    clock.now = utc(9, 0, 20)
    second, rec = _scheduler(store, clock, "skip")
    _drain(second)
    assert rec.fired == [("01 09:00", "2024-05-01")]


def test_failed_run_is_recorded_and_the_schedule_goes_on(store):
    clock = Clock(utc(0, 30))

    def boom(ticket):
        raise RuntimeError("model missing")

    sched = CronDaemon([_workflow()], store, clock=clock, execute=boom)
    clock.now = utc(1)
    _drain(sched)
    clock.now = utc(2)
    _drain(sched)
    assert [(r.status, r.error) for r in store.runs("hourly")] == \
        [("failed", "RuntimeError: model missing")] * 2
    assert store.lock("hourly") is None


def test_time_zone_sets_fire_times_and_run_date(store):
    tokyo = Schedule(cron="0 1 * * *", timezone="Asia/Tokyo")
    # 01:00 in Tokyo is 16:00 UTC the day before; its run_date is the Tokyo date
    assert next_fire(tokyo, utc(12)) == utc(16)
    clock = Clock(utc(12))
    sched, rec = _scheduler(store, clock, cron="0 1 * * *", tz="Asia/Tokyo")
    clock.now = utc(16, 0, 3)
    _drain(sched)
    assert rec.fired == [("01 16:00", "2024-05-02")]


def test_decide_is_pure_policy():
    s = Schedule(cron="*/15 * * * *", missed="skip", grace_seconds=60)
    d = decide(s, utc(1), utc(2, 0, 30))
    assert (d.fire, d.num_skipped, d.last_fire) == (utc(2), 3, utc(2))
    d = decide(s, utc(1), utc(2, 5))
    assert (d.fire, d.num_skipped, d.last_fire) == (None, 4, utc(2))
    assert latest_fire(s, utc(2)) == utc(2) and latest_fire(s, utc(2, 14)) == utc(2)
    c = Schedule(cron="*/15 * * * *", missed="catch_up")
    assert decide(c, utc(1), utc(2, 5)).fire == utc(1, 15)


def test_serve_runs_and_stops_cleanly(store):
    clock = Clock(utc(0, 30))
    done = threading.Event()
    sched = CronDaemon([_workflow()], store, clock=clock, execute=lambda t: done.set())
    clock.now = utc(1, 0, 1)
    thread = threading.Thread(target=sched.serve, kwargs={"poll_seconds": 0.05})
    thread.start()
    assert done.wait(10)
    sched.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert [r.status for r in store.runs("hourly")] == ["succeeded"]


def test_scheduler_needs_a_schedule(store):
    wf = parse_workflow({"steps": {"a": {"input": "x", "filter": "n > 0"}}}, "plain.yaml")
    with pytest.raises(WorkflowError, match="has no `schedule:`"):
        CronDaemon([wf], store)


def test_cli_schedule_stops_on_sigterm(tmp_path):
    """In this process: the command installs its handlers, then gets a real SIGTERM."""
    path = tmp_path / "nightly.yaml"
    path.write_text(yaml.safe_dump({
        "name": "nightly", "schedule": {"cron": "0 3 * * *", "timezone": "Europe/Paris"},
        "workdir": "work/{{ run_date }}",
        "steps": {"a": {"input": "in.parquet", "filter": "x > 0"}}}))
    original = signal.getsignal(signal.SIGTERM)

    def terminate_when_handled():
        deadline = time.monotonic() + 30
        while signal.getsignal(signal.SIGTERM) is original and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate_when_handled)
    killer.start()
    result = CliRunner().invoke(main, ["workflow", "schedule", str(path), "--poll-seconds", "5",
                                       "--store", f"sqlite:///{tmp_path}/runs.db"])
    killer.join()
    assert result.exit_code == 0, result.output
    assert "nightly: cron '0 3 * * *' (Europe/Paris), missed: skip, next fire" in result.output
    assert result.output.rstrip().endswith("scheduler stopped")
    assert signal.getsignal(signal.SIGTERM) is original  # handlers restored
    assert open_store(tmp_path / "runs.db").last_fire("nightly") is not None


def test_a_scheduled_run_executes_the_steps_for_its_run_date(tmp_path, store):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for day in ("2024-05-01", "2024-05-02"):
        (tmp_path / day).mkdir()
        pq.write_table(pa.table({"n": [1, 2, 3, 4, 5][: int(day[-1]) + 2]}),
                       tmp_path / day / "in.parquet")
    wf = parse_workflow({
        "name": "daily", "schedule": {"cron": "0 6 * * *", "missed": "catch_up"},
        "workdir": str(tmp_path / "work" / "{{ run_date }}"),
        "steps": {"big": {"input": str(tmp_path / "{{ run_date }}" / "in.parquet"),
                          "filter": "n > 1", "partition_rows": 2,
                          "output": str(tmp_path / "out" / "{{ run_date }}")}},
    }, "daily.yaml")
    clock = Clock(datetime(2024, 4, 30, 12, tzinfo=timezone.utc))
    sched = CronDaemon([wf], store, clock=clock)
    clock.now = datetime(2024, 5, 2, 7, tzinfo=timezone.utc)  # two fires due: catch up
    _drain(sched)
    counts = [(r.run_date, r.status, store.steps(r.run_id)[0].num_rows)
              for r in reversed(store.runs("daily"))]
    assert counts == [("2024-05-01", "succeeded", 2), ("2024-05-02", "succeeded", 3)]
    assert pq.read_table(tmp_path / "out" / "2024-05-02").column("n").to_pylist() == [2, 3, 4]
