"""The run store's schema: a version table and an ordered list of migrations.

A database at version N has had MIGRATIONS[0:N] applied, each in one transaction with
the version bump, so a crash mid-upgrade leaves the old version intact. Append new
migrations at the end; never edit one that has shipped.
"""
from __future__ import annotations

import sqlite3

from fusegen.workflows.errors import WorkflowError

MIGRATIONS: list[tuple[str, list[str]]] = [
    ("run history", [
        """CREATE TABLE runs (
               run_id INTEGER PRIMARY KEY AUTOINCREMENT,
               workflow TEXT NOT NULL,
               source TEXT,                 -- the workflow file
               run_date TEXT NOT NULL,      -- YYYY-MM-DD, as the templates saw it
               params TEXT NOT NULL,        -- JSON, after --param overrides
               status TEXT NOT NULL,        -- queued | running | succeeded | failed | interrupted
               started TEXT,                -- ISO 8601, UTC
               finished TEXT,
               error TEXT)""",
        "CREATE INDEX runs_by_workflow ON runs (workflow, run_id)",
        """CREATE TABLE steps (
               run_id INTEGER NOT NULL REFERENCES runs (run_id),
               step TEXT NOT NULL,
               position INTEGER NOT NULL,   -- order the DAG ran it in
               kind TEXT NOT NULL,          -- generate | transform
               status TEXT NOT NULL,        -- pending | running | succeeded | failed | interrupted
               output TEXT,
               started TEXT,
               finished TEXT,
               num_input_rows INTEGER,
               num_rows INTEGER,
               num_errors INTEGER,
               errors_by_code TEXT,         -- JSON {code: rows}
               num_prompt_tokens INTEGER,
               num_generated_tokens INTEGER,
               num_parts INTEGER,
               num_parts_kept INTEGER,      -- committed by an earlier attempt
               error TEXT,
               PRIMARY KEY (run_id, step))""",
    ]),
    ("scheduling: triggers, resumed runs, the last fire time, one lock per workflow", [
        "ALTER TABLE runs ADD COLUMN trigger TEXT NOT NULL DEFAULT 'manual'",
        "ALTER TABLE runs ADD COLUMN scheduled_for TEXT",
        "ALTER TABLE runs ADD COLUMN resumes INTEGER",
        """CREATE TABLE schedule_state (
               workflow TEXT PRIMARY KEY,
               last_fire TEXT NOT NULL)     -- fires up to here were started or skipped""",
        """CREATE TABLE locks (
               workflow TEXT PRIMARY KEY,
               run_id INTEGER NOT NULL,
               owner TEXT NOT NULL,         -- host:pid:nonce of the process running it
               heartbeat TEXT NOT NULL)""",
    ]),
    # runs.status gains `skipped`: a run that found every step's output up to date
    ("run times: the {{ run_time }} a run saw", [
        "ALTER TABLE runs ADD COLUMN run_time TEXT",  # ISO 8601 UTC; NULL: recorded before
    ]),
]
LATEST = len(MIGRATIONS)


def schema_version(conn: sqlite3.Connection) -> int:
    exists = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                          "name = 'schema_version'").fetchone()
    if not exists:
        return 0
    row = conn.execute("SELECT version FROM schema_version").fetchone()
    return row[0] if row else 0


def migrate(conn: sqlite3.Connection, where: str, target: int = LATEST) -> int:
    """Bring the database up to `target`; returns the version it had. The connection must
    be in autocommit mode (isolation_level=None): each migration is its own transaction."""
    conn.execute("BEGIN IMMEDIATE")  # one process upgrades; the others wait, then see it
    try:
        found = schema_version(conn)
        if found > LATEST:
            raise WorkflowError(f"run store {where} has schema version {found}, newer than "
                                f"this fusegen knows ({LATEST}); upgrade fusegen, or pass "
                                "--store to use another database")
        if found == 0:
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            conn.execute("INSERT INTO schema_version (version) VALUES (0)")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    for version in range(found + 1, target + 1):
        _apply(conn, version)
    return found


def _apply(conn: sqlite3.Connection, version: int) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        if schema_version(conn) >= version:  # another process got here first
            conn.execute("ROLLBACK")
            return
        for statement in MIGRATIONS[version - 1][1]:
            conn.execute(statement)
        conn.execute("UPDATE schema_version SET version = ?", (version,))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
