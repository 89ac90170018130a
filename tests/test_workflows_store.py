"""The run store: schema migrations from an older version, the refusal of a newer one,
store URLs, and the per-workflow lock (busy, stale by heartbeat, stale by dead process)."""
import sqlite3
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from fusegen.workflows.errors import WorkflowBusy, WorkflowError
from fusegen.workflows.migrations import LATEST, MIGRATIONS, migrate, schema_version
from fusegen.workflows.store import LEASE_SECONDS, RunStore, new_owner, open_store

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)


def _v1_database(path):
    """A store as the first release left it: version 1, one finished run with a step."""
    conn = sqlite3.connect(path, isolation_level=None)
    assert migrate(conn, str(path), target=1) == 0
    conn.execute("INSERT INTO runs (workflow, source, run_date, params, status, started, "
                 "finished) VALUES ('nightly', 'n.yaml', '2024-04-30', '{\"n\": 2}', "
                 "'succeeded', '2024-04-30T02:00:00+00:00', '2024-04-30T02:05:00+00:00')")
    conn.execute("INSERT INTO steps (run_id, step, position, kind, status, num_rows, "
                 "errors_by_code) VALUES (1, 'draft', 0, 'generate', 'succeeded', 40, "
                 "'{\"null_prompt\": 1}')")
    conn.close()


def test_migrates_a_version_1_store_and_keeps_its_runs(tmp_path):
    path = tmp_path / "runs.db"
    _v1_database(path)
    store = RunStore(path)
    assert store.upgraded_from == 1
    conn = sqlite3.connect(path)
    assert schema_version(conn) == LATEST == len(MIGRATIONS) == 3
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"runs", "steps", "schedule_state", "locks", "schema_version"} <= tables
    [old] = store.runs("nightly")
    assert (old.run_id, old.status, old.params, old.trigger, old.scheduled_for, old.resumes) \
        == (1, "succeeded", {"n": 2}, "manual", None, None)
    [step] = store.steps(1)
    assert (step.num_rows, step.errors_by_code) == (40, {"null_prompt": 1})
    # the new schema works on the upgraded file
    run_id = store.start_run("nightly", source="n.yaml", run_date="2024-05-01", params={},
                             owner=new_owner(), now=T0, trigger="schedule", scheduled_for=T0)
    assert run_id == 2 and store.last_fire("nightly") == T0
    assert RunStore(path).upgraded_from == LATEST  # opening again changes nothing


def test_a_newer_store_is_refused(tmp_path):
    path = tmp_path / "runs.db"
    RunStore(path)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE schema_version SET version = ?", (LATEST + 1,))
    conn.commit()
    with pytest.raises(WorkflowError, match=f"schema version {LATEST + 1}, newer than"):
        RunStore(path)


def test_store_urls(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEGEN_STATE_DIR", str(tmp_path / "state"))
    assert open_store().path == tmp_path / "state" / "runs.db"
    assert open_store(f"sqlite:///{tmp_path}/a.db").path == tmp_path / "a.db"
    monkeypatch.chdir(tmp_path)
    assert open_store("sqlite:///rel.db").path.resolve() == tmp_path / "rel.db"
    with pytest.raises(WorkflowError, match="postgresql:// is not supported"):
        open_store("postgresql://db/fusegen")


def _start(store, owner, now, **kw):
    return store.start_run("wf", source="wf.yaml", run_date="2024-05-01", params={"n": 1},
                           owner=owner, now=now, **kw)


def test_lock_busy_then_stale_by_heartbeat(tmp_path):
    store = RunStore(tmp_path / "runs.db")
    first = _start(store, new_owner(), T0)  # this (live) process
    with pytest.raises(WorkflowBusy, match="already running \\(run 1"):
        _start(store, new_owner(), T0 + timedelta(seconds=LEASE_SECONDS - 1))
    store.heartbeat(first, T0 + timedelta(seconds=LEASE_SECONDS))
    with pytest.raises(WorkflowBusy):
        _start(store, new_owner(), T0 + timedelta(seconds=LEASE_SECONDS + 60))
    later = T0 + timedelta(seconds=3 * LEASE_SECONDS)
    second = _start(store, new_owner(), later)
    assert store.run(first).status == "interrupted"
    assert store.run(second).resumes == first
    assert store.lock("wf").run_id == second
    store.finish_run(second, "succeeded", later)
    assert store.lock("wf") is None
    third = _start(store, new_owner(), later)
    assert store.run(third).resumes is None  # the last attempt succeeded: nothing to continue


def test_lock_of_a_dead_process_is_stale_at_once(tmp_path):
    store = RunStore(tmp_path / "runs.db")
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    dead = new_owner().rsplit(":", 2)
    dead_owner = f"{dead[0]}:{proc.stdout.strip()}:x"
    first = _start(store, dead_owner, T0)
    second = _start(store, new_owner(), T0 + timedelta(seconds=1))
    assert store.run(first).status == "interrupted"
    assert store.run(second).resumes == first
