"""The run store: every run and step of every workflow, the scheduler's last fire times,
and one lock per workflow so two runs of it never overlap.

Embedded SQLite by default (`<state dir>/runs.db`); `--store sqlite:///path` points at
another file. Every call opens its own connection and does its work in one IMMEDIATE
transaction, so the store is safe to share between threads and processes.
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

from fusegen.workflows.errors import WorkflowBusy, WorkflowError
from fusegen.workflows.migrations import migrate

LEASE_SECONDS = 600  # a lock whose heartbeat is older than this belongs to a dead run
HEARTBEAT_SECONDS = 30
ACTIVE = ("queued", "running")
# A run's status: queued | running | succeeded | skipped (every step's output was already
# committed for the same inputs: nothing to do) | failed | interrupted
SKIPPED = "skipped"
SHOWN_STATUS = {SKIPPED: "skipped (up to date)"}  # as history and show print it


def state_dir() -> Path:
    """FUSEGEN_STATE_DIR, or ~/.fusegen/state."""
    return Path(os.environ.get("FUSEGEN_STATE_DIR") or Path.home() / ".fusegen" / "state")


def open_store(url: str | os.PathLike | None = None) -> "RunStore":
    """A store from `sqlite:///relative.db`, `sqlite:////absolute.db`, a plain path, or
    None for the default file under the state directory."""
    if url is None:
        return RunStore(state_dir() / "runs.db")
    url = str(url)
    if url.startswith("sqlite:///"):
        return RunStore(Path(url[len("sqlite:///"):]))
    if "://" in url:
        raise WorkflowError(f"--store {url.split('://')[0]}:// is not supported; use "
                            "sqlite:///path/to/runs.db (a shared database backend plugs in "
                            "behind workflows.store.open_store)")
    return RunStore(Path(url))


def new_owner() -> str:
    """Names the process (and object) holding a lock: host:pid:nonce."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(slots=True)
class RunRecord:
    run_id: int
    workflow: str
    source: str | None
    run_date: str
    params: dict
    status: str
    started: str | None
    finished: str | None
    error: str | None
    trigger: str
    scheduled_for: str | None
    resumes: int | None
    run_time: str | None = None  # the {{ run_time }} it ran with (ISO 8601 UTC)


@dataclass(slots=True)
class StepRecord:
    run_id: int
    step: str
    position: int
    kind: str
    status: str
    output: str | None
    started: str | None
    finished: str | None
    num_input_rows: int | None
    num_rows: int | None
    num_errors: int | None
    errors_by_code: dict
    num_prompt_tokens: int | None
    num_generated_tokens: int | None
    num_parts: int | None
    num_parts_kept: int | None
    error: str | None


@dataclass(slots=True)
class Lock:
    workflow: str
    run_id: int
    owner: str
    heartbeat: str


class RunStore:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _create_owner_only(self.path)
            conn = self._connect()
        except (OSError, sqlite3.Error) as exc:
            raise WorkflowError(f"cannot open the run store {self.path}: {exc}; pass --store "
                                "sqlite:///a/writable/runs.db or set FUSEGEN_STATE_DIR") from None
        try:
            self.upgraded_from = migrate(conn, str(self.path))
        finally:
            conn.close()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.row_factory = sqlite3.Row
        return conn

    @contextmanager
    def _tx(self):
        """One transaction; IMMEDIATE so a read-check-write is atomic across processes."""
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        finally:
            conn.close()

    # -- runs and the lock ----------------------------------------------------------------

    def start_run(self, workflow: str, *, source: str | None, run_date: str, params: dict,
                  owner: str, now: datetime, trigger: str = "manual",
                  scheduled_for: datetime | None = None, status: str = "running",
                  lease_seconds: float = LEASE_SECONDS, run_time: str | None = None) -> int:
        """Record a new run and take the workflow's lock, in one transaction. A lock held
        by a live run raises WorkflowBusy; a dead run's lock is taken over (that run is
        marked interrupted). A scheduled start also advances the workflow's last fire."""
        params_json = json.dumps(params, sort_keys=True, default=str)
        with self._tx() as conn:
            lock = _lock(conn, workflow)
            if lock is not None:
                if not lock_is_stale(lock, now, lease_seconds):
                    raise WorkflowBusy(
                        f"workflow {workflow!r} is already running (run {lock.run_id}, "
                        f"{_owner_text(lock.owner)}, last heartbeat {lock.heartbeat}); "
                        "two runs of one workflow never overlap: wait for it to finish")
                _interrupt(conn, lock, now)
            resumes = conn.execute(
                "SELECT run_id FROM runs WHERE workflow = ? AND run_date = ? AND params = ? "
                "AND status IN ('failed', 'interrupted') AND run_id > coalesce((SELECT "
                "max(run_id) FROM runs WHERE workflow = ? AND run_date = ? AND params = ? "
                "AND status IN ('succeeded', 'skipped')), 0) ORDER BY run_id DESC LIMIT 1",
                (workflow, run_date, params_json) * 2).fetchone()
            cur = conn.execute(
                "INSERT INTO runs (workflow, source, run_date, params, status, started, "
                "trigger, scheduled_for, resumes, run_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (workflow, source, run_date, params_json, status, iso(now), trigger,
                 iso(scheduled_for) if scheduled_for else None,
                 resumes[0] if resumes else None, run_time))
            run_id = cur.lastrowid
            conn.execute("INSERT INTO locks (workflow, run_id, owner, heartbeat) "
                         "VALUES (?, ?, ?, ?)", (workflow, run_id, owner, iso(now)))
            if scheduled_for is not None:
                _set_last_fire(conn, workflow, scheduled_for)
        return run_id

    def mark_running(self, run_id: int, now: datetime) -> None:
        with self._tx() as conn:
            conn.execute("UPDATE runs SET status = 'running', started = ? WHERE run_id = ?",
                         (iso(now), run_id))

    def heartbeat(self, run_id: int, now: datetime) -> None:
        with self._tx() as conn:
            conn.execute("UPDATE locks SET heartbeat = ? WHERE run_id = ?", (iso(now), run_id))

    def finish_run(self, run_id: int, status: str, now: datetime, error: str | None = None):
        """Record the end of a run and release its lock (if it still holds it)."""
        with self._tx() as conn:
            conn.execute("UPDATE runs SET status = ?, finished = ?, error = ? WHERE run_id = ?",
                         (status, iso(now), error, run_id))
            conn.execute("UPDATE steps SET status = 'interrupted', finished = ? WHERE "
                         "run_id = ? AND status = 'running'", (iso(now), run_id))
            conn.execute("DELETE FROM locks WHERE run_id = ?", (run_id,))

    def lock(self, workflow: str) -> Lock | None:
        with self._tx() as conn:
            return _lock(conn, workflow)

    def take_over(self, run_id: int, now: datetime,
                  lease_seconds: float = LEASE_SECONDS) -> RunRecord | None:
        """The run, for a resume: one left queued or running by a process that is gone
        (its lock stale, or no longer its own) is first marked interrupted and its lock
        freed. A run still alive raises WorkflowBusy naming its process."""
        with self._tx() as conn:
            run = _run(conn, run_id)
            if run is None or run.status not in ACTIVE:
                return run
            lock = _lock(conn, run.workflow)
            if lock is not None and lock.run_id == run_id:
                if not lock_is_stale(lock, now, lease_seconds):
                    raise WorkflowBusy(f"run {run_id} is {run.status} "
                                       f"({_owner_text(lock.owner)}); wait for it to end")
                _interrupt(conn, lock, now)
            else:
                _mark_interrupted(conn, run_id, now)
            return _run(conn, run_id)

    def release_stale(self, workflow: str, now: datetime,
                      lease_seconds: float = LEASE_SECONDS) -> RunRecord | None:
        """Mark a dead run interrupted and free its lock; returns that run, or None."""
        with self._tx() as conn:
            lock = _lock(conn, workflow)
            if lock is None or not lock_is_stale(lock, now, lease_seconds):
                return None
            _interrupt(conn, lock, now)
            return _run(conn, lock.run_id)

    # -- steps ----------------------------------------------------------------------------

    def add_steps(self, run_id: int, steps: list[tuple[str, str, str]]) -> None:
        """(name, kind, output) of every step, in the order they will run."""
        with self._tx() as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO steps (run_id, step, position, kind, status, output) "
                "VALUES (?, ?, ?, ?, 'pending', ?)",
                [(run_id, name, i, kind, output) for i, (name, kind, output) in enumerate(steps)])

    def step_started(self, run_id: int, step: str, now: datetime) -> None:
        with self._tx() as conn:
            conn.execute("UPDATE steps SET status = 'running', started = ? WHERE run_id = ? "
                         "AND step = ?", (iso(now), run_id, step))

    def step_finished(self, run_id: int, step: str, now: datetime, counts: dict) -> None:
        """counts: any of the StepRecord count fields (num_rows, num_errors, ...)."""
        counts = dict(counts)
        if "errors_by_code" in counts:
            counts["errors_by_code"] = json.dumps(counts["errors_by_code"], sort_keys=True)
        names = [n for n in counts if n in _STEP_COUNTS]
        sets = "".join(f", {n} = ?" for n in names)
        with self._tx() as conn:
            conn.execute(f"UPDATE steps SET status = 'succeeded', finished = ?{sets} "
                         "WHERE run_id = ? AND step = ?",
                         (iso(now), *[counts[n] for n in names], run_id, step))

    def step_failed(self, run_id: int, step: str, now: datetime, error: str) -> None:
        with self._tx() as conn:
            conn.execute("UPDATE steps SET status = 'failed', finished = ?, error = ? "
                         "WHERE run_id = ? AND step = ?", (iso(now), error, run_id, step))

    # -- reading ----------------------------------------------------------------------------

    def run(self, run_id: int) -> RunRecord | None:
        with self._tx() as conn:
            return _run(conn, run_id)

    def first_attempt(self, run_id: int) -> int:
        """The run that `run_id` continues, through every resume: its {{ run_id }}."""
        with self._tx() as conn:
            seen = {run_id}
            while True:
                row = conn.execute("SELECT resumes FROM runs WHERE run_id = ?",
                                   (run_id,)).fetchone()
                if row is None or row[0] is None or row[0] in seen:
                    return run_id
                run_id = row[0]
                seen.add(run_id)

    def latest_runs(self) -> list[RunRecord]:
        """Each workflow's newest run, by workflow name."""
        with self._tx() as conn:
            rows = conn.execute("SELECT * FROM runs WHERE run_id IN (SELECT max(run_id) FROM "
                                "runs GROUP BY workflow) ORDER BY workflow").fetchall()
        return [_run_record(r) for r in rows]

    def runs(self, workflow: str | None = None, limit: int = 20) -> list[RunRecord]:
        """Newest first."""
        where, args = ("WHERE workflow = ?", (workflow,)) if workflow else ("", ())
        with self._tx() as conn:
            rows = conn.execute(f"SELECT * FROM runs {where} ORDER BY run_id DESC LIMIT ?",
                                (*args, limit)).fetchall()
        return [_run_record(r) for r in rows]

    def steps(self, run_id: int) -> list[StepRecord]:
        with self._tx() as conn:
            rows = conn.execute("SELECT * FROM steps WHERE run_id = ? ORDER BY position",
                                (run_id,)).fetchall()
        return [StepRecord(**{**dict(r), "errors_by_code": json.loads(r["errors_by_code"] or "{}")})
                for r in rows]

    # -- schedule state -----------------------------------------------------------------------

    def last_fire(self, workflow: str) -> datetime | None:
        with self._tx() as conn:
            row = conn.execute("SELECT last_fire FROM schedule_state WHERE workflow = ?",
                               (workflow,)).fetchone()
        return datetime.fromisoformat(row[0]) if row else None

    def set_last_fire(self, workflow: str, when: datetime) -> None:
        with self._tx() as conn:
            _set_last_fire(conn, workflow, when)


_STEP_COUNTS = {f.name for f in fields(StepRecord)} - {
    "run_id", "step", "position", "kind", "status", "started", "finished", "error"}


def iso(when: datetime) -> str:
    if when.tzinfo is None:
        raise ValueError("the store keeps aware datetimes only")
    return when.astimezone(timezone.utc).isoformat(timespec="seconds")


def lock_is_stale(lock: Lock, now: datetime, lease_seconds: float = LEASE_SECONDS) -> bool:
    """A lock is dead when its process is gone (same host) or its heartbeat is too old."""
    host, pid, _ = (lock.owner.rsplit(":", 2) + ["", ""])[:3]
    if host == socket.gethostname() and pid.isdigit() and not _pid_alive(int(pid)):
        return True
    return (now - datetime.fromisoformat(lock.heartbeat)).total_seconds() > lease_seconds


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child not yet reaped is a zombie: gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _owner_text(owner: str) -> str:
    host, pid, _ = (owner.rsplit(":", 2) + ["", ""])[:3]
    return f"pid {pid} on {host}"


def _lock(conn, workflow: str) -> Lock | None:
    row = conn.execute("SELECT * FROM locks WHERE workflow = ?", (workflow,)).fetchone()
    return Lock(**dict(row)) if row else None


def _interrupt(conn, lock: Lock, now: datetime) -> None:
    _mark_interrupted(conn, lock.run_id, now)
    conn.execute("DELETE FROM locks WHERE workflow = ?", (lock.workflow,))


def _mark_interrupted(conn, run_id: int, now: datetime) -> None:
    conn.execute("UPDATE runs SET status = 'interrupted', finished = ?, error = coalesce(error, "
                 "'the process running it stopped (killed or lost)') WHERE run_id = ? AND "
                 "status IN ('queued', 'running')", (iso(now), run_id))
    conn.execute("UPDATE steps SET status = 'interrupted' WHERE run_id = ? AND status = "
                 "'running'", (run_id,))


def _create_owner_only(path: Path) -> None:
    """Create the database file readable by its owner only: runs record parameters and
    errors. SQLite gives its journal files the database file's mode."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return  # an existing store keeps the mode its owner chose
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
    finally:
        os.close(fd)


def _run(conn, run_id: int) -> RunRecord | None:
    row = conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return _run_record(row) if row else None


def _run_record(row) -> RunRecord:
    return RunRecord(**{**dict(row), "params": json.loads(row["params"])})


def _set_last_fire(conn, workflow: str, when: datetime) -> None:
    conn.execute("INSERT INTO schedule_state (workflow, last_fire) VALUES (?, ?) ON CONFLICT "
                 "(workflow) DO UPDATE SET last_fire = excluded.last_fire",
                 (workflow, iso(when)))
