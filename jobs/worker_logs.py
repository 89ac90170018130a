"""fusegen's log lines on the Dask workers: a worker plugin that hands the records of the
"fusegen" loggers to each worker's own log, where `client.get_worker_logs()`, the
dashboard's worker pages and a `dask worker`'s stderr show Dask's own."""
from __future__ import annotations

import logging
import os

from distributed.diagnostics.plugin import WorkerPlugin

from fusegen.jobs.redact import Redactor, redact_url

log = logging.getLogger("fusegen.jobs")


class WorkerLogs(WorkerPlugin):
    """fusegen's log records on a worker reach that worker's own log: the records that
    `client.get_worker_logs()` and the dashboard's worker pages show, and, in a worker
    process (`--workers N`, `dask worker`), Dask's own handlers (its stderr), with the
    job's secrets masked. Without it they go nowhere: a worker process never configures
    the "fusegen" logger. In the driver's own process (the in-process worker) the
    driver's logging stays as the driver set it."""

    name = "fusegen-logs"  # registering again (the next job) replaces this job's

    def __init__(self, redactor: Redactor):
        self.redactor = redactor
        self.driver_pid = os.getpid()
        self._handler: _ToWorkerLog | None = None
        self._level: int | None = None  # the "fusegen" logger's level before setup

    def setup(self, worker) -> None:
        logger = logging.getLogger("fusegen")
        # The handler behind Worker.get_logs (Dask's: each node keeps its records in it).
        targets = [worker._deque_handler]
        if os.getpid() != self.driver_pid:
            targets += logging.getLogger("distributed").handlers
            if logger.level == logging.NOTSET:  # as Dask's worker logger: INFO and up
                self._level = logger.level
                logger.setLevel(logging.INFO)
        self._handler = _ToWorkerLog(targets, self.redactor)
        logger.addHandler(self._handler)

    def teardown(self, worker) -> None:
        logger = logging.getLogger("fusegen")
        logger.removeHandler(self._handler)
        if self._level is not None:
            logger.setLevel(self._level)


class _ToWorkerLog(logging.Handler):
    """Hands each record, its message redacted, to the worker's handlers. A copy: the
    record's own handlers (the driver's, in its process) see it as logged."""

    def __init__(self, targets: list[logging.Handler], redactor: Redactor):
        super().__init__()
        self.targets, self.redactor = targets, redactor

    def emit(self, record: logging.LogRecord) -> None:
        record = logging.makeLogRecord(record.__dict__)
        record.msg, record.args = self.redactor(record.getMessage()), ()
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = self.redactor(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        for target in self.targets:
            if record.levelno >= target.level:
                target.handle(record)


def unregister(client) -> None:
    """Take the plugin off the cluster's workers (an external cluster outlives the job);
    not once the scheduler is lost (the job has failed; waiting to reconnect would only
    delay saying so)."""
    if client.status != "running":
        return
    try:
        client.unregister_worker_plugin(WorkerLogs.name)
    except Exception as exc:  # noqa: BLE001 - the job's own outcome stands
        log.warning("could not remove fusegen's log plugin from the Dask workers: %s",
                    redact_url(str(exc)))
